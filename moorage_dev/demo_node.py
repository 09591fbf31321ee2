"""The storage-node part of ``moorage demo``.

Starts a real storage node (loop pool, SQLite catalog, ganesha, NBD server,
gRPC API on a unix socket) under the state directory, drives it through the
API and real clients, then takes everything down again.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import trio
from rich.console import Console
from rich.table import Table

from backend.api.client import BackendClient
from backend.api.proto import backend_pb2 as pb
from backend.daemon import DaemonConfig, run_daemon
from backend.poolinit import init_loop_pool, read_pool_record, release_loop_pool
from hostio import tools
from hostio.sizes import format_size
from moorage_dev.demo_csi import csi_demo

T = TypeVar("T")
POOL_SIZE = 2 << 30
NODE = "demo-node"
TOOL_TIMEOUT = 120.0  # qemu-io, nbdinfo, nfs-cp, nfs-ls on a few MiB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _tool(argv: list[str], stdin: bytes | None = None) -> str:
    if shutil.which(tools.tool_path(argv[0])) is None:
        raise RuntimeError(f"{argv[0]} is not installed; run deploy/host/install-deps.sh")
    run = functools.partial(tools.run, argv, timeout=TOOL_TIMEOUT, input=stdin)
    try:
        return (await trio.to_thread.run_sync(run)).stdout
    except tools.ToolError as e:
        raise RuntimeError(str(e)) from e


async def node_demo(state: Path, console: Console) -> None:
    state = state.absolute()
    pool_dir = state / "pool"
    data_dir = state / "data"
    made_pool = False
    if read_pool_record(pool_dir) is None:
        await trio.to_thread.run_sync(init_loop_pool, pool_dir, POOL_SIZE)
        made_pool = True
    nfs_port, mount_port, nbd_port = _free_port(), _free_port(), _free_port()
    config = DaemonConfig(
        data_dir=data_dir,
        pool_dir=pool_dir,
        nbd_listen=f"127.0.0.1:{nbd_port}",
        nfs_port=nfs_port,
        mount_port=mount_port,
        graceless=True,
        grace_period=5,
        lease_lifetime=5,
    )
    console.rule("[bold]storage node")
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_daemon, config)
            console.print(
                f"storage node up: API {config.api_address}, NBD 127.0.0.1:{nbd_port}, "
                f"NFS 127.0.0.1:{nfs_port} (MOUNT {mount_port}), pool {pool_dir} "
                f"({format_size(POOL_SIZE)} sparse xfs image, loop-mounted)"
            )
            client = BackendClient(config.api_address)
            try:
                await _drive(client, nfs_port, mount_port, console)
                await trio.to_thread.run_sync(csi_demo, state, config.api_address, console)
            finally:
                client.close()
                nursery.cancel_scope.cancel()
    finally:
        if made_pool:
            await trio.to_thread.run_sync(release_loop_pool, pool_dir)
            image = pool_dir.with_name(pool_dir.name + ".img")
            image.unlink(missing_ok=True)
            pool_dir.with_name(pool_dir.name + ".pool.json").unlink(missing_ok=True)
            shutil.rmtree(data_dir, ignore_errors=True)
    console.print("storage node stopped; pool released, nothing left mounted")


async def _drive(client: BackendClient, nfs_port: int, mount_port: int, console: Console) -> None:
    async def call(fn: Callable[..., T], *args: object) -> T:
        return await trio.to_thread.run_sync(fn, *args)

    start = time.perf_counter()
    block = await call(
        client.create_volume,
        pb.CreateVolumeRequest(name="demo-block", type=pb.NBD, size_bytes=512 << 20),
    )
    files = await call(
        client.create_volume,
        pb.CreateVolumeRequest(
            name="demo-files", type=pb.NFS, size_bytes=256 << 20, parameters={"fs_type": "xfs"}
        ),
    )
    created = time.perf_counter() - start
    nbd_target = (await call(client.publish, block.id, NODE, "127.0.0.1", False)).nbd
    nfs_target = (await call(client.publish, files.id, NODE, "127.0.0.1", False)).nfs
    console.print(
        f"created a 512 MiB block volume and a 256 MiB filesystem volume in {created:.2f} s; "
        f"published both to {NODE} (127.0.0.1)"
    )

    uri = f"nbd://{nbd_target.host}:{nbd_target.port}/{nbd_target.export_name}"
    await _tool(["qemu-io", "-f", "raw", "-c", "write -P 0xa5 1M 8M", "-c", "flush", uri])
    checked = await _tool(["qemu-io", "-f", "raw", "-c", "read -P 0xa5 1M 8M", uri])
    nbd_ok = "read 8388608/8388608" in checked
    allocation = await _tool(["nbdinfo", "--map", uri])

    v3 = f"?nfsport={nfs_port}&mountport={mount_port}&version=3"
    path = nfs_target.export_path
    payload = os.urandom(4 << 20)
    local = Path(f"/tmp/moorage-demo-{os.getpid()}.bin")
    local.write_bytes(payload)
    try:
        await _tool(["nfs-cp", str(local), f"nfs://127.0.0.1{path}/hello.bin{v3}"])
    finally:
        local.unlink()
    back = await trio.run_process(
        ["nfs-cat", f"nfs://127.0.0.1{path}/hello.bin{v3}"], capture_stdout=True, check=True
    )
    nfs_ok = bytes(back.stdout) == payload
    listing = await _tool(["nfs-ls", f"nfs://127.0.0.1/volumes?version=4&nfsport={nfs_port}"])

    snap = await call(client.create_snapshot, "demo-block-snap", block.id)
    clone = await call(
        client.create_volume,
        pb.CreateVolumeRequest(
            name="demo-block-clone", type=pb.NBD, size_bytes=512 << 20, snapshot_id=snap.id
        ),
    )
    clone_target = (await call(client.publish, clone.id, NODE, "127.0.0.1", False)).nbd
    clone_uri = f"nbd://{clone_target.host}:{clone_target.port}/{clone_target.export_name}"
    clone_check = await _tool(["qemu-io", "-f", "raw", "-c", "read -P 0xa5 1M 8M", clone_uri])
    clone_ok = "read 8388608/8388608" in clone_check
    grown = await call(client.expand_volume, files.id, 512 << 20)

    t = Table(title="what real clients saw")
    t.add_column("check")
    t.add_column("result")
    t.add_row("qemu-io wrote 8 MiB to the block volume over NBD, read it back", _ok(nbd_ok))
    data_rows = [line.split() for line in allocation.splitlines() if "data" in line]
    t.add_row(
        "nbdinfo --map: allocated ranges",
        ", ".join(f"{r[0]}+{r[1]}" for r in data_rows) or "none",
    )
    t.add_row("nfs-cp wrote 4 MiB over NFSv3, nfs-cat read it back identical", _ok(nfs_ok))
    t.add_row("nfs-ls over NFSv4 lists /volumes", " ".join(listing.split()[-1:]) or "?")
    t.add_row(f"snapshot {snap.id[:8]}… cloned; the clone holds the same 8 MiB", _ok(clone_ok))
    t.add_row("filesystem volume expanded online", f"{format_size(grown.size_bytes)}")
    console.print(t)

    cap = await call(client.capacity)
    health = await call(client.health)
    console.print(
        f"pool: {format_size(cap.total_bytes)} total, {format_size(cap.provisioned_bytes)} "
        f"provisioned, {format_size(cap.available_bytes)} available; ganesha running: "
        f"{health.ganesha_running}; NBD exports: {health.nbd_exports}"
    )
    for vol in (clone, block, files):
        await call(client.unpublish, vol.id, NODE)
        await call(client.delete_volume, vol.id)
    await call(client.delete_snapshot, snap.id)
    if not (nbd_ok and nfs_ok and clone_ok):
        raise RuntimeError("a check failed (see the table above)")


def _ok(flag: bool) -> str:
    return "[green]ok[/green]" if flag else "[red]FAILED[/red]"
