"""A storage node in a network namespace of its own with two client namespaces beside
it, for the tests of who may reach a published volume.

The storage node runs in a network namespace "store" (``ip netns exec``), its NBD
server on the store's address and ganesha on every address of that namespace, with an
rpcbind of the namespace's own; its API stays on the unix socket.  Two client
namespaces, "nodeA" and "nodeB", hang off a bridge inside "store":

    nodeA  eth0 10.231.0.2/24 --veth-- +
                                       br0 10.231.0.1/24  (store)
    nodeB  eth0 10.231.0.3/24 --veth-- +

No namespace has a route beyond that /24 and nothing is linked to the host, so no
packet leaves the three namespaces.  The clients are the real tools, each run inside
its client namespace; a refusal must read as the refusal it is (``refused``).

``site`` is a module-scoped fixture (``site_fixture``): a module imports it to share
one site among its tests; the namespaces' names are the site's own, so no two sites
meet.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.api.proto import backend_pb2 as pb
from tests.backend_node import BackendNode, make_node
from tests.conftest import REPO
from tests.netns import ip, kill_netns_processes, netns_list

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


@pytest.fixture(scope="module", name="site")
def site_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """A storage node in "store", reachable from "nodeA" and "nodeB"."""
    tag = f"{os.getpid()}-{next(_names)}"
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
