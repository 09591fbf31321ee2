"""moorage: fuse package."""
