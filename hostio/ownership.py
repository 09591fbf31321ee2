"""Giving a tree of files to a group, as kubelet does for a pod's fsGroup.

Every file and directory under the root (the root last) gets the group as
its owner and group read and write; a directory also group search and the
set-group-ID bit, so what is made in it later belongs to the group too.  A
regular file loses set-user-ID (chown drops it anyway; it is never added
back); a device, socket or fifo only changes group; a symbolic link changes
group itself and is never followed.

The files may belong to someone else (an NFS export's clients, a pod): each
is opened without following a link (``os.fwalk``, ``O_PATH|O_NOFOLLOW``) and
changed through that descriptor, so a link swapped in during the walk cannot
lead outside the tree.
"""

from __future__ import annotations

import os
import stat

_NO_FOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def give_to_group(root: str | os.PathLike[str], gid: int) -> bool:
    """Give the tree at ``root`` to group ``gid``; whether anything was done.

    Nothing is done when the root already belongs to the group (Kubernetes'
    ``OnRootMismatch``); the root is changed last, so a walk cut short is
    done again the next time.  OSError from the first change refused.
    """
    top = os.open(root, _NO_FOLLOW_DIR)
    try:
        if os.fstat(top).st_gid == gid:
            return False
        for _, dirs, files, dir_fd in os.fwalk(dir_fd=top, follow_symlinks=False):
            for name in [*dirs, *files]:
                _give_entry(dir_fd, name, gid)
        _give_fd(top, gid)
    finally:
        os.close(top)
    return True


def _give_entry(dir_fd: int, name: str, gid: int) -> None:
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            os.chown(name, -1, gid, dir_fd=dir_fd, follow_symlinks=False)
        else:
            _give_fd(fd, gid)
    finally:
        os.close(fd)


def _give_fd(fd: int, gid: int) -> None:
    """Group owner, and group rights, of what ``fd`` (possibly O_PATH) holds."""
    st = os.fstat(fd)
    inode = f"/proc/self/fd/{fd}"  # the opened inode itself, whatever its name is now
    os.chown(inode, -1, gid)
    mode = stat.S_IMODE(st.st_mode) | stat.S_IRGRP | stat.S_IWGRP
    if stat.S_ISDIR(st.st_mode):
        os.chmod(inode, mode | stat.S_IXGRP | stat.S_ISGID)
    elif stat.S_ISREG(st.st_mode):
        os.chmod(inode, mode & ~stat.S_ISUID)
