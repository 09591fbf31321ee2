"""Kernel nbd devices given a new connection when their storage node comes back.

A kernel nbd device whose connection fails (its server went away, or a
request went unanswered for the device's timeout) waits its dead-connection
timeout for a new socket (``NBD_CMD_RECONFIGURE``), then fails I/O with EIO;
the kernel says so on the "nbd_mc_group" multicast group
(``NBD_CMD_LINK_DEAD``).  :class:`Reconnector` listens there and, for a device
recorded under its state directory, connects to the device's export again and
hands the kernel the new socket: at once, then every :data:`RETRY` seconds
while the device stays attached and its server stays away, so a storage node
back within the bound is a pause, and one back later makes the device work
again for what comes next (what failed in between stays failed).  A
definitive answer (the export does not exist or is not for this node) ends
the tries: waiting cannot change it, and the device fails I/O as it would
anyway.

The CSI node plugin runs one in a thread; ``moorage attach watch`` runs one
in the foreground for devices attached by hand.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Final

from csi.attach.block import kernel_attachments, kernel_connected
from csi.attach.errors import AttachError
from nbd import client as nbd_client
from nbd import kernel as nbd_kernel
from nbd.kernel_monitor import LinkDeadMonitor

log = logging.getLogger("moorage.attach")

RETRY: Final = 2.0  # seconds between tries while a device's server stays away
CONNECT_TIMEOUT: Final = 10.0  # one try's handshake


def reconnect(device: str, uri: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Give ``device`` a new connection to ``uri``.  Raises OSError (no server,
    try again), nbd.client.HandshakeError (the server refused: definitive when
    it sent a reply) or nbd.kernel.KernelNBDError."""
    negotiated = nbd_client.connect_uri(uri, timeout)
    try:
        nbd_kernel.reconnect_kernel(device, negotiated, backend_identifier=uri)
    finally:
        negotiated.sock.close()  # the kernel holds its own reference now


def _definitive(error: Exception) -> bool:
    return isinstance(error, nbd_client.HandshakeError) and error.reply is not None


class Reconnector:
    """Listens for dead nbd links and reconnects this state directory's devices."""

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        retry: float = RETRY,
        connect: Callable[[str, str], None] = reconnect,
    ) -> None:
        """Nothing is opened here: :meth:`open` does, before :meth:`run`."""
        self.state_dir = state_dir
        self.retry = retry
        self._connect = connect
        self._stopping = threading.Event()
        self._pending: dict[str, str] = {}  # device -> uri, still to reconnect
        self._monitor: LinkDeadMonitor | None = None

    def open(self) -> None:
        """Start listening for dead links (the nbd module loaded if it can be);
        AttachError when this kernel cannot say."""
        try:
            support = nbd_kernel.probe_kernel_nbd(load_module=True)
            if support.family is None:
                raise nbd_kernel.KernelNBDUnavailable(support.reason)
            self._monitor = LinkDeadMonitor()
        except (OSError, nbd_kernel.KernelNBDError) as e:
            raise AttachError(f"cannot watch the kernel's nbd devices: {e}") from e

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None

    def _note_dead(self, indices: list[int]) -> None:
        records = {a.device: a.uri for a in kernel_attachments(self.state_dir)}
        for index in indices:
            device = f"/dev/nbd{index}"
            uri = records.get(device)
            if uri is None:
                log.info("%s lost its connection; not attached by this node, left alone", device)
                continue
            log.warning("%s (%s) lost its connection: reconnecting", device, uri)
            self._pending[device] = uri

    def _try_pending(self) -> None:
        records = {a.device: a.uri for a in kernel_attachments(self.state_dir)}
        for device, uri in list(self._pending.items()):
            if records.get(device) != uri or not kernel_connected(device):
                del self._pending[device]  # detached meanwhile
                continue
            try:
                self._connect(device, uri)
            except (OSError, nbd_client.HandshakeError, nbd_kernel.KernelNBDError) as e:
                if _definitive(e):
                    log.error("%s (%s): %s; not reconnected", device, uri, e)
                    del self._pending[device]
                else:
                    log.debug("%s (%s): no server yet: %s", device, uri, e)
                continue
            log.warning("%s (%s) reconnected", device, uri)
            del self._pending[device]

    def run(self) -> None:
        """Until :meth:`stop`: wait for dead links, reconnect what is pending."""
        if self._monitor is None:
            raise RuntimeError("the reconnector is not open: call open() first")
        while not self._stopping.is_set():
            dead = self._monitor.wait(self.retry if self._pending else 1.0)
            if dead:
                self._note_dead(dead)
            if self._pending:
                self._try_pending()

    def start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name="nbd-reconnect", daemon=True)
        thread.start()
        return thread
