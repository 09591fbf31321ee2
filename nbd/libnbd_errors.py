"""The libnbd binding's errors: ``NBDError`` (an ``OSError``) and its builtin-subclass variants.

Apart from :mod:`nbd.libnbd` so that :mod:`nbd.libnbd_ctypes`, which makes them
from ``nbd_get_error()``/``nbd_get_errno()``, can raise them too; :mod:`nbd.libnbd`
exports them with its client.
"""

from __future__ import annotations

import errno as errnos


class NBDError(OSError):
    """A libnbd call failed: libnbd's message, and its errno when it gave one (else None)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        if errno:
            super().__init__(errno, message)
        else:
            super().__init__(message)
        self.message = message


class NBDUnavailable(NBDError):
    """``libnbd.so.0`` cannot be loaded (or lacks a symbol this module needs)."""


_KINDS: dict[type[OSError], type[NBDError]] = {}


def error_for(message: str, errno: int | None) -> NBDError:
    """An NBDError that is also the builtin OSError subclass for ``errno`` (if there is one)."""
    builtin = type(OSError(errno, message)) if errno else OSError
    if builtin is OSError:
        return NBDError(message, errno)
    kind = _KINDS.get(builtin)
    if kind is None:
        kind = type(f"NBD{builtin.__name__}", (NBDError, builtin), {"__module__": __name__})
        _KINDS[builtin] = kind  # a racing thread builds an equal class: harmless
    return kind(message, errno)


def lost(error: NBDError | None) -> NBDError:
    """What a request meets on a connection that is gone: a fresh error like the
    one it died of (``ENOTCONN`` if it gave none), or "connection closed"."""
    if error is not None:
        return error_for(error.message, error.errno or errnos.ENOTCONN)
    return NBDError("connection closed", errnos.ENOTCONN)


def stalled(timeout: float) -> NBDError:
    """The error of a connection whose oldest request went unanswered for ``timeout`` s."""
    return NBDError(f"no reply within {timeout:.1f}s", errnos.ETIMEDOUT)
