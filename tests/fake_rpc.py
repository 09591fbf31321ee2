"""A gRPC error with a status code and details, as a client call raises it, for tests of
what is made of such errors without a server to raise them."""

from __future__ import annotations

import grpc


class FakeRpcError(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
