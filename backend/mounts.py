"""Mounts on the storage node: the kernel's mount table, loop-mounting an image, unmounting.

The table is read from /proc/self/mountinfo, so it is this process's mount
namespace as the kernel sees it, not what a mount helper remembers.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from backend.api.errors import CommandFailed, FailedPrecondition
from backend.commands import run
from hostio.mountinfo import read_mountinfo

_TIMEOUT = 120.0


def mount_table() -> dict[Path, str]:
    """Mount point -> mount source, from /proc/self/mountinfo (the topmost mount wins)."""
    return {Path(e.mount_point): e.source for e in read_mountinfo()}


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below ``path``, deepest first (the order to unmount them)."""
    found = [p for p in mount_table() if p == path or path in p.parents]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def unmount(mount_point: Path) -> None:
    """Unmount everything stacked on ``mount_point``; a busy one is FailedPrecondition.

    Each is thawed first: unmounting a frozen filesystem succeeds but keeps its
    superblock, and so its loop device, alive until someone thaws it.
    """
    while mount_point in mount_table():
        with contextlib.suppress(CommandFailed):  # EINVAL when it is not frozen
            run(["fsfreeze", "-u", str(mount_point)], timeout=_TIMEOUT)
        try:
            run(["umount", str(mount_point)], timeout=_TIMEOUT)
        except CommandFailed as e:
            if "busy" in e.stderr:
                raise FailedPrecondition(f"{mount_point} is busy: {e.stderr.strip()}") from e
            raise


def mount_loop(image: Path, mount_point: Path, fs_type: str, options: str) -> None:
    """Mount the filesystem in the file ``image`` on ``mount_point`` (``options`` hold "loop")."""
    run(["mount", "-t", fs_type, "-o", options, str(image), str(mount_point)], timeout=_TIMEOUT)
