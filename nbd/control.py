"""Messages between the NBD server's listening process and its workers.

They travel over a ``SOCK_SEQPACKET`` unix socket pair, one message per
packet, so no framing is needed; a packet may carry file descriptors
(``SCM_RIGHTS``): an accepted client socket, or the shared memory.  A
message is a JSON object whose ``op`` says what it is:

listener → worker
    ``config`` (once, first; carries the shared memfd): the server settings
    and the worker's process index; ``export`` (seq, slot, export): add or
    change an export; ``remove`` (seq, name); ``conn`` (carries the client's
    socket); ``sync`` (seq): nothing but an acknowledgement wanted;
    ``shutdown``: drain and exit; ``hold`` (id, paths, lease, timeout): hold
    the I/O of those images (``nbd.holds``); ``release`` (id): end that hold.
worker → listener
    ``ack`` (seq): every change up to seq is in the worker's table;
    ``closed``: one of the connections handed to it has ended;
    ``held`` (id, error): the hold is reached (error null) or failed.

A ``conn`` whose socket could not be received (the receiver is out of
descriptors) arrives without it: one connection is lost, not the channel.
Both sides refuse what does not decode (``ControlError``): the other end is
our own process, so a bad message is a bug, and the channel is dropped.
"""

from __future__ import annotations

import array
import json
import socket
from pathlib import Path
from typing import Any

import trio

from nbd.exports import Export, ExportError, parse_networks

# Largest message: an export with a long list of client networks fits.
MAX_MESSAGE = 256 * 1024
MAX_FDS = 2

OPS_TO_WORKER = frozenset(
    {"config", "export", "remove", "conn", "sync", "shutdown", "hold", "release"}
)
OPS_TO_LISTENER = frozenset({"ack", "closed", "held"})


class ControlError(Exception):
    """A control message that does not decode."""


Message = dict[str, Any]


def encode(msg: Message) -> bytes:
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ControlError(f"control message of {len(data)} bytes is too long")
    return data


def decode(data: bytes, ops: frozenset[str]) -> Message:
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ControlError(f"control message is not JSON: {e}") from None
    if not isinstance(msg, dict) or msg.get("op") not in ops:
        raise ControlError(f"unexpected control message {str(msg)[:80]!r}")
    return msg


def export_to_wire(export: Export) -> Message:
    return {
        "name": export.name,
        "path": str(export.path),
        "read_only": export.read_only,
        "description": export.description,
        "allowed_clients": None
        if export.allowed_clients is None
        else sorted(str(n) for n in export.allowed_clients),
        "tls_required": export.tls_required,
        "min_block_size": export.min_block_size,
        "iops_limit": export.iops_limit,
        "bandwidth_limit": export.bandwidth_limit,
    }


def export_from_wire(d: object) -> Export:
    if not isinstance(d, dict):
        raise ControlError("export is not an object")
    try:
        allowed = d["allowed_clients"]
        return Export(
            name=_typed(d["name"], str),
            path=Path(_typed(d["path"], str)),
            read_only=_typed(d["read_only"], bool),
            description=_typed(d["description"], str),
            allowed_clients=None if allowed is None else parse_networks(_typed(allowed, list)),
            tls_required=_typed(d["tls_required"], bool),
            min_block_size=_typed(d["min_block_size"], int),
            iops_limit=_typed(d["iops_limit"], int),
            bandwidth_limit=_typed(d["bandwidth_limit"], int),
        )
    except KeyError as e:
        raise ControlError(f"export without {e}") from None
    except ExportError as e:
        raise ControlError(f"invalid export: {e}") from None


def _typed(value: object, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ControlError(f"{value!r} is not a {kind.__name__}")
    return value


# ------------------------------------------------------------------ transport


async def send(sock: trio.socket.SocketType, msg: Message, fds: list[int] | None = None) -> None:
    """Send one message (and ``fds``, which stay open here)."""
    data = encode(msg)
    ancillary = []
    if fds:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
    sent = await sock.sendmsg([data], ancillary)
    if sent != len(data):  # pragma: no cover - SEQPACKET sends all or fails
        raise ControlError("control message sent in part")


async def receive(
    sock: trio.socket.SocketType, ops: frozenset[str]
) -> tuple[Message, list[int]] | None:
    """One message and the descriptors it carried (close-on-exec, now ours);
    None when the other end has closed."""
    space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    data, ancillary, flags, _ = await sock.recvmsg(MAX_MESSAGE, space, socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    if not data and not fds:
        return None
    try:
        if flags & socket.MSG_TRUNC:
            raise ControlError("control message truncated")
        msg = decode(data, ops)
        if flags & socket.MSG_CTRUNC:
            if msg["op"] != "conn":
                raise ControlError("control message's descriptors truncated")
            # No room for the client's socket here (EMFILE): that one
            # connection is lost, and the receiver says so; the channel lives.
            for fd in fds:
                socket.close(fd)
            fds = []
        return msg, fds
    except ControlError:
        for fd in fds:
            socket.close(fd)
        raise


def socketpair() -> tuple[socket.socket, socket.socket]:
    """A control channel: (listener's end, worker's end), both close-on-exec."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
