"""How many volumes this node can hold now: NodeGetInfo's ``max_volumes_per_node``.

Kubernetes compares the count with the volumes of this driver it sees on the
node, so it is a total: the volumes the plugin holds (``ours``, from its node
records) plus what the block path can still attach.  Per path:

- **kernel-nbd**: the free ``/dev/nbdN``: a device under ``/sys/block`` with no
  ``pid`` file (no connection) and a size of 0.  A device that is busy but not
  ours (``nbd-client``, qemu-nbd, another driver) is not counted at all; ours are
  already in ``ours``.  The pool is the devices the module made (``nbds_max``);
  with ``nbds_max=0`` netlink adds a device per connect, so the pool is taken
  as the module's default of 16 devices (or as many as exist, when more do).
- **fuse-loop**: each attachment is a FUSE process of its own, budgeted at
  ``attachment_bytes`` (64 MiB by default, ``node.fuse_attachment_mib``): what
  the host can still give is ``MemAvailable`` (``MemFree`` on a kernel without
  it) divided by the budget.  Ours already use memory that MemAvailable no
  longer shows, so they count once, in ``ours``.
- no block path: nothing can be attached.

The total is at most 1024 on the FUSE path and never below 1: 0 would tell
kubelet "no limit" (CSINode leaves ``allocatable.count`` unset for it).  So a
node with nothing left reports what it holds, and 1 when it holds nothing.
Reading a few sysfs files and /proc/meminfo keeps it cheap, since kubelet calls
NodeGetInfo every ``nodeAllocatableUpdatePeriodSeconds``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from csi.attach.paths import Plan
from nbd import kernel as nbd_kernel

FUSE_ATTACHMENT_BYTES: Final = 64 << 20
MAX_FUSE_ATTACHMENTS: Final = 1024
NBDS_MAX_DEFAULT: Final = 16  # the nbd module's default nbds_max
# Host facts, module level so tests can point elsewhere (/sys/block is nbd.kernel.SYS_BLOCK).
NBDS_MAX = Path("/sys/module/nbd/parameters/nbds_max")
MEMINFO = Path("/proc/meminfo")

_NBD_NAME = re.compile(r"nbd\d+")


@dataclass(frozen=True, slots=True)
class VolumeLimit:
    """What NodeGetInfo reports (``count``), from what it is made of, and why."""

    count: int
    ours: int
    free: int
    reason: str


@dataclass(frozen=True, slots=True)
class NBDDevices:
    free: int
    busy: int


def _nbd_busy(device: Path) -> bool:
    """A device with a connection, or a size set (an ioctl attach on its way)."""
    if (device / "pid").exists():
        return True
    try:
        return int((device / "size").read_text()) != 0
    except (OSError, ValueError):
        return True  # unreadable: never offered as free


def nbd_devices(sys_block: Path | None = None) -> NBDDevices:
    """The kernel's nbd devices, free and busy (anyone's)."""
    sys_block = sys_block or nbd_kernel.SYS_BLOCK
    try:
        names = [n for n in os.listdir(sys_block) if _NBD_NAME.fullmatch(n)]
    except OSError:
        names = []
    busy = sum(1 for n in names if _nbd_busy(sys_block / n))
    return NBDDevices(free=len(names) - busy, busy=busy)


def _nbds_max() -> int | None:
    try:
        return int(NBDS_MAX.read_text())
    except (OSError, ValueError):
        return None


def available_memory() -> int | None:
    """Bytes the host can still give without swapping: MemAvailable (MemFree
    where the kernel has no MemAvailable); None when /proc/meminfo is unreadable."""
    try:
        fields = dict(
            (line.split(":", 1)[0], line.split()[1])
            for line in MEMINFO.read_text().splitlines()
            if ":" in line and len(line.split()) >= 2
        )
        value = fields.get("MemAvailable", fields.get("MemFree"))
        return None if value is None else int(value) * 1024
    except (OSError, ValueError):
        return None


def volume_limit(
    plan: Plan, ours: int, attachment_bytes: int = FUSE_ATTACHMENT_BYTES
) -> VolumeLimit:
    """This node's total (see the module docstring for the rules); ``ours``:
    the volumes the plugin holds that Kubernetes counts (not inline ephemeral ones)."""
    if plan.block == "kernel-nbd":
        devices = nbd_devices()
        free = devices.free
        reason = f"{free} free nbd device(s), {devices.busy} busy"
        present = devices.free + devices.busy
        if _nbds_max() == 0 and present < NBDS_MAX_DEFAULT:
            free += NBDS_MAX_DEFAULT - present
            reason += f"; nbds_max=0 (devices made on connect): a pool of {NBDS_MAX_DEFAULT}"
        count = ours + free
    elif plan.block == "fuse-loop":
        memory = available_memory()
        free = 0 if memory is None else memory // attachment_bytes
        reason = (
            "memory unknown (/proc/meminfo unreadable)"
            if memory is None
            else f"{memory >> 20} MiB available, {attachment_bytes >> 20} MiB per attachment"
        )
        count = min(MAX_FUSE_ATTACHMENTS, ours + free)
    else:
        free, reason = 0, "no block path"
        count = ours
    return VolumeLimit(count=max(1, count), ours=ours, free=free, reason=reason)
