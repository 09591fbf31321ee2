"""Errors of the CSI plugin, each with the gRPC status code the spec gives it.

Services raise these; the gRPC server turns them into statuses in one
place.  A failed backend call becomes one of them through
:func:`from_backend`, keeping the storage node's own code (its API already
speaks the same codes) and naming the storage node in the message.
"""

from __future__ import annotations

import grpc

from backend.api.errors import StatusError


class CsiError(StatusError):
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


class PermissionDenied(CsiError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(CsiError):
    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(CsiError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unimplemented(CsiError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(CsiError):
    code = grpc.StatusCode.INTERNAL


# What the plugin answers for a call to a storage node that failed with the
# status on the left (the spec's error scheme).  A code keeps its meaning
# unless a comment says why not; a code not here (OK: a failed call never
# ends so) answers INTERNAL.
FROM_BACKEND: dict[grpc.StatusCode, type[CsiError]] = {
    # the call was cut short on our side (the channel closed): try again
    grpc.StatusCode.CANCELLED: Aborted,
    # no status: the storage node died mid-call
    grpc.StatusCode.UNKNOWN: Unavailable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    # the storage node knows who we are and refuses: a grant is missing
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
    # a storage node without a call this plugin makes (an older version): to a
    # CO, UNIMPLEMENTED would mean this plugin lacks the call, never to retry
    grpc.StatusCode.UNIMPLEMENTED: Internal,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    # the plugin claims no loss it cannot see: the storage node's message says what
    grpc.StatusCode.DATA_LOSS: Internal,
    # the token or certificate the storage node was given is not valid
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def from_backend(error: grpc.RpcError, storage_node: str) -> CsiError:
    """The CSI error for a failed backend call to ``storage_node``."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
    return FROM_BACKEND.get(code, Internal)(f"storage node {storage_node}: {details}")
