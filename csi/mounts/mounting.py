"""Mounting on this node: ``mount``, bind mounts, read-only remounts, ``umount``.

Each is idempotent: what is asked for already being there is success, and
something else mounted in its place is a
:class:`~csi.mounts.errors.FilesystemError`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence

from csi.mounts import tools
from csi.mounts.errors import FilesystemError, MountError
from csi.mounts.table import mount_entry
from csi.mounts.tools import TIMEOUT
from csi.mounts.validation import (
    validate_fstype,
    validate_options,
    validate_path,
    validate_source,
)
from hostio.mountinfo import MountEntry


def _same_source(entry: MountEntry, source: str, fstype: str | None) -> bool:
    if fstype is not None and entry.fstype != fstype:
        return False
    try:
        st = os.stat(source)
    except OSError:
        return entry.source == source
    if stat.S_ISBLK(st.st_mode):
        return (entry.major, entry.minor) == (os.major(st.st_rdev), os.minor(st.st_rdev))
    return entry.source == source


def mount(
    source: str,
    target: str | os.PathLike[str],
    fstype: str | None = None,
    options: Sequence[str] = (),
    *,
    timeout: float = TIMEOUT,
) -> None:
    """``mount -t FSTYPE -o OPTIONS -- SOURCE TARGET``.

    Idempotent: the same source already mounted on ``target`` (with the same
    read-only-ness) is success; anything else mounted there is a FilesystemError.
    """
    source = validate_source(source)
    target_path = validate_path(target, "mount target")
    opts = validate_options(options)
    if fstype is not None:
        validate_fstype(fstype)
    existing = mount_entry(target_path)
    if existing is not None:
        if not _same_source(existing, source, fstype):
            raise FilesystemError(
                f"{target_path} already has {existing.source} ({existing.fstype}) mounted"
            )
        if ("ro" in opts) != existing.read_only:
            mode = "read-only" if existing.read_only else "read-write"
            raise FilesystemError(f"{source} is already mounted {mode} on {target_path}")
        return
    argv = ["mount"]
    if fstype is not None:
        argv += ["-t", fstype]
    if opts:
        argv += ["-o", ",".join(opts)]
    tools.run([*argv, "--", source, target_path], timeout)


def set_read_only(target: str | os.PathLike[str], read_only: bool = True) -> None:
    """Make the mount on ``target`` read-only (or writable) for this mount only.

    ``mount -o remount,bind,ro`` changes the per-mount flag, so it works on any
    mount (a bind, a FUSE mount), leaving the filesystem itself as it is.
    """
    target_path = validate_path(target, "mount target")
    if mount_entry(target_path) is None:
        raise FilesystemError(f"nothing is mounted on {target_path}")
    mode = "ro" if read_only else "rw"
    tools.run(["mount", "-o", f"remount,bind,{mode}", "--", target_path], TIMEOUT)


# Per-mount flags (mount(2)'s MS_NOSUID, MS_NODEV, MS_NOEXEC and the atime
# ones): a bind remount sets them on one mount, whatever its filesystem.
MOUNT_FLAGS = frozenset(
    {"nosuid", "nodev", "noexec", "noatime", "nodiratime", "relatime", "strictatime"}
)
ATIME_FLAGS = frozenset({"noatime", "relatime", "strictatime"})


def set_mount_flags(target: str | os.PathLike[str], flags: Iterable[str]) -> None:
    """Add per-mount ``flags`` (of :data:`MOUNT_FLAGS`) to the mount on ``target``.

    ``mount -o remount,bind,FLAGS`` sets the mount's flags to exactly what it
    is given, so the ones it has (read-only, nosuid, nodev, noexec, the atime
    mode) are given again; an atime mode asked for replaces the one it has.
    Bind mounts made of it afterwards copy them.
    """
    wanted = list(dict.fromkeys(flags))
    unknown = sorted(set(wanted) - MOUNT_FLAGS)
    if unknown:
        raise FilesystemError(f"not per-mount flags: {unknown}")
    target_path = validate_path(target, "mount target")
    entry = mount_entry(target_path)
    if entry is None:
        raise FilesystemError(f"nothing is mounted on {target_path}")
    if not wanted:
        return
    keep = [o for o in entry.mount_options if o in MOUNT_FLAGS]
    if ATIME_FLAGS & set(wanted):
        keep = [o for o in keep if o not in ATIME_FLAGS]
    mode = "ro" if "ro" in entry.mount_options else "rw"
    options = ",".join(dict.fromkeys([mode, *keep, *wanted]))
    tools.run(["mount", "-o", f"remount,bind,{options}", "--", target_path], TIMEOUT)


def bind_mount(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    read_only: bool = False,
    *,
    timeout: float = TIMEOUT,
) -> None:
    """Bind ``source`` (a directory, or a file onto a file) on ``target``.

    A read-only bind is ``mount --bind`` then ``mount -o remount,bind,ro``
    (the first ignores "ro"); if the remount fails the bind is undone.
    Idempotent: ``source`` already bound there is success, its read-only-ness
    brought to what is asked; another mount there is a FilesystemError.
    """
    source_path = validate_path(source, "bind source")
    target_path = validate_path(target, "bind target")
    existing = mount_entry(target_path)
    if existing is not None:
        try:
            same = os.path.samefile(source_path, target_path)
        except OSError:
            same = False
        if not same:
            raise FilesystemError(
                f"{target_path} already has another mount ({existing.source}, {existing.fstype})"
            )
        if existing.read_only != read_only:
            set_read_only(target_path, read_only)
        return
    tools.run(["mount", "--bind", "--", source_path, target_path], timeout)
    if read_only:
        try:
            set_read_only(target_path, True)
        except BaseException:
            # never leave a writable bind where a read-only one was asked for
            unmount(target_path)
            raise


def unmount(
    target: str | os.PathLike[str], lazy: bool = False, *, timeout: float = TIMEOUT
) -> None:
    """``umount -c [-l] -- TARGET``; nothing mounted there is success (one mount is removed).

    ``-c`` (no canonicalization): TARGET is a mount point exactly as the mount
    table names it, so umount(8) need not stat its way to it, and a stat of a
    mount whose server is gone waits (a FUSE NFS mount past its bound answers
    each in seconds; a hard kernel NFS mount never would)."""
    target_path = validate_path(target, "unmount target")
    if mount_entry(target_path) is None:
        return
    try:
        tools.run(["umount", "-c", *(["-l"] if lazy else []), "--", target_path], timeout)
    except MountError:
        if mount_entry(target_path) is None:  # someone else unmounted it meanwhile
            return
        raise
