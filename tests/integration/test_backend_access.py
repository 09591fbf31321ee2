"""Who may reach a published volume, across real network namespaces.

The storage node runs in a network namespace "store" of its own (``ip netns
exec``), its NBD server on the store's address and ganesha on every address
of that namespace, with an rpcbind of the namespace's own; its API stays on
the unix socket.  Two client namespaces, "nodeA" and "nodeB", hang off a
bridge inside "store":

    nodeA  eth0 10.231.0.2/24 --veth-- +
                                       br0 10.231.0.1/24  (store)
    nodeB  eth0 10.231.0.3/24 --veth-- +

No namespace has a route beyond that /24 and nothing is linked to the host,
so no packet leaves the three namespaces.  The clients are the real tools:
libnfs's ``nfs-ls``/``nfs-cp``/``nfs-cat`` (NFSv3 with explicit NFS and
MOUNT ports), libnbd's ``nbdinfo``, and a raw NBD client holding a
connection open, each run inside its client namespace.
"""

from __future__ import annotations

import itertools
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.api.proto import backend_pb2 as pb
from tests.backend_node import BackendNode, make_node
from tests.conftest import REPO
from tests.netns import ip, kill_netns_processes, netns_list, netns_pids

STORE_IP = "10.231.0.1"
A_IP = "10.231.0.2"
B_IP = "10.231.0.3"
PREFIX = 24
SUBNET = f"10.231.0.0/{PREFIX}"
NODE_A = "node-a"
NODE_B = "node-b"
NFS_SIZE = 64 << 20  # rounded up to the smallest xfs image
NBD_SIZE = 16 << 20
TOOL_TIMEOUT = 30.0

_names = itertools.count()

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


@dataclass(frozen=True)
class Topology:
    store: str
    node_a: str
    node_b: str

    @property
    def namespaces(self) -> tuple[str, str, str]:
        return (self.store, self.node_a, self.node_b)

    def create(self) -> None:
        for ns in self.namespaces:
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", self.store, "link", "add", "br0", "type", "bridge")
        ip("-n", self.store, "addr", "add", f"{STORE_IP}/{PREFIX}", "dev", "br0")
        ip("-n", self.store, "link", "set", "br0", "up")
        for ns, port, address in ((self.node_a, "veth-a", A_IP), (self.node_b, "veth-b", B_IP)):
            # both ends are made inside the namespaces: nothing appears on the host
            ip("-n", self.store, "link", "add", port, "type", "veth", "peer", "eth0", "netns", ns)
            ip("-n", self.store, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{address}/{PREFIX}", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def delete(self) -> list[str]:
        """Kill what still runs in the namespaces, delete them; returns what was killed."""
        killed: list[str] = []
        existing = set(netns_list())
        for ns in self.namespaces:
            if ns in existing:
                killed += kill_netns_processes(ns)
                ip("netns", "delete", ns)
        return killed


def in_ns(ns: str, *argv: str, timeout: float = TOOL_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def _show(result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"{' '.join(result.args)} exited {result.returncode}\n"
        f"stdout: {result.stdout.strip()}\nstderr: {result.stderr.strip()}"
    )


def succeeds(ns: str, *argv: str) -> str:
    result = in_ns(ns, *argv)
    assert result.returncode == 0, _show(result)
    return result.stdout


# How each refusal reads: a client that fails for another reason (the server
# gone, the network down) does not pass for a refused one.
NFS_MOUNT_REFUSED = "MNT3ERR_ACCES"
NFS_READ_ONLY = "NFS3ERR_ROFS"
NBD_NO_EXPORT = "server has no export named"


def refused(ns: str, why: str, *argv: str) -> None:
    """Run a client that must be refused, and refused for the reason ``why`` names."""
    result = in_ns(ns, *argv)
    assert result.returncode != 0, f"expected a refusal: {_show(result)}"
    assert why in result.stderr, f"refused, but not with {why!r}: {_show(result)}"


# ------------------------------------------------------------------ the site


@dataclass
class Site:
    topology: Topology
    node: BackendNode
    scratch: Path

    @property
    def store(self) -> str:
        return self.topology.store

    @property
    def a(self) -> str:
        return self.topology.node_a

    @property
    def b(self) -> str:
        return self.topology.node_b

    def nfs_volume(self, prefix: str) -> tuple[str, str]:
        """A new nfs volume: (id, name)."""
        name = f"{prefix}-{next(_names)}"
        with self.node.client() as c:
            vol = c.create_volume(
                pb.CreateVolumeRequest(name=name, type=pb.NFS, size_bytes=NFS_SIZE)
            )
        return vol.id, name

    def nbd_volume(self, prefix: str) -> str:
        name = f"{prefix}-{next(_names)}"
        with self.node.client() as c:
            vol = c.create_volume(
                pb.CreateVolumeRequest(name=name, type=pb.NBD, size_bytes=NBD_SIZE)
            )
        return vol.id

    def publish(self, vol_id: str, node: str, read_only: bool = False) -> pb.PublishVolumeResponse:
        address = A_IP if node == NODE_A else B_IP
        with self.node.client() as c:
            return c.publish(vol_id, node, address, read_only)

    def unpublish(self, vol_id: str, node: str) -> None:
        with self.node.client() as c:
            c.unpublish(vol_id, node)

    def nfs_url(self, name: str, file: str = "") -> str:
        return self.node.nfs_url(f"/volumes/{name}", file)

    def nbd_url(self, export: str = "") -> str:
        return f"nbd://{STORE_IP}:{self.node.nbd_port}/{export}"

    def local_file(self, content: bytes) -> Path:
        path = self.scratch / f"upload-{next(_names)}"
        path.write_bytes(content)
        return path

    def nfs_write(self, ns: str, name: str, file: str, content: bytes) -> str:
        return succeeds(ns, "nfs-cp", str(self.local_file(content)), self.nfs_url(name, file))

    def nfs_write_refused(self, ns: str, why: str, name: str, file: str) -> None:
        refused(ns, why, "nfs-cp", str(self.local_file(b"refused\n")), self.nfs_url(name, file))

    def nbd_exports_seen(self, ns: str) -> list[str]:
        """What ``nbdinfo --list`` shows from ``ns`` (it fails when shown an export it
        then may not open)."""
        out = succeeds(ns, "nbdinfo", "--list", "--json", self.nbd_url())
        return [str(e["export-name"]) for e in json.loads(out).get("exports", [])]


_CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 5)"


def _check_links(topology: Topology, nbd_port: int) -> None:
    """Both clients reach the store's NBD port; no namespace routes beyond the test's /24."""
    for ns in (topology.node_a, topology.node_b):
        succeeds(ns, sys.executable, "-c", _CONNECT, STORE_IP, str(nbd_port))
    for ns in topology.namespaces:
        routes = succeeds(ns, "ip", "-4", "route", "show").splitlines()
        assert all(r.startswith(f"{SUBNET} ") for r in routes), f"{ns}: {routes}"
        for family in ("-4", "-6"):
            every = succeeds(ns, "ip", family, "route", "show", "table", "all")
            assert "default" not in every, f"{ns}: {every}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """A storage node in "store", reachable from "nodeA" and "nodeB"."""
    tag = f"{os.getpid()}"
    topology = Topology(f"mrg-store-{tag}", f"mrg-nodeA-{tag}", f"mrg-nodeB-{tag}")
    root = tmp_path_factory.mktemp("access")
    node: BackendNode | None = None
    leftovers: list[str] = []
    try:
        topology.create()
        node = make_node(root / "node")
        node.netns = topology.store
        node.nbd_host = STORE_IP
        node.nfs_advertise = STORE_IP
        node.start()
        _check_links(topology, node.nbd_port)
        scratch = root / "scratch"
        scratch.mkdir()
        yield Site(topology, node, scratch)
    finally:
        if node is not None:
            node.stop()
            # a daemon that stopped stops its ganesha and its rpcbind with it
            leftovers = kill_netns_processes(topology.store)
        leftovers += topology.delete()
        if node is not None:
            node.teardown()
    assert not leftovers, f"processes left running in the namespaces: {leftovers}"


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
