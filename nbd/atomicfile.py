"""Replacing a small file whole: after a crash or a power loss it holds the old
content or the new, never a mix, and a write that returned is on disk.

The data goes to a temporary file in the same directory (a dot name ending in
``.tmp``, which no reader's ``*.json`` or ``*.conf`` picks up), is fsynced,
renamed over the path, and the directory is fsynced so that the rename itself
is durable.  Every record the project keeps is written through
:func:`write_atomically`: the node plugin's state, the block attachment
records, the pool's marker and record, ganesha's export files.

It lives in ``nbd`` because that is the package every other one may import.
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make the entries of ``directory`` (a rename, an unlink) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
