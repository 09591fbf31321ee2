"""The paths kubelet hands the node plugin, checked before anything is recorded or touched.

A staging or target path must be absolute and lie strictly under kubelet's
root directory (``--kubelet-dir``), as written and with its symlinks
resolved: ``/``, ``/etc``, the root itself or a link out of it are refused
(INVALID_ARGUMENT), and nothing is recorded for them.  A staging path that
exists must be a directory.

Unstage and unpublish act only on what the node state records (or on a bind
of the volume's own staging mount); :func:`leave_alone` answers for any
other path, leaving what lies there as it is, and :func:`check_free` keeps
a new stage or publication from being recorded over something foreign.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

from csi import mounts
from csi.errors import FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger("moorage.csi.node")

DEFAULT_ROOT = Path("/var/lib/kubelet")
_MAX_PATH = 4096


def absolute(value: str, what: str) -> Path:
    """``value`` as a normalised absolute path, or INVALID_ARGUMENT."""
    if not value:
        raise InvalidArgument(f"{what} is missing")
    if not value.startswith("/") or "\0" in value or len(value.encode()) > _MAX_PATH:
        raise InvalidArgument(f"{what} {value[:140]!r} is not an absolute path")
    return Path(os.path.normpath(value))


def _resolved(path: Path) -> Path:
    """``path`` with its symlinks resolved, without looking into a mount on it."""
    return Path(mounts.resolve_to_mount_point(path))


def _strictly_under(path: Path, root: Path) -> bool:
    return path != root and path.is_relative_to(root)


class KubeletPaths:
    """kubelet's root directory, and the checks of paths that must lie under it."""

    def __init__(self, root: Path = DEFAULT_ROOT) -> None:
        if not root.is_absolute():
            raise ValueError(f"kubelet directory {str(root)[:80]!r} is not an absolute path")
        self.root = Path(os.path.normpath(root))

    def check(self, value: str, what: str) -> Path:
        """``value``, absolute and under the kubelet directory; else INVALID_ARGUMENT."""
        path = absolute(value, what)
        if not _strictly_under(path, self.root):
            raise InvalidArgument(
                f"{what} {str(path)[:140]} is not under kubelet's directory {self.root} "
                "(--kubelet-dir): this plugin touches nothing else"
            )
        real, real_root = _resolved(path), Path(os.path.realpath(self.root))
        if not _strictly_under(real, real_root):
            raise InvalidArgument(
                f"{what} {str(path)[:140]} leads to {str(real)[:140]}, outside kubelet's "
                f"directory {real_root}"
            )
        return path

    def staging(self, value: str) -> Path:
        """A NodeStageVolume staging path: checked, and a directory if it exists."""
        path = self.check(value, "staging_target_path")
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return path  # made when staging, under the kubelet directory
        except NotADirectoryError as e:
            raise InvalidArgument(f"staging_target_path {path}: a parent is not a directory") from e
        except OSError:
            # a mount whose FUSE process died (ENOTCONN): the stage steps repair it
            # when the node state says it is this volume's, and refuse it otherwise
            return path
        if not stat.S_ISDIR(mode):
            raise InvalidArgument(f"staging_target_path {path} is not a directory")
        return path


def occupant(path: Path) -> str | None:
    """What lies at ``path``, for a path the plugin has no record of: None when
    nothing does (or an empty directory, which is how kubelet leaves one)."""
    entry = mounts.mount_entry(path)
    if entry is not None:
        return f"a {entry.fstype} mount of {entry.source}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"something that cannot be examined ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "a file"
    try:
        with os.scandir(path) as entries:
            empty = next(entries, None) is None
    except OSError as e:
        return f"a directory that cannot be read ({e.strerror})"
    return None if empty else "a directory that is not empty"


def leave_alone(path: Path, why: str) -> None:
    """For unstage and unpublish of a path the node state does not record:
    nothing there is success (never made, or undone already); anything else
    is NOT_FOUND, ``why`` and what it is, and it is left as it is."""
    found = occupant(path)
    if found is not None:
        raise NotFound(f"{why} by this plugin; {found} there is left as it is")
    log.info("%s: nothing to do", why)


def check_free(path: Path, what: str, file_ok: bool = False) -> None:
    """FAILED_PRECONDITION if ``path``, about to be recorded as a new stage or
    publication, holds something the plugin did not make (an empty directory,
    or with ``file_ok`` an empty file, is what kubelet may have made)."""
    found = occupant(path)
    if found == "a file" and file_ok:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size == 0:
                return
    if found is not None:
        raise FailedPrecondition(
            f"{what} {path} holds {found}, which this plugin did not make: "
            "nothing is recorded or mounted over it"
        )


def same_mount(path: Path, other: Path) -> bool:
    """Whether the mounts on ``path`` and ``other`` show the same thing (one is
    a bind of the other): same filesystem, same root within it."""
    a, b = mounts.mount_entry(path), mounts.mount_entry(other)
    if a is None or b is None:
        return False
    return (a.major, a.minor, a.root) == (b.major, b.minor, b.root)
