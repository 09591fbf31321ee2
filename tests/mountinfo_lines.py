"""Lines of /proc/self/mountinfo as the kernel writes them (its octal escapes included),
for a fake mount table."""

from __future__ import annotations


def _escape(path: str) -> str:
    """As the kernel writes a path in mountinfo."""
    for char in "\\ \t\n":
        path = path.replace(char, f"\\{ord(char):03o}")
    return path


def mountinfo_line(
    mount_id: int,
    mount_point: str,
    source: str,
    fstype: str,
    *,
    dev: str = "7:3",
    root: str = "/",
    options: str = "rw,relatime",
    optional: str = "shared:1",
    super_options: str = "rw",
) -> str:
    fields = [str(mount_id), "1", dev, _escape(root), _escape(mount_point), options]
    fields += [*optional.split(), "-", fstype, _escape(source), super_options]
    return " ".join(fields)
