"""torpor.client"""
