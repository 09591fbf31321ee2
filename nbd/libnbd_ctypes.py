"""libnbd through ctypes: loading ``libnbd.so.0``, its prototypes and its callback structs.

Every libnbd function that :mod:`nbd.libnbd` and :mod:`nbd.aio` call is declared in
``_PROTOTYPES`` (signatures of libnbd 1.14) with an ``errcheck`` hook: libnbd keeps its
error per thread, so the hook reads ``nbd_get_error()``/``nbd_get_errno()`` immediately
after the failing call, on the same thread, and raises the matching
:class:`~nbd.libnbd_errors.NBDError`.

The library is loaded on first use (``_lib()``): importing this module works without it,
and the first use raises :class:`~nbd.libnbd_errors.NBDUnavailable`.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

from nbd.libnbd_errors import NBDError, NBDUnavailable, error_for

SONAME = "libnbd.so.0"

# int (*callback)(void *user_data, const char *metacontext, uint64_t offset,
#                 uint32_t *entries, size_t nr_entries, int *error)
_ExtentFn = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_char_p,
    ctypes.c_uint64,
    ctypes.POINTER(ctypes.c_uint32),
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_int),
)
_FreeFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _ExtentCallback(ctypes.Structure):
    """``nbd_extent_callback``, passed to libnbd by value."""

    _fields_ = [("callback", _ExtentFn), ("user_data", ctypes.c_void_p), ("free", _FreeFn)]


# int (*callback)(void *user_data, int *error)
_CompletionFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


class _CompletionCallback(ctypes.Structure):
    """``nbd_completion_callback``, passed to libnbd by value."""

    _fields_ = [("callback", _CompletionFn), ("user_data", ctypes.c_void_p), ("free", _FreeFn)]


def _last_error() -> NBDError:
    lib = _loaded
    assert lib is not None
    message = lib.nbd_get_error()
    text = message.decode(errors="replace") if message else "libnbd call failed"
    return error_for(text, int(lib.nbd_get_errno()))


def _check_int(result: int, func: Any, args: tuple[Any, ...]) -> int:
    if result == -1:
        raise _last_error()
    return result


def _check_ptr(result: Any, func: Any, args: tuple[Any, ...]) -> Any:
    if not result:
        raise _last_error()
    return result


_H = ctypes.c_void_p
_STR = ctypes.c_char_p
_U32, _U64, _INT = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int
_RANGE = [_H, _U64, _U64, _U32]  # (h, count, offset, flags)
_IO = [_H, ctypes.c_void_p, ctypes.c_size_t, _U64, _U32]  # (h, buf, count, offset, flags)
_Check = Callable[[Any, Any, tuple[Any, ...]], Any] | None

# name: (restype, argtypes, errcheck).  Signatures from libnbd.h of libnbd 1.14.
_PROTOTYPES: dict[str, tuple[Any, list[Any], _Check]] = {
    "nbd_create": (ctypes.c_void_p, [], _check_ptr),
    "nbd_close": (None, [_H], None),
    "nbd_get_error": (_STR, [], None),
    "nbd_get_errno": (_INT, [], None),
    "nbd_get_version": (_STR, [_H], _check_ptr),
    "nbd_supports_tls": (_INT, [_H], _check_int),
    "nbd_set_export_name": (_INT, [_H, _STR], _check_int),
    # Returns a malloc'd string the caller frees: kept as a raw pointer.
    "nbd_get_export_name": (ctypes.c_void_p, [_H], _check_ptr),
    "nbd_set_tls": (_INT, [_H, _INT], _check_int),
    "nbd_get_tls_negotiated": (_INT, [_H], _check_int),
    "nbd_set_tls_certificates": (_INT, [_H, _STR], _check_int),
    "nbd_set_tls_verify_peer": (_INT, [_H, ctypes.c_bool], _check_int),
    "nbd_set_request_structured_replies": (_INT, [_H, ctypes.c_bool], _check_int),
    "nbd_get_structured_replies_negotiated": (_INT, [_H], _check_int),
    "nbd_set_handshake_flags": (_INT, [_H, _U32], _check_int),
    "nbd_add_meta_context": (_INT, [_H, _STR], _check_int),
    "nbd_connect_uri": (_INT, [_H, _STR], _check_int),
    "nbd_connect_tcp": (_INT, [_H, _STR, _STR], _check_int),
    "nbd_connect_unix": (_INT, [_H, _STR], _check_int),
    "nbd_aio_is_ready": (_INT, [_H], None),
    "nbd_is_read_only": (_INT, [_H], _check_int),
    "nbd_is_rotational": (_INT, [_H], _check_int),
    "nbd_can_flush": (_INT, [_H], _check_int),
    "nbd_can_fua": (_INT, [_H], _check_int),
    "nbd_can_trim": (_INT, [_H], _check_int),
    "nbd_can_zero": (_INT, [_H], _check_int),
    "nbd_can_fast_zero": (_INT, [_H], _check_int),
    "nbd_can_df": (_INT, [_H], _check_int),
    "nbd_can_multi_conn": (_INT, [_H], _check_int),
    "nbd_can_cache": (_INT, [_H], _check_int),
    "nbd_can_meta_context": (_INT, [_H, _STR], _check_int),
    "nbd_get_protocol": (_STR, [_H], _check_ptr),
    "nbd_get_size": (ctypes.c_int64, [_H], _check_int),
    "nbd_get_block_size": (ctypes.c_int64, [_H, _INT], _check_int),
    "nbd_pread": (_INT, _IO, _check_int),
    "nbd_pwrite": (_INT, _IO, _check_int),
    "nbd_flush": (_INT, [_H, _U32], _check_int),
    "nbd_trim": (_INT, _RANGE, _check_int),
    "nbd_zero": (_INT, _RANGE, _check_int),
    "nbd_cache": (_INT, _RANGE, _check_int),
    "nbd_block_status": (_INT, [_H, _U64, _U64, _ExtentCallback, _U32], _check_int),
    "nbd_shutdown": (_INT, [_H, _U32], _check_int),
    # The asynchronous API, for nbd.aio.
    "nbd_aio_get_fd": (_INT, [_H], _check_int),
    "nbd_aio_get_direction": (ctypes.c_uint, [_H], None),
    "nbd_aio_notify_read": (_INT, [_H], _check_int),
    "nbd_aio_notify_write": (_INT, [_H], _check_int),
    "nbd_aio_pread": (
        ctypes.c_int64,
        [_H, ctypes.c_void_p, ctypes.c_size_t, _U64, _CompletionCallback, _U32],
        _check_int,
    ),
    "nbd_aio_pwrite": (
        ctypes.c_int64,
        [_H, ctypes.c_void_p, ctypes.c_size_t, _U64, _CompletionCallback, _U32],
        _check_int,
    ),
    "nbd_aio_flush": (ctypes.c_int64, [_H, _CompletionCallback, _U32], _check_int),
    "nbd_aio_zero": (ctypes.c_int64, [_H, _U64, _U64, _CompletionCallback, _U32], _check_int),
    "nbd_aio_in_flight": (_INT, [_H], _check_int),
    "nbd_aio_is_dead": (_INT, [_H], None),
    "nbd_aio_is_closed": (_INT, [_H], None),
}

_load_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_free: Callable[[int], None] | None = None


def _lib() -> ctypes.CDLL:
    """libnbd with its prototypes declared, loaded on first use."""
    global _loaded, _free
    if _loaded is not None:
        return _loaded
    with _load_lock:
        if _loaded is None:
            try:
                lib = ctypes.CDLL(SONAME)
                for name, (restype, argtypes, errcheck) in _PROTOTYPES.items():
                    func = getattr(lib, name)
                    func.restype = restype
                    func.argtypes = argtypes
                    if errcheck is not None:
                        func.errcheck = errcheck
                libc_free = ctypes.CDLL(None).free
            except (OSError, AttributeError) as e:
                raise NBDUnavailable(
                    f"libnbd is not usable: cannot load {SONAME} ({e}); install libnbd0 (>= 1.14)"
                ) from e
            libc_free.restype = None
            libc_free.argtypes = [ctypes.c_void_p]
            _free = libc_free
            _loaded = lib
    return _loaded


def _take_string(pointer: int) -> str:
    """Copy a malloc'd C string that libnbd handed over, then free it."""
    assert _free is not None
    try:
        return ctypes.string_at(pointer).decode(errors="replace")
    finally:
        _free(pointer)
