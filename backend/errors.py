"""Errors of the storage node, by kind.

Raised anywhere in ``backend``; mapped to gRPC status codes once, where the
API answers.
"""

from __future__ import annotations


class BackendError(Exception):
    """Base of every error the backend reports to its callers."""


class InvalidArgument(BackendError):
    pass


class NotFound(BackendError):
    pass


class AlreadyExists(BackendError):
    pass


class FailedPrecondition(BackendError):
    pass


class ResourceExhausted(BackendError):
    pass


class Unavailable(BackendError):
    pass


class CommandFailed(BackendError):
    """An external tool (mkfs, mount, ...) failed; carries its stderr."""

    def __init__(self, argv: list[str], returncode: int, stderr: str) -> None:
        super().__init__(f"{argv[0]} exited {returncode}: {stderr.strip()}")
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr
