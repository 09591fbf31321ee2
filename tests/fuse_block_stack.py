"""A test's FUSE block attachments (``fuse.blockfile`` and a loop device) and the
filesystems mounted on them, taken down in reverse order whatever happened and then
checked for leftovers; and what tests do on them: mkfs, a writer thread that fsyncs
small files until stopped, reading again until an export answers."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fuse.blockdev import Attachment, attach_fuse_block, detach_fuse_block
from fuse.loop import loop_status
from tests.conftest import run

MiB = 1 << 20
IMAGE_SIZE = 512 * MiB
IO_TIMEOUT = 60.0  # a request waits this long for a server that went away (tests only)


def fuse_processes(marker: str) -> list[str]:
    result = subprocess.run(
        ["pgrep", "-af", "fuse.blockfile"], capture_output=True, text=True, timeout=10
    )
    return [line for line in result.stdout.splitlines() if marker in line]


def leftovers(tmp: Path) -> list[str]:
    """Mounts, loop devices and FUSE processes of this test that still exist."""
    marker = str(tmp)
    with open("/proc/mounts") as mounts:
        found = [f"mount: {line.strip()}" for line in mounts if marker in line]
    loops = run(["losetup", "-a"]).stdout.splitlines()
    found += [f"loop: {line}" for line in loops if marker in line]
    found += [f"process: {line}" for line in fuse_processes(marker)]
    return found


@dataclass
class BlockStack:
    """What a test attached and mounted, taken down in reverse order whatever happened."""

    tmp: Path
    attached: list[str] = field(default_factory=list)  # URIs
    mounts: list[Path] = field(default_factory=list)

    @property
    def state_dir(self) -> Path:
        return self.tmp / "state"

    def attach(self, uri: str, workers: int = 1, nbd_client: str = "auto") -> Attachment:
        self.attached.append(uri)
        attachment = attach_fuse_block(
            uri,
            self.state_dir,
            connections=4,
            timeout=IO_TIMEOUT,
            workers=workers,
            nbd_client=nbd_client,
        )
        assert loop_status(attachment.device) is not None
        return attachment

    def detach(self, attachment: Attachment) -> None:
        assert detach_fuse_block(attachment.device, self.state_dir)
        self.attached.remove(attachment.uri)

    def mount(self, device: str, fstype: str) -> Path:
        target = self.tmp / f"fs{len(self.mounts)}-{os.path.basename(device)}"
        target.mkdir(exist_ok=True)
        run(["mount", "-t", fstype, device, str(target)])
        self.mounts.append(target)
        return target

    def umount(self, target: Path) -> None:
        run(["umount", str(target)])
        self.mounts.remove(target)

    def close(self) -> None:
        """Unmount, detach; kill what refuses; then nothing of the test may be left."""
        for target in reversed(self.mounts):
            umount = subprocess.Popen(["umount", str(target)], stderr=subprocess.DEVNULL)
            try:
                code = umount.wait(20)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                self._kill_fuse()  # a server that is gone: fail its I/O so unmounting ends
                umount.wait(60)
                subprocess.run(["umount", "-l", str(target)], timeout=60, capture_output=True)
        self.mounts.clear()
        for uri in reversed(self.attached):
            try:
                detach_fuse_block(uri, self.state_dir, timeout=10)
            except Exception:
                self._kill_fuse()
                detach_fuse_block(uri, self.state_dir, timeout=10)
        self.attached.clear()
        left = leftovers(self.tmp)
        assert not left, "left behind:\n" + "\n".join(left)

    def _kill_fuse(self) -> None:
        for line in fuse_processes(str(self.state_dir)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)


def mkfs(fstype: str, device: str) -> None:
    argv = ["mkfs.ext4", "-F", "-q"] if fstype == "ext4" else ["mkfs.xfs", "-f", "-q"]
    run([*argv, device])


class Writer(threading.Thread):
    """Writes and fsyncs small files until stopped; remembers those whose fsync returned."""

    def __init__(self, directory: Path) -> None:
        super().__init__(name="writer", daemon=True)
        self.directory = directory
        self.done: dict[str, str] = {}
        self.error: BaseException | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                for i in range(1_000_000):
                    if self.stopping.is_set():
                        return
                    data = os.urandom(256 * 1024 + i * 4096 % MiB)
                    name = f"w-{i:05d}.bin"
                    with (self.directory / name).open("wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.fsync(dir_fd)
                    self.done[name] = hashlib.sha256(data).hexdigest()
            finally:
                os.close(dir_fd)
        except BaseException as e:
            self.error = e

    def wait_for(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.done) < count:
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"only {len(self.done)} of {count} files written"
            time.sleep(0.05)


def reads_again(fd: int, expected: bytes, within: float) -> None:
    """Past the bound a connection is tried again every 2 s: read the start of ``fd``
    until the export answers, ``expected`` (within ``within`` seconds)."""
    deadline = time.monotonic() + within
    while True:
        try:
            assert os.pread(fd, len(expected), 0) == expected
            return
        except OSError:
            assert time.monotonic() < deadline, "the export did not come back"
            time.sleep(0.5)
