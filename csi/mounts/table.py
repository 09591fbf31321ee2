"""What is mounted on a path of this node, from ``/proc/self/mountinfo``.

Paths are matched against the kernel's table (parsed by
:mod:`hostio.mountinfo`), not found by stat-ing them, so bind mounts of
single files are seen too, and a FUSE mount whose daemon died is still found.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from csi.mounts.errors import FilesystemError
from hostio.mountinfo import MountEntry, parse_mountinfo, topmost

MOUNTINFO = Path("/proc/self/mountinfo")  # module level so tests can point elsewhere


def mount_entries() -> list[MountEntry]:
    """Every mount this process sees, in mount order."""
    return parse_mountinfo(MOUNTINFO.read_bytes(), str(MOUNTINFO))


def resolve_to_mount_point(
    path: str | os.PathLike[str], entries: list[MountEntry] | None = None
) -> str:
    """``path`` with its symlinks resolved, without looking into a mount on it.

    A mount point is not a symlink, so when the path's resolved parent plus its
    name is a mount point in the table, that is the answer and the mount's
    root is never stat-ed: stat-ing the root of a mount whose server is away
    waits for that server (up to the volume's I/O timeout), and a dead FUSE
    mount answers ENOTCONN.  Anything else is resolved in full."""
    text = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(text)
    candidate = os.path.join(os.path.realpath(parent), name)
    table = mount_entries() if entries is None else entries
    if any(e.mount_point == candidate for e in table):
        return candidate
    return os.path.realpath(candidate)


def mount_entry(path: str | os.PathLike[str]) -> MountEntry | None:
    """The topmost mount on ``path`` exactly (not on a parent of it), or None."""
    entries = mount_entries()
    return topmost(entries, resolve_to_mount_point(path, entries))


def mount_containing(path: str | os.PathLike[str]) -> MountEntry | None:
    """The mount ``path`` lies on; for a path that does not exist yet, the mount
    of its nearest existing parent (where it will be made). None if that mount is
    not in this process's table (it lies outside our root)."""
    target = Path(os.path.abspath(os.fspath(path)))
    while True:
        try:
            fd = os.open(target, os.O_PATH | os.O_CLOEXEC)
            break
        except FileNotFoundError:
            if target.parent == target:
                raise
            target = target.parent
    try:
        # exact, unlike a prefix match: overmounts and bind mounts are told apart
        fdinfo = Path(f"/proc/self/fdinfo/{fd}").read_text()
    finally:
        os.close(fd)
    fields = dict(line.split(":", 1) for line in fdinfo.splitlines() if ":" in line)
    mount_id = int(fields["mnt_id"])
    return next((e for e in mount_entries() if e.mount_id == mount_id), None)


def _device_number(device: str) -> int:
    try:
        st = os.stat(device)
    except OSError as e:
        raise FilesystemError(f"{device}: {e.strerror}") from e
    if not stat.S_ISBLK(st.st_mode):
        raise FilesystemError(f"{device} is not a block device")
    return st.st_rdev


def mounts_of_device(device: str | os.PathLike[str]) -> list[MountEntry]:
    """Every mount of the filesystem on block device ``device``."""
    rdev = _device_number(os.fspath(device))
    return [e for e in mount_entries() if (e.major, e.minor) == (os.major(rdev), os.minor(rdev))]
