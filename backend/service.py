"""The storage node's service: its operations and what callers can read.

``StorageService`` is what the gRPC service and the start-up
reconciliation call.  How an operation starts and ends (locks, the recorded
intent, the journal) is ``backend/operation.py``; the operations are
``volume_ops.py``, ``snapshot_ops.py`` and ``publication_ops.py``.

Methods are synchronous and thread-safe: the gRPC server calls them from its
worker threads.
"""

from __future__ import annotations

from backend import quarantine, validation
from backend.adoption_ops import AdoptionOperations
from backend.catalog.db import list_snapshots, list_volumes
from backend.catalog.models import Snapshot
from backend.publication_ops import PublicationOperations
from backend.snapshot_ops import SnapshotOperations
from backend.views import (
    CapacityInfo,
    HealthInfo,
    SnapshotInfo,
    VolumeInfo,
    capacity_info,
    low_space_problem,
    snapshot_info,
    volume_info,
)
from backend.volume_ops import VolumeOperations

VERSION = "0.1.0"
DEFAULT_PAGE = 100
MAX_PAGE = 1000


class StorageService(
    VolumeOperations, SnapshotOperations, PublicationOperations, AdoptionOperations
):
    """Every operation of the storage node, and the views of its catalog."""

    @staticmethod
    def _page(max_entries: int, token: str) -> tuple[int, str | None]:
        limit = min(max_entries or DEFAULT_PAGE, MAX_PAGE)
        after = validation.object_id(token, "starting token") if token else None
        return limit, after

    def list_volumes(self, max_entries: int = 0, token: str = "") -> tuple[list[VolumeInfo], str]:
        limit, after = self._page(max_entries, token)
        with self.catalog.session() as s:
            rows = list_volumes(s, after, limit + 1)
            more = len(rows) > limit
            rows = rows[:limit]
            infos = [volume_info(s, v, self.pool) for v in rows]
        return infos, (rows[-1].id if more and rows else "")

    def list_snapshots(
        self,
        max_entries: int = 0,
        token: str = "",
        source_volume_id: str | None = None,
        snapshot_id: str | None = None,
    ) -> tuple[list[SnapshotInfo], str]:
        limit, after = self._page(max_entries, token)
        with self.catalog.session() as s:
            if snapshot_id is not None:
                snap = s.get(Snapshot, validation.object_id(snapshot_id, "snapshot id"))
                return ([snapshot_info(snap)] if snap else []), ""
            if source_volume_id is not None:
                validation.object_id(source_volume_id, "source volume id")
            rows = list_snapshots(s, after, limit + 1, source_volume_id=source_volume_id)
            more = len(rows) > limit
            rows = rows[:limit]
            return [snapshot_info(x) for x in rows], (rows[-1].id if more and rows else "")

    def capacity(self) -> CapacityInfo:
        with self.catalog.session() as s:
            return capacity_info(s, self.pool, self.config.overcommit_ratio)

    def health(self) -> HealthInfo:
        """ok: nothing wrong; serving: requests are served (a pool low on space
        is not ok, but still serving)."""
        st = self.exporter.status()
        problems = []
        if not st.ganesha_running:
            problems.append("ganesha is not running")
        low = None
        try:
            total, free = self.pool.capacity()
            low = low_space_problem(total, free, self.config.low_space_percent)
        except OSError as e:
            problems.append(f"pool {self.pool.root} unreadable: {e.strerror or e}")
        serving = not problems
        if low is not None:
            problems.append(low)
        still = ["still serving"] if serving and problems else []
        return HealthInfo(
            ok=not problems,
            version=VERSION,
            ganesha_running=st.ganesha_running,
            nbd_exports=st.nbd_exports,
            nbd_connections=st.nbd_connections,
            message="; ".join(problems + still + self._notices()) or "ok",
            serving=serving,
            low_space=low is not None,
        )

    def _notices(self) -> list[str]:
        """What an operator should see but that does not stop the node serving."""
        quarantined = quarantine.count(self.pool)
        if quarantined:
            return [f"{quarantined} images in quarantine (moorage pool orphans)"]
        return []
