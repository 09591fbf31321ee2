"""``moorage attach|detach|mount|unmount``: attach and mount volumes on this host by hand.

The same mechanics the CSI node plugin uses (``csi.attach``), for operators
and tests:

    moorage attach probe                       which paths this host uses, and why
    moorage attach nbd nbd://HOST:PORT/NAME    attach an NBD export; prints the device
    moorage attach list [--json]               what is attached
    moorage attach watch                       reconnect kernel nbd devices whose server
                                               comes back (runs until SIGINT/SIGTERM)
    moorage detach DEVICE|URI                  detach it again
    moorage mount nfs SERVER[:PORT]:/PATH DIR  mount an NFS export
    moorage unmount DIR                        unmount it

Attachments are recorded under a state directory, by default
``/run/moorage/attach`` (env ``MOORAGE_ATTACH_STATE_DIR``, option
``--state-dir``): a device does not outlive a reboot, so neither does its
record.  The FUSE processes log there too.  The paths can be forced with ``MOORAGE_BLOCK_PATH`` /
``MOORAGE_NFS_PATH``.
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from csi import attach, mounts
from csi.config import DEFAULT_IO_TIMEOUT, MAX_IO_TIMEOUT
from moorage.output import fail, print_json

DEFAULT_STATE_DIR = "/run/moorage/attach"
STATE_DIR_ENV = "MOORAGE_ATTACH_STATE_DIR"
_NFS_SPEC = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+)(?::(\d+))?:(/.*)")

attach_app = typer.Typer(
    help="Attach NBD exports as block devices on this host (kernel nbd or FUSE + loop).",
    no_args_is_help=True,
)
mount_app = typer.Typer(
    help="Mount exports on this host (kernel NFS client or the FUSE NFS mount).",
    no_args_is_help=True,
)
console = Console()


# one Option shared by the commands that take it
_STATE_DIR = typer.Option(
    Path(DEFAULT_STATE_DIR),
    "--state-dir",
    envvar=STATE_DIR_ENV,
    help="Where attachments are recorded.",
)


@contextmanager
def _errors(command: str) -> Iterator[None]:
    """What the mechanics raise, as one line on stderr and exit status 1."""
    try:
        yield
    except (attach.AttachError, mounts.MountError, mounts.FilesystemError, ValueError) as e:
        raise fail(command, str(e)) from e
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        raise fail(command, f"{where}{e.strerror or e}") from e


def _plan(command: str) -> attach.Plan:
    with _errors(command):
        return attach.probe()


# ------------------------------------------------------------------ attach


@attach_app.command("probe")
def attach_probe(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show which block and NFS paths this host uses, and why.

    Force one with MOORAGE_BLOCK_PATH=kernel-nbd|fuse-loop or
    MOORAGE_NFS_PATH=kernel-nfs|fuse-nfs; forcing one this host cannot use fails.
    """
    plan = _plan("attach probe")
    if as_json:
        print_json(plan.to_dict())
        return
    typer.echo(f"block: {plan.block or 'none'}")
    typer.echo(f"  {plan.block_reason}")
    typer.echo(f"nfs: {plan.nfs or 'none'}")
    typer.echo(f"  {plan.nfs_reason}")


class KernelInterface(enum.StrEnum):
    """``attach nbd --kernel-interface`` (nbd.kernel.KERNEL_INTERFACES)."""

    auto = "auto"
    netlink = "netlink"
    ioctl = "ioctl"


@attach_app.command("nbd")
def attach_nbd(
    uri: str = typer.Argument(..., help="nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=P"),
    connections: int = typer.Option(
        4, "--connections", min=1, max=16, help="NBD connections (fuse-loop path)."
    ),
    io_timeout: float = typer.Option(
        DEFAULT_IO_TIMEOUT,
        "--io-timeout",
        min=1,
        max=MAX_IO_TIMEOUT,
        help="Seconds I/O waits for a server that went away before failing with EIO.",
    ),
    kernel_interface: KernelInterface = typer.Option(
        KernelInterface.auto,
        "--kernel-interface",
        help="Kernel nbd path: netlink (reconnect, dead-connection timeout, resize), the "
        "older ioctls, or auto (netlink when the kernel has it).",
    ),
    state_dir: Path = _STATE_DIR,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Attach an NBD export as a block device and print the device (/dev/nbdN or /dev/loopN).

    Attaching a URI that is already attached prints its device again.  A kernel
    nbd device is reconnected when its server comes back only while something
    watches it: the CSI node plugin, or `moorage attach watch`.
    """
    plan = _plan("attach nbd")
    with _errors("attach nbd"):
        device = attach.attach_block(
            uri,
            state_dir,
            plan,
            connections=connections,
            io_timeout=io_timeout,
            kernel_interface=kernel_interface.value,
        )
    if as_json:
        print_json({"device": device, "uri": uri})
    else:
        typer.echo(device)


def _attachments_table(attachments: list[attach.BlockAttachment]) -> Table:
    t = Table()
    for column in ("DEVICE", "PATH", "URI", "FUSE FILE MOUNT", "PID"):
        t.add_column(column)
    for a in attachments:
        t.add_row(
            a.device, a.path, a.uri, a.mountpoint or "-", "-" if a.pid is None else str(a.pid)
        )
    return t


@attach_app.command("list")
def attach_list(
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    state_dir: Path = _STATE_DIR,
) -> None:
    """List the block devices attached on this host."""
    with _errors("attach list"):
        attachments = attach.list_block_attachments(state_dir)
    if as_json:
        print_json([a.to_dict() for a in attachments])
    else:
        console.print(_attachments_table(attachments))


@attach_app.command("watch")
def attach_watch(state_dir: Path = _STATE_DIR) -> None:
    """Reconnect the kernel nbd devices attached here when their server comes back.

    Runs until SIGINT or SIGTERM.  (The FUSE block path reconnects by itself.)
    """
    with _errors("attach watch"):
        reconnector = attach.Reconnector(state_dir)
        reconnector.open()
    stop = threading.Event()

    def stopping(signum: int, frame: object) -> None:
        reconnector.stop()
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stopping)
    thread = reconnector.start_thread()
    typer.echo(f"watching the kernel nbd devices recorded under {state_dir}", err=True)
    while not stop.wait(1.0) and thread.is_alive():
        pass
    reconnector.stop()
    thread.join(10)
    reconnector.close()


def detach(
    device: str = typer.Argument(..., help="The device (/dev/nbdN, /dev/loopN) or its NBD URI."),
    state_dir: Path = _STATE_DIR,
) -> None:
    """Detach a block device attached by `moorage attach nbd` (nothing attached: no-op)."""
    with _errors("detach"):
        attach.detach_block(device, state_dir)


# ------------------------------------------------------------------ mount


def parse_nfs_spec(spec: str) -> tuple[str, int, str]:
    """``SERVER[:PORT]:/PATH`` → (server, port, path); an IPv6 server in brackets."""
    match = _NFS_SPEC.fullmatch(spec)
    if match is None:
        raise typer.BadParameter(f"expected SERVER[:PORT]:/PATH, not {spec!r}")
    port = int(match[2]) if match[2] else attach.NFS_PORT
    if not 0 < port < 65536:
        raise typer.BadParameter(f"port out of range in {spec!r}")
    return match[1], port, match[3]


def fuse_nfs_log(state_dir: Path, directory: Path) -> Path:
    """Where the FUSE NFS mount process for ``directory`` logs."""
    key = hashlib.sha256(os.fsencode(os.path.realpath(directory))).hexdigest()[:16]
    return state_dir / "fuse-nfs" / f"{directory.name or 'root'}-{key}.log"


@mount_app.command("nfs")
def mount_nfs(
    export: str = typer.Argument(..., help="SERVER[:PORT]:/PATH (PORT defaults to 2049)."),
    directory: Path = typer.Argument(..., help="Mount point (an existing directory)."),
    mount_port: int | None = typer.Option(
        None,
        "--mount-port",
        help="The MOUNT protocol's port (FUSE NFSv3 path; default: ask rpcbind).",
    ),
    read_only: bool = typer.Option(False, "--read-only", help="Mount read-only."),
    state_dir: Path = _STATE_DIR,
) -> None:
    """Mount an NFS export: kernel NFSv4.1 where the kernel has a client, else FUSE over NFSv3.

    The FUSE mount runs in a process of its own until `moorage unmount`; it
    logs to STATE_DIR/fuse-nfs/.
    """
    server, port, path = parse_nfs_spec(export)
    directory = directory.absolute()
    plan = _plan("mount nfs")
    with _errors("mount nfs"):
        attach.mount_nfs_export(
            server,
            port,
            mount_port,
            path,
            directory,
            plan,
            read_only=read_only,
            log_file=fuse_nfs_log(state_dir.absolute(), directory),
        )


def unmount(
    # a str, not a Path: click stats a Path argument, and a stat of a mount whose
    # server is away waits for it (csi.attach.unmount_nfs never looks into the mount)
    directory: str = typer.Argument(..., help="Where the NFS export is mounted."),
) -> None:
    """Unmount an NFS export mounted by `moorage mount nfs` (nothing mounted: no-op)."""
    with _errors("unmount"):
        attach.unmount_nfs(directory)
