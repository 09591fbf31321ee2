"""Quarantined images: list them, record one as a volume again, or remove one on request.

Adopting is an operation like create: the volume is recorded ``creating``
with a journal entry naming the quarantined file, then the file is linked
back to ``POOL/volumes/<id>.img`` (never over anything), the filesystem of an
nfs volume is mounted, and the volume is marked ready.  A crash in between is
finished by the start-up reconciliation (``finish_adopt``).
"""

from __future__ import annotations

import logging
import os

from sqlalchemy.orm import Session

from backend import quarantine, validation
from backend.api.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from backend.catalog.db import get_volume_by_name, record_operation
from backend.catalog.models import FsType, OperationKind, Volume, VolumeState, VolumeType
from backend.filesystems import FS_TYPES
from backend.operation import Intent, ServiceContext, close_journal, new_id
from backend.quarantine import Orphan
from backend.views import VolumeInfo
from backend.volume_ops import Volumes, next_export_id
from hostio.atomicfile import fsync_directory

log = logging.getLogger("moorage.backend.adopt")


class Adoption:
    """The quarantine's operations, over the service's shared context."""

    def __init__(self, ctx: ServiceContext, volumes: Volumes) -> None:
        self.ctx = ctx
        self.volumes = volumes

    def list_orphans(self) -> list[Orphan]:
        return quarantine.list_orphans(self.ctx.pool)

    def purge_orphan(self, name: str) -> Orphan:
        with self.ctx.locks.hold(f"orphan:{name}"):
            return quarantine.purge(self.ctx.pool, name)

    def adopt_volume(self, orphan: str, name: str, kind: str = "") -> VolumeInfo:
        """Record the quarantined image ``orphan`` as volume ``name``.

        ``kind`` (nbd or nfs) defaults to nfs when the image holds an xfs or
        ext4 filesystem, nbd otherwise.  The volume keeps its old id when the
        catalog does not use it; its size is the image's.
        """
        name = validation.volume_name(name)
        quarantine.orphan_path(self.ctx.pool, orphan)  # validates the name, NotFound if gone
        if kind not in ("", "nbd", "nfs"):
            raise InvalidArgument(f"volume type {kind[:20]!r} is not nbd or nfs")

        def decide(s: Session) -> Intent[str]:
            info = next(
                (o for o in quarantine.list_orphans(self.ctx.pool) if o.name == orphan), None
            )
            if info is None:
                raise FailedPrecondition(f"quarantined image {orphan} is gone")
            if get_volume_by_name(s, name) is not None:
                raise AlreadyExists(f"a volume named {name!r} exists")
            fs = info.fs_type if info.fs_type in FS_TYPES else None
            vtype = VolumeType(kind or ("nfs" if fs else "nbd"))
            if vtype == VolumeType.NFS and fs is None:
                raise InvalidArgument(
                    f"{orphan} holds no xfs or ext4 filesystem: adopt it as an nbd volume"
                )
            vol_id = info.original_id
            if s.get(Volume, vol_id) is not None or self.ctx.pool.image_path(vol_id).exists():
                vol_id = new_id()
            params = {"fs_type": fs, "squash": "root_squash"} if vtype == VolumeType.NFS else {}
            s.add(
                Volume(
                    id=vol_id,
                    name=name,
                    type=vtype,
                    size_bytes=info.size_bytes,
                    fs_type=FsType(fs) if vtype == VolumeType.NFS and fs else None,
                    squash="root_squash",
                    parameters=params,
                    labels={},
                    state=VolumeState.CREATING,
                    nfs_export_id=next_export_id(s) if vtype == VolumeType.NFS else None,
                )
            )
            record_operation(s, OperationKind.ADOPT_VOLUME, vol_id, {"orphan": orphan})
            return Intent(vol_id, lambda: self.finish_adopt(vol_id, orphan))

        vol_id = self.ctx.operation(
            [f"name:{name}", f"orphan:{orphan}"], decide, failpoint_at="adopt.intent"
        )
        return self.volumes.get_volume(volume_id=vol_id)

    def finish_adopt(self, vol_id: str, orphan: str) -> None:
        """Link the image back into place, mount an nfs volume, mark it ready (idempotent).

        On failure the image goes back to quarantine and the record is removed.
        """
        with self.ctx.catalog.read_session() as s:
            v = s.get(Volume, vol_id)
            if v is None:
                return
            vtype, fs = v.type, (v.fs_type.value if v.fs_type else None)
        image = self.ctx.pool.image_path(vol_id)
        source = quarantine.folder(self.ctx.pool) / orphan
        try:
            self.ctx.pool.ensure_layout()
            if source.exists():
                if not image.exists():
                    os.link(source, image)  # never replaces: fails if the name is taken
                if os.stat(source).st_ino == os.stat(image).st_ino:
                    source.unlink()
                fsync_directory(image.parent)
                fsync_directory(source.parent)
            os.chmod(image, 0o600)
            if vtype == VolumeType.NFS:
                assert fs is not None
                self.ctx.pool.mount_fs_volume(vol_id, fs)
                self.ctx.pool.ensure_export_dir(vol_id)
        except BaseException as e:
            log.error("adopting %s as volume %s failed: %s", orphan, vol_id, e)
            self.ctx.pool.unmount_fs_volume(vol_id)
            self.ctx.pool.remove_mount_dir(vol_id)
            if image.exists() and not source.exists():
                quarantine.quarantine(self.ctx.pool, image, "volume", vol_id)
            with self.ctx.catalog.session() as s:
                close_journal(s, vol_id, OperationKind.ADOPT_VOLUME, error=str(e))
                v = s.get(Volume, vol_id)
                if v is not None:
                    s.delete(v)
            raise
        with self.ctx.catalog.session() as s:
            v = s.get(Volume, vol_id)
            if v is not None:
                v.state = VolumeState.READY
            close_journal(s, vol_id, OperationKind.ADOPT_VOLUME)
        log.warning("quarantined image %s adopted as volume %s", orphan, vol_id)
