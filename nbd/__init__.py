"""moorage: nbd package."""
