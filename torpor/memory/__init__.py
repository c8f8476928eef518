"""torpor.memory"""
