"""A NETLINK_GENERIC socket: request/ack exchanges with the kernel, and family lookup.

The I/O half of generic netlink; every message it sends or reads is built and
parsed by ``nbd.netlink``.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import time
from collections.abc import Callable

from nbd.netlink import (
    NETLINK_CAP_ACK,
    NETLINK_EXT_ACK,
    NETLINK_GENERIC,
    NLMSG_DONE,
    NLMSG_ERROR,
    SOL_NETLINK,
    FamilyNotFound,
    GenlFamily,
    NetlinkError,
    NetlinkMessage,
    NetlinkParseError,
    getfamily_request,
    parse_family,
    parse_nlmsgerr,
    parse_nlmsgs,
)

_RECV_BUFFER = 64 * 1024


class GenericNetlink:
    """A NETLINK_GENERIC socket for request/ack exchanges with the kernel."""

    def __init__(self, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
        try:
            self.sock.bind((0, 0))
            self.sock.settimeout(timeout)
            # Error text from the kernel, and no echo of our request in acks.
            for option in (NETLINK_EXT_ACK, NETLINK_CAP_ACK):
                with contextlib.suppress(OSError):
                    self.sock.setsockopt(SOL_NETLINK, option, 1)
        except BaseException:
            self.sock.close()
            raise
        self._seq = int(time.time()) & 0x7FFFFFFF

    def __enter__(self) -> GenericNetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def recv_messages(self) -> list[NetlinkMessage]:
        data, _, flags, _ = self.sock.recvmsg(_RECV_BUFFER)
        if flags & socket.MSG_TRUNC:
            raise NetlinkParseError(f"netlink datagram larger than {_RECV_BUFFER} bytes")
        return parse_nlmsgs(data)

    def transact(self, build: Callable[[int], bytes]) -> list[NetlinkMessage]:
        """Send ``build(seq)`` (which asks for an ack); return the replies before the ack."""
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        seq = self._seq
        self.sock.send(build(seq))
        replies: list[NetlinkMessage] = []
        while True:
            for msg in self.recv_messages():
                if msg.seq != seq:
                    continue
                if msg.type == NLMSG_ERROR:
                    error, text = parse_nlmsgerr(msg)
                    if error:
                        raise NetlinkError(error, text)
                    return replies
                if msg.type == NLMSG_DONE:
                    return replies
                replies.append(msg)


def resolve_family(name: str, nl: GenericNetlink | None = None) -> GenlFamily:
    """Ask the controller for a family's id and multicast groups."""
    own = nl is None
    link = GenericNetlink() if nl is None else nl
    try:
        try:
            replies = link.transact(lambda seq: getfamily_request(name, seq))
        except NetlinkError as e:
            if e.errno == errno.ENOENT:
                raise FamilyNotFound(f"generic netlink family {name!r} is not registered") from e
            raise
        return parse_family(replies)
    finally:
        if own:
            link.close()
