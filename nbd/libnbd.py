"""A typed NBD client over libnbd (``libnbd.so.0``, written against the 1.14 ABI).

The synchronous API is bound here: every call blocks the calling thread (ctypes drops the
GIL meanwhile) and a handle may be shared between threads, libnbd serialising its users.
The C declarations and the loading of the library are in :mod:`nbd.libnbd_ctypes`; the
asynchronous calls are driven from trio by :mod:`nbd.aio`.
For parallel I/O open several handles; :class:`~nbd.libnbd_pool.ConnectionPool` does that
when the server advertises multi-conn.

Errors: a failing call raises :class:`NBDError` (an ``OSError``) made from
``nbd_get_error()``/``nbd_get_errno()``, which libnbd keeps per thread, so they are read in a
ctypes ``errcheck`` hook, immediately after the call and on the same thread.  Where the errno
has a builtin ``OSError`` subclass the error is also an instance of it
(``except PermissionError`` catches a write to a read-only export).

The library is loaded on first use; without it importing this module still works and the
first use raises :class:`NBDUnavailable`.
"""

from __future__ import annotations

import ctypes
import enum
import errno as _errno
import os
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Self

from nbd.libnbd_ctypes import _ExtentCallback, _ExtentFn, _FreeFn, _lib, _take_string

# The errors this client raises, defined apart so the ctypes layer can raise them
# too; they are part of this module's API, so they are re-exported here.
from nbd.libnbd_errors import NBDError as NBDError
from nbd.libnbd_errors import NBDUnavailable as NBDUnavailable

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, StrPath, WriteableBuffer


class Tls(enum.IntEnum):
    """``nbd_set_tls`` modes."""

    DISABLE = 0
    ALLOW = 1
    REQUIRE = 2


class BlockSize(enum.IntEnum):
    """Which block size constraint ``get_block_size`` reports."""

    MINIMUM = 0
    PREFERRED = 1
    MAXIMUM = 2


class CmdFlag(enum.IntFlag):
    """Per-command flags (``LIBNBD_CMD_FLAG_*``)."""

    FUA = 0x01
    NO_HOLE = 0x02
    DF = 0x04
    REQ_ONE = 0x08
    FAST_ZERO = 0x10


class HandshakeFlag(enum.IntFlag):
    """Handshake flags the client offers (``LIBNBD_HANDSHAKE_FLAG_*``)."""

    FIXED_NEWSTYLE = 0x01
    NO_ZEROES = 0x02


class AllocationState(enum.IntFlag):
    """``base:allocation`` extent flags (``LIBNBD_STATE_*``)."""

    HOLE = 1
    ZERO = 2


# The C names, for readers coming from the libnbd manual pages.
LIBNBD_TLS_DISABLE: Final = Tls.DISABLE
LIBNBD_TLS_ALLOW: Final = Tls.ALLOW
LIBNBD_TLS_REQUIRE: Final = Tls.REQUIRE
LIBNBD_SIZE_MINIMUM: Final = BlockSize.MINIMUM
LIBNBD_SIZE_PREFERRED: Final = BlockSize.PREFERRED
LIBNBD_SIZE_MAXIMUM: Final = BlockSize.MAXIMUM
LIBNBD_CMD_FLAG_FUA: Final = CmdFlag.FUA
LIBNBD_CMD_FLAG_NO_HOLE: Final = CmdFlag.NO_HOLE
LIBNBD_CMD_FLAG_DF: Final = CmdFlag.DF
LIBNBD_CMD_FLAG_REQ_ONE: Final = CmdFlag.REQ_ONE
LIBNBD_CMD_FLAG_FAST_ZERO: Final = CmdFlag.FAST_ZERO
LIBNBD_HANDSHAKE_FLAG_FIXED_NEWSTYLE: Final = HandshakeFlag.FIXED_NEWSTYLE
LIBNBD_HANDSHAKE_FLAG_NO_ZEROES: Final = HandshakeFlag.NO_ZEROES
LIBNBD_STATE_HOLE: Final = AllocationState.HOLE
LIBNBD_STATE_ZERO: Final = AllocationState.ZERO
LIBNBD_CONTEXT_BASE_ALLOCATION: Final = "base:allocation"


class Extent(NamedTuple):
    """One block status extent: ``length`` bytes with context-specific ``flags``."""

    length: int
    flags: int

    @property
    def is_hole(self) -> bool:
        return bool(self.flags & AllocationState.HOLE)

    @property
    def is_zero(self) -> bool:
        return bool(self.flags & AllocationState.ZERO)


def _c_string(value: str) -> bytes:
    data = value.encode()
    if b"\0" in data:
        raise ValueError(f"NUL byte in {value!r}")
    return data


def _c_path(value: StrPath) -> bytes:
    data = os.fsencode(value)
    if b"\0" in data:
        raise ValueError(f"NUL byte in {value!r}")
    return data


def _range(count: int, offset: int) -> None:
    if count < 0 or offset < 0:
        raise ValueError(f"negative count or offset: count={count} offset={offset}")


# ----------------------------------------------------------------- client


class NBDClient:
    """One libnbd handle (``nbd_create``); a context manager that disconnects and closes it.

    Configure (TLS, export name, meta contexts) before connecting; query and do I/O after.
    """

    def __init__(self) -> None:
        self._h: int | None = None
        self._h = int(_lib().nbd_create())

    @classmethod
    def open(
        cls,
        uri: str,
        *,
        meta_contexts: Iterable[str] = (LIBNBD_CONTEXT_BASE_ALLOCATION,),
        configure: Callable[[NBDClient], None] | None = None,
    ) -> Self:
        """A connected client: meta contexts requested, ``configure`` applied, then the URI."""
        client = cls()
        try:
            for name in meta_contexts:
                client.add_meta_context(name)
            if configure is not None:
                configure(client)
            client.connect_uri(uri)
        except BaseException:
            client.close()
            raise
        return client

    @property
    def handle(self) -> int:
        """The ``struct nbd_handle *`` (for :mod:`nbd.aio`); EBADF once closed."""
        return self._handle()

    def _handle(self) -> int:
        if self._h is None:
            raise NBDError("libnbd handle is closed", _errno.EBADF)
        return self._h

    # -- lifetime

    def close(self) -> None:
        """``nbd_close``: drop the connection and free the handle.  Idempotent."""
        h, self._h = self._h, None
        if h is not None:
            _lib().nbd_close(h)

    def shutdown(self) -> None:
        """``nbd_shutdown``: send pending requests, then a polite disconnect."""
        _lib().nbd_shutdown(self._handle(), 0)

    def is_connected(self) -> bool:
        """Ready for transmission commands (``nbd_aio_is_ready``)."""
        return self._h is not None and _lib().nbd_aio_is_ready(self._h) == 1

    def __enter__(self) -> Self:
        return self

    def disconnect(self) -> None:
        """Shut down politely if connected, then close; errors on the way are moot."""
        try:
            if self.is_connected():
                self.shutdown()
        except NBDError:
            pass  # the connection is gone anyway; closing is what matters
        finally:
            self.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.disconnect()

    def __del__(self) -> None:
        if getattr(self, "_h", None) is not None:
            try:  # noqa: SIM105 - plain try: at interpreter exit, contextlib may be gone
                self.close()
            except Exception:
                pass

    # -- before connecting

    def set_export_name(self, name: str) -> None:
        _lib().nbd_set_export_name(self._handle(), _c_string(name))

    def set_tls(self, tls: Tls | int) -> None:
        _lib().nbd_set_tls(self._handle(), int(tls))

    def set_tls_certificates(self, directory: StrPath) -> None:
        """A directory with ``ca-cert.pem`` (and ``client-cert.pem``/``client-key.pem``)."""
        _lib().nbd_set_tls_certificates(self._handle(), _c_path(directory))

    def set_tls_verify_peer(self, verify: bool) -> None:
        _lib().nbd_set_tls_verify_peer(self._handle(), verify)

    def set_request_structured_replies(self, request: bool) -> None:
        _lib().nbd_set_request_structured_replies(self._handle(), request)

    def set_handshake_flags(self, flags: HandshakeFlag | int) -> None:
        _lib().nbd_set_handshake_flags(self._handle(), int(flags))

    def add_meta_context(self, name: str) -> None:
        """Ask for a meta context (``base:allocation``) when connecting."""
        _lib().nbd_add_meta_context(self._handle(), _c_string(name))

    # -- connecting

    def connect_uri(self, uri: str) -> None:
        """``nbd://``, ``nbds://``, ``nbd+unix://``... (the export name comes from the URI)."""
        _lib().nbd_connect_uri(self._handle(), _c_string(uri))

    def connect_tcp(self, host: str, port: int | str) -> None:
        _lib().nbd_connect_tcp(self._handle(), _c_string(host), _c_string(str(port)))

    def connect_unix(self, path: StrPath) -> None:
        _lib().nbd_connect_unix(self._handle(), _c_path(path))

    # -- queries

    def get_version(self) -> str:
        return bytes(_lib().nbd_get_version(self._handle())).decode()

    def supports_tls(self) -> bool:
        return bool(_lib().nbd_supports_tls(self._handle()))

    def get_export_name(self) -> str:
        return _take_string(int(_lib().nbd_get_export_name(self._handle())))

    def get_size(self) -> int:
        return int(_lib().nbd_get_size(self._handle()))

    def get_block_size(self, kind: BlockSize | int) -> int:
        """A block size constraint the server advertised, 0 where it gave none."""
        return int(_lib().nbd_get_block_size(self._handle(), int(kind)))

    def get_protocol(self) -> str:
        """``newstyle-fixed``, ``newstyle`` or ``oldstyle``."""
        return bytes(_lib().nbd_get_protocol(self._handle())).decode()

    def get_tls_negotiated(self) -> bool:
        return bool(_lib().nbd_get_tls_negotiated(self._handle()))

    def get_structured_replies_negotiated(self) -> bool:
        return bool(_lib().nbd_get_structured_replies_negotiated(self._handle()))

    def is_read_only(self) -> bool:
        return bool(_lib().nbd_is_read_only(self._handle()))

    def is_rotational(self) -> bool:
        return bool(_lib().nbd_is_rotational(self._handle()))

    def can_flush(self) -> bool:
        return bool(_lib().nbd_can_flush(self._handle()))

    def can_fua(self) -> bool:
        return bool(_lib().nbd_can_fua(self._handle()))

    def can_trim(self) -> bool:
        return bool(_lib().nbd_can_trim(self._handle()))

    def can_zero(self) -> bool:
        return bool(_lib().nbd_can_zero(self._handle()))

    def can_fast_zero(self) -> bool:
        return bool(_lib().nbd_can_fast_zero(self._handle()))

    def can_df(self) -> bool:
        return bool(_lib().nbd_can_df(self._handle()))

    def can_multi_conn(self) -> bool:
        return bool(_lib().nbd_can_multi_conn(self._handle()))

    def can_cache(self) -> bool:
        return bool(_lib().nbd_can_cache(self._handle()))

    def can_meta_context(self, name: str) -> bool:
        return bool(_lib().nbd_can_meta_context(self._handle(), _c_string(name)))

    # -- I/O

    def pread(self, count: int, offset: int, flags: CmdFlag | int = 0) -> bytes:
        buffer = bytearray(count)
        self.pread_into(buffer, offset, flags)
        return bytes(buffer)

    def pread_into(self, buffer: WriteableBuffer, offset: int, flags: CmdFlag | int = 0) -> int:
        """Read ``len(buffer)`` bytes straight into a writable, contiguous buffer."""
        h = self._handle()
        with memoryview(buffer) as view:
            if view.readonly:
                raise TypeError("pread_into needs a writable buffer")
            count = view.nbytes
            _range(count, offset)
            target = (ctypes.c_char * count).from_buffer(view)
            try:
                _lib().nbd_pread(h, target, count, offset, int(flags))
            finally:
                del target  # release the export so the memoryview can be released
        return count

    def pwrite(self, data: ReadableBuffer, offset: int, flags: CmdFlag | int = 0) -> None:
        """Write all of ``data`` at ``offset``; ``CmdFlag.FUA`` makes it durable on reply."""
        h = self._handle()
        if isinstance(data, bytes):
            _range(len(data), offset)
            _lib().nbd_pwrite(h, data, len(data), offset, int(flags))
            return
        with memoryview(data) as view:
            count = view.nbytes
            _range(count, offset)
            if view.readonly:
                source: Any = bytes(view)  # ctypes maps only writable buffers in place
            else:
                source = (ctypes.c_char * count).from_buffer(view)
            try:
                _lib().nbd_pwrite(h, source, count, offset, int(flags))
            finally:
                del source

    def flush(self, flags: CmdFlag | int = 0) -> None:
        _lib().nbd_flush(self._handle(), int(flags))

    def trim(self, count: int, offset: int, flags: CmdFlag | int = 0) -> None:
        _range(count, offset)
        _lib().nbd_trim(self._handle(), count, offset, int(flags))

    def zero(self, count: int, offset: int, flags: CmdFlag | int = 0) -> None:
        """Write zeroes; ``NO_HOLE`` keeps the range allocated, ``FAST_ZERO`` fails if slow."""
        _range(count, offset)
        _lib().nbd_zero(self._handle(), count, offset, int(flags))

    def cache(self, count: int, offset: int, flags: CmdFlag | int = 0) -> None:
        _range(count, offset)
        _lib().nbd_cache(self._handle(), count, offset, int(flags))

    def block_status(
        self,
        count: int,
        offset: int,
        flags: CmdFlag | int = 0,
        *,
        context: str = LIBNBD_CONTEXT_BASE_ALLOCATION,
    ) -> list[Extent]:
        """Extents of ``context`` from ``offset`` on: they may cover less than ``count``, or
        (the last one) more.  Needs the context requested before connecting."""
        h = self._handle()
        _range(count, offset)
        wanted = _c_string(context)
        extents: list[Extent] = []
        failures: list[BaseException] = []

        def on_extents(
            user_data: Any, metacontext: bytes | None, start: int, entries: Any, n: int, error: Any
        ) -> int:
            try:
                if metacontext == wanted:
                    values: list[int] = entries[:n]
                    extents.extend(map(Extent, values[0::2], values[1::2]))
                return 0
            except BaseException as e:  # never let an exception unwind into C
                failures.append(e)
                error[0] = _errno.EPROTO
                return -1

        # The thunk lives until nbd_block_status returns, after which libnbd (a synchronous
        # call, no free function) never calls it again.
        callback = _ExtentCallback(_ExtentFn(on_extents), None, _FreeFn())
        try:
            _lib().nbd_block_status(h, count, offset, callback, int(flags))
        except NBDError as e:
            if failures:
                raise failures[0] from e
            raise
        if failures:
            raise failures[0]
        return extents
