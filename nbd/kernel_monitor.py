"""Watching the kernel's nbd devices for lost connections (NBD_CMD_LINK_DEAD multicasts).

A device whose server went away is reported here; ``nbd.kernel.reconnect_kernel``
gives it a fresh socket.
"""

from __future__ import annotations

from nbd.kernel import _netlink_family
from nbd.kernel_errors import KernelNBDUnavailable
from nbd.netlink import (
    NBD_GENL_MCAST_GROUP_NAME,
    NETLINK_ADD_MEMBERSHIP,
    SOL_NETLINK,
    parse_link_dead,
)
from nbd.netlink_socket import GenericNetlink


class LinkDeadMonitor:
    """Listens on "nbd_mc_group" for NBD_CMD_LINK_DEAD: a device lost its connection.

    The answer to one is ``reconnect_kernel`` with a fresh socket, within the
    device's dead-connection timeout.
    """

    def __init__(self) -> None:
        self.family = _netlink_family()
        group = self.family.mcast_groups.get(NBD_GENL_MCAST_GROUP_NAME)
        if group is None:
            raise KernelNBDUnavailable(f"no {NBD_GENL_MCAST_GROUP_NAME!r} multicast group")
        self._nl = GenericNetlink(timeout=0)
        try:
            self._nl.sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, group)
        except BaseException:
            self._nl.close()
            raise

    def fileno(self) -> int:
        return self._nl.sock.fileno()

    def wait(self, timeout: float | None = None) -> list[int]:
        """Indices of devices whose link died; [] if nothing arrived within ``timeout``."""
        self._nl.sock.settimeout(timeout)
        try:
            messages = self._nl.recv_messages()
        except TimeoutError:
            return []
        return parse_link_dead(messages, self.family.id)

    def close(self) -> None:
        self._nl.close()

    def __enter__(self) -> LinkDeadMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
