"""The storage node's operations, each journaled and crash-safe.

Every multi-step operation follows the same shape: under the catalog lock,
decide and record the intent (the row in its transitional state plus a
pending journal entry); then do the file, mount and export work, each step
idempotent; then record completion.  ``backend/reconcile.py`` re-runs the
middle step of any operation a crash interrupted.

Methods are synchronous and thread-safe: the gRPC server calls them from its
worker threads.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend import validation
from backend.catalog.db import (
    Catalog,
    finish_operation,
    get_publication,
    get_snapshot_by_name,
    get_volume_by_name,
    list_snapshots,
    list_volumes,
    publications_of,
    record_operation,
)
from backend.catalog.models import (
    Operation,
    OperationKind,
    Publication,
    PublicationState,
    Snapshot,
    SnapshotState,
    Volume,
    VolumeState,
    VolumeType,
)
from backend.errors import (
    AlreadyExists,
    BackendError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from backend.failpoints import failpoint
from backend.ganesha.config import MAX_EXPORT_ID, ExportConfig
from backend.pool import Pool
from nbd.exports import Export

log = logging.getLogger("moorage.backend")

VERSION = "0.1.0"
DEFAULT_PAGE = 100
MAX_PAGE = 1000


# ------------------------------------------------------------ what callers see


@dataclass(frozen=True)
class VolumeInfo:
    id: str
    name: str
    type: str
    size_bytes: int
    used_bytes: int
    fs_type: str | None
    squash: str | None
    source_snapshot_id: str | None
    source_volume_id: str | None
    state: str
    published_nodes: tuple[str, ...]
    parameters: dict[str, str]
    created_unix: int
    labels: dict[str, str] = field(default_factory=dict)
    publications: tuple[PublicationInfo, ...] = ()


@dataclass(frozen=True)
class PublicationInfo:
    node_id: str
    node_address: str
    read_only: bool


@dataclass(frozen=True)
class SnapshotInfo:
    id: str
    name: str
    source_volume_id: str
    type: str
    size_bytes: int
    fs_type: str | None
    state: str
    ready_to_use: bool
    created_unix: int


@dataclass(frozen=True)
class CapacityInfo:
    total_bytes: int
    free_bytes: int
    provisioned_bytes: int
    overcommit_ratio: float
    available_bytes: int


@dataclass(frozen=True)
class NfsTargetInfo:
    server: str
    port: int
    path: str
    mount_port: int


@dataclass(frozen=True)
class NbdTargetInfo:
    host: str
    port: int
    export_name: str
    tls: bool


@dataclass(frozen=True)
class HealthInfo:
    ok: bool
    version: str
    ganesha_running: bool
    nbd_exports: int
    nbd_connections: int
    message: str


@dataclass(frozen=True)
class ExporterStatus:
    ganesha_running: bool
    nbd_exports: int
    nbd_connections: int


class Exporter(Protocol):
    """What makes volumes reachable: ganesha's export files and the NBD export table."""

    def set_nfs_export(self, export: ExportConfig) -> None: ...
    def remove_nfs_export(self, export_id: int) -> None: ...
    def add_nbd_export(self, export: Export) -> None: ...
    def remove_nbd_export(self, name: str) -> None: ...
    def status(self) -> ExporterStatus: ...


@dataclass(frozen=True)
class ServiceConfig:
    nbd_host: str = "127.0.0.1"
    nbd_port: int = 10809
    nbd_tls: bool = False
    nfs_server: str = "127.0.0.1"
    nfs_port: int = 2049
    mount_port: int = 20048
    overcommit_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0.1 <= self.overcommit_ratio <= 100:
            raise InvalidArgument("overcommit ratio must be between 0.1 and 100")


# ------------------------------------------------------------------ helpers


def nbd_export_name(volume_id: str, node_id: str) -> str:
    return f"{volume_id}@{node_id}"


def nfs_pseudo_path(volume: Volume) -> str:
    return f"/volumes/{volume.name}"


def _unix(volume: Volume | Snapshot) -> int:
    return int(volume.created_at.timestamp())


def _new_id() -> str:
    return uuid.uuid4().hex


@dataclass
class _Locks:
    """One lock per key (volume id or name), so unrelated operations run in parallel."""

    guard: threading.Lock = field(default_factory=threading.Lock)
    held: dict[str, tuple[threading.Lock, int]] = field(default_factory=dict)

    @contextmanager
    def hold(self, key: str) -> Iterator[None]:
        with self.guard:
            lock, users = self.held.get(key, (threading.Lock(), 0))
            self.held[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self.guard:
                lock, users = self.held[key]
                if users == 1:
                    del self.held[key]
                else:
                    self.held[key] = (lock, users - 1)


class StorageService:
    def __init__(
        self, catalog: Catalog, pool: Pool, exporter: Exporter, config: ServiceConfig
    ) -> None:
        self.catalog = catalog
        self.pool = pool
        self.exporter = exporter
        self.config = config
        # Decisions that read then write the catalog (capacity, names, export ids).
        self._decide = threading.Lock()
        self._locks = _Locks()

    # -------------------------------------------------------------- views

    def _volume_info(self, s: Session, v: Volume, used: bool = True) -> VolumeInfo:
        pubs = publications_of(s, v.id)
        used_bytes = 0
        if used and v.state == VolumeState.READY:
            try:
                used_bytes = self.pool.used_bytes(v.id, v.type.value)
            except (OSError, BackendError) as e:
                log.warning("used bytes of volume %s: %s", v.id, e)
        return VolumeInfo(
            id=v.id,
            name=v.name,
            type=v.type.value,
            size_bytes=v.size_bytes,
            used_bytes=used_bytes,
            fs_type=v.fs_type.value if v.fs_type else None,
            squash=v.squash if v.type == VolumeType.NFS else None,
            source_snapshot_id=v.source_snapshot_id,
            source_volume_id=v.source_volume_id,
            state=v.state.value,
            published_nodes=tuple(sorted(p.node_id for p in pubs)),
            parameters=dict(v.parameters or {}),
            created_unix=_unix(v),
            labels=dict(v.labels or {}),
            publications=tuple(
                PublicationInfo(p.node_id, p.node_address, p.read_only)
                for p in sorted(pubs, key=lambda p: p.node_id)
            ),
        )

    @staticmethod
    def _snapshot_info(snap: Snapshot) -> SnapshotInfo:
        return SnapshotInfo(
            id=snap.id,
            name=snap.name,
            source_volume_id=snap.source_volume_id,
            type=snap.volume_type.value,
            size_bytes=snap.size_bytes,
            fs_type=snap.fs_type.value if snap.fs_type else None,
            state=snap.state.value,
            ready_to_use=snap.state == SnapshotState.READY,
            created_unix=_unix(snap),
        )

    def get_volume(self, volume_id: str | None = None, name: str | None = None) -> VolumeInfo:
        with self.catalog.session() as s:
            if volume_id is not None:
                v = s.get(Volume, validation.object_id(volume_id, "volume id"))
            else:
                v = get_volume_by_name(s, validation.volume_name(name or ""))
            if v is None:
                raise NotFound(f"volume {volume_id or name} not found")
            return self._volume_info(s, v)

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
            infos = [self._volume_info(s, v) for v in rows]
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
                return ([self._snapshot_info(snap)] if snap else []), ""
            if source_volume_id is not None:
                validation.object_id(source_volume_id, "source volume id")
            rows = list_snapshots(s, after, limit + 1, source_volume_id=source_volume_id)
            more = len(rows) > limit
            rows = rows[:limit]
            return [self._snapshot_info(x) for x in rows], (rows[-1].id if more and rows else "")

    def capacity(self) -> CapacityInfo:
        with self.catalog.session() as s:
            return self._capacity(s)

    def _capacity(self, s: Session) -> CapacityInfo:
        total, free = self.pool.capacity()
        provisioned = int(s.scalar(select(func.coalesce(func.sum(Volume.size_bytes), 0))) or 0)
        ratio = self.config.overcommit_ratio
        available = max(0, int(total * ratio) - provisioned)
        return CapacityInfo(total, free, provisioned, ratio, available)

    def _check_capacity(self, s: Session, extra: int) -> None:
        cap = self._capacity(s)
        if extra > cap.available_bytes:
            raise ResourceExhausted(
                f"{extra} bytes requested but only {cap.available_bytes} available "
                f"(pool {cap.total_bytes} bytes x overcommit {cap.overcommit_ratio}, "
                f"{cap.provisioned_bytes} provisioned)"
            )

    def health(self) -> HealthInfo:
        st = self.exporter.status()
        problems = []
        if not st.ganesha_running:
            problems.append("ganesha is not running")
        return HealthInfo(
            ok=not problems,
            version=VERSION,
            ganesha_running=st.ganesha_running,
            nbd_exports=st.nbd_exports,
            nbd_connections=st.nbd_connections,
            message="; ".join(problems) or "ok",
        )

    # ------------------------------------------------------------ volumes

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
        name = validation.volume_name(name)
        volume_labels = validation.labels(dict(labels or {}))
        if kind not in ("nbd", "nfs"):
            raise InvalidArgument(f"volume type {kind[:20]!r} is not nbd or nfs")
        size = validation.size(size)
        params = validation.parameters(kind, dict(parameters or {}))
        if source_snapshot_id and source_volume_id:
            raise InvalidArgument("give a source snapshot or a source volume, not both")
        if source_snapshot_id:
            validation.object_id(source_snapshot_id, "source snapshot id")
        if source_volume_id:
            validation.object_id(source_volume_id, "source volume id")
        vtype = VolumeType(kind)
        with self._locks.hold(f"name:{name}"):
            with self._decide, self.catalog.session() as s:
                existing = get_volume_by_name(s, name)
                if existing is not None:
                    same = (
                        existing.type == vtype
                        and existing.size_bytes == size
                        and dict(existing.parameters or {}) == params
                        and existing.source_snapshot_id == (source_snapshot_id or None)
                        and existing.source_volume_id == (source_volume_id or None)
                    )
                    if not same:
                        raise AlreadyExists(
                            f"volume {name!r} exists with a different type, size, parameters "
                            "or source"
                        )
                    if existing.state not in (VolumeState.CREATING, VolumeState.READY):
                        raise FailedPrecondition(f"volume {name!r} is {existing.state.value}")
                    vol_id = existing.id
                    pending = existing.state == VolumeState.CREATING
                else:
                    self._check_source(s, vtype, size, source_snapshot_id, source_volume_id)
                    self._check_capacity(s, size)
                    vol_id = _new_id()
                    s.add(
                        Volume(
                            id=vol_id,
                            name=name,
                            type=vtype,
                            size_bytes=size,
                            fs_type=params.get("fs_type"),
                            squash=params.get("squash", "root_squash"),
                            parameters=params,
                            labels=volume_labels,
                            source_snapshot_id=source_snapshot_id or None,
                            source_volume_id=source_volume_id or None,
                            state=VolumeState.CREATING,
                            nfs_export_id=self._next_export_id(s)
                            if vtype == VolumeType.NFS
                            else None,
                        )
                    )
                    kind_op = (
                        OperationKind.CLONE_VOLUME
                        if source_snapshot_id or source_volume_id
                        else OperationKind.CREATE_VOLUME
                    )
                    record_operation(s, kind_op, vol_id, {"name": name})
                    pending = True
            if pending:
                failpoint("create.intent")
                self.finish_create(vol_id)
        return self.get_volume(volume_id=vol_id)

    @staticmethod
    def _next_export_id(s: Session) -> int:
        highest = s.scalar(select(func.max(Volume.nfs_export_id))) or 0
        if highest >= MAX_EXPORT_ID:
            used = set(s.scalars(select(Volume.nfs_export_id)).all())
            free = next((i for i in range(1, MAX_EXPORT_ID + 1) if i not in used), None)
            if free is None:
                raise ResourceExhausted("no NFS export id left")
            return free
        return int(highest) + 1

    def _check_source(
        self,
        s: Session,
        vtype: VolumeType,
        size: int,
        snapshot_id: str | None,
        volume_id: str | None,
    ) -> None:
        if snapshot_id:
            snap = s.get(Snapshot, snapshot_id)
            if snap is None or snap.state != SnapshotState.READY:
                raise NotFound(f"snapshot {snapshot_id} not found")
            if snap.volume_type != vtype:
                raise InvalidArgument(f"snapshot {snapshot_id} is of an {snap.volume_type} volume")
            if size < snap.size_bytes:
                raise InvalidArgument(f"size is smaller than the snapshot ({snap.size_bytes})")
        if volume_id:
            src = s.get(Volume, volume_id)
            if src is None or src.state != VolumeState.READY:
                raise NotFound(f"volume {volume_id} not found")
            if src.type != vtype:
                raise InvalidArgument(f"volume {volume_id} is an {src.type} volume")
            if size < src.size_bytes:
                raise InvalidArgument(f"size is smaller than the source volume ({src.size_bytes})")

    def _close_journal(
        self, s: Session, target: str, *kinds: OperationKind, error: str | None = None
    ) -> None:
        """Mark the pending journal entry of ``target`` done (or failed with ``error``)."""
        op = self._pending_op(s, target, *kinds)
        if op is not None:
            finish_operation(op, error=error)

    def _pending_op(self, s: Session, target: str, *kinds: OperationKind) -> Operation | None:
        return s.scalars(
            select(Operation)
            .where(Operation.target_id == target, Operation.kind.in_(kinds))
            .where(Operation.state == "pending")
            .order_by(Operation.id.desc())
        ).first()

    def finish_create(self, vol_id: str) -> None:
        """Build a creating volume's files (idempotent), then mark it ready.

        On failure the half-made volume is removed, files and record.
        """
        with self.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is None:
                return
            kind, size = v.type, v.size_bytes
            fs = v.fs_type.value if v.fs_type else None
            snap_id, src_id = v.source_snapshot_id, v.source_volume_id
        try:
            if snap_id:
                self.pool.clone_from_snapshot(snap_id, vol_id, size, kind.value, fs)
            elif src_id:
                self.pool.clone_from_volume(src_id, vol_id, size, kind.value, fs)
            elif kind == VolumeType.NBD:
                self.pool.create_block_image(vol_id, size)
            else:
                assert fs is not None
                self.pool.create_fs_volume(vol_id, size, fs)
        except BaseException as e:
            log.error("creating volume %s failed: %s; removing what was made", vol_id, e)
            self.pool.delete_volume(vol_id)
            with self.catalog.session() as s:
                self._close_journal(
                    s, vol_id, OperationKind.CREATE_VOLUME, OperationKind.CLONE_VOLUME, error=str(e)
                )
                v = s.get(Volume, vol_id)
                if v is not None:
                    s.delete(v)
            raise
        failpoint("create.files")
        with self.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is not None:
                v.state = VolumeState.READY
            self._close_journal(s, vol_id, OperationKind.CREATE_VOLUME, OperationKind.CLONE_VOLUME)
        log.info("volume %s ready", vol_id)

    def delete_volume(self, volume_id: str) -> None:
        vol_id = validation.object_id(volume_id, "volume id")
        with self._locks.hold(vol_id):
            with self._decide, self.catalog.session() as s:
                v = s.get(Volume, vol_id)
                if v is None:
                    return  # already gone: deleting is idempotent
                pubs = publications_of(s, vol_id)
                if pubs:
                    nodes = ", ".join(sorted(p.node_id for p in pubs))
                    raise FailedPrecondition(f"volume {vol_id} is published to {nodes}")
                if v.state != VolumeState.DELETING:
                    v.state = VolumeState.DELETING
                    record_operation(s, OperationKind.DELETE_VOLUME, vol_id)
            failpoint("delete.intent")
            self.finish_delete(vol_id)

    def finish_delete(self, vol_id: str) -> None:
        self.pool.delete_volume(vol_id)
        failpoint("delete.files")
        with self.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is not None:
                s.delete(v)
            self._close_journal(s, vol_id, OperationKind.DELETE_VOLUME)
        log.info("volume %s deleted", vol_id)

    def expand_volume(self, volume_id: str, size: int) -> VolumeInfo:
        vol_id = validation.object_id(volume_id, "volume id")
        new_size = validation.size(size)
        with self._locks.hold(vol_id):
            with self._decide, self.catalog.session() as s:
                v = s.get(Volume, vol_id)
                if v is None:
                    raise NotFound(f"volume {vol_id} not found")
                if v.state not in (VolumeState.READY, VolumeState.EXPANDING):
                    raise FailedPrecondition(f"volume {vol_id} is {v.state.value}")
                if v.state == VolumeState.READY:
                    if new_size <= v.size_bytes:
                        return self._volume_info(s, v)  # already that big: nothing to do
                    if (
                        v.fs_type is not None
                        and not self.pool.grows_online(v.fs_type.value)
                        and publications_of(s, vol_id)
                    ):
                        # Refused before the intent is recorded: the volume stays ready.
                        raise FailedPrecondition(
                            f"volume {vol_id} is {v.fs_type.value}, which this host grows only "
                            "offline: unpublish it first"
                        )
                    self._check_capacity(s, new_size - v.size_bytes)
                    v.state = VolumeState.EXPANDING
                    record_operation(s, OperationKind.EXPAND_VOLUME, vol_id, {"size": new_size})
                else:
                    op = self._pending_op(s, vol_id, OperationKind.EXPAND_VOLUME)
                    new_size = max(new_size, int((op.payload or {}).get("size", 0)) if op else 0)
            failpoint("expand.intent")
            self.finish_expand(vol_id, new_size)
        return self.get_volume(volume_id=vol_id)

    def finish_expand(self, vol_id: str, new_size: int) -> None:
        with self.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is None:
                return
            kind, fs = v.type, (v.fs_type.value if v.fs_type else None)
        if kind == VolumeType.NBD:
            self.pool.expand_block_image(vol_id, new_size)
        else:
            assert fs is not None
            self.pool.expand_fs_volume(vol_id, new_size, fs)
        failpoint("expand.files")
        with self.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is not None:
                v.size_bytes = max(v.size_bytes, new_size)
                v.state = VolumeState.READY
            self._close_journal(s, vol_id, OperationKind.EXPAND_VOLUME)
        log.info("volume %s expanded to %d bytes", vol_id, new_size)

    def modify_volume(self, volume_id: str, parameters: dict[str, str]) -> VolumeInfo:
        """Change mutable parameters; the exports follow from the catalog at once.

        One catalog transaction is the whole intent: a crash after it leaves the
        exports to the start-up reconciliation, which renders them from the catalog.
        """
        vol_id = validation.object_id(volume_id, "volume id")
        with self._locks.hold(vol_id):
            with self._decide, self.catalog.session() as s:
                v = s.get(Volume, vol_id)
                if v is None:
                    raise NotFound(f"volume {vol_id} not found")
                if v.state not in (VolumeState.READY, VolumeState.EXPANDING):
                    raise FailedPrecondition(f"volume {vol_id} is {v.state.value}")
                changes = validation.mutable_parameters(v.type.value, dict(parameters))
                merged = {**(v.parameters or {}), **changes}
                if v.type == VolumeType.NBD:
                    merged = {k: val for k, val in merged.items() if val != "0"}
                else:
                    v.squash = changes["squash"]
                v.parameters = merged
            failpoint("modify.recorded")
            self.apply_exports(vol_id)
        log.info("volume %s modified: %s", vol_id, changes)
        return self.get_volume(volume_id=vol_id)

    # ---------------------------------------------------------- snapshots

    def create_snapshot(self, name: str, source_volume_id: str) -> SnapshotInfo:
        name = validation.volume_name(name, "snapshot name")
        src = validation.object_id(source_volume_id, "source volume id")
        with self._locks.hold(f"snap:{name}"), self._locks.hold(src):
            with self._decide, self.catalog.session() as s:
                existing = get_snapshot_by_name(s, name)
                if existing is not None:
                    if existing.source_volume_id != src:
                        raise AlreadyExists(f"snapshot {name!r} exists for another volume")
                    if existing.state == SnapshotState.READY:
                        return self._snapshot_info(existing)
                    if existing.state == SnapshotState.DELETING:
                        raise FailedPrecondition(f"snapshot {name!r} is being deleted")
                    snap_id = existing.id
                else:
                    v = s.get(Volume, src)
                    if v is None:
                        raise NotFound(f"volume {src} not found")
                    if v.state != VolumeState.READY:
                        raise FailedPrecondition(f"volume {src} is {v.state.value}")
                    snap_id = _new_id()
                    s.add(
                        Snapshot(
                            id=snap_id,
                            name=name,
                            source_volume_id=src,
                            volume_type=v.type,
                            fs_type=v.fs_type,
                            size_bytes=v.size_bytes,
                            state=SnapshotState.CREATING,
                        )
                    )
                    record_operation(s, OperationKind.CREATE_SNAPSHOT, snap_id, {"source": src})
            failpoint("snapshot.intent")
            self.finish_snapshot(snap_id)
        with self.catalog.session() as s:
            snap = s.get(Snapshot, snap_id)
            assert snap is not None
            return self._snapshot_info(snap)

    def finish_snapshot(self, snap_id: str) -> None:
        with self.catalog.session() as s:
            snap = s.get(Snapshot, snap_id)
            if snap is None:
                return
            src = snap.source_volume_id
            fs = snap.fs_type.value if snap.fs_type else None
            source_exists = s.get(Volume, src) is not None
        try:
            if not source_exists:
                raise NotFound(f"source volume {src} of snapshot {snap_id} is gone")
            self.pool.snapshot(src, snap_id, fs)
        except BaseException as e:
            self.pool.delete_snapshot(snap_id)
            with self.catalog.session() as s:
                snap = s.get(Snapshot, snap_id)
                if snap is not None:
                    s.delete(snap)
                self._close_journal(s, snap_id, OperationKind.CREATE_SNAPSHOT, error=str(e))
            raise
        failpoint("snapshot.files")
        with self.catalog.session() as s:
            snap = s.get(Snapshot, snap_id)
            if snap is not None:
                snap.state = SnapshotState.READY
            self._close_journal(s, snap_id, OperationKind.CREATE_SNAPSHOT)
        log.info("snapshot %s of volume %s ready", snap_id, src)

    def delete_snapshot(self, snapshot_id: str) -> None:
        snap_id = validation.object_id(snapshot_id, "snapshot id")
        with self._locks.hold(snap_id):
            with self._decide, self.catalog.session() as s:
                snap = s.get(Snapshot, snap_id)
                if snap is None:
                    return
                if snap.state != SnapshotState.DELETING:
                    snap.state = SnapshotState.DELETING
                    record_operation(s, OperationKind.DELETE_SNAPSHOT, snap_id)
            failpoint("delete_snapshot.intent")
            self.finish_delete_snapshot(snap_id)

    def finish_delete_snapshot(self, snap_id: str) -> None:
        self.pool.delete_snapshot(snap_id)
        failpoint("delete_snapshot.files")
        with self.catalog.session() as s:
            snap = s.get(Snapshot, snap_id)
            if snap is not None:
                s.delete(snap)
            self._close_journal(s, snap_id, OperationKind.DELETE_SNAPSHOT)

    # ------------------------------------------------------- publications

    def publish_volume(
        self,
        volume_id: str,
        node_id: str,
        node_address: str,
        read_only: bool,
        multi_writer: bool = False,
        single_node: bool = False,
    ) -> NfsTargetInfo | NbdTargetInfo:
        """Make the volume reachable by one node.  ``single_node``: refuse when
        another node holds a publication (decided under the catalog lock, so two
        callers racing for two nodes cannot both win)."""
        vol_id = validation.object_id(volume_id, "volume id")
        node = validation.node_id(node_id)
        address = validation.node_address(node_address)
        with self._locks.hold(vol_id):
            with self._decide, self.catalog.session() as s:
                v = s.get(Volume, vol_id)
                if v is None:
                    raise NotFound(f"volume {vol_id} not found")
                if v.state not in (VolumeState.READY, VolumeState.EXPANDING):
                    raise FailedPrecondition(f"volume {vol_id} is {v.state.value}")
                pub = get_publication(s, vol_id, node)
                if pub is not None:
                    if (
                        pub.read_only != read_only
                        or pub.node_address != address
                        or pub.multi_writer != multi_writer
                    ):
                        raise AlreadyExists(
                            f"volume {vol_id} is published to {node} with other parameters"
                        )
                    if pub.state == PublicationState.UNPUBLISHING:
                        raise FailedPrecondition(
                            f"volume {vol_id} is being unpublished from {node}"
                        )
                else:
                    others = [p.node_id for p in publications_of(s, vol_id) if p.node_id != node]
                    if single_node and others:
                        raise FailedPrecondition(
                            f"volume {vol_id} is single-node and already published to {others[0]}"
                        )
                    if v.type == VolumeType.NBD and not read_only:
                        writers = [
                            p.node_id
                            for p in publications_of(s, vol_id)
                            if not p.read_only and not (multi_writer and p.multi_writer)
                        ]
                        if writers:
                            raise FailedPrecondition(
                                f"block volume {vol_id} is already published read-write to "
                                f"{writers[0]}"
                            )
                    s.add(
                        Publication(
                            volume_id=vol_id,
                            node_id=node,
                            node_address=address,
                            read_only=read_only,
                            multi_writer=multi_writer,
                            state=PublicationState.PUBLISHING,
                        )
                    )
                    record_operation(s, OperationKind.PUBLISH, vol_id, {"node": node})
            failpoint("publish.intent")
            self.apply_exports(vol_id)
            failpoint("publish.exported")
            with self.catalog.session() as s:
                pub = get_publication(s, vol_id, node)
                assert pub is not None
                pub.state = PublicationState.PUBLISHED
                self._close_journal(s, vol_id, OperationKind.PUBLISH)
                v = s.get(Volume, vol_id)
                assert v is not None
                return self._target(v, node)

    def _target(self, v: Volume, node: str) -> NfsTargetInfo | NbdTargetInfo:
        if v.type == VolumeType.NFS:
            return NfsTargetInfo(
                self.config.nfs_server,
                self.config.nfs_port,
                nfs_pseudo_path(v),
                self.config.mount_port,
            )
        return NbdTargetInfo(
            self.config.nbd_host,
            self.config.nbd_port,
            nbd_export_name(v.id, node),
            self.config.nbd_tls,
        )

    def unpublish_volume(self, volume_id: str, node_id: str) -> None:
        vol_id = validation.object_id(volume_id, "volume id")
        node = validation.node_id(node_id)
        with self._locks.hold(vol_id):
            with self._decide, self.catalog.session() as s:
                pub = get_publication(s, vol_id, node)
                if pub is None:
                    return  # not published there: nothing to undo
                if pub.state != PublicationState.UNPUBLISHING:
                    pub.state = PublicationState.UNPUBLISHING
                    record_operation(s, OperationKind.UNPUBLISH, vol_id, {"node": node})
            failpoint("unpublish.intent")
            self.finish_unpublish(vol_id, node)

    def finish_unpublish(self, vol_id: str, node: str) -> None:
        self.apply_exports(vol_id)
        failpoint("unpublish.exported")
        with self.catalog.session() as s:
            pub = get_publication(s, vol_id, node)
            if pub is not None:
                s.delete(pub)
            self._close_journal(s, vol_id, OperationKind.UNPUBLISH)
        log.info("volume %s unpublished from %s", vol_id, node)

    # ------------------------------------------------------------ exports

    def nfs_export_config(self, v: Volume, pubs: Sequence[Publication]) -> ExportConfig:
        live = [p for p in pubs if p.state != PublicationState.UNPUBLISHING]
        return ExportConfig(
            export_id=self.nfs_export_id(v),
            path=self.pool.export_dir(v.id),
            pseudo=nfs_pseudo_path(v),
            clients=tuple(sorted(p.node_address for p in live if not p.read_only)),
            ro_clients=tuple(sorted(p.node_address for p in live if p.read_only)),
            squash=v.squash,  # type: ignore[arg-type]
        )

    @staticmethod
    def nfs_export_id(v: Volume) -> int:
        if v.nfs_export_id is None:
            raise FailedPrecondition(f"volume {v.id} has no NFS export id")
        return v.nfs_export_id

    def nbd_exports_of(self, v: Volume, pubs: Sequence[Publication]) -> list[Export]:
        return [
            Export(
                name=nbd_export_name(v.id, p.node_id),
                path=self.pool.image_path(v.id),
                read_only=p.read_only,
                description=f"moorage volume {v.name} for node {p.node_id}",
                allowed_clients=frozenset({ipaddress.ip_network(p.node_address)}),
                tls_required=self.config.nbd_tls,
                iops_limit=int((v.parameters or {}).get("iops_limit", 0)),
                bandwidth_limit=int((v.parameters or {}).get("bandwidth_limit", 0)),
            )
            for p in pubs
            if p.state != PublicationState.UNPUBLISHING
        ]

    def apply_exports(self, vol_id: str) -> None:
        """Make the exporter match the catalog for one volume (idempotent)."""
        with self.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is None:
                return
            pubs = publications_of(s, vol_id)
            if v.type == VolumeType.NFS:
                live = [p for p in pubs if p.state != PublicationState.UNPUBLISHING]
                if live:
                    self.exporter.set_nfs_export(self.nfs_export_config(v, pubs))
                elif v.nfs_export_id is not None:
                    self.exporter.remove_nfs_export(v.nfs_export_id)
                return
            wanted = {e.name: e for e in self.nbd_exports_of(v, pubs)}
            for p in pubs:
                name = nbd_export_name(v.id, p.node_id)
                if name not in wanted:
                    self.exporter.remove_nbd_export(name)
            for export in wanted.values():
                self.exporter.add_nbd_export(export)
