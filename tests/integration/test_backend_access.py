"""Who may reach a published volume, across real network namespaces.

The storage node runs in a network namespace of its own, "store", with two client
namespaces "nodeA" and "nodeB" beside it (``tests/access_site.py`` builds them and
nothing else is linked to them).  The clients are the real tools: libnfs's
``nfs-ls``/``nfs-cp``/``nfs-cat`` (NFSv3 with explicit NFS and MOUNT ports),
libnbd's ``nbdinfo``, and a raw NBD client holding a connection open, each run
inside its client namespace.
"""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

from tests.access_site import (
    NBD_NO_EXPORT,
    NBD_SIZE,
    NFS_MOUNT_REFUSED,
    NFS_READ_ONLY,
    NODE_A,
    NODE_B,
    STORE_IP,
    TOOL_TIMEOUT,
    Site,
    refused,
    site_fixture,  # noqa: F401  (the module-scoped site)
    succeeds,
)
from tests.conftest import REPO
from tests.netns import netns_pids

# Runs in nodeA: opens an export, reads from it, says so, then waits for the
# server to close the connection (exit 0) or gives up after 60s (exit 1).
HOLDER = """
import sys, trio
from tests.nbdwire import WireClient

async def main(host: str, port: str, name: str) -> None:
    client = WireClient(await trio.open_tcp_stream(host, int(port)))
    await client.greeting()
    negotiated = await client.go(name)
    await client.read(0, 4096)
    print("open", negotiated.size, flush=True)
    await client.expect_closed(timeout=60)
    print("closed", flush=True)

trio.run(main, *sys.argv[1:])
"""


# ------------------------------------------------------------------ namespaces


# ------------------------------------------------------------------ the site


# ------------------------------------------------------------------ rpcbind


def _rpc_rows(listing: str) -> set[tuple[str, ...]]:
    """``rpcinfo -p`` rows as (program, version, protocol, port)."""
    return {tuple(line.split()[:4]) for line in listing.splitlines()[1:]}


def test_rpcbind_of_the_store_namespace_has_ganeshas_registrations(site: Site) -> None:
    node = site.node
    listing = succeeds(site.a, "rpcinfo", "-p", STORE_IP)
    rows = _rpc_rows(listing)
    assert ("100003", "3", "tcp", str(node.nfs_port)) in rows, listing
    assert ("100005", "3", "tcp", str(node.mount_port)) in rows, listing
    running = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in netns_pids(site.store)}
    assert {"rpcbind", "ganesha.nfsd"} <= running, running
    # ganesha registered with the namespace's rpcbind, not with one the host may run
    host = subprocess.run(
        ["rpcinfo", "-p", "127.0.0.1"], capture_output=True, text=True, timeout=TOOL_TIMEOUT
    )
    assert ("100003", "3", "tcp", str(node.nfs_port)) not in _rpc_rows(host.stdout), host.stdout


# ------------------------------------------------------------------ NFS


def test_nfs_volume_published_to_a_is_reachable_from_a_only(site: Site) -> None:
    vol_id, name = site.nfs_volume("nfs-a-only")
    target = site.publish(vol_id, NODE_A)
    assert (target.nfs.server, target.nfs.export_path) == (STORE_IP, f"/volumes/{name}")

    site.nfs_write(site.a, name, "hello.txt", b"from node A\n")
    assert succeeds(site.a, "nfs-cat", site.nfs_url(name, "hello.txt")) == "from node A\n"
    assert "hello.txt" in succeeds(site.a, "nfs-ls", site.nfs_url(name))

    refused(site.b, NFS_MOUNT_REFUSED, "nfs-ls", site.nfs_url(name))
    refused(site.b, NFS_MOUNT_REFUSED, "nfs-cat", site.nfs_url(name, "hello.txt"))
    site.nfs_write_refused(site.b, NFS_MOUNT_REFUSED, name, "from-b.txt")
    assert "from-b.txt" not in succeeds(site.a, "nfs-ls", site.nfs_url(name))


def test_nfs_unpublish_from_the_only_node_refuses_it(site: Site) -> None:
    vol_id, name = site.nfs_volume("nfs-unpublish")
    site.publish(vol_id, NODE_A)
    site.nfs_write(site.a, name, "before.txt", b"before\n")

    site.unpublish(vol_id, NODE_A)
    refused(site.a, NFS_MOUNT_REFUSED, "nfs-ls", site.nfs_url(name))
    refused(site.a, NFS_MOUNT_REFUSED, "nfs-cat", site.nfs_url(name, "before.txt"))
    site.nfs_write_refused(site.a, NFS_MOUNT_REFUSED, name, "after.txt")

    # published again, A finds what it wrote, and nothing written while refused
    site.publish(vol_id, NODE_A)
    listing = succeeds(site.a, "nfs-ls", site.nfs_url(name))
    assert "before.txt" in listing and "after.txt" not in listing, listing


def test_nfs_published_to_both_lets_both_in_and_unpublish_refuses_only_one(site: Site) -> None:
    vol_id, name = site.nfs_volume("nfs-both")
    site.publish(vol_id, NODE_A)
    site.publish(vol_id, NODE_B)

    site.nfs_write(site.a, name, "a.txt", b"from A\n")
    site.nfs_write(site.b, name, "b.txt", b"from B\n")
    assert succeeds(site.b, "nfs-cat", site.nfs_url(name, "a.txt")) == "from A\n"
    assert succeeds(site.a, "nfs-cat", site.nfs_url(name, "b.txt")) == "from B\n"

    # the export stays, with B alone in its client list
    site.unpublish(vol_id, NODE_A)
    refused(site.a, NFS_MOUNT_REFUSED, "nfs-ls", site.nfs_url(name))
    site.nfs_write_refused(site.a, NFS_MOUNT_REFUSED, name, "a2.txt")
    site.nfs_write(site.b, name, "b2.txt", b"B again\n")
    listing = succeeds(site.b, "nfs-ls", site.nfs_url(name))
    assert "a.txt" in listing and "b2.txt" in listing and "a2.txt" not in listing, listing


def test_nfs_read_only_publication_refuses_writes_of_that_node_only(site: Site) -> None:
    vol_id, name = site.nfs_volume("nfs-ro")
    site.publish(vol_id, NODE_A)
    site.publish(vol_id, NODE_B, read_only=True)

    site.nfs_write(site.a, name, "a.txt", b"written by A\n")
    assert succeeds(site.b, "nfs-cat", site.nfs_url(name, "a.txt")) == "written by A\n"
    site.nfs_write_refused(site.b, NFS_READ_ONLY, name, "b.txt")
    site.nfs_write_refused(site.b, NFS_READ_ONLY, name, "a.txt")  # nor overwrite
    assert succeeds(site.a, "nfs-cat", site.nfs_url(name, "a.txt")) == "written by A\n"
    site.nfs_write(site.a, name, "a2.txt", b"A still writes\n")
    listing = succeeds(site.b, "nfs-ls", site.nfs_url(name))
    assert "a2.txt" in listing and "b.txt" not in listing, listing

    # published read-write instead (unpublished, published again), B writes
    site.unpublish(vol_id, NODE_B)
    site.publish(vol_id, NODE_B)
    site.nfs_write(site.b, name, "b.txt", b"now B writes\n")
    assert succeeds(site.a, "nfs-cat", site.nfs_url(name, "b.txt")) == "now B writes\n"


# ------------------------------------------------------------------ NBD


def test_nbd_export_published_to_a_is_reachable_from_a_only(site: Site) -> None:
    vol_id = site.nbd_volume("nbd-a-only")
    target = site.publish(vol_id, NODE_A)
    export = f"{vol_id}@{NODE_A}"
    assert (target.nbd.host, target.nbd.port) == (STORE_IP, site.node.nbd_port)
    assert target.nbd.export_name == export

    assert int(succeeds(site.a, "nbdinfo", "--size", site.nbd_url(export))) == NBD_SIZE
    assert export in site.nbd_exports_seen(site.a)

    refused(site.b, NBD_NO_EXPORT, "nbdinfo", "--size", site.nbd_url(export))
    assert export not in site.nbd_exports_seen(site.b)

    # B's own (read-only) export of the volume does not open A's
    site.publish(vol_id, NODE_B, read_only=True)
    own = f"{vol_id}@{NODE_B}"
    assert int(succeeds(site.b, "nbdinfo", "--size", site.nbd_url(own))) == NBD_SIZE
    seen = site.nbd_exports_seen(site.b)
    assert own in seen and export not in seen, seen
    refused(site.b, NBD_NO_EXPORT, "nbdinfo", "--size", site.nbd_url(export))
    refused(site.a, NBD_NO_EXPORT, "nbdinfo", "--size", site.nbd_url(own))


def _read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def test_nbd_unpublish_closes_as_open_connection_and_refuses_a(site: Site) -> None:
    vol_id = site.nbd_volume("nbd-unpublish")
    site.publish(vol_id, NODE_A)
    export = f"{vol_id}@{NODE_A}"
    holder_args = [STORE_IP, str(site.node.nbd_port), export]
    holder = subprocess.Popen(
        ["ip", "netns", "exec", site.a, sys.executable, "-c", HOLDER, *holder_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        line = _read_line(holder, TOOL_TIMEOUT)
        assert line == f"open {NBD_SIZE}\n", (line, holder.poll())

        site.unpublish(vol_id, NODE_A)
        # the server closed A's connection: the holder sees EOF at once
        rest, errors = holder.communicate(timeout=TOOL_TIMEOUT)
        assert holder.returncode == 0 and rest == "closed\n", (rest, errors)
        refused(site.a, NBD_NO_EXPORT, "nbdinfo", "--size", site.nbd_url(export))
        assert export not in site.nbd_exports_seen(site.a)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.communicate()
