"""Errors of the CSI plugin, each with the gRPC status code the spec gives it.

Services raise these; the gRPC server turns them into statuses in one
place.  A failed backend call becomes one of them through
:func:`from_backend`, keeping the storage node's own code (its API already
speaks the same codes) and naming the storage node in the message.
"""

from __future__ import annotations

import grpc


class CsiError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(CsiError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(CsiError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(CsiError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(CsiError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRange(CsiError):
    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhausted(CsiError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Aborted(CsiError):
    code = grpc.StatusCode.ABORTED


class Unavailable(CsiError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(CsiError):
    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(CsiError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unimplemented(CsiError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(CsiError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[CsiError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        OutOfRange,
        ResourceExhausted,
        Aborted,
        Unavailable,
        Unauthenticated,
        DeadlineExceeded,
        Unimplemented,
        Internal,
    )
}
# A storage node refusing our credentials is, to Kubernetes, a misconfigured
# secret: PERMISSION_DENIED keeps its meaning.
_BY_CODE[grpc.StatusCode.PERMISSION_DENIED] = Unauthenticated


def from_backend(error: grpc.RpcError, storage_node: str) -> CsiError:
    """The CSI error for a failed backend call to ``storage_node``."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
    # A channel that never connected reports UNAVAILABLE (or UNKNOWN with no
    # details when the process died mid-call): the storage node is down.
    cls = _BY_CODE.get(code, Unavailable if code == grpc.StatusCode.UNKNOWN else Internal)
    if code == grpc.StatusCode.CANCELLED:
        cls = Aborted
    return cls(f"storage node {storage_node}: {details}")
