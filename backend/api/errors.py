"""The errors a moorage gRPC call fails with, each kind naming its status code.

:class:`StatusError` is what a server's one interceptor answers with its own
code and message; anything else a call raises is an internal error.  The
storage node's errors (:class:`BackendError` and its kinds) are raised
anywhere in ``backend``; the CSI plugin derives its own kinds from
:class:`StatusError` too.
"""

from __future__ import annotations

from typing import ClassVar

import grpc


class StatusError(Exception):
    """An error a call answers with :attr:`code` and the error's message."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL


class BackendError(StatusError):
    """Base of every error the backend reports to its callers."""


class InvalidArgument(BackendError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(BackendError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(BackendError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(BackendError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(BackendError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(BackendError):
    code = grpc.StatusCode.UNAVAILABLE


class CommandFailed(BackendError):
    """An external tool (mkfs, mount, ...) failed; carries its stderr.  INTERNAL."""

    def __init__(self, argv: list[str], returncode: int, stderr: str) -> None:
        super().__init__(f"{argv[0]} exited {returncode}: {stderr.strip()}")
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr
