"""Network probes the supervisor asks before and after starting ganesha.

Whether something accepts TCP on a port (rpcbind), whether an ONC RPC server
answers the NULL procedure of a program (ganesha is ready only then: it binds
its sockets a while before its service threads answer), and whether a port is
already taken by a listener (another NFS server, a ganesha left running).
"""

from __future__ import annotations

import errno
import ipaddress
import secrets
import socket
import struct
from typing import Final

import trio

NFS_PROGRAM: Final = 100003
RPCBIND_PORT: Final = 111


async def accepts_tcp(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts a TCP connection on ``host:port``."""
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            return False
        await stream.aclose()
        return True
    return False


async def rpc_ping(
    host: str, port: int, program: int = NFS_PROGRAM, version: int = 3, timeout: float = 2.0
) -> bool:
    """Whether an ONC RPC server on TCP ``host:port`` answers NULL for ``program``/``version``."""
    xid = secrets.randbits(32)
    # xid, CALL, RPC v2, program, version, procedure NULL, AUTH_NONE cred and verifier
    call = struct.pack(">10I", xid, 0, 2, program, version, 0, 0, 0, 0, 0)
    record = struct.pack(">I", 0x80000000 | len(call)) + call
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            return False
        try:
            await stream.send_all(record)
            reply = b""
            while len(reply) < 28:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return False
                reply += chunk
        except (trio.BrokenResourceError, OSError):
            return False
        finally:
            await stream.aclose()
        # record mark, xid, REPLY, MSG_ACCEPTED, verifier (flavor, length, body), SUCCESS
        _, r_xid, msg_type, reply_stat, _, verf_len = struct.unpack(">6I", reply[:24])
        if r_xid != xid or msg_type != 1 or reply_stat != 0:
            return False
        offset = 24 + (verf_len + 3) // 4 * 4
        if len(reply) < offset + 4:
            return False
        (accept_stat,) = struct.unpack(">I", reply[offset : offset + 4])
        return bool(accept_stat == 0)
    return False


def port_in_use(host: str, port: int) -> bool:
    """Whether a listener holds TCP ``host:port`` (binding it fails with EADDRINUSE)."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # TIME_WAIT leftovers are no obstacle; a listener is
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False
