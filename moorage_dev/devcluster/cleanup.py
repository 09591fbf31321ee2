"""Leave nothing behind: processes, mounts, loop devices, cgroups, namespaces.

Used by ``down`` after the graceful part (workloads, claims and the chart
removed through the API) whether or not that part worked.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from backend.loopdevices import loop_backing_id, loop_devices
from hostio import tools as hosttools
from hostio.mountinfo import MountEntry, read_mountinfo

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: the cgroup moorage's node plugin moves its FUSE daemons to (chart: node.fuseCgroup)
FUSE_CGROUP = "moorage-fuse"
# umount/losetup on a dead server's mount can block; past this the lazy way is taken
UMOUNT_TIMEOUT = 30.0


def _pids_in(cgroup: str) -> set[int]:
    pids: set[int] = set()
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / cgroup
        if not top.is_dir():
            continue
        for procs in top.rglob("cgroup.procs"):
            try:
                pids.update(int(x) for x in procs.read_text().split())
            except OSError:
                continue
    return pids


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def kill_containers(cgroups: list[str], containerd_sockets: list[Path]) -> int:
    """SIGKILL every process in the cgroups and the shims of our containerds."""
    victims = set().union(*(_pids_in(c) for c in cgroups))
    sockets = {str(s) for s in containerd_sockets}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = _cmdline(int(entry.name))
        shim = bool(argv) and argv[0].endswith("containerd-shim-runc-v2")
        if shim and "-address" in argv and argv[argv.index("-address") + 1] in sockets:
            victims.add(int(entry.name))
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in victims):
        time.sleep(0.1)
    return len(victims)


def _mount_points() -> list[str]:
    return [e.mount_point for e in read_mountinfo()]


def unmount_under(prefixes: list[Path]) -> list[str]:
    """Unmount every mount at or under the prefixes, deepest first (lazily if busy)."""
    wanted = [str(p) for p in prefixes]
    gone: list[str] = []
    for _ in range(5):
        points = [
            m
            for m in _mount_points()
            if any(m == w or m.startswith(w.rstrip("/") + "/") for w in wanted)
        ]
        if not points:
            break
        for point in sorted(set(points), key=len, reverse=True):
            try:
                hosttools.run(["umount", point], timeout=UMOUNT_TIMEOUT)
            except hosttools.ToolError:  # busy, or a dead server's mount: detach it
                with contextlib.suppress(hosttools.ToolError):
                    hosttools.run(["umount", "-l", point], timeout=UMOUNT_TIMEOUT)
            gone.append(point)
    return gone


def fuse_devices_under(prefixes: list[Path], mounts: list[MountEntry] | None = None) -> set[int]:
    """Device numbers of the FUSE filesystems mounted at or under the prefixes
    (in ``mounts``, by default this process's mount table)."""
    wanted = [str(p).rstrip("/") for p in prefixes]
    devices = set()
    for entry in read_mountinfo() if mounts is None else mounts:
        point = entry.mount_point
        if not entry.fstype.startswith("fuse"):
            continue
        if any(point == w or point.startswith(w + "/") for w in wanted):
            devices.add(os.makedev(entry.major, entry.minor))
    return devices


def detach_loops(prefixes: list[Path], devices: set[int]) -> list[str]:
    """Detach loop devices whose backing file lies under the prefixes or on ``devices``.

    Files under the prefixes are found as the storage node finds its own (a
    loop attached inside a pod names its file relative to a mount the host
    never had: backend.loopdevices); ``devices`` catches files of filesystems that
    are gone or dead, such as a FUSE block file whose daemon was killed.
    """
    candidates = {d for prefix in prefixes for d in loop_devices(prefix)}
    for entry in Path("/sys/block").glob("loop*"):
        backing = loop_backing_id(f"/dev/{entry.name}")
        if backing is not None and backing[0] in devices:
            candidates.add(f"/dev/{entry.name}")
    detached = []
    for device in sorted(candidates):
        try:
            hosttools.run(["losetup", "-d", device], timeout=UMOUNT_TIMEOUT)
        except hosttools.ToolError:
            continue
        detached.append(device)
    return detached


def remove_cgroups(cgroups: list[str]) -> None:
    """Remove the cluster's cgroups, deepest first, in every hierarchy."""
    for hierarchy in CGROUP_ROOT.iterdir():
        for name in cgroups:
            top = hierarchy / name
            if not top.is_dir():
                continue
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()


def remove_pod_netns() -> None:
    """The pod sandboxes' namespaces containerd pinned under /run/netns (cni-*)."""
    base = Path("/run/netns")
    if not base.is_dir():
        return
    for entry in base.glob("cni-*"):
        with contextlib.suppress(hosttools.ToolError):
            hosttools.run(["umount", str(entry)], timeout=UMOUNT_TIMEOUT)
        entry.unlink(missing_ok=True)
