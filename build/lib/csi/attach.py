"""Attaching NBD exports as block devices and mounting NFS exports on this node.

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

Block attachments are remembered under a state directory: ``fuse.blockdev``
keeps its own records there; a kernel attachment is one JSON file under
``STATE_DIR/kernel-nbd/``.  Attaching a URI that is already attached returns
its device, and detaching what is not attached does nothing, so both may be
repeated.  pyfuse3 is an optional dependency: the FUSE modules are imported
only when a FUSE path is used.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

from csi import mounts
from nbd import client as nbd_client
from nbd import kernel as nbd_kernel

BlockPath = Literal["kernel-nbd", "fuse-loop"]
NFSPath = Literal["kernel-nfs", "fuse-nfs"]
BLOCK_PATHS: Final[tuple[str, ...]] = get_args(BlockPath)
NFS_PATHS: Final[tuple[str, ...]] = get_args(NFSPath)

BLOCK_PATH_ENV: Final = "MOORAGE_BLOCK_PATH"
NFS_PATH_ENV: Final = "MOORAGE_NFS_PATH"
CONFIG_KEYS: Final = {"block_path": BLOCK_PATH_ENV, "nfs_path": NFS_PATH_ENV}

# Host facts, module level so tests can point elsewhere.
DEV_FUSE = Path("/dev/fuse")
DEV_LOOP_CONTROL = Path("/dev/loop-control")
PROC_FILESYSTEMS = Path("/proc/filesystems")
MOUNT_NFS4 = (Path("/sbin/mount.nfs4"), Path("/usr/sbin/mount.nfs4"))

KERNEL_STATE: Final = "kernel-nbd"  # subdirectory of the state dir for kernel attachments
# The FUSE NFS mount's type in the mount table (fuse.nfsmount.FSTYPE, without importing pyfuse3)
FUSE_NFS_FSTYPE: Final = "fuse.moorage-nfs"
KERNEL_NFS_FSTYPES: Final = ("nfs4", "nfs")
NFS_PORT: Final = 2049

_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")
_EXPORT_PATH = re.compile(r"/[A-Za-z0-9._/-]*")
_NBD_DEVICE = re.compile(r"/dev/nbd(\d+)")


class AttachError(Exception):
    """An attach, detach, mount or unmount that did not happen, with the reason."""


class PathUnavailable(AttachError):
    """The chosen (or forced) path cannot work on this host."""


# ------------------------------------------------------------------ the plan


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


def _pyfuse3_installed() -> bool:
    return importlib.util.find_spec("pyfuse3") is not None


def _missing_for_fuse(*devices: Path) -> list[str]:
    missing = [f"no {d}" for d in devices if not _char_device(d)]
    if not _pyfuse3_installed():
        missing.append("pyfuse3 is not installed")
    return missing


def _kernel_nbd() -> tuple[bool, str]:
    return nbd_kernel.kernel_nbd_available()


def _fuse_loop() -> tuple[bool, str]:
    missing = _missing_for_fuse(DEV_FUSE, DEV_LOOP_CONTROL)
    if missing:
        return False, "FUSE block file on a loop device unavailable: " + ", ".join(missing)
    return True, f"a FUSE block file on a loop device ({DEV_FUSE} and {DEV_LOOP_CONTROL} present)"


def _kernel_nfs() -> tuple[bool, str]:
    try:
        names = {line.split()[-1] for line in PROC_FILESYSTEMS.read_text().splitlines() if line}
    except OSError as e:
        return False, f"kernel NFS client unknown: cannot read {PROC_FILESYSTEMS}: {e.strerror}"
    client = [n for n in KERNEL_NFS_FSTYPES if n in names]
    if not client:
        return False, f"kernel NFS client unavailable: neither nfs4 nor nfs in {PROC_FILESYSTEMS}"
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


# ------------------------------------------------------------------ block devices


@dataclass(frozen=True, slots=True)
class BlockAttachment:
    """An attached export: its device, URI, path, and (fuse-loop) its FUSE file's mount."""

    device: str
    uri: str
    path: BlockPath
    mountpoint: str | None = None
    pid: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _kernel_dir(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / KERNEL_STATE


def _kernel_records(state_dir: str | os.PathLike[str]) -> list[BlockAttachment]:
    found: list[BlockAttachment] = []
    for record in sorted(_kernel_dir(state_dir).glob("nbd*.json")):
        try:
            data = json.loads(record.read_text())
            found.append(
                BlockAttachment(device=str(data["device"]), uri=str(data["uri"]), path="kernel-nbd")
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written or foreign: not ours to list
    return found


def _write_kernel_record(state_dir: str | os.PathLike[str], device: str, uri: str) -> None:
    directory = _kernel_dir(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    name = Path(device).name
    tmp = directory / f".{name}.json.tmp"
    tmp.write_text(json.dumps({"device": device, "uri": uri}) + "\n")
    tmp.replace(directory / f"{name}.json")


def _kernel_connected(device: str) -> bool:
    match = _NBD_DEVICE.fullmatch(device)
    return match is not None and (nbd_kernel.SYS_BLOCK / f"nbd{match[1]}" / "pid").exists()


def list_block_attachments(state_dir: str | os.PathLike[str]) -> list[BlockAttachment]:
    """Every block attachment recorded under ``state_dir``, kernel ones first."""
    found = _kernel_records(state_dir)
    if _pyfuse3_installed() and Path(state_dir).exists():
        from fuse import blockdev

        for a in blockdev.list_attachments(state_dir):
            found.append(
                BlockAttachment(
                    device=a.device,
                    uri=a.uri,
                    path="fuse-loop",
                    mountpoint=str(a.mountpoint),
                    pid=a.pid,
                )
            )
    return found


def attach_block(
    uri: str,
    state_dir: str | os.PathLike[str],
    plan: Plan,
    *,
    connections: int = 4,
    timeout: float = 30.0,
) -> str:
    """Attach the NBD export at ``uri``; its block device ("/dev/nbdN" or "/dev/loopN").

    ``connections`` is for fuse-loop (NBD connections behind the FUSE file);
    the kernel path uses one.  Already attached: its device.
    """
    if plan.block is None:
        raise PathUnavailable(f"no block path on this host: {plan.block_reason}")
    try:
        nbd_client.parse_nbd_uri(uri)
    except ValueError as e:
        raise AttachError(str(e)) from e
    existing = [a for a in list_block_attachments(state_dir) if a.uri == uri]
    for a in existing:
        if a.path == "kernel-nbd" and _kernel_connected(a.device):
            return a.device
    # fuse.blockdev is idempotent itself, and repairs a half-made or broken attachment
    if plan.block == "fuse-loop" or any(a.path == "fuse-loop" for a in existing):
        from fuse import blockdev

        try:
            attachment = blockdev.attach_fuse_block(uri, state_dir, connections=connections)
        except (OSError, ValueError, RuntimeError) as e:
            raise AttachError(f"attaching {uri} through FUSE and a loop device failed: {e}") from e
        return attachment.device
    for a in existing:  # a kernel record whose device is gone: forget it
        _detach_kernel(a.device, state_dir)
    return _attach_kernel(uri, state_dir, timeout)


def _attach_kernel(uri: str, state_dir: str | os.PathLike[str], timeout: float) -> str:
    try:
        negotiated = nbd_client.connect_uri(uri, timeout)
    except (OSError, ValueError, nbd_client.HandshakeError) as e:
        raise AttachError(f"connecting to {uri} failed: {e}") from e
    try:
        device = nbd_kernel.attach_kernel(negotiated, backend_identifier=uri)
    except nbd_kernel.KernelNBDError as e:
        raise AttachError(f"attaching {uri} to the kernel's nbd driver failed: {e}") from e
    finally:
        negotiated.sock.close()  # the kernel holds its own reference now
    try:
        _write_kernel_record(state_dir, device, uri)
    except OSError as e:
        with contextlib.suppress(nbd_kernel.KernelNBDError):
            nbd_kernel.detach_kernel(device)
        raise AttachError(f"recording {device} under {state_dir} failed: {e}") from e
    return device


def _detach_kernel(device: str, state_dir: str | os.PathLike[str]) -> None:
    if _kernel_connected(device):
        try:
            nbd_kernel.detach_kernel(device)
        except nbd_kernel.KernelNBDError as e:
            raise AttachError(f"detaching {device} failed: {e}") from e
    with contextlib.suppress(FileNotFoundError):
        (_kernel_dir(state_dir) / f"{Path(device).name}.json").unlink()


def _detach_fuse(device_or_uri: str, state_dir: str | os.PathLike[str]) -> None:
    if not _pyfuse3_installed():
        return  # no FUSE attachment can exist
    from fuse import blockdev

    try:
        blockdev.detach_fuse_block(device_or_uri, state_dir)
    except (OSError, ValueError, RuntimeError) as e:
        # a device still mounted is refused (fuse.loop.LoopBusy) and left as it is
        raise AttachError(f"detaching {device_or_uri} failed: {e}") from e


def detach_block(device_or_uri: str, state_dir: str | os.PathLike[str]) -> None:
    """Detach a device (or whatever a URI is attached as); not attached: nothing to do."""
    if "://" in device_or_uri:
        for a in _kernel_records(state_dir):
            if a.uri == device_or_uri:
                _detach_kernel(a.device, state_dir)
        _detach_fuse(device_or_uri, state_dir)  # also clears a half-made attachment
    elif _NBD_DEVICE.fullmatch(device_or_uri):
        _detach_kernel(device_or_uri, state_dir)
    else:
        _detach_fuse(device_or_uri, state_dir)


def refresh_block(uri: str, state_dir: str | os.PathLike[str], timeout: float = 30.0) -> int:
    """After the export grew: make its device as large; the new size in bytes."""
    found = [a for a in list_block_attachments(state_dir) if a.uri == uri]
    if not found:
        raise AttachError(f"{uri} is not attached on this node")
    a = found[0]
    if a.path == "kernel-nbd":
        try:
            negotiated = nbd_client.connect_uri(uri, timeout)
        except (OSError, ValueError, nbd_client.HandshakeError) as e:
            raise AttachError(f"connecting to {uri} to read its size failed: {e}") from e
        negotiated.sock.close()
        try:
            nbd_kernel.resize_kernel(a.device, negotiated.size, backend_identifier=uri)
        except nbd_kernel.KernelNBDError as e:
            raise AttachError(f"resizing {a.device} failed: {e}") from e
        return negotiated.size
    from fuse import blockdev

    attachment = next(x for x in blockdev.list_attachments(state_dir) if x.uri == uri)
    try:
        return blockdev.refresh_size(attachment)
    except (OSError, RuntimeError) as e:
        raise AttachError(f"refreshing {a.device} failed: {e}") from e


def reconcile_block_attachments(state_dir: str | os.PathLike[str]) -> list[str]:
    """At a restart: undo half-made attachments, report broken ones (left as
    they are: a filesystem may still be mounted on them).  One line each."""
    report = [
        f"{a.uri} on {a.device}: lost its NBD connection"
        for a in _kernel_records(state_dir)
        if not _kernel_connected(a.device)
    ]
    if _pyfuse3_installed() and Path(state_dir).exists():
        from fuse import blockdev

        report += blockdev.reconcile_attachments(state_dir)
    return report


def block_attachment_problem(uri: str, state_dir: str | os.PathLike[str]) -> str | None:
    """Why the attachment of ``uri`` does not work (None: it does)."""
    found = [a for a in list_block_attachments(state_dir) if a.uri == uri]
    if not found:
        return f"{uri} is not attached on this node"
    a = found[0]
    if a.path == "kernel-nbd":
        return None if _kernel_connected(a.device) else f"{a.device} lost its NBD connection"
    from fuse import blockdev

    for x in blockdev.list_attachments(state_dir):
        if x.uri == uri and not blockdev.is_healthy(x):
            return (
                f"the FUSE block file process of {a.device} (pid {x.pid}) is dead or its "
                "mount is gone: unstage and stage the volume again"
            )
    return None


# ------------------------------------------------------------------ NFS


def _validate_export(server: str, port: int, mount_port: int | None, path: str) -> None:
    if not _HOST.fullmatch(server):
        raise AttachError(f"NFS server must be a host name or address: {server!r}")
    if not _EXPORT_PATH.fullmatch(path) or "/../" in f"{path}/":
        raise AttachError(f"NFS export path must be an absolute path: {path!r}")
    for p in (port, mount_port):
        if p is not None and not 0 < p < 65536:
            raise AttachError(f"port out of range: {p}")


def _same_export(entry: mounts.MountEntry, server: str, path: str) -> bool:
    if entry.fstype == FUSE_NFS_FSTYPE:
        return entry.source == f"moorage-nfs:{server}:{path}"
    return entry.fstype in KERNEL_NFS_FSTYPES and entry.source == f"{server}:{path}"


def mount_nfs_export(
    server: str,
    port: int,
    mount_port: int | None,
    path: str,
    target: str | os.PathLike[str],
    plan: Plan,
    read_only: bool = False,
    log_file: Path | None = None,
    options: Sequence[str] = (),
) -> None:
    """Mount ``server:path`` on ``target`` by the plan's NFS path.

    kernel-nfs: ``mount -t nfs4 -o port=PORT,vers=4.1[,ro],OPTIONS SERVER:PATH
    TARGET`` (``mount_port`` is not used by NFSv4; an ``nfsvers``/``vers`` in
    ``options`` replaces the 4.1).  The FUSE path takes no options: the
    caller decides which it can honour.  fuse-nfs: ``fuse.nfsmount`` in a
    process of its own (NFSv3; ``mount_port`` None asks the portmapper),
    made read-only per mount when asked; that process inherits this one's
    stderr (its log) and working directory.  The same export already mounted
    there: its read-only-ness is brought to what is asked; another mount
    there is an error.
    """
    if plan.nfs is None:
        raise PathUnavailable(f"no NFS path on this host: {plan.nfs_reason}")
    _validate_export(server, port, mount_port, path)
    target_path = os.path.abspath(target)
    existing = mounts.mount_entry(target_path)
    if existing is not None:
        if not _same_export(existing, server, path):
            raise AttachError(
                f"{target_path} already has {existing.source} ({existing.fstype}) mounted"
            )
        if existing.read_only != read_only:
            mounts.set_read_only(target_path, read_only)
        return
    if plan.nfs == "kernel-nfs":
        extra = [o for o in mounts.validate_options(options) if o not in ("ro", "rw")]
        versioned = any(o.startswith(("vers=", "nfsvers=")) for o in extra)
        kernel_options = [
            f"port={port}",
            *([] if versioned else ["vers=4.1"]),
            *extra,
            *(["ro"] if read_only else []),
        ]
        mounts.mount(f"{server}:{path}", target_path, "nfs4", kernel_options)
        return
    from fuse import nfsmount

    try:
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
        nfsmount.mount_nfs(
            server, port, mount_port, path, target_path, foreground=False, log_file=log_file
        )
    except (nfsmount.MountError, OSError, ValueError) as e:
        raise AttachError(str(e)) from e
    if read_only:
        try:
            mounts.set_read_only(target_path, True)
        except BaseException:
            mounts.unmount(target_path)  # never leave it writable when read-only was asked
            raise


def unmount_nfs(target: str | os.PathLike[str]) -> None:
    """Unmount the NFS mount (kernel or FUSE) on ``target``; nothing mounted: nothing to do.

    Anything but an NFS mount there is refused.
    """
    target_path = os.path.abspath(target)
    entry = mounts.mount_entry(target_path)
    if entry is None:
        return
    if entry.fstype != FUSE_NFS_FSTYPE and entry.fstype not in KERNEL_NFS_FSTYPES:
        raise AttachError(f"{target_path} is not an NFS mount ({entry.fstype}, {entry.source})")
    # as root, umount ends a FUSE mount too; its process then exits
    mounts.unmount(target_path)


__all__ = [
    "BLOCK_PATHS",
    "NFS_PATHS",
    "AttachError",
    "BlockAttachment",
    "BlockPath",
    "NFSPath",
    "PathUnavailable",
    "Plan",
    "attach_block",
    "block_attachment_problem",
    "detach_block",
    "list_block_attachments",
    "mount_nfs_export",
    "probe",
    "reconcile_block_attachments",
    "refresh_block",
    "unmount_nfs",
]
