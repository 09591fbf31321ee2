"""The kernel lane's fixtures: one guest and one storage node for the session.

The guest (tests/kernel/guest.py) boots Debian's cloud kernel from the root
filesystem ``make guest`` caches (MOORAGE_GUEST); the storage node is a real
``moorage backend serve`` on a loop pool, inside the lane's network namespace,
its NBD server and ganesha on the namespace's address: the one thing the guest
can reach.  Run by ``make test-kernel``, never by ``make test``.
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.api.proto import backend_pb2 as pb
from tests.backend_node import BackendNode, make_node
from tests.csi_plugin import sanity_binary
from tests.kernel.guest import API_PORT, GUEST_IP, HOST_IP, Lane, lane

NODE_ID = "kernel-lane"
# What runs inside the guest (tests/kernel/test_csi_in_guest.py runs it there).
collect_ignore = [] if os.environ.get("MOORAGE_IN_GUEST") else ["inguest"]
_names = itertools.count()


@pytest.fixture(scope="session")
def guest_dir() -> Path:
    value = os.environ.get("MOORAGE_GUEST")
    if not value:
        pytest.fail("MOORAGE_GUEST is not set: run the kernel lane with make test-kernel")
    path = Path(value)
    if not (path / "vmlinuz").is_file() or not (path / "base.cpio").is_file():
        pytest.fail(f"no guest at {path}: make guest builds it")
    return path


@dataclass
class Store:
    """The storage node, seen from the tests: volumes published to the guest."""

    node: BackendNode

    def volume(self, kind: str, size: int, prefix: str = "k") -> pb.Volume:
        with self.node.client() as c:
            return c.create_volume(
                pb.CreateVolumeRequest(
                    name=f"{prefix}-{next(_names)}",
                    type=pb.NBD if kind == "nbd" else pb.NFS,
                    size_bytes=size,
                )
            )

    def publish(self, volume: pb.Volume, read_only: bool = False) -> pb.PublishVolumeResponse:
        with self.node.client() as c:
            return c.publish(volume.id, NODE_ID, GUEST_IP, read_only)

    def unpublish(self, volume: pb.Volume) -> None:
        with self.node.client() as c:
            c.unpublish(volume.id, NODE_ID)

    def delete(self, volume: pb.Volume) -> None:
        with self.node.client() as c:
            c.delete_volume(volume.id)


@pytest.fixture(scope="session")
def guest(guest_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lane]:
    with lane(guest_dir, tmp_path_factory.mktemp("lane"), [sanity_binary()]) as running:
        yield running


# Where the guest keeps the token the storage node's API on the lane's network
# (API_PORT, beside the unix socket the host's tests use) asks for.
GUEST_TOKEN = "/etc/moorage/token"


@pytest.fixture(scope="session")
def store(guest: Lane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    root = tmp_path_factory.mktemp("store")
    token = secrets.token_hex(24)
    node = make_node(root / "node")
    node.netns = guest.netns
    node.nbd_host = HOST_IP
    node.nfs_advertise = HOST_IP
    node.also_listen = f"{HOST_IP}:{API_PORT}"
    node.token_file = root / "token"
    node.token_file.write_text(token + "\n")
    node.token_file.chmod(0o600)
    guest.run("sh", "-euc", f"umask 077; mkdir -p {Path(GUEST_TOKEN).parent}; cat > {GUEST_TOKEN}",
              input=token + "\n")  # fmt: skip
    try:
        node.start()
        yield Store(node)
    finally:
        node.teardown()
