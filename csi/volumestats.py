"""What NodeGetVolumeStats tells of a staged or published volume: its usage,
and its condition (why it does not work, in one line, or nothing).

The condition is checked before the usage is read, so a volume whose
attachment or mount is gone is reported, never read through.
"""

from __future__ import annotations

import os
from pathlib import Path

from csi import attach, mounts, stage
from csi.nodestate import StagedVolume
from csi.proto import csi_pb2 as pb


def problem(record: StagedVolume, path: Path, attach_dir: Path) -> str | None:
    """Why the volume does not work at ``path`` (its staging path or a target); None: it does."""
    if record.uri:
        found = attach.block_attachment_problem(record.uri, attach_dir)
        if found is not None:
            return found
    mounted = path
    if record.access == "block" and str(path) == record.staging_path:
        mounted = path / stage.DEVICE_FILE
    if mounts.mount_entry(mounted) is None:
        return f"{mounted} is not mounted any more: unpublish and publish (or restage) it"
    return None


def usage(record: StagedVolume, path: Path) -> list[pb.VolumeUsage]:
    """Bytes (and, for a filesystem, inodes) of the volume at ``path``."""
    if record.access == "block":
        device = path / stage.DEVICE_FILE if str(path) == record.staging_path else path
        fd = os.open(device, os.O_RDONLY)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
        return [pb.VolumeUsage(unit=pb.VolumeUsage.BYTES, total=size)]
    st = os.statvfs(path)
    return [
        pb.VolumeUsage(
            unit=pb.VolumeUsage.BYTES,
            total=st.f_blocks * st.f_frsize,
            available=st.f_bavail * st.f_frsize,
            used=(st.f_blocks - st.f_bfree) * st.f_frsize,
        ),
        pb.VolumeUsage(
            unit=pb.VolumeUsage.INODES,
            total=st.f_files,
            available=st.f_favail,
            used=st.f_files - st.f_ffree,
        ),
    ]
