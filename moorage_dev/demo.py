"""``moorage demo``: run what moorage has so far on embedded defaults.

Everything shown is computed on the spot by real tools talking to the real
server: nothing here is canned output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import trio
import typer
from rich.console import Console
from rich.table import Table

from moorage.output import CANNOT_START, fail
from nbd.exports import Export, ExportTable
from nbd.server import NBDServer

console = Console()

DEMO_SIZE = 256 * 1024 * 1024
DATA_SIZE = 32 * 1024 * 1024


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise fail("demo", f"needs {tool}; run deploy/host/install-deps.sh", CANNOT_START)
    return path


async def _run(argv: list[str]) -> str:
    result = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({result.returncode}): {result.stderr.decode()}")
    return bytes(result.stdout).decode()


def _sha256(path: Path, length: int | None = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        remaining = length if length is not None else -1
        while remaining:
            chunk = f.read(1 << 20 if remaining < 0 else min(1 << 20, remaining))
            if not chunk:
                break
            h.update(chunk)
            remaining -= len(chunk)
    return h.hexdigest()


async def _nbd_demo(state: Path) -> None:
    work = state / "demo"
    work.mkdir(parents=True, exist_ok=True)
    image = work / "block-volume.img"
    source = work / "random-data.bin"
    copy_back = work / "copy-back.img"
    with image.open("wb") as f:
        f.truncate(DEMO_SIZE)  # sparse, like a thin block volume
    source.write_bytes(os.urandom(DATA_SIZE))

    table = ExportTable([Export(name="demo-volume", path=image, description="moorage demo")])
    server = NBDServer(table)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(server.serve_tcp, "127.0.0.1", 0)
        port = listeners[0].socket.getsockname()[1]
        uri = f"nbd://127.0.0.1:{port}/demo-volume"
        console.rule("[bold]NBD server")
        console.print(f"listening on 127.0.0.1:{port}, export {uri}")

        info = json.loads(await _run([_need("nbdinfo"), "--json", uri]))
        exp = info["exports"][0]
        t = Table(title="nbdinfo --json (what a real NBD client negotiated)")
        t.add_column("property")
        t.add_column("value")
        t.add_row("protocol", f"{info['protocol']}, structured replies: {info['structured']}")
        t.add_row("export size", f"{exp['export-size']} bytes")
        caps = [k[4:] for k, v in exp.items() if k.startswith("can_") and v]
        t.add_row("capabilities", ", ".join(sorted(caps)))
        t.add_row("meta contexts", ", ".join(exp.get("contexts", [])))
        console.print(t)

        # Write 32 MiB of random data at offset 64 MiB with qemu-io, leaving the rest a hole.
        start = time.perf_counter()
        await _run(
            [
                _need("qemu-io"),
                "-f",
                "raw",
                "-c",
                f"write -s {source} {64 << 20} {DATA_SIZE}",
                "-c",
                "flush",
                uri,
            ]
        )
        wrote = time.perf_counter() - start
        console.print(
            f"qemu-io wrote {DATA_SIZE >> 20} MiB of random data at 64 MiB and flushed "
            f"in {wrote:.2f} s"
        )
        nbd_map = await _run([_need("nbdinfo"), "--map", uri])
        m = Table(title="nbdinfo --map (allocation reported by the server)")
        for col in ("offset", "length", "type"):
            m.add_column(col)
        for line in nbd_map.splitlines():
            fields = line.split()
            if len(fields) >= 4:
                m.add_row(fields[0], fields[1], " ".join(fields[3:]))
        console.print(m)

        start = time.perf_counter()
        await _run([_need("nbdcopy"), uri, str(copy_back)])
        copied = time.perf_counter() - start
        nursery.cancel_scope.cancel()

    with copy_back.open("rb") as f:
        f.seek(64 << 20)
        region = f.read(DATA_SIZE)
    same = hashlib.sha256(region).hexdigest() == _sha256(source)
    console.print(
        f"nbdcopy read the whole {DEMO_SIZE >> 20} MiB export back in {copied:.2f} s; "
        f"the 32 MiB region {'matches' if same else 'DOES NOT match'} what was written "
        f"(sha256 {_sha256(source)[:16]}…)"
    )
    for p in (source, copy_back, image):
        p.unlink()
    if not same:
        raise fail("demo", "what nbdcopy read back does not match what was written")


def demo(
    state_dir: Path = typer.Option(Path(".moorage"), "--state-dir", help="Where state lives."),
) -> None:
    """Run the NBD server and a whole storage node, and drive them with real clients."""
    # The demo prints its own account; the servers' own logs are noise here.
    for name in ("moorage.nbd", "moorage.backend", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("moorage.ganesha").setLevel(logging.ERROR)
    try:
        trio.run(_nbd_demo, state_dir)
        from moorage_dev.demo_node import node_demo  # the storage node's imports, only here

        trio.run(node_demo, state_dir, console)
    except (RuntimeError, subprocess.SubprocessError) as e:
        raise fail("demo", f"failed: {e}") from e
