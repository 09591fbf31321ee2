"""The storage nodes' health, checked in the background by the controller.

Every ``interval`` seconds (``--storage-node-check-interval``) each
configured storage node is asked its Health (at most
``storagenodes.PROBE_TIMEOUT``), one thread per node so a node that does not
answer never delays the others.  What it answers goes to three
places, never to the CSI Probe (which answers for this process only):

- the gauge ``moorage_csi_storage_node_up{storage_node}``: 1 while the node
  answers and serves (a node low on space but serving counts as up), else 0;
- one log line when a node goes down (WARNING, with the reason) or comes
  back (INFO), and at the first check;
- the VolumeCondition the controller reports for the node's volumes
  (``StorageNodes.problem``).
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from csi.storagenodes import PROBE_TIMEOUT, Health, StorageNodes

log = logging.getLogger("moorage.csi.storagenodes")

CHECK_INTERVAL = 15.0
UP_METRIC = "moorage_csi_storage_node_up"


class StorageNodeHealth:
    """Checks every storage node of ``nodes`` until :meth:`stop`."""

    def __init__(
        self,
        nodes: StorageNodes,
        interval: float = CHECK_INTERVAL,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError("the check interval must be positive")
        self.nodes = nodes
        self.interval = interval
        self.up = Gauge(
            UP_METRIC,
            "1 while the storage node answers its Health call and serves "
            "(low on space counts as up), else 0.",
            ["storage_node"],
            registry=REGISTRY if registry is None else registry,
        )
        self._last: dict[str, bool] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """One checking thread per storage node; the first checks start at once."""
        for name in self.nodes.names:
            thread = threading.Thread(
                target=self._watch, args=(name,), name=f"health-{name}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def stop(self) -> None:
        """Stop checking; a check under way ends within its own timeout."""
        self._stop.set()
        for thread in self._threads:
            thread.join(PROBE_TIMEOUT + 1)
        self._threads.clear()

    def check(self, name: str) -> Health:
        """Ask ``name`` now: the gauge, the log on a change, the kept answer."""
        health = self.nodes.health(name)
        with self._lock:
            before = self._last.get(name)
            self._last[name] = health.ok
        if before != health.ok:
            # the message names the node: "storage node NAME: ..."
            if health.ok:
                log.info("up: %s", health.message)
            else:
                log.warning("down: %s", health.message)
        self.up.labels(name).set(1 if health.ok else 0)
        return health

    def _watch(self, name: str) -> None:
        while not self._stop.is_set():
            try:
                self.check(name)
            except Exception:  # a bug here must not end the checks
                log.exception("checking storage node %s failed", name)
            self._stop.wait(self.interval)
