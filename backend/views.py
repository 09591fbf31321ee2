"""What callers of the storage service see: frozen records made from catalog rows.

The gRPC API turns these into protobuf messages; nothing here changes the
catalog.  A view is made inside a catalog session; what the pool must be
asked (the bytes a volume uses) is added after it, outside any session.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend import validation
from backend.api.errors import BackendError
from backend.catalog.db import group_members, publications_of
from backend.catalog.models import (
    GroupSnapshot,
    Operation,
    OperationKind,
    OperationState,
    Snapshot,
    SnapshotState,
    Volume,
    VolumeState,
    VolumeType,
)
from backend.pool import Pool

log = logging.getLogger("moorage.backend")

DEFAULT_PAGE = 100
MAX_PAGE = 1000


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
    group_snapshot_id: str | None = None


@dataclass(frozen=True)
class GroupSnapshotInfo:
    id: str
    name: str
    source_volume_ids: tuple[str, ...]
    state: str
    ready_to_use: bool
    created_unix: int
    # One per source volume, in the order of ``source_volume_ids``.
    snapshots: tuple[SnapshotInfo, ...]


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
    # ok is false for any problem; serving only when requests cannot be served
    # (e.g. ganesha down), not for a warning such as a pool low on space.
    serving: bool = True
    low_space: bool = False


def _unix(row: Volume | Snapshot | GroupSnapshot) -> int:
    return int(row.created_at.timestamp())


def volume_info(s: Session, v: Volume) -> VolumeInfo:
    """``v`` as the catalog records it; the bytes in use are ``with_used_bytes``'s."""
    pubs = publications_of(s, v.id)
    return VolumeInfo(
        id=v.id,
        name=v.name,
        type=v.type.value,
        size_bytes=v.size_bytes,
        used_bytes=0,
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


def with_used_bytes(info: VolumeInfo, pool: Pool) -> VolumeInfo:
    """``info`` with how much of a ready volume is written, asked of the pool
    (a stat or statvfs per volume: call it outside any catalog session)."""
    if info.state != VolumeState.READY.value:
        return info
    try:
        return replace(info, used_bytes=pool.used_bytes(info.id, info.type))
    except (OSError, BackendError) as e:
        log.warning("used bytes of volume %s: %s", info.id, e)
        return info


def page(max_entries: int, token: str) -> tuple[int, str | None]:
    """A listing's page: how many entries (``max_entries``, 0 for the default,
    at most ``MAX_PAGE``), and the id to list after (the caller's token)."""
    limit = min(max_entries or DEFAULT_PAGE, MAX_PAGE)
    after = validation.object_id(token, "starting token") if token else None
    return limit, after


def snapshot_info(snap: Snapshot) -> SnapshotInfo:
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
        group_snapshot_id=snap.group_snapshot_id,
    )


def group_snapshot_info(s: Session, group: GroupSnapshot) -> GroupSnapshotInfo:
    members = {m.source_volume_id: m for m in group_members(s, group.id)}
    snaps = tuple(snapshot_info(members[v]) for v in group.source_volume_ids if v in members)
    return GroupSnapshotInfo(
        id=group.id,
        name=group.name,
        source_volume_ids=tuple(group.source_volume_ids),
        state=group.state.value,
        ready_to_use=group.state == SnapshotState.READY and all(x.ready_to_use for x in snaps),
        created_unix=_unix(group),
        snapshots=snaps,
    )


def capacity_info(s: Session, pool: Pool, overcommit_ratio: float) -> CapacityInfo:
    """The pool's size and what the catalog has promised of it.

    Provisioned is every volume's size plus what expansions decided and not
    finished yet will add (their pending journal entries hold the size), so
    that decisions taken while others are still growing cannot overshoot.
    """
    total, free = pool.capacity()
    provisioned = int(s.scalar(select(func.coalesce(func.sum(Volume.size_bytes), 0))) or 0)
    provisioned += pending_growth(s)
    available = max(0, int(total * overcommit_ratio) - provisioned)
    return CapacityInfo(total, free, provisioned, overcommit_ratio, available)


def pending_growth(s: Session) -> int:
    """Bytes that pending expansions add to their volumes' recorded sizes."""
    targets: dict[str, int] = {}
    query = select(Operation.target_id, Operation.payload).where(
        Operation.kind == OperationKind.EXPAND_VOLUME, Operation.state == OperationState.PENDING
    )
    for target, payload in s.execute(query):
        size = int((payload or {}).get("size", 0))
        targets[target] = max(targets.get(target, 0), size)
    if not targets:
        return 0
    sizes = s.execute(select(Volume.id, Volume.size_bytes).where(Volume.id.in_(targets)))
    return sum(max(0, targets[vol_id] - size) for vol_id, size in sizes)


def low_space_problem(total: int, free: int, percent: float) -> str | None:
    """What health says when the pool's free space is under ``percent`` of it; None if not."""
    if total <= 0 or free * 100 >= total * percent:
        return None
    return f"pool low on space: {free} bytes free ({free * 100 / total:.1f}% < {percent:g}%)"
