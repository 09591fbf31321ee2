"""Loop devices over sparse images, and directories, under one test's directory; their
cleanup unmounts (lazily if busy) everything mounted below it, deepest first, and
detaches the loop devices."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from csi import mounts
from tests.conftest import run


class Disks:
    """Loop devices over sparse images, and directories, under one test's tmp_path."""

    def __init__(self, base: Path) -> None:
        self.base = Path(os.path.realpath(base))
        self.loops: list[str] = []

    def image(self, name: str, size: int) -> Path:
        path = self.base / f"{name}.img"
        with path.open("wb") as f:
            f.truncate(size)
        return path

    def loop(self, size: int, name: str = "disk") -> str:
        image = self.image(f"{name}-{len(self.loops)}", size)
        device = run(["losetup", "--find", "--show", str(image)]).stdout.strip()
        self.loops.append(device)
        return device

    def backing(self, device: str) -> Path:
        return Path(run(["losetup", "--noheadings", "-O", "BACK-FILE", device]).stdout.strip())

    def grow(self, device: str, size: int) -> None:
        """Grow the image and tell the loop device (losetup -c)."""
        os.truncate(self.backing(device), size)
        run(["losetup", "-c", device])

    def dir(self, name: str) -> Path:
        path = self.base / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def cleanup(self) -> None:
        # deepest first, so nested mounts come off before their parents
        ours = [
            e.mount_point
            for e in mounts.mount_entries()
            if e.mount_point.startswith(str(self.base) + "/")
        ]
        for target in sorted(ours, key=len, reverse=True):
            done = subprocess.run(["umount", "--", target], capture_output=True, timeout=60)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", "--", target], capture_output=True, timeout=60)
        for device in self.loops:
            subprocess.run(["losetup", "-d", device], capture_output=True, timeout=60)
