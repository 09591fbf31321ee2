"""Authentication of backend API calls: a bearer token, or mutual TLS.

The local default is a unix socket with mode 0600, where the file system
decides who may connect.  Over TCP the daemon refuses to start without a
token or client-certificate verification.  A token file its group or
others may read is refused by the daemon and warned of by clients.
"""

from __future__ import annotations

import hmac
import logging
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from backend.errors import InvalidArgument

log = logging.getLogger("moorage.backend.auth")
# (file, mode) already warned of: a client may read its token file often
_warned: set[tuple[Path, int]] = set()


def read_token(path: Path, *, refuse_shared: bool = False) -> str:
    """The bearer token in ``path``.

    A file its group or others may read is refused with ``refuse_shared``
    (the storage node's ``--token-file``, unless ``--allow-shared-token-file``),
    else warned of once (a client's token file).
    """
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        problem = (
            f"token file {path} has mode {mode:04o} (its group or others may read it): "
            f"chmod 600 {path}"
        )
        if refuse_shared:
            raise InvalidArgument(f"{problem}, or pass --allow-shared-token-file")
        if (path, mode) not in _warned:
            _warned.add((path, mode))
            log.warning("%s", problem)
    token = path.read_text().strip()
    if len(token) < 16:
        raise InvalidArgument(f"token in {path} is shorter than 16 characters")
    return token


def _abort_unauthenticated(message: str) -> grpc.RpcMethodHandler[Any, Any]:
    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.unary_unary_rpc_method_handler(deny)


class BearerTokenInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else bytes(value)
        if not presented:
            return _abort_unauthenticated("missing bearer token")
        if not hmac.compare_digest(presented, self._expected):
            return _abort_unauthenticated("invalid bearer token")
        return continuation(handler_call_details)


class BearerToken(grpc.AuthMetadataPlugin):
    """Client side: attaches the token to every call."""

    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(
        self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback
    ) -> None:
        callback((("authorization", f"Bearer {self._token}"),), None)
