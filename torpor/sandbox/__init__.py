"""torpor.sandbox"""
