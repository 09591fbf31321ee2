"""NBD exports attached as block devices: kernel nbd, or a FUSE block file behind a loop device.

Block attachments are remembered under a state directory: ``fuse.blockdev``
keeps its own records there; a kernel attachment is one JSON file under
``STATE_DIR/kernel-nbd/``.  Attaching a URI that is already attached returns
its device, and detaching what is not attached does nothing, so both may be
repeated.  pyfuse3 is an optional dependency: the FUSE modules are imported
only when a FUSE path is used.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from csi.attach.errors import AttachError, PathUnavailable
from csi.attach.paths import BlockPath, Plan, pyfuse3_installed
from csi.config import DEFAULT_IO_TIMEOUT
from hostio.atomicfile import unlink_durably, write_atomically
from nbd import client as nbd_client
from nbd import kernel as nbd_kernel
from nbd.uri import parse_nbd_uri

KERNEL_STATE: Final = "kernel-nbd"  # subdirectory of the state dir for kernel attachments
_NBD_DEVICE = re.compile(r"/dev/nbd(\d+)")


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


def _kernel_scan(state_dir: str | os.PathLike[str]) -> tuple[list[BlockAttachment], list[str]]:
    """The kernel attachment records, and one line for each file that is not one."""
    found: list[BlockAttachment] = []
    unreadable: list[str] = []
    for record in sorted(_kernel_dir(state_dir).glob("nbd*.json")):
        try:
            data = json.loads(record.read_text())
            found.append(
                BlockAttachment(device=str(data["device"]), uri=str(data["uri"]), path="kernel-nbd")
            )
        except FileNotFoundError:
            continue  # detached meanwhile
        except (OSError, ValueError, KeyError, TypeError) as e:
            # written atomically, so not half-written: damaged; left for the operator
            unreadable.append(
                f"attachment record {record} is unreadable ({str(e)[:200]}): its device is "
                "neither listed nor detached; repair or remove the file"
            )
    return found, unreadable


def _kernel_records(state_dir: str | os.PathLike[str]) -> list[BlockAttachment]:
    return _kernel_scan(state_dir)[0]


def kernel_attachments(state_dir: str | os.PathLike[str]) -> list[BlockAttachment]:
    """The kernel nbd devices attached under ``state_dir`` (from their records)."""
    return _kernel_records(state_dir)


def kernel_connected(device: str) -> bool:
    """Whether the kernel still has ``device`` (/dev/nbdN) configured."""
    return _kernel_connected(device)


def _write_kernel_record(state_dir: str | os.PathLike[str], device: str, uri: str) -> None:
    directory = _kernel_dir(state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    record = json.dumps({"device": device, "uri": uri}) + "\n"
    write_atomically(directory / f"{Path(device).name}.json", record)


def _kernel_connected(device: str) -> bool:
    match = _NBD_DEVICE.fullmatch(device)
    return match is not None and (nbd_kernel.SYS_BLOCK / f"nbd{match[1]}" / "pid").exists()


def list_block_attachments(state_dir: str | os.PathLike[str]) -> list[BlockAttachment]:
    """Every block attachment recorded under ``state_dir``, kernel ones first."""
    found = _kernel_records(state_dir)
    if pyfuse3_installed() and Path(state_dir).exists():
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
    io_timeout: float = DEFAULT_IO_TIMEOUT,
    kernel_interface: str = "auto",
) -> str:
    """Attach the NBD export at ``uri``; its block device ("/dev/nbdN" or "/dev/loopN").

    ``connections`` is for fuse-loop (NBD connections behind the FUSE file);
    the kernel path uses one.  ``timeout`` bounds connecting;  ``io_timeout``
    is how long I/O waits for a server that went away before it fails with
    EIO (the FUSE file's timeout; the kernel's request timeout and dead
    connection timeout).  ``kernel_interface`` is the kernel path's
    (``nbd.kernel.KERNEL_INTERFACES``: the ioctls give no dead-connection
    timeout and no reconnect).  Already attached: its device.
    """
    if plan.block is None:
        raise PathUnavailable(f"no block path on this host: {plan.block_reason}")
    if kernel_interface not in nbd_kernel.KERNEL_INTERFACES:
        choices = ", ".join(nbd_kernel.KERNEL_INTERFACES)
        raise AttachError(f"kernel nbd interface {kernel_interface!r}: expected one of {choices}")
    if kernel_interface != "auto" and plan.block != "kernel-nbd":
        raise PathUnavailable(
            f"the {kernel_interface} interface of kernel nbd was asked for, but this host's "
            f"block path is {plan.block}: {plan.block_reason}"
        )
    try:
        parse_nbd_uri(uri)
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
            # one FUSE process (no ``workers``), also when repairing an attachment
            # whose record says more: see fuse.blockdev's docstring
            attachment = blockdev.attach_fuse_block(
                uri, state_dir, connections=connections, timeout=io_timeout
            )
        except (OSError, ValueError, RuntimeError) as e:
            raise AttachError(f"attaching {uri} through FUSE and a loop device failed: {e}") from e
        return attachment.device
    for a in existing:  # a kernel record whose device is gone: forget it
        _detach_kernel(a.device, state_dir)
    return _attach_kernel(uri, state_dir, timeout, io_timeout, kernel_interface)


def _attach_kernel(
    uri: str,
    state_dir: str | os.PathLike[str],
    timeout: float,
    io_timeout: float,
    interface: str = "auto",
) -> str:
    try:
        negotiated = nbd_client.connect_uri(uri, timeout)
    except (OSError, ValueError, nbd_client.HandshakeError) as e:
        raise AttachError(f"connecting to {uri} failed: {e}") from e
    seconds = max(1, round(io_timeout / 2))
    try:
        # a request unanswered for half the bound fails the connection; the device
        # then waits the other half for a new one (NBD_CMD_RECONFIGURE), then fails I/O
        device = nbd_kernel.attach_kernel(
            negotiated,
            interface=interface,
            backend_identifier=uri,
            io_timeout=seconds,
            dead_conn_timeout=seconds,
        )
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
    unlink_durably(_kernel_dir(state_dir) / f"{Path(device).name}.json", missing_ok=True)


def _detach_fuse(device_or_uri: str, state_dir: str | os.PathLike[str]) -> None:
    if not pyfuse3_installed():
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
    records, report = _kernel_scan(state_dir)
    report += [
        f"{a.uri} on {a.device}: lost its NBD connection"
        for a in records
        if not _kernel_connected(a.device)
    ]
    if pyfuse3_installed() and Path(state_dir).exists():
        from fuse import blockdev

        report += blockdev.reconcile_attachments(state_dir)
    return report


def block_attachment_problem(uri: str, state_dir: str | os.PathLike[str]) -> str | None:
    """Why the attachment of ``uri`` does not work (None: it does)."""
    if pyfuse3_installed():
        from fuse import blockdev

        unreadable = blockdev.record_problem(uri, state_dir)
        if unreadable is not None:
            return unreadable
    found = [a for a in list_block_attachments(state_dir) if a.uri == uri]
    if not found:
        damaged = _kernel_scan(state_dir)[1]  # named by device: one of them may be this URI's
        return f"{uri} is not attached on this node" + "".join(f"; {d}" for d in damaged)
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
