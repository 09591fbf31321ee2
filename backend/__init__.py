"""moorage: backend package."""
