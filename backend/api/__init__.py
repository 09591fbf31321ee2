"""The storage node's API as its clients see it: the one part of ``backend`` the
CSI plugin may import.

It holds the protobuf messages and stubs, the client with its credentials
(bearer token, TLS), the errors a call fails with and their status codes, and
the server interceptor that turns those errors into statuses for every moorage
gRPC server.  It imports nothing else of ``backend``.
"""
