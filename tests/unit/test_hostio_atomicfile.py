"""hostio.atomicfile: a record is replaced whole, and durably, directory included."""

from __future__ import annotations

import errno
import io
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hostio import atomicfile


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_the_file_then_the_rename_then_the_directory_are_made_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "record.json"
    path.write_text("old\n")
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", _fd_path(fd)))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("replace", os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomicfile.write_atomically(path, "new\n")

    assert path.read_text() == "new\n"
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"], events
    temp = events[0][1]
    assert Path(temp).parent == tmp_path and Path(temp).name.startswith(".record.json.")
    assert temp.endswith(".tmp")  # no reader's *.json picks it up
    assert events[1] == ("replace", str(path))
    assert events[2] == ("fsync", str(tmp_path))  # the rename itself survives a power loss


def test_mode_is_set_and_no_temporary_file_is_left(tmp_path: Path) -> None:
    path = tmp_path / "export-1.conf"
    atomicfile.write_atomically(path, b"EXPORT {}\n", mode=0o644)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    atomicfile.write_atomically(path, "text is UTF-8: é\n")
    assert path.read_bytes() == "text is UTF-8: é\n".encode()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the default: records are private
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export-1.conf"]


def _fsync_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)


def _disk_fills_half_way(monkeypatch: pytest.MonkeyPatch) -> None:
    real_fdopen = os.fdopen

    class FullDisk(io.BufferedWriter):
        def write(self, data: Any) -> int:
            super().write(bytes(data)[: len(data) // 2])
            self.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    def fdopen(fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode == "wb":  # the temporary file: half of the data reaches it
            return FullDisk(io.FileIO(fd, "wb"))
        return real_fdopen(fd, mode, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", fdopen)


@pytest.mark.parametrize("failure", [_fsync_fails, _disk_fills_half_way])
def test_a_failed_write_leaves_the_old_file_whole_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Callable[[pytest.MonkeyPatch], None]
) -> None:
    path = tmp_path / "record.json"
    path.write_text("old\n")
    failure(monkeypatch)
    with pytest.raises(OSError):
        atomicfile.write_atomically(path, "new content, longer than the old\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_a_removal_is_made_durable_and_may_be_of_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "record.json"
    path.write_text("old\n")
    seen: list[str] = []
    monkeypatch.setattr(os, "fsync", lambda fd: seen.append(_fd_path(fd)))
    assert atomicfile.unlink_durably(path) is True
    assert not path.exists() and seen == [str(tmp_path)]
    assert atomicfile.unlink_durably(path, missing_ok=True) is False
    with pytest.raises(FileNotFoundError):
        atomicfile.unlink_durably(path)


def test_concurrent_writers_each_leave_one_whole_version(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    versions = [f"{n}\n" * 2000 for n in range(8)]
    threads = [
        threading.Thread(target=atomicfile.write_atomically, args=(path, v)) for v in versions
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert path.read_text() in versions
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


def test_fsync_directory_syncs_the_directory_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    monkeypatch.setattr(os, "fsync", lambda fd: seen.append(_fd_path(fd)))
    atomicfile.fsync_directory(tmp_path)
    assert seen == [str(tmp_path)]
