"""Start-up reconciliation: make images, mounts and exports match the catalog.

The catalog is the source of truth.  First every operation a crash
interrupted is finished (each step is idempotent) or undone; then what is on
disk is compared with what the catalog says, and each difference repaired
and reported.
"""

from __future__ import annotations

import logging

from sqlalchemy import select

from backend import quarantine
from backend.api.errors import BackendError
from backend.catalog.db import finish_operation, pending_operations, publications_of
from backend.catalog.models import (
    Operation,
    OperationKind,
    OperationState,
    PublicationState,
    Snapshot,
    SnapshotState,
    Volume,
    VolumeState,
    VolumeType,
)
from backend.exporting import exportable, publication_problem
from backend.ganesha.config import ExportConfig
from backend.ganesha.files import GaneshaFiles
from backend.service import StorageService

log = logging.getLogger("moorage.backend.reconcile")


def reconcile(service: StorageService, files: GaneshaFiles) -> list[str]:
    """Repair what a crash left behind; returns one line per repair."""
    repairs: list[str] = []
    pool = service.pool
    for path in pool.remove_partial_files():
        repairs.append(f"removed partial file {path}")
    # A crash in the middle of a snapshot or clone leaves its source frozen:
    # thaw first, or finishing it fails to freeze again and undoes it.
    for vol_id in sorted(pool.list_mounts()):
        pool.thaw_fs_volume(vol_id)
    repairs += _finish_operations(service)
    repairs += _reconcile_files(service)
    repairs += _reconcile_exports(service, files)
    for line in repairs:
        log.info("reconcile: %s", line)
    return repairs


def _finish_operations(service: StorageService) -> list[str]:
    """Run again the step of every operation a crash interrupted: the same
    ``finish_*`` step the operation itself runs once its intent is recorded."""
    repairs: list[str] = []
    with service.catalog.read_session() as s:
        ops = [(o.id, o.kind, o.target_id, dict(o.payload or {})) for o in pending_operations(s)]
    for op_id, kind, target, payload in ops:
        what = f"interrupted {kind.value} of {target}"
        node = str(payload.get("node", ""))
        try:
            match kind:
                case OperationKind.CREATE_VOLUME | OperationKind.CLONE_VOLUME:
                    service.volumes.finish_create(target)
                case OperationKind.DELETE_VOLUME:
                    service.volumes.finish_delete(target)
                case OperationKind.EXPAND_VOLUME:
                    service.volumes.finish_expand(target, int(payload.get("size", 0)))
                case OperationKind.CREATE_SNAPSHOT:
                    service.snapshots.finish_snapshot(target)
                case OperationKind.DELETE_SNAPSHOT:
                    service.snapshots.finish_delete_snapshot(target)
                case OperationKind.CREATE_GROUP_SNAPSHOT:
                    # No NBD client is connected yet: the barrier holds nothing.
                    service.group_snapshots.finish_group_snapshot(target)
                case OperationKind.DELETE_GROUP_SNAPSHOT:
                    service.group_snapshots.finish_delete_group_snapshot(target)
                case OperationKind.PUBLISH:
                    service.publications.finish_publish(target, node)
                case OperationKind.UNPUBLISH:
                    service.publications.finish_unpublish(target, node)
                case OperationKind.ADOPT_VOLUME:
                    service.adoption.finish_adopt(target, str(payload.get("orphan", "")))
            repairs.append(f"finished {what}")
        except (BackendError, OSError) as e:
            repairs.append(f"rolled back {what}: {e}")
        with service.catalog.session() as s:
            op = s.get(Operation, op_id)
            if op is not None and op.state == OperationState.PENDING:
                finish_operation(op, error="abandoned at start-up")
    return repairs


def _reconcile_files(service: StorageService) -> list[str]:
    pool = service.pool
    repairs: list[str] = []
    with service.catalog.read_session() as s:
        volumes = {v.id: (v.type, v.fs_type, v.state) for v in s.scalars(select(Volume))}
        snapshots = {x.id: x.state for x in s.scalars(select(Snapshot))}
    # Images the catalog does not know are never deleted here: a catalog
    # restored from a backup or on the wrong path must not cost data.  They
    # are moved aside whole, reported, and left to the operator.
    images = pool.list_volume_images()
    for orphan in sorted(images - set(volumes)):
        pool.unmount_fs_volume(orphan)
        pool.remove_mount_dir(orphan)
        moved = quarantine.quarantine(pool, pool.image_path(orphan), "volume", orphan)
        repairs.append(f"quarantined unknown volume image {orphan} as {moved.name}")
    for orphan in sorted(pool.list_mounts() - set(volumes)):
        pool.unmount_fs_volume(orphan)  # its image is gone: nothing to keep
        pool.remove_mount_dir(orphan)
        repairs.append(f"unmounted orphan volume mount {orphan}")
    for orphan in sorted(pool.list_snapshot_images() - set(snapshots)):
        moved = quarantine.quarantine(pool, pool.snapshot_path(orphan), "snapshot", orphan)
        repairs.append(f"quarantined unknown snapshot image {orphan} as {moved.name}")
    for vol_id, (vtype, fs_type, state) in sorted(volumes.items()):
        if vol_id not in images:
            log.error("volume %s (%s) has no image: its data is lost", vol_id, state.value)
            repairs.append(f"volume {vol_id} has no image (not repairable)")
            continue
        live = state in (VolumeState.READY, VolumeState.EXPANDING)
        if vtype == VolumeType.NFS and live and not pool.is_mounted(vol_id):
            assert fs_type is not None
            pool.mount_fs_volume(vol_id, fs_type.value)
            repairs.append(f"mounted filesystem of volume {vol_id}")
    snap_images = pool.list_snapshot_images()
    for snap_id, snap_state in sorted(snapshots.items()):
        if snap_state == SnapshotState.READY and snap_id not in snap_images:
            repairs.append(f"snapshot {snap_id} has no image (not repairable)")
    return repairs


def _reconcile_exports(service: StorageService, files: GaneshaFiles) -> list[str]:
    """Render every volume's exports from the catalog.  A publication that
    cannot be exported (a row an older version wrote with a node id or address
    today's rules refuse) is reported and left out, never a reason not to start:
    ``unpublish`` removes it."""
    wanted: list[ExportConfig] = []
    nbd_count = 0
    skipped: list[str] = []
    with service.catalog.read_session() as s:
        for v in s.scalars(select(Volume)):
            pubs = [p for p in publications_of(s, v.id) if p.state != PublicationState.UNPUBLISHING]
            for p in pubs:
                problem = publication_problem(p)
                if problem is not None:
                    log.error(
                        "publication of volume %s to %r is not exported: %s (unpublish it)",
                        v.id,
                        p.node_id[:80],
                        problem,
                    )
                    who = f"{p.node_id[:80]!r}"
                    skipped.append(f"publication of volume {v.id} to {who} not exported: {problem}")
            if not exportable(pubs):
                continue
            try:
                if v.type == VolumeType.NFS:
                    wanted.append(service.exports.nfs_config(v, pubs))
                else:
                    for export in service.exports.nbd_exports(v, pubs):
                        service.exporter.add_nbd_export(export)
                        nbd_count += 1
            except (BackendError, ValueError) as e:
                log.error("exports of volume %s cannot be rendered: %s", v.id, e)
                skipped.append(f"exports of volume {v.id} not rendered: {e}")
    repairs = skipped + files.sync(wanted)
    if nbd_count:
        log.info("reconcile: %d NBD exports serving", nbd_count)
    return repairs
