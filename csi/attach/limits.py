"""How many volumes this node can hold now: NodeGetInfo's ``max_volumes_per_node``.

Kubernetes compares the count with the volumes of this driver it sees on the
node, so it is a total: the volumes the plugin holds (``ours``, from its node
records) plus what the node can still attach.  Per path:

- **kernel-nbd**: the free ``/dev/nbdN``: a device under ``/sys/block`` with no
  ``pid`` file (no connection) and a size of 0.  A device that is busy but not
  ours (``nbd-client``, qemu-nbd, another driver) is not counted at all; ours are
  already in ``ours``.  Which devices can be had depends on the interface the
  plugin attaches through (``csi.attach.block`` passes no index, interface
  "auto"):

  - netlink: a connect without an index takes an unused device, and when none
    is unused the kernel makes a new one, whatever ``nbds_max`` is.  The
    kernel's own bound is the minor numbers (``MINORMASK >> part_shift``), far
    beyond what a node should take, so the pool is a policy:
    ``node.nbd_devices`` when set, else ``max(devices present, nbds_max,
    NBD_POOL_DEFAULT)``, and what can still be attached is the pool less the
    busy devices (anyone's).
  - ioctl only (no netlink family): the plugin can use only the devices that
    exist (``nbd.kernel`` picks a free one), so the pool is those (at most
    ``node.nbd_devices`` when set).

- **fuse-loop**: each attachment is a FUSE process of its own, budgeted at
  ``attachment_bytes`` (64 MiB by default, ``node.fuse_attachment_mib``): what
  the host can still give is ``MemAvailable`` (``MemFree`` on a kernel without
  it) divided by the budget.  Ours already use memory that MemAvailable no
  longer shows, so they count once, in ``ours``.
- no block path but an NFS path: NFS volumes need no block device.  On
  fuse-nfs each is a FUSE process, budgeted like fuse-loop; on kernel-nfs the
  kernel's NFS client holds them, and the count is the fixed bound
  ``MAX_FUSE_ATTACHMENTS`` (1024).
- neither path: nothing can be attached; the count is what the node holds.

There is one count per driver, for block and NFS volumes together: on a
kernel-nbd node an NFS volume is counted in ``ours`` but the free part is nbd
devices only, so a node with every nbd device busy refuses NFS volumes too.

The total is at most 1024 on the FUSE and NFS paths and never below 1: 0 would
tell kubelet "no limit" (CSINode leaves ``allocatable.count`` unset for it).  So
a node with nothing left reports what it holds, and 1 when it holds nothing.
Reading a few sysfs files, /proc/meminfo and one generic netlink lookup keeps
it cheap, since kubelet calls NodeGetInfo every
``nodeAllocatableUpdatePeriodSeconds``.
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
NBD_POOL_DEFAULT: Final = 16  # netlink: the pool is at least this (the module's default nbds_max)
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
    try:
        if (device / "pid").exists():
            return True
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


def nbd_netlink() -> bool:
    """Whether the kernel's nbd driver answers on generic netlink (what
    ``nbd.kernel.attach_kernel`` prefers); no module loaded: False."""
    try:
        return nbd_kernel.probe_kernel_nbd(load_module=False).netlink
    except OSError:
        return False


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


def _memory_free(attachment_bytes: int) -> tuple[int, str]:
    memory = available_memory()
    if memory is None:
        return 0, "memory unknown (/proc/meminfo unreadable)"
    return (
        memory // attachment_bytes,
        f"{memory >> 20} MiB available, {attachment_bytes >> 20} MiB per attachment",
    )


def volume_limit(
    plan: Plan,
    ours: int,
    attachment_bytes: int = FUSE_ATTACHMENT_BYTES,
    nbd_pool: int = 0,
) -> VolumeLimit:
    """This node's total (see the module docstring for the rules); ``ours``:
    the volumes the plugin holds that Kubernetes counts (not inline ephemeral ones);
    ``nbd_pool``: ``node.nbd_devices`` (0: the automatic rule)."""
    if plan.block == "kernel-nbd":
        devices = nbd_devices()
        present = devices.free + devices.busy
        if nbd_netlink():
            pool = nbd_pool or max(present, _nbds_max() or 0, NBD_POOL_DEFAULT)
            reason = f"netlink: a pool of {pool} nbd device(s) (made on connect as needed)"
        else:
            pool = min(present, nbd_pool) if nbd_pool else present
            reason = f"ioctl: a pool of the {pool} nbd device(s) present"
        if nbd_pool:
            reason += " (node.nbd_devices)"
        free = max(0, pool - devices.busy)
        reason += f", {devices.busy} busy"
        count = ours + free
    elif plan.block == "fuse-loop" or plan.nfs == "fuse-nfs":
        free, reason = _memory_free(attachment_bytes)
        if plan.block is None:
            reason = f"no block path, fuse-nfs: {reason}"
        count = min(MAX_FUSE_ATTACHMENTS, ours + free)
    elif plan.nfs is not None:
        free = max(0, MAX_FUSE_ATTACHMENTS - ours)
        reason = f"no block path, {plan.nfs}: a fixed bound of {MAX_FUSE_ATTACHMENTS}"
        count = ours + free
    else:
        free, reason = 0, "no block path, no NFS path"
        count = ours
    return VolumeLimit(count=max(1, count), ours=ours, free=free, reason=reason)
