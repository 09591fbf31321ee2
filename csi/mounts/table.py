"""What is mounted where on this node, from ``/proc/self/mountinfo``.

Octal escapes such as ``\\040`` are decoded, so bind mounts of single
files are seen too, and a FUSE mount whose daemon died is still found.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from csi.mounts.errors import FilesystemError

MOUNTINFO = Path("/proc/self/mountinfo")  # module level so tests can point elsewhere


@dataclass(frozen=True, slots=True)
class MountEntry:
    """One line of /proc/self/mountinfo, unescaped."""

    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    mount_point: str
    mount_options: tuple[str, ...]
    fstype: str
    source: str
    super_options: tuple[str, ...]
    # propagation tags: shared:N (a peer group), master:N (a slave of one), ...
    optional_fields: tuple[str, ...] = ()

    @property
    def read_only(self) -> bool:
        return "ro" in self.mount_options or "ro" in self.super_options

    @property
    def peer_group(self) -> int | None:
        """N of ``shared:N``: mounts made on this mount propagate to its peers."""
        return _tag(self.optional_fields, "shared:")

    @property
    def master(self) -> int | None:
        """N of ``master:N``: this mount receives the mounts of peer group N."""
        return _tag(self.optional_fields, "master:")


def _tag(fields: tuple[str, ...], prefix: str) -> int | None:
    for tag in fields:
        if tag.startswith(prefix) and tag[len(prefix) :].isdigit():
            return int(tag[len(prefix) :])
    return None


_OCTAL = re.compile(rb"\\([0-7]{3})")


def _unescape(field: bytes) -> str:
    """The kernel escapes space, tab, newline and backslash as ``\\ooo``."""
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), field))


def parse_mountinfo(data: bytes) -> list[MountEntry]:
    """Parse mountinfo(5); malformed lines are skipped."""
    entries: list[MountEntry] = []
    for line in data.splitlines():
        fields = line.split(b" ")
        try:
            sep = fields.index(b"-", 6)
            major, minor = fields[2].split(b":")
            entries.append(
                MountEntry(
                    mount_id=int(fields[0]),
                    parent_id=int(fields[1]),
                    major=int(major),
                    minor=int(minor),
                    root=_unescape(fields[3]),
                    mount_point=_unescape(fields[4]),
                    mount_options=tuple(_unescape(fields[5]).split(",")),
                    fstype=_unescape(fields[sep + 1]),
                    source=_unescape(fields[sep + 2]),
                    super_options=tuple(_unescape(fields[sep + 3]).split(","))
                    if len(fields) > sep + 3
                    else (),
                    optional_fields=tuple(f.decode("ascii", "replace") for f in fields[6:sep]),
                )
            )
        except (ValueError, IndexError):
            continue
    return entries


def mount_entries() -> list[MountEntry]:
    """Every mount this process sees, in mount order."""
    return parse_mountinfo(MOUNTINFO.read_bytes())


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
    target = resolve_to_mount_point(path, entries)
    found = None
    for entry in entries:
        if entry.mount_point == target:
            found = entry  # later lines are mounted on top of earlier ones
    return found


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
