"""Generated CSI protobuf stubs (built from csi.proto, never committed)."""
