"""Replacing a small file whole: after a crash or a power loss it holds the old
content or the new, never a mix, and a write that returned is on disk.

The data goes to a temporary file in the same directory (a dot name ending in
``.tmp``, which no reader's ``*.json`` or ``*.conf`` picks up), is fsynced,
renamed over the path, and the directory is fsynced so that the rename itself
is durable.  Every record and configuration file the project keeps is
written through :func:`write_atomically` (the node plugin's state, the block
attachment records, the pool's marker and record, ganesha's files, pid
files), and removed through :func:`unlink_durably`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def _fsync(path: str | os.PathLike[str], flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make the entries of ``directory`` (a rename, a link, an unlink) durable."""
    _fsync(directory, os.O_DIRECTORY)


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Make the data of the file (or the entries of the directory) ``path`` durable."""
    _fsync(path, 0)


def write_atomically(path: str | os.PathLike[str], data: bytes | str, mode: int = 0o600) -> None:
    """Replace ``path`` by ``data`` (text is written as UTF-8), with permissions ``mode``.

    Concurrent writers of one path each use a temporary file of their own: the
    last rename wins, and every reader sees one whole version.
    """
    payload = data.encode() if isinstance(data, str) else data
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    fsync_directory(directory)


def unlink_durably(path: str | os.PathLike[str], missing_ok: bool = False) -> bool:
    """Remove ``path`` and make the removal durable; whether it was there.

    A record removed without the directory fsynced can come back after a
    power loss and describe something long gone.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise
        return False
    fsync_directory(os.path.dirname(os.path.abspath(os.fspath(path))))
    return True
