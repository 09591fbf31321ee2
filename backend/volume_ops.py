"""The storage node's volumes: create (or clone), delete, expand, modify, give
to a group; read one or a page of them.

Space is decided twice, both under the decision lock before anything is
recorded: the sizes promised may not pass pool size x overcommit (pending
expansions counted, ``views.capacity_info``), and an nfs volume, whose image
is fully allocated, needs that much real free space in the pool now, less
what other decisions hold until their images are allocated
(``Pool.reserve_space``).  Either refusal is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from backend import validation
from backend.api.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from backend.catalog.db import (
    get_volume_by_name,
    list_volumes,
    publications_of,
    record_operation,
)
from backend.catalog.models import (
    OperationKind,
    Snapshot,
    SnapshotState,
    Volume,
    VolumeState,
    VolumeType,
)
from backend.failpoints import failpoint
from backend.ganesha.config import MAX_EXPORT_ID
from backend.operation import (
    Intent,
    ServiceContext,
    close_journal,
    new_id,
    pending_operation,
)
from backend.views import VolumeInfo, page, volume_info, with_used_bytes

log = logging.getLogger("moorage.backend")


def next_export_id(s: Session) -> int:
    """The NFS export id for a new nfs volume: one past the highest, or the
    lowest free one once the highest is taken."""
    highest = s.scalar(select(func.max(Volume.nfs_export_id))) or 0
    if highest >= MAX_EXPORT_ID:
        used = set(s.scalars(select(Volume.nfs_export_id)).all())
        free = next((i for i in range(1, MAX_EXPORT_ID + 1) if i not in used), None)
        if free is None:
            raise ResourceExhausted("no NFS export id left")
        return free
    return int(highest) + 1


class Volumes:
    """Every operation on volumes, over the service's shared context."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def get_volume(self, volume_id: str | None = None, name: str | None = None) -> VolumeInfo:
        with self.ctx.catalog.read_session() as s:
            if volume_id is not None:
                v = s.get(Volume, validation.object_id(volume_id, "volume id"))
            else:
                v = get_volume_by_name(s, validation.volume_name(name or ""))
            if v is None:
                raise NotFound(f"volume {volume_id or name} not found")
            info = volume_info(s, v)
        return with_used_bytes(info, self.ctx.pool)

    def list_volumes(self, max_entries: int = 0, token: str = "") -> tuple[list[VolumeInfo], str]:
        """A page of volumes by id, and the token of the next page ("" at the end).

        The rows are read in one short read session; their images are measured after."""
        limit, after = page(max_entries, token)
        with self.ctx.catalog.read_session() as s:
            rows = list_volumes(s, after, limit + 1)
            more = len(rows) > limit
            infos = [volume_info(s, v) for v in rows[:limit]]
        next_token = infos[-1].id if more and infos else ""
        return [with_used_bytes(i, self.ctx.pool) for i in infos], next_token

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
        fresh_id = new_id()  # the new volume's, if one is made
        tickets: list[object] = []  # real pool space held for it

        def decide(s: Session) -> Intent[str]:
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
                        f"volume {name!r} exists with a different type, size, parameters or source"
                    )
                if existing.state not in (VolumeState.CREATING, VolumeState.READY):
                    raise FailedPrecondition(f"volume {name!r} is {existing.state.value}")
                existing_id = existing.id
                if existing.state == VolumeState.READY:
                    return Intent(existing_id)
                return Intent(existing_id, lambda: self.finish_create(existing_id))
            self._check_source(s, vtype, size, source_snapshot_id, source_volume_id)
            self.ctx.check_capacity(s, size)
            if vtype == VolumeType.NFS:
                source: Path | None = None
                if source_snapshot_id:
                    source = self.ctx.pool.snapshot_path(source_snapshot_id)
                elif source_volume_id:
                    source = self.ctx.pool.image_path(source_volume_id)
                needed = self.ctx.pool.fs_volume_needs(size, params["fs_type"], source)
                tickets.append(
                    self.ctx.pool.reserve_space(fresh_id, needed, f"nfs volume {name!r}")
                )
            vol_id = fresh_id
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
                    nfs_export_id=next_export_id(s) if vtype == VolumeType.NFS else None,
                )
            )
            cloned = source_snapshot_id or source_volume_id
            op = OperationKind.CLONE_VOLUME if cloned else OperationKind.CREATE_VOLUME
            record_operation(s, op, vol_id, {"name": name})
            return Intent(vol_id, lambda: self.finish_create(vol_id))

        try:
            vol_id = self.ctx.operation([f"name:{name}"], decide, failpoint_at="create.intent")
        finally:
            for ticket in tickets:  # allocated (or undone) by now
                self.ctx.pool.release_space(ticket)
        return self.get_volume(volume_id=vol_id)

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

    def finish_create(self, vol_id: str) -> None:
        """Build a creating volume's files (idempotent), then mark it ready.

        On failure the half-made volume is removed, files and record.
        """
        with self.ctx.catalog.read_session() as s:
            v = s.get(Volume, vol_id)
            if v is None:
                return
            kind, size = v.type, v.size_bytes
            fs = v.fs_type.value if v.fs_type else None
            snap_id, src_id = v.source_snapshot_id, v.source_volume_id
        try:
            if snap_id:
                self.ctx.pool.clone_from_snapshot(snap_id, vol_id, size, kind.value, fs)
            elif src_id:
                self.ctx.pool.clone_from_volume(src_id, vol_id, size, kind.value, fs)
            elif kind == VolumeType.NBD:
                self.ctx.pool.create_block_image(vol_id, size)
            else:
                assert fs is not None
                self.ctx.pool.create_fs_volume(vol_id, size, fs)
        except BaseException as e:
            log.error("creating volume %s failed: %s; removing what was made", vol_id, e)
            self.ctx.pool.delete_volume(vol_id)
            with self.ctx.catalog.session() as s:
                close_journal(
                    s, vol_id, OperationKind.CREATE_VOLUME, OperationKind.CLONE_VOLUME, error=str(e)
                )
                v = s.get(Volume, vol_id)
                if v is not None:
                    s.delete(v)
            raise
        failpoint("create.files")
        with self.ctx.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is not None:
                v.state = VolumeState.READY
            close_journal(s, vol_id, OperationKind.CREATE_VOLUME, OperationKind.CLONE_VOLUME)
        log.info("volume %s ready", vol_id)

    def delete_volume(self, volume_id: str) -> None:
        vol_id = validation.object_id(volume_id, "volume id")

        def decide(s: Session) -> Intent[None]:
            v = s.get(Volume, vol_id)
            if v is None:
                return Intent(None)  # already gone: deleting is idempotent
            pubs = publications_of(s, vol_id)
            if pubs:
                nodes = ", ".join(sorted(p.node_id for p in pubs))
                raise FailedPrecondition(f"volume {vol_id} is published to {nodes}")
            if v.state != VolumeState.DELETING:
                v.state = VolumeState.DELETING
                record_operation(s, OperationKind.DELETE_VOLUME, vol_id)
            return Intent(None, lambda: self.finish_delete(vol_id))

        self.ctx.operation([vol_id], decide, failpoint_at="delete.intent")

    def finish_delete(self, vol_id: str) -> None:
        self.ctx.pool.delete_volume(vol_id)
        failpoint("delete.files")
        with self.ctx.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is not None:
                s.delete(v)
            close_journal(s, vol_id, OperationKind.DELETE_VOLUME)
        log.info("volume %s deleted", vol_id)

    def expand_volume(self, volume_id: str, size: int) -> VolumeInfo:
        vol_id = validation.object_id(volume_id, "volume id")
        requested = validation.size(size)
        tickets: list[object] = []  # real pool space held for the growth

        def reserve_growth(v: Volume, new_size: int) -> None:
            if v.type == VolumeType.NFS and v.fs_type is not None:
                needed = self.ctx.pool.fs_growth_needs(v.id, new_size, v.fs_type.value)
                what = f"growing nfs volume {v.name!r}"
                tickets.append(self.ctx.pool.reserve_space(vol_id, needed, what))

        def decide(s: Session) -> Intent[None]:
            v = s.get(Volume, vol_id)
            if v is None:
                raise NotFound(f"volume {vol_id} not found")
            if v.state not in (VolumeState.READY, VolumeState.EXPANDING):
                raise FailedPrecondition(f"volume {vol_id} is {v.state.value}")
            new_size = requested
            if v.state == VolumeState.READY:
                if new_size <= v.size_bytes:
                    return Intent(None)  # already that big: nothing to do
                if (
                    v.fs_type is not None
                    and not self.ctx.pool.grows_online(v.fs_type.value)
                    and publications_of(s, vol_id)
                ):
                    # Refused before the intent is recorded: the volume stays ready.
                    raise FailedPrecondition(
                        f"volume {vol_id} is {v.fs_type.value}, which this host grows only "
                        "offline: unpublish it first"
                    )
                self.ctx.check_capacity(s, new_size - v.size_bytes)
                reserve_growth(v, new_size)
                v.state = VolumeState.EXPANDING
                record_operation(s, OperationKind.EXPAND_VOLUME, vol_id, {"size": new_size})
            else:
                # An expansion that did not finish: the size it grows to is already
                # counted (capacity_info); asking for more is decided like a new one.
                op = pending_operation(s, vol_id, OperationKind.EXPAND_VOLUME)
                pending = max(v.size_bytes, int((op.payload or {}).get("size", 0)) if op else 0)
                if new_size > pending:
                    self.ctx.check_capacity(s, new_size - pending)
                    if op is None:
                        record_operation(s, OperationKind.EXPAND_VOLUME, vol_id, {"size": new_size})
                    else:
                        op.payload = {**(op.payload or {}), "size": new_size}
                new_size = max(new_size, pending)
                reserve_growth(v, new_size)
            return Intent(None, lambda: self.finish_expand(vol_id, new_size))

        try:
            self.ctx.operation([vol_id], decide, failpoint_at="expand.intent")
        finally:
            for ticket in tickets:
                self.ctx.pool.release_space(ticket)
        return self.get_volume(volume_id=vol_id)

    def finish_expand(self, vol_id: str, new_size: int) -> None:
        with self.ctx.catalog.read_session() as s:
            v = s.get(Volume, vol_id)
            if v is None:
                return
            kind, fs = v.type, (v.fs_type.value if v.fs_type else None)
        try:
            if kind == VolumeType.NBD:
                self.ctx.pool.expand_block_image(vol_id, new_size)
            else:
                assert fs is not None
                self.ctx.pool.expand_fs_volume(vol_id, new_size, fs)
        except ResourceExhausted as e:
            # The pool had no room for the grown image, which stayed as it was:
            # the volume is ready at its old size (other failures leave it
            # expanding, for a retry or the next start to finish).
            with self.ctx.decisions, self.ctx.catalog.session() as s:
                v = s.get(Volume, vol_id)
                if v is not None and v.state == VolumeState.EXPANDING:
                    v.state = VolumeState.READY
                close_journal(s, vol_id, OperationKind.EXPAND_VOLUME, error=str(e))
            raise
        failpoint("expand.files")
        # Under the decision lock: the new size and the end of the pending
        # expansion are seen together by every capacity decision.
        with self.ctx.decisions, self.ctx.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is not None:
                v.size_bytes = max(v.size_bytes, new_size)
                v.state = VolumeState.READY
            close_journal(s, vol_id, OperationKind.EXPAND_VOLUME)
        log.info("volume %s expanded to %d bytes", vol_id, new_size)

    def set_volume_group(self, volume_id: str, gid: int) -> VolumeInfo:
        """Give a ready nfs volume's files to group ``gid`` (a pod's fsGroup), on
        this node, which owns the export: the nodes mounting it may squash root."""
        vol_id = validation.object_id(volume_id, "volume id")
        gid = validation.group_id(gid)
        with self.ctx.locks.hold(vol_id):  # no delete, expansion or snapshot meanwhile
            with self.ctx.catalog.read_session() as s:
                v = s.get(Volume, vol_id)
                if v is None:
                    raise NotFound(f"volume {vol_id} not found")
                if v.type != VolumeType.NFS:
                    raise InvalidArgument(
                        f"volume {vol_id} is {v.type.value}: a block volume's filesystem is "
                        "the node's, which gives it to a group itself"
                    )
                if v.state != VolumeState.READY:
                    raise FailedPrecondition(f"volume {vol_id} is {v.state.value}")
            if not self.ctx.pool.is_mounted(vol_id):
                raise FailedPrecondition(f"volume {vol_id}'s filesystem is not mounted here")
            try:
                changed = self.ctx.pool.give_export_to_group(vol_id, gid)
            except OSError as e:
                raise FailedPrecondition(
                    f"cannot give volume {vol_id}'s files to group {gid}: {e}"
                ) from e
            if changed:
                log.info("volume %s given to group %d", vol_id, gid)
        return self.get_volume(vol_id)

    def modify_volume(self, volume_id: str, parameters: dict[str, str]) -> VolumeInfo:
        """Change mutable parameters; the exports follow from the catalog at once.

        One catalog transaction is the whole intent: a crash after it leaves the
        exports to the start-up reconciliation, which renders them from the catalog.
        """
        vol_id = validation.object_id(volume_id, "volume id")

        def decide(s: Session) -> Intent[dict[str, str]]:
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
            return Intent(changes, lambda: self.ctx.apply_exports(vol_id))

        changes = self.ctx.operation([vol_id], decide, failpoint_at="modify.recorded")
        log.info("volume %s modified: %s", vol_id, changes)
        return self.get_volume(volume_id=vol_id)
