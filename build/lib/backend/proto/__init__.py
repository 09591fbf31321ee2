"""Backend API protocol (generated stubs live beside the .proto)."""
