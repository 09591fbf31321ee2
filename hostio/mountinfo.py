"""The kernel's mount table, from ``/proc/self/mountinfo`` or ``/proc/PID/mountinfo``.

A line is ``ID PARENT MAJOR:MINOR ROOT MOUNT-POINT OPTIONS [OPTIONAL...] -
FSTYPE SOURCE SUPER-OPTIONS`` (proc(5)), its fields separated by single
spaces.  The kernel writes a space, a tab, a newline and a backslash in a
field as an octal escape (``\\040``, ``\\011``, ``\\012``, ``\\134``) and every
other byte as it is, so a path is decoded from its bytes by undoing every
``\\NNN`` and then :func:`os.fsdecode`: a name that is not UTF-8 keeps its
bytes (``os.fsencode`` gives them back) and compares equal to the same path
from :mod:`os`.  A line that does not have this shape is logged and skipped;
the rest of the table is still read.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("moorage.hostio")

_OCTAL = re.compile(rb"\\([0-7]{3})")
_SEPARATOR = b"-"
_FIRST_OPTIONAL = 6  # index of the first optional field, or of the separator


@dataclass(frozen=True, slots=True)
class MountEntry:
    """One line of mountinfo, unescaped."""

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


def unescape(field: bytes) -> str:
    """A mountinfo field as text: every ``\\NNN`` undone, then decoded as a path."""
    return os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m[1], 8) & 0xFF]), field))


def _number(field: bytes) -> int:
    if not field.isdigit():  # int() would take "+1", " 1" and "1_0"
        raise ValueError(f"not a number: {field!r}")
    return int(field)


def _entry(line: bytes) -> MountEntry:
    fields = line.split(b" ")
    sep = fields.index(_SEPARATOR, _FIRST_OPTIONAL)  # ValueError: no separator
    if len(fields) < sep + 3:
        raise ValueError("no filesystem type or source after the separator")
    major, minor = fields[2].split(b":")
    return MountEntry(
        mount_id=_number(fields[0]),
        parent_id=_number(fields[1]),
        major=_number(major),
        minor=_number(minor),
        root=unescape(fields[3]),
        mount_point=unescape(fields[4]),
        mount_options=tuple(unescape(fields[5]).split(",")),
        fstype=unescape(fields[sep + 1]),
        source=unescape(fields[sep + 2]),
        super_options=tuple(unescape(fields[sep + 3]).split(",")) if len(fields) > sep + 3 else (),
        optional_fields=tuple(f.decode("ascii", "replace") for f in fields[_FIRST_OPTIONAL:sep]),
    )


def parse_mountinfo(data: bytes, where: str = "mountinfo") -> list[MountEntry]:
    """Every well-formed line of mountinfo ``data``, in order; the others logged and skipped.

    Lines end at ``\\n`` only: the kernel escapes a newline in a path, but not
    a carriage return or any other byte.
    """
    entries: list[MountEntry] = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line:
            continue
        try:
            entries.append(_entry(line))
        except (ValueError, IndexError) as e:
            log.warning("%s line %d skipped, not a mount: %r (%s)", where, number, line[:200], e)
    return entries


def mountinfo_path(pid: int | None = None) -> Path:
    """``/proc/self/mountinfo``, or that of process ``pid`` (its mount namespace)."""
    return Path("/proc", "self" if pid is None else str(pid), "mountinfo")


def read_mountinfo(pid: int | None = None) -> list[MountEntry]:
    """The mounts this process sees (or process ``pid`` sees), in mount order.

    Later entries are mounted on top of earlier ones on the same mount
    point.  OSError when the file cannot be read (``pid`` has exited).
    """
    path = mountinfo_path(pid)
    return parse_mountinfo(path.read_bytes(), str(path))


def topmost(entries: list[MountEntry], mount_point: str) -> MountEntry | None:
    """The entry last mounted on ``mount_point`` exactly (the one a path lookup sees), or None."""
    found = None
    for entry in entries:
        if entry.mount_point == mount_point:
            found = entry
    return found
