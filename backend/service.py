"""The storage node's service: every operation callers may ask for, in one place.

``StorageService`` builds the shared context (catalog, pool, exporter,
configuration, locks) and one object per concern over it: volumes,
snapshots, group snapshots, publications, the quarantine.  Its methods are what the gRPC API
serves; each hands the call to the object that owns it.  The node's own
state (capacity, health) is answered here.

Methods are synchronous and thread-safe: the gRPC server calls them from its
worker threads.
"""

from __future__ import annotations

from backend import quarantine
from backend.adoption_ops import Adoption
from backend.catalog.db import Catalog
from backend.exporting import Exporter, Exports
from backend.group_snapshot_ops import GroupSnapshots
from backend.operation import ServiceConfig, ServiceContext
from backend.pool import Pool
from backend.publication_ops import Publications
from backend.quarantine import Orphan
from backend.snapshot_ops import Snapshots
from backend.views import (
    CapacityInfo,
    GroupSnapshotInfo,
    HealthInfo,
    NbdTargetInfo,
    NfsTargetInfo,
    SnapshotInfo,
    VolumeInfo,
    capacity_info,
    low_space_problem,
)
from backend.volume_ops import Volumes

VERSION = "0.1.0"


class StorageService:
    """Every operation of the storage node, and the views of its catalog."""

    def __init__(
        self, catalog: Catalog, pool: Pool, exporter: Exporter, config: ServiceConfig
    ) -> None:
        self.context = ServiceContext(catalog, pool, exporter, config)
        self.volumes = Volumes(self.context)
        self.snapshots = Snapshots(self.context)
        self.group_snapshots = GroupSnapshots(self.context)
        self.publications = Publications(self.context)
        self.adoption = Adoption(self.context, self.volumes)

    @property
    def catalog(self) -> Catalog:
        return self.context.catalog

    @property
    def pool(self) -> Pool:
        return self.context.pool

    @property
    def exporter(self) -> Exporter:
        return self.context.exporter

    @property
    def exports(self) -> Exports:
        return self.context.exports

    @property
    def config(self) -> ServiceConfig:
        return self.context.config

    # volumes

    def create_volume(
        self,
        name: str,
        kind: str,
        size: int,
        parameters: dict[str, str] | None = None,
        source_snapshot_id: str | None = None,
        source_volume_id: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> VolumeInfo:
        return self.volumes.create_volume(
            name, kind, size, parameters, source_snapshot_id, source_volume_id, labels
        )

    def delete_volume(self, volume_id: str) -> None:
        self.volumes.delete_volume(volume_id)

    def expand_volume(self, volume_id: str, size: int) -> VolumeInfo:
        return self.volumes.expand_volume(volume_id, size)

    def set_volume_group(self, volume_id: str, gid: int) -> VolumeInfo:
        return self.volumes.set_volume_group(volume_id, gid)

    def modify_volume(self, volume_id: str, parameters: dict[str, str]) -> VolumeInfo:
        return self.volumes.modify_volume(volume_id, parameters)

    def get_volume(self, volume_id: str | None = None, name: str | None = None) -> VolumeInfo:
        return self.volumes.get_volume(volume_id, name)

    def list_volumes(self, max_entries: int = 0, token: str = "") -> tuple[list[VolumeInfo], str]:
        return self.volumes.list_volumes(max_entries, token)

    # snapshots

    def create_snapshot(self, name: str, source_volume_id: str) -> SnapshotInfo:
        return self.snapshots.create_snapshot(name, source_volume_id)

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.snapshots.delete_snapshot(snapshot_id)

    def list_snapshots(
        self,
        max_entries: int = 0,
        token: str = "",
        source_volume_id: str | None = None,
        snapshot_id: str | None = None,
    ) -> tuple[list[SnapshotInfo], str]:
        return self.snapshots.list_snapshots(max_entries, token, source_volume_id, snapshot_id)

    # group snapshots

    def create_group_snapshot(self, name: str, source_volume_ids: list[str]) -> GroupSnapshotInfo:
        return self.group_snapshots.create_group_snapshot(name, source_volume_ids)

    def delete_group_snapshot(self, group_snapshot_id: str) -> None:
        self.group_snapshots.delete_group_snapshot(group_snapshot_id)

    def get_group_snapshot(self, group_snapshot_id: str) -> GroupSnapshotInfo:
        return self.group_snapshots.get_group_snapshot(group_snapshot_id)

    # publications

    def publish_volume(
        self,
        volume_id: str,
        node_id: str,
        node_address: str,
        read_only: bool,
        multi_writer: bool = False,
        single_node: bool = False,
    ) -> NfsTargetInfo | NbdTargetInfo:
        return self.publications.publish_volume(
            volume_id, node_id, node_address, read_only, multi_writer, single_node
        )

    def unpublish_volume(self, volume_id: str, node_id: str) -> None:
        self.publications.unpublish_volume(volume_id, node_id)

    # the quarantine

    def list_orphans(self) -> list[Orphan]:
        return self.adoption.list_orphans()

    def adopt_volume(self, orphan: str, name: str, kind: str = "") -> VolumeInfo:
        return self.adoption.adopt_volume(orphan, name, kind)

    def purge_orphan(self, name: str) -> Orphan:
        return self.adoption.purge_orphan(name)

    # the node

    def capacity(self) -> CapacityInfo:
        with self.catalog.read_session() as s:
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
