"""moorage: csi package."""
