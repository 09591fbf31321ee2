"""The storage node's group snapshots: several volumes captured at one point in time.

A group snapshot is one snapshot per source volume, all taken inside one
barrier, so together they are crash-consistent: what they hold is what a
power cut at one instant would have left on every member.

- nbd members: the I/O of every NBD client on them is held at once (each
  connection reads no new request; what it already read is served to the
  end, the reply thread's writes included; ``nbd.holds``), then every image
  is flushed (fdatasync).
- nfs members: every filesystem is frozen (``fsfreeze``) before any copy.
- Then each image is copied (a reflink where the pool has them), and the
  hold is released and the filesystems thawed.

Bounds: the hold must be reached within ``HOLD_TIMEOUT`` (a client stalled
in the middle of a request makes the group snapshot fail, with everything
released); the hold itself lasts at most ``HOLD_LEASE``, and a group whose
copies took longer than that is not trusted and fails (the lease is looked
at before each copy).  On a pool without reflink, a group with more
allocated data than ``PLAIN_COPY_LIMIT`` is refused up front.  A failed group
snapshot leaves no snapshot behind, as a request refused up front does.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

from sqlalchemy.orm import Session

from backend import validation
from backend.api.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from backend.catalog.db import get_group_snapshot_by_name, group_members, record_operation
from backend.catalog.models import (
    GroupSnapshot,
    OperationKind,
    Snapshot,
    SnapshotState,
    Volume,
    VolumeState,
    VolumeType,
)
from backend.failpoints import failpoint
from backend.operation import Intent, ServiceContext, close_journal, new_id
from backend.views import GroupSnapshotInfo, group_snapshot_info

log = logging.getLogger("moorage.backend")

# Most volumes in one group snapshot.
MAX_MEMBERS = 64
# How long NBD clients' in-flight requests have to finish once their I/O is held.
HOLD_TIMEOUT = 10.0
# How long the I/O of the members may stay held: flush and copies must be done by then.
HOLD_LEASE = 60.0
# On a pool without reflink every member is a sparse copy of its allocated
# data, made while the members' I/O is held.  A copy rate assumed for that
# (an assumption for a slow disk reading and writing at once, not a
# measurement), and the most allocated bytes a group may have there: what
# that rate copies in half the lease.  A larger group is refused up front.
PLAIN_COPY_RATE = 32 << 20  # bytes per second
PLAIN_COPY_LIMIT = int(PLAIN_COPY_RATE * HOLD_LEASE / 2)


class GroupSnapshots:
    """Every operation on group snapshots, over the service's shared context."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def get_group_snapshot(self, group_id: str) -> GroupSnapshotInfo:
        group_id = validation.object_id(group_id, "group snapshot id")
        with self.ctx.catalog.read_session() as s:
            group = s.get(GroupSnapshot, group_id)
            if group is None:
                raise NotFound(f"group snapshot {group_id} not found")
            return group_snapshot_info(s, group)

    def create_group_snapshot(
        self, name: str, source_volume_ids: Sequence[str]
    ) -> GroupSnapshotInfo:
        name = validation.volume_name(name, "group snapshot name")
        sources = [validation.object_id(v, "source volume id") for v in source_volume_ids]
        if not sources:
            raise InvalidArgument("a group snapshot needs at least one source volume")
        if len(sources) > MAX_MEMBERS:
            raise InvalidArgument(f"a group snapshot takes at most {MAX_MEMBERS} volumes")
        if len(set(sources)) != len(sources):
            raise InvalidArgument("a source volume is named twice")

        def decide(s: Session) -> Intent[str]:
            existing = get_group_snapshot_by_name(s, name)
            if existing is not None:
                if sorted(existing.source_volume_ids) != sorted(sources):
                    raise AlreadyExists(f"group snapshot {name!r} exists for other volumes")
                existing_id = existing.id
                if existing.state == SnapshotState.READY:
                    return Intent(existing_id)
                if existing.state == SnapshotState.DELETING:
                    raise FailedPrecondition(f"group snapshot {name!r} is being deleted")
                return Intent(existing_id, lambda: self.finish_group_snapshot(existing_id))
            volumes = []
            for src in sources:
                v = s.get(Volume, src)
                if v is None:
                    raise NotFound(f"volume {src} not found")
                if v.state != VolumeState.READY:
                    raise FailedPrecondition(f"volume {src} is {v.state.value}")
                volumes.append(v)
            self._check_plain_copies_fit(volumes)
            group_id = new_id()
            s.add(GroupSnapshot(id=group_id, name=name, source_volume_ids=sources))
            for v in volumes:
                s.add(
                    Snapshot(
                        id=new_id(),
                        # Not a name a client can give (no ':' there): unique, never asked for.
                        name=f"{group_id}:{v.id}",
                        source_volume_id=v.id,
                        volume_type=v.type,
                        fs_type=v.fs_type,
                        size_bytes=v.size_bytes,
                        state=SnapshotState.CREATING,
                        group_snapshot_id=group_id,
                    )
                )
            record_operation(s, OperationKind.CREATE_GROUP_SNAPSHOT, group_id, {"name": name})
            return Intent(group_id, lambda: self.finish_group_snapshot(group_id))

        # The volumes in one order, so two groups sharing volumes never wait on each other.
        keys = [f"group:{name}", *sorted(sources)]
        group_id = self.ctx.operation(keys, decide, failpoint_at="group_snapshot.intent")
        return self.get_group_snapshot(group_id)

    def finish_group_snapshot(self, group_id: str) -> None:
        """Take every member inside one barrier (see the module's text); on any
        failure remove the group and its members, files and rows."""
        with self.ctx.catalog.read_session() as s:
            group = s.get(GroupSnapshot, group_id)
            if group is None:
                return
            order = {v: i for i, v in enumerate(group.source_volume_ids)}
            members = [
                (m.id, m.source_volume_id, m.volume_type, m.fs_type.value if m.fs_type else None)
                for m in sorted(group_members(s, group_id), key=lambda m: order[m.source_volume_id])
            ]
            missing = [m[1] for m in members if s.get(Volume, m[1]) is None]
        pool = self.ctx.pool
        try:
            if missing:
                raise NotFound(f"source volumes {', '.join(missing)} are gone")
            # A copy an interrupted attempt left was taken at another instant.
            for snap_id, *_ in members:
                pool.delete_snapshot(snap_id)
            nbd = [vol for _, vol, kind, _ in members if kind == VolumeType.NBD]
            nfs = [(vol, fs) for _, vol, kind, fs in members if kind == VolumeType.NFS and fs]
            # No flush before the hold: measured, it made the hold longer, not
            # shorter (docs/performance.md, section 8).
            with ExitStack() as barrier:
                barrier.enter_context(pool.frozen_together(nfs))
                lease_ends = time.monotonic() + HOLD_LEASE
                barrier.enter_context(self._nbd_io_held(nbd))
                for vol in nbd:
                    pool.flush_image(vol)
                failpoint("group_snapshot.held")
                for snap_id, vol, _, _ in members:
                    self._check_lease(lease_ends)  # fail before a copy that cannot count
                    pool.snapshot(vol, snap_id, None)  # frozen or held already
                self._check_lease(lease_ends)
        except BaseException as e:
            self._remove(group_id, [m[0] for m in members], OperationKind.CREATE_GROUP_SNAPSHOT, e)
            raise
        failpoint("group_snapshot.files")
        with self.ctx.catalog.session() as s:
            group = s.get(GroupSnapshot, group_id)
            if group is not None:
                group.state = SnapshotState.READY
            for m in group_members(s, group_id):
                m.state = SnapshotState.READY
            close_journal(s, group_id, OperationKind.CREATE_GROUP_SNAPSHOT)
        log.info("group snapshot %s of %d volumes ready", group_id, len(members))

    def _check_plain_copies_fit(self, volumes: Sequence[Volume]) -> None:
        """FailedPrecondition when the pool copies without reflink and the members'
        allocated data is more than ``PLAIN_COPY_LIMIT``: the copies would likely
        outlast the hold's lease, with the clients stopped all that time."""
        pool = self.ctx.pool
        if pool.supports_reflink():
            return
        total = sum(pool.allocated_bytes(pool.image_path(v.id)) for v in volumes)
        if total > PLAIN_COPY_LIMIT:
            raise FailedPrecondition(
                f"cannot snapshot these volumes together: the pool has no reflink, and copying "
                f"their {total >> 20} MiB of data would likely take longer than the "
                f"{HOLD_LEASE:g}s the members' I/O may be held (at most "
                f"{PLAIN_COPY_LIMIT >> 20} MiB on such a pool)"
            )

    @staticmethod
    def _check_lease(lease_ends: float) -> None:
        if time.monotonic() >= lease_ends:
            raise Unavailable(
                f"the copies took longer than the hold's lease ({HOLD_LEASE:g}s): "
                "the members' I/O may have resumed before the last one was taken"
            )

    @contextmanager
    def _nbd_io_held(self, vol_ids: Sequence[str]) -> Iterator[None]:
        if not vol_ids:
            yield
            return
        hold_id = uuid.uuid4().hex
        images = [self.ctx.pool.image_path(v) for v in vol_ids]
        started = time.monotonic()
        self.ctx.exporter.hold_nbd_io(hold_id, images, HOLD_LEASE, HOLD_TIMEOUT)
        reached = time.monotonic()
        try:
            yield
        finally:
            self.ctx.exporter.release_nbd_io(hold_id)
            log.info(
                "NBD I/O of %d volumes held %.1f ms (reached in %.1f ms)",
                len(vol_ids),
                (time.monotonic() - started) * 1000,
                (reached - started) * 1000,
            )

    def _remove(
        self,
        group_id: str,
        snap_ids: Sequence[str],
        kind: OperationKind,
        error: BaseException | None = None,
    ) -> None:
        """Remove the members' files, then the group's and members' rows; close the journal."""
        for snap_id in snap_ids:
            self.ctx.pool.delete_snapshot(snap_id)
        with self.ctx.catalog.session() as s:
            for m in group_members(s, group_id):
                s.delete(m)
            group = s.get(GroupSnapshot, group_id)
            if group is not None:
                s.delete(group)
            close_journal(s, group_id, kind, error=None if error is None else str(error))

    def delete_group_snapshot(self, group_id: str) -> None:
        """Delete a group snapshot and every member; OK when it is already gone."""
        group_id = validation.object_id(group_id, "group snapshot id")

        def decide(s: Session) -> Intent[None]:
            group = s.get(GroupSnapshot, group_id)
            if group is None:
                return Intent(None)
            if group.state != SnapshotState.DELETING:
                group.state = SnapshotState.DELETING
                for m in group_members(s, group_id):
                    m.state = SnapshotState.DELETING
                record_operation(s, OperationKind.DELETE_GROUP_SNAPSHOT, group_id)
            return Intent(None, lambda: self.finish_delete_group_snapshot(group_id))

        # The keys a create of this group takes, in its order: a delete never runs
        # while a create of the same group (taking it again) copies its members.
        with self.ctx.catalog.read_session() as s:
            group = s.get(GroupSnapshot, group_id)
            keys = (
                [group_id]
                if group is None
                else [f"group:{group.name}", *sorted(group.source_volume_ids)]
            )
        self.ctx.operation(keys, decide, failpoint_at="delete_group_snapshot.intent")

    def finish_delete_group_snapshot(self, group_id: str) -> None:
        with self.ctx.catalog.read_session() as s:
            snap_ids = [m.id for m in group_members(s, group_id)]
        self._remove(group_id, snap_ids, OperationKind.DELETE_GROUP_SNAPSHOT)
        log.info("group snapshot %s deleted (%d members)", group_id, len(snap_ids))
