"""torpor.server"""
