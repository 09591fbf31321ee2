"""The storage node's snapshots: take one of a volume, delete one, list them."""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from backend import validation
from backend.api.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from backend.catalog.db import get_snapshot_by_name, list_snapshots, record_operation
from backend.catalog.models import OperationKind, Snapshot, SnapshotState, Volume, VolumeState
from backend.failpoints import failpoint
from backend.operation import Intent, ServiceContext, close_journal, new_id
from backend.views import SnapshotInfo, page, snapshot_info

log = logging.getLogger("moorage.backend")


class Snapshots:
    """Every operation on snapshots, over the service's shared context."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def list_snapshots(
        self,
        max_entries: int = 0,
        token: str = "",
        source_volume_id: str | None = None,
        snapshot_id: str | None = None,
    ) -> tuple[list[SnapshotInfo], str]:
        """A page of snapshots by id (only one volume's with ``source_volume_id``;
        only that one with ``snapshot_id``), and the token of the next page."""
        limit, after = page(max_entries, token)
        with self.ctx.catalog.read_session() as s:
            if snapshot_id is not None:
                snap = s.get(Snapshot, validation.object_id(snapshot_id, "snapshot id"))
                return ([snapshot_info(snap)] if snap else []), ""
            if source_volume_id is not None:
                validation.object_id(source_volume_id, "source volume id")
            rows = list_snapshots(s, after, limit + 1, source_volume_id=source_volume_id)
            more = len(rows) > limit
            rows = rows[:limit]
            return [snapshot_info(x) for x in rows], (rows[-1].id if more and rows else "")

    def create_snapshot(self, name: str, source_volume_id: str) -> SnapshotInfo:
        name = validation.volume_name(name, "snapshot name")
        src = validation.object_id(source_volume_id, "source volume id")

        def decide(s: Session) -> Intent[str]:
            existing = get_snapshot_by_name(s, name)
            if existing is not None:
                if existing.source_volume_id != src:
                    raise AlreadyExists(f"snapshot {name!r} exists for another volume")
                existing_id = existing.id
                if existing.state == SnapshotState.READY:
                    return Intent(existing_id)
                if existing.state == SnapshotState.DELETING:
                    raise FailedPrecondition(f"snapshot {name!r} is being deleted")
                return Intent(existing_id, lambda: self.finish_snapshot(existing_id))
            v = s.get(Volume, src)
            if v is None:
                raise NotFound(f"volume {src} not found")
            if v.state != VolumeState.READY:
                raise FailedPrecondition(f"volume {src} is {v.state.value}")
            snap_id = new_id()
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
            return Intent(snap_id, lambda: self.finish_snapshot(snap_id))

        snap_id = self.ctx.operation([f"snap:{name}", src], decide, failpoint_at="snapshot.intent")
        with self.ctx.catalog.read_session() as s:
            snap = s.get(Snapshot, snap_id)
            assert snap is not None
            return snapshot_info(snap)

    def finish_snapshot(self, snap_id: str) -> None:
        with self.ctx.catalog.read_session() as s:
            snap = s.get(Snapshot, snap_id)
            if snap is None:
                return
            src = snap.source_volume_id
            fs = snap.fs_type.value if snap.fs_type else None
            source_exists = s.get(Volume, src) is not None
        try:
            if not source_exists:
                raise NotFound(f"source volume {src} of snapshot {snap_id} is gone")
            self.ctx.pool.snapshot(src, snap_id, fs)
        except BaseException as e:
            self.ctx.pool.delete_snapshot(snap_id)
            with self.ctx.catalog.session() as s:
                snap = s.get(Snapshot, snap_id)
                if snap is not None:
                    s.delete(snap)
                close_journal(s, snap_id, OperationKind.CREATE_SNAPSHOT, error=str(e))
            raise
        failpoint("snapshot.files")
        with self.ctx.catalog.session() as s:
            snap = s.get(Snapshot, snap_id)
            if snap is not None:
                snap.state = SnapshotState.READY
            close_journal(s, snap_id, OperationKind.CREATE_SNAPSHOT)
        log.info("snapshot %s of volume %s ready", snap_id, src)

    def delete_snapshot(self, snapshot_id: str) -> None:
        snap_id = validation.object_id(snapshot_id, "snapshot id")

        def decide(s: Session) -> Intent[None]:
            snap = s.get(Snapshot, snap_id)
            if snap is None:
                return Intent(None)
            if snap.group_snapshot_id is not None:
                raise InvalidArgument(
                    f"snapshot {snap_id} is a member of group snapshot {snap.group_snapshot_id}: "
                    "it is deleted with its group only"
                )
            if snap.state != SnapshotState.DELETING:
                snap.state = SnapshotState.DELETING
                record_operation(s, OperationKind.DELETE_SNAPSHOT, snap_id)
            return Intent(None, lambda: self.finish_delete_snapshot(snap_id))

        self.ctx.operation([snap_id], decide, failpoint_at="delete_snapshot.intent")

    def finish_delete_snapshot(self, snap_id: str) -> None:
        self.ctx.pool.delete_snapshot(snap_id)
        failpoint("delete_snapshot.files")
        with self.ctx.catalog.session() as s:
            snap = s.get(Snapshot, snap_id)
            if snap is not None:
                s.delete(snap)
            close_journal(s, snap_id, OperationKind.DELETE_SNAPSHOT)
