"""moorage: moorage package."""
