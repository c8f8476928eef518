"""torpor.sandbox.guest"""
