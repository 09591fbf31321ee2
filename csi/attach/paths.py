"""Which block and NFS path this host uses, and why: :func:`probe` makes the :class:`Plan`.

Each has a kernel path and a FUSE fallback, and :func:`probe` picks one of
each for this host, saying why:

- block: **kernel-nbd** (``/dev/nbdN``, via ``nbd.kernel``) where the kernel
  has an nbd driver, else **fuse-loop** (``fuse.blockdev``: the export as one
  file on a FUSE mount, behind a loop device), which needs ``/dev/fuse``,
  ``/dev/loop-control`` and pyfuse3.
- NFS: **kernel-nfs** (``mount -t nfs4``, NFSv4.1) where the kernel has an NFS
  client (``nfs``/``nfs4`` in /proc/filesystems) and ``mount.nfs4`` is
  installed, else **fuse-nfs** (``fuse.nfsmount``, libnfs over NFSv3), which
  needs ``/dev/fuse`` and pyfuse3.

Either may be forced by configuration: a mapping with ``block_path`` /
``nfs_path``, or (when none is given) the environment variables
``MOORAGE_BLOCK_PATH`` / ``MOORAGE_NFS_PATH``; ``auto`` or empty means probe.
Forcing a path this host cannot use is an error saying why.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final, Literal

from csi.attach.errors import PathUnavailable
from hostio import tools
from nbd import kernel as nbd_kernel

BlockPath = Literal["kernel-nbd", "fuse-loop"]
NFSPath = Literal["kernel-nfs", "fuse-nfs"]

BLOCK_PATH_ENV: Final = "MOORAGE_BLOCK_PATH"
NFS_PATH_ENV: Final = "MOORAGE_NFS_PATH"
CONFIG_KEYS: Final = {"block_path": BLOCK_PATH_ENV, "nfs_path": NFS_PATH_ENV}

# Host facts, module level so tests can point elsewhere.
DEV_FUSE = Path("/dev/fuse")
DEV_LOOP_CONTROL = Path("/dev/loop-control")
PROC_FILESYSTEMS = Path("/proc/filesystems")
MOUNT_NFS4 = (Path("/sbin/mount.nfs4"), Path("/usr/sbin/mount.nfs4"))

# the kernel NFS client: its names in /proc/filesystems and in the mount table
KERNEL_NFS_FSTYPES: Final = ("nfs4", "nfs")


@dataclass(frozen=True, slots=True)
class Plan:
    """Which block and NFS path this host uses (None: neither works), and why."""

    block: BlockPath | None
    block_reason: str
    nfs: NFSPath | None
    nfs_reason: str

    def to_dict(self) -> dict[str, str | None]:
        return asdict(self)


def _char_device(path: Path) -> bool:
    try:
        return stat.S_ISCHR(path.stat().st_mode)
    except OSError:
        return False


def pyfuse3_installed() -> bool:
    """Whether pyfuse3, which every FUSE path needs, is installed."""
    return importlib.util.find_spec("pyfuse3") is not None


def _missing_for_fuse(*devices: Path) -> list[str]:
    missing = [f"no {d}" for d in devices if not _char_device(d)]
    if not pyfuse3_installed():
        missing.append("pyfuse3 is not installed")
    return missing


def _kernel_nbd() -> tuple[bool, str]:
    return nbd_kernel.kernel_nbd_available()


def _fuse_loop() -> tuple[bool, str]:
    missing = _missing_for_fuse(DEV_FUSE, DEV_LOOP_CONTROL)
    if missing:
        return False, "FUSE block file on a loop device unavailable: " + ", ".join(missing)
    return True, f"a FUSE block file on a loop device ({DEV_FUSE} and {DEV_LOOP_CONTROL} present)"


def _kernel_filesystems() -> set[str]:
    return {line.split()[-1] for line in PROC_FILESYSTEMS.read_text().splitlines() if line}


def _load_nfs_module() -> None:
    """Load the NFS client module (a node's kernel has it as a module that only
    the first NFS mount would load), as the nbd probe loads nbd."""
    with contextlib.suppress(tools.ToolError):
        tools.run(["modprobe", "nfs"], timeout=30)


def _kernel_nfs() -> tuple[bool, str]:
    try:
        names = _kernel_filesystems()
        if not any(n in names for n in KERNEL_NFS_FSTYPES):
            _load_nfs_module()
            names = _kernel_filesystems()
    except OSError as e:
        return False, f"kernel NFS client unknown: cannot read {PROC_FILESYSTEMS}: {e.strerror}"
    client = [n for n in KERNEL_NFS_FSTYPES if n in names]
    if not client:
        return False, (
            f"kernel NFS client unavailable: neither nfs4 nor nfs in {PROC_FILESYSTEMS} "
            "(modprobe nfs did not add them)"
        )
    helper = next((p for p in MOUNT_NFS4 if os.access(p, os.X_OK)), None)
    if helper is None:
        return False, f"kernel NFS client present ({client[0]}) but mount.nfs4 is not installed"
    return True, f"kernel NFS client ({client[0]} in {PROC_FILESYSTEMS}, {helper})"


def _fuse_nfs() -> tuple[bool, str]:
    missing = _missing_for_fuse(DEV_FUSE)
    if missing:
        return False, "FUSE NFS mount unavailable: " + ", ".join(missing)
    return True, f"the FUSE NFS mount over libnfs, NFSv3 ({DEV_FUSE} present)"


Check = Callable[[], tuple[bool, str]]


def _choose(
    forced: str | None, where: str, paths: tuple[tuple[str, Check], tuple[str, Check]]
) -> tuple[str | None, str]:
    """The first working path, or the forced one (an error if it cannot work)."""
    (first, first_check), (second, second_check) = paths
    names = (first, second)
    if forced:
        if forced not in names:
            raise PathUnavailable(f"{where}={forced!r}: expected auto, {first} or {second}")
        check = first_check if forced == first else second_check
        ok, reason = check()
        if not ok:
            raise PathUnavailable(f"{where}={forced} cannot be used on this host: {reason}")
        return forced, f"{reason} (forced by {where})"
    ok, first_reason = first_check()
    if ok:
        return first, first_reason
    ok, second_reason = second_check()
    if ok:
        return second, f"{first_reason}; using {second_reason}"
    return None, f"{first_reason}; {second_reason}"


def _overrides(config: Mapping[str, str] | None) -> dict[str, tuple[str | None, str]]:
    """Per key: (forced value or None, where it came from)."""
    if config is None:
        return {
            key: ((os.environ.get(env) or "").strip() or None, env)
            for key, env in CONFIG_KEYS.items()
        }
    unknown = set(config) - set(CONFIG_KEYS)
    if unknown:
        raise PathUnavailable(
            f"unknown attach configuration {sorted(unknown)}: expected {sorted(CONFIG_KEYS)}"
        )
    return {key: ((config.get(key) or "").strip() or None, key) for key in CONFIG_KEYS}


def probe(config: Mapping[str, str] | None = None) -> Plan:
    """Decide this host's block and NFS paths (see the module docstring for the rules)."""
    overrides = _overrides(config)
    picked: dict[str, tuple[str | None, str]] = {}
    for key, checks in (
        ("block_path", (("kernel-nbd", _kernel_nbd), ("fuse-loop", _fuse_loop))),
        ("nfs_path", (("kernel-nfs", _kernel_nfs), ("fuse-nfs", _fuse_nfs))),
    ):
        forced, where = overrides[key]
        if forced == "auto":
            forced = None
        picked[key] = _choose(forced, where, checks)
    block, block_reason = picked["block_path"]
    nfs, nfs_reason = picked["nfs_path"]
    return Plan(
        block=_as_block_path(block),
        block_reason=block_reason,
        nfs=_as_nfs_path(nfs),
        nfs_reason=nfs_reason,
    )


def _as_block_path(name: str | None) -> BlockPath | None:
    if name == "kernel-nbd":
        return "kernel-nbd"
    if name == "fuse-loop":
        return "fuse-loop"
    return None


def _as_nfs_path(name: str | None) -> NFSPath | None:
    if name == "kernel-nfs":
        return "kernel-nfs"
    if name == "fuse-nfs":
        return "fuse-nfs"
    return None
