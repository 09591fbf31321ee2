"""The volume conditions the node plugin last reported, counted for Prometheus.

kubelet asks NodeGetVolumeStats of every volume staged or published on its
node (every minute, ``--volume-stats-agg-period``), whether or not its
CSIVolumeHealth gate shows the condition anywhere.  Each answer's
``abnormal`` is kept here by volume id, and the gauge
``moorage_csi_volumes_abnormal`` counts the volumes last reported abnormal
that are still staged on the node (a record in the node state), so the
count is read at scrape time without touching a mount: a mount whose server
is away can take the I/O timeout to answer.  Volume ids never appear in the
metric: the metrics port has no authentication.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

ABNORMAL_METRIC = "moorage_csi_volumes_abnormal"


class VolumeConditions:
    """The last reported condition of each volume: True when abnormal."""

    def __init__(self) -> None:
        self._abnormal: dict[str, bool] = {}
        self._lock = threading.Lock()

    def record(self, volume_id: str, abnormal: bool) -> None:
        with self._lock:
            self._abnormal[volume_id] = abnormal

    def abnormal(self, staged: Callable[[str], bool]) -> int:
        """Volumes last reported abnormal and still ``staged``; the others are
        forgotten (unstaged, or deleted from the node state by a reconcile)."""
        with self._lock:
            gone = [v for v in self._abnormal if not staged(v)]
            for volume_id in gone:
                del self._abnormal[volume_id]
            return sum(self._abnormal.values())


class VolumeConditionsCollector(Collector):
    """``moorage_csi_volumes_abnormal``, read at each scrape."""

    def __init__(self, conditions: VolumeConditions, staged: Callable[[str], bool]) -> None:
        self.conditions = conditions
        self.staged = staged

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            ABNORMAL_METRIC,
            "Volumes on this node whose condition, as last reported to kubelet "
            "(NodeGetVolumeStats), is abnormal.",
            value=self.conditions.abnormal(self.staged),
        )
