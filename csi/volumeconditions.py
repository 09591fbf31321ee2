"""The volume conditions the node plugin last reported, counted for Prometheus.

kubelet asks NodeGetVolumeStats of every volume staged or published on its
node (every minute, ``--volume-stats-agg-period``), whether or not its
CSIVolumeHealth gate shows the condition anywhere.  kubelet asks once per
path the volume is at (``volume_path``: each pod's publication of it), and
the answers may differ (one bind mount gone, the others fine), so each
answer's ``abnormal`` is kept here by volume id and path: kept by volume id
alone, a volume with one broken publication of two would flap between
abnormal and not at each round of kubelet's calls, and an alert's ``for``
might never run out.  The gauge ``moorage_csi_volumes_abnormal`` counts the
volumes with any path last reported abnormal that are still staged on the
node (a record in the node state); a path unpublished is forgotten, so the
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
    """The last reported condition of each volume at each of its paths: True
    when abnormal."""

    def __init__(self) -> None:
        self._abnormal: dict[str, dict[str, bool]] = {}
        self._lock = threading.Lock()

    def record(self, volume_id: str, volume_path: str, abnormal: bool) -> None:
        with self._lock:
            self._abnormal.setdefault(volume_id, {})[volume_path] = abnormal

    def forget(self, volume_id: str, volume_path: str) -> None:
        """The volume is no longer at ``volume_path`` (unpublished from it):
        kubelet will not ask about that path again."""
        with self._lock:
            paths = self._abnormal.get(volume_id)
            if paths is not None:
                paths.pop(volume_path, None)
                if not paths:
                    del self._abnormal[volume_id]

    def abnormal(self, staged: Callable[[str], bool]) -> int:
        """Volumes with a path last reported abnormal and still ``staged``; the
        others are forgotten (unstaged, or deleted from the node state by a
        reconcile)."""
        with self._lock:
            gone = [v for v in self._abnormal if not staged(v)]
            for volume_id in gone:
                del self._abnormal[volume_id]
            return sum(any(paths.values()) for paths in self._abnormal.values())


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
