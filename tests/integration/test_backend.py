"""The storage node end to end: a real ``moorage backend serve``, ganesha and clients.

Every test runs its own daemon (the ``backend_node`` fixture: a 4 GiB loop xfs
pool, free loopback ports) and talks to it through the gRPC API, the admin
CLI, and the real data-path clients: libnfs's ``nfs-cp``/``nfs-cat``/``nfs-ls``
(NFSv3 for data, NFSv4 for listing the pseudo root), and ``nbdinfo`` /
``qemu-io`` for block volumes.

Why this file is long: each of its nine tests is one long scenario on a daemon of its
own (a loop pool, ganesha, free ports) that takes one part of the API through the gRPC
API, the admin CLI and the real NFS and NBD clients, with the node's state checked
between steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from backend.api.client import BackendClient
from backend.api.proto import backend_pb2 as pb
from backend.pool import Pool
from tests.backend_calls import (
    big_random_file,
    expect,
    nbd_uri,
    nbd_volume,
    nfs_volume,
    pool_images,
    rpc_error,
    tool,
)
from tests.backend_node import BackendNode, backend_node, make_node  # noqa: F401
from tests.conftest import REPO, free_port

MiB = 1 << 20
TiB = 1 << 40
Code = grpc.StatusCode


# ------------------------------------------------------------------ helpers


@pytest.fixture
def node(backend_node: BackendNode) -> BackendNode:  # noqa: F811
    return backend_node


def output(result: subprocess.CompletedProcess[bytes]) -> str:
    return (result.stdout + result.stderr).decode(errors="replace")


def random_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def nbdinfo(uri: str) -> dict[str, Any]:
    """The one export nbdinfo --json reports for ``uri``."""
    info = json.loads(tool("nbdinfo", "--json", uri).stdout)
    exports = info["exports"]
    assert len(exports) == 1, exports
    return cast(dict[str, Any], exports[0])


def qemu_io(
    uri: str, *commands: str, check: bool = True, read_only: bool = False
) -> subprocess.CompletedProcess[bytes]:
    argv = ["qemu-io", "-f", "raw", *(["-r"] if read_only else [])]
    for command in commands:
        argv += ["-c", command]
    return tool(*argv, uri, check=check)


def all_volumes(c: BackendClient) -> list[pb.Volume]:
    volumes: list[pb.Volume] = []
    token = ""
    while True:
        page = c.list_volumes(max_entries=100, token=token)
        volumes.extend(page.volumes)
        token = page.next_token
        if not token:
            return volumes


def mounted_under(path: Path) -> list[str]:
    """Mount points in /proc/mounts at or below ``path``."""
    prefix = str(path)
    points = []
    for line in Path("/proc/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return points


def usable_bytes(node: BackendNode, vol_id: str) -> int:
    """Free space in an nfs volume's filesystem, as the server sees it."""
    st = os.statvfs(node.pool_dir / "mnt" / vol_id / "export")
    return st.f_bavail * st.f_frsize


def cli_fails(node: BackendNode, *args: str) -> str:
    """Run the CLI expecting a failure; returns what it printed."""
    result = node.cli(*args, check=False)
    assert result.returncode != 0, f"moorage {args} succeeded:\n{result.stdout}"
    return result.stdout + result.stderr


def cli_json(node: BackendNode, *args: str) -> Any:
    return json.loads(node.cli(*args, "--json").stdout)


# ------------------------------------------------------- create, get, list


def test_create_get_list_through_api_and_cli(node: BackendNode) -> None:
    mode = node.socket.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600, oct(mode)

    with node.client() as c:
        # API: one volume of each type
        blk = nbd_volume(c, "blk-api", 64 * MiB)
        assert len(blk.id) == 32 and int(blk.id, 16) >= 0
        assert (blk.name, blk.type, blk.size_bytes, blk.state) == (
            "blk-api",
            pb.NBD,
            64 * MiB,
            "ready",
        )
        assert blk.fs_type == "" and dict(blk.parameters) == {}
        fs = nfs_volume(c, "fs-api", 64 * MiB)
        assert (fs.type, fs.size_bytes, fs.state, fs.fs_type) == (pb.NFS, 64 * MiB, "ready", "xfs")
        assert dict(fs.parameters) == {"fs_type": "xfs", "squash": "root_squash"}
        assert (node.pool_dir / "volumes" / f"{blk.id}.img").stat().st_size == 64 * MiB
        assert mounted_under(node.pool_dir / "mnt" / fs.id) == [str(node.pool_dir / "mnt" / fs.id)]

        # CLI: one of each type, --json parsed
        cblk = cli_json(node, "volume", "create", "blk-cli", "--size", "32M")
        assert (cblk["name"], cblk["type"], int(cblk["size_bytes"])) == ("blk-cli", "NBD", 32 * MiB)
        assert cblk["state"] == "ready" and len(cblk["id"]) == 32
        cfs_args: tuple[str, ...] = ("volume", "create", "fs-cli", "--type", "nfs", "--size", "64M")
        cfs_args += ("--fs-type", "ext4", "--squash", "no_root_squash")
        cfs = cli_json(node, *cfs_args)
        assert (cfs["type"], cfs["fs_type"], cfs["squash"]) == ("NFS", "ext4", "no_root_squash")
        assert int(cfs["size_bytes"]) == 64 * MiB
        assert c.get_volume(volume_id=cfs["id"]).parameters["fs_type"] == "ext4"

        # idempotent: the same name and parameters give the same volume
        assert nbd_volume(c, "blk-api", 64 * MiB).id == blk.id
        assert nfs_volume(c, "fs-api", 64 * MiB).id == fs.id
        assert cli_json(node, "volume", "create", "blk-cli", "--size", "32M")["id"] == cblk["id"]
        # ... and a different size, type or parameters is ALREADY_EXISTS
        expect(Code.ALREADY_EXISTS, lambda: nbd_volume(c, "blk-api", 128 * MiB))
        expect(Code.ALREADY_EXISTS, lambda: nfs_volume(c, "blk-api", 64 * MiB))
        expect(Code.ALREADY_EXISTS, lambda: nbd_volume(c, "fs-api", 64 * MiB))
        expect(Code.ALREADY_EXISTS, lambda: nfs_volume(c, "fs-api", 64 * MiB, fs_type="ext4"))
        out = cli_fails(node, "volume", "create", "blk-cli", "--size", "33M")
        assert "ALREADY_EXISTS" in out
        assert c.get_volume(volume_id=blk.id).size_bytes == 64 * MiB
        assert c.get_volume(name="blk-cli").size_bytes == 32 * MiB

        # GetVolume by id and by name, API and CLI
        assert c.get_volume(volume_id=fs.id).name == "fs-api"
        assert c.get_volume(name="fs-api").id == fs.id
        assert cli_json(node, "volume", "get", blk.id)["name"] == "blk-api"

        # NOT_FOUND for what does not exist
        unknown = uuid.uuid4().hex
        expect(Code.NOT_FOUND, lambda: c.get_volume(volume_id=unknown))
        expect(Code.NOT_FOUND, lambda: c.get_volume(name="no-such-volume"))
        expect(Code.NOT_FOUND, lambda: c.expand_volume(unknown, 128 * MiB))
        expect(Code.NOT_FOUND, lambda: c.publish(unknown, "n1", "127.0.0.1"))
        expect(Code.NOT_FOUND, lambda: c.create_snapshot("snap-x", unknown))
        expect(Code.NOT_FOUND, lambda: nbd_volume(c, "clone-x", 64 * MiB, snapshot_id=unknown))
        expect(Code.NOT_FOUND, lambda: nbd_volume(c, "clone-y", 64 * MiB, volume_id=unknown))
        assert "NOT_FOUND" in cli_fails(node, "volume", "get", unknown)
        assert list(c.list_snapshots(source_volume_id=unknown).snapshots) == []

        # ListVolumes pagination: 7 volumes in pages of 3, each exactly once
        made = {blk.id, fs.id, cblk["id"], cfs["id"]}
        for i in range(3):
            made.add(nbd_volume(c, f"page-{i}", MiB).id)
        seen: list[str] = []
        sizes: list[int] = []
        token = ""
        while True:
            page = c.list_volumes(max_entries=3, token=token)
            assert 1 <= len(page.volumes) <= 3
            sizes.append(len(page.volumes))
            seen.extend(v.id for v in page.volumes)
            token = page.next_token
            if not token:
                break
        assert sizes == [3, 3, 1]
        assert sorted(seen) == sorted(made) and len(seen) == 7
        listed = cli_json(node, "volume", "list")
        assert sorted(v["id"] for v in listed) == sorted(made)
        # the human table shows names and ids
        human = node.cli("volume", "list").stdout
        for name in ("blk-api", "fs-api", "blk-cli", "fs-cli", "page-0", "page-1", "page-2"):
            assert name in human
        assert all(vol_id in human for vol_id in made)
        expect(Code.INVALID_ARGUMENT, lambda: c.list_volumes(max_entries=3, token="not-a-token"))

        # the pool status adds it up
        status = cli_json(node, "pool", "status")
        cap = c.capacity()
        provisioned = sum(v.size_bytes for v in all_volumes(c))
        assert provisioned == 2 * 64 * MiB + 32 * MiB + 64 * MiB + 3 * MiB
        assert cap.provisioned_bytes == provisioned
        assert int(status["capacity"]["provisioned_bytes"]) == provisioned
        assert status["health"]["ok"] is True and status["health"]["ganesha_running"] is True


# --------------------------------------------------------------- data paths


def test_nbd_volume_publish_io_expand_unpublish(node: BackendNode) -> None:
    with node.client() as c:
        vol = nbd_volume(c, "blk", 64 * MiB)
        target = c.publish(vol.id, "n1", "127.0.0.1")
        assert target.WhichOneof("target") == "nbd"
        assert (target.nbd.host, target.nbd.port) == ("127.0.0.1", node.nbd_port)
        assert target.nbd.export_name == f"{vol.id}@n1" and not target.nbd.tls
        assert list(c.get_volume(volume_id=vol.id).published_nodes) == ["n1"]
        # publishing again the same way is a no-op; differently, ALREADY_EXISTS
        assert c.publish(vol.id, "n1", "127.0.0.1") == target
        expect(Code.ALREADY_EXISTS, lambda: c.publish(vol.id, "n1", "127.0.0.1", read_only=True))
        expect(Code.ALREADY_EXISTS, lambda: c.publish(vol.id, "n1", "127.0.0.2"))
        # one writer at a time for a block volume
        expect(Code.FAILED_PRECONDITION, lambda: c.publish(vol.id, "n2", "127.0.0.1"))

        uri = nbd_uri(target)
        info = nbdinfo(uri)
        assert info["export-name"] == f"{vol.id}@n1"
        assert info["export-size"] == 64 * MiB
        assert info["is_read_only"] is False

        qemu_io(uri, "write -P 0x5a 0 1M", "write -P 0xa5 63M 1M")
        qemu_io(uri, "read -P 0x5a 0 1M", "read -P 0xa5 63M 1M", "read -P 0 32M 1M")
        wrong = qemu_io(uri, "read -P 0xa5 0 1M", check=False)
        assert wrong.returncode != 0 and "Pattern verification failed" in output(wrong)
        # the end of the volume is the end
        past = qemu_io(uri, "write -P 0x11 100M 1M", check=False)
        assert past.returncode != 0, output(past)

        # expand (through the CLI): a new connection sees the new size
        grown = cli_json(node, "volume", "expand", "blk", "--size", "128M")
        assert int(grown["size_bytes"]) == 128 * MiB and grown["state"] == "ready"
        assert (node.pool_dir / "volumes" / f"{vol.id}.img").stat().st_size == 128 * MiB
        assert nbdinfo(uri)["export-size"] == 128 * MiB
        qemu_io(uri, "write -P 0x11 100M 1M", "write -P 0x22 127M 1M")
        qemu_io(uri, "read -P 0x11 100M 1M", "read -P 0x22 127M 1M", "read -P 0x5a 0 1M")
        # expanding to a smaller or equal size changes nothing
        assert c.expand_volume(vol.id, 64 * MiB).size_bytes == 128 * MiB

        # a reader on another node
        ro = c.publish(vol.id, "n2", "127.0.0.1", read_only=True)
        ro_uri = nbd_uri(ro)
        assert ro.nbd.export_name == f"{vol.id}@n2"
        ro_info = nbdinfo(ro_uri)
        assert ro_info["is_read_only"] is True and ro_info["export-size"] == 128 * MiB
        qemu_io(ro_uri, "read -P 0x11 100M 1M", read_only=True)
        refused = qemu_io(ro_uri, "write -P 0x33 0 1M", check=False)  # opening it rw
        assert refused.returncode != 0 and "Permission denied" in output(refused)
        refused = qemu_io(ro_uri, "write -P 0x33 0 1M", check=False, read_only=True)
        assert refused.returncode != 0
        qemu_io(uri, "read -P 0x5a 0 1M")
        assert sorted(c.get_volume(volume_id=vol.id).published_nodes) == ["n1", "n2"]

        # unpublish: the exports are gone
        c.unpublish(vol.id, "n1")
        c.unpublish(vol.id, "n2")
        for gone in (uri, ro_uri):
            result = tool("nbdinfo", "--size", gone, check=False)
            assert result.returncode != 0
            assert "no export named" in output(result), output(result)
        c.unpublish(vol.id, "n1")  # again: nothing to undo
        assert list(c.get_volume(volume_id=vol.id).published_nodes) == []
        assert c.health().nbd_exports == 0


def test_nfs_volume_publish_io_expand_unpublish(node: BackendNode, tmp_path: Path) -> None:
    with node.client() as c:
        vol = nfs_volume(c, "share", 64 * MiB)
        target = c.publish(vol.id, "n1", "127.0.0.1")
        assert target.WhichOneof("target") == "nfs"
        nfs = target.nfs
        assert (nfs.server, nfs.port, nfs.mount_port) == (
            "127.0.0.1",
            node.nfs_port,
            node.mount_port,
        )
        assert nfs.export_path == "/volumes/share"
        assert c.publish(vol.id, "n1", "127.0.0.1") == target

        data = random_file(tmp_path / "hello.bin", 300_000)
        out = tool(
            "nfs-cp", str(tmp_path / "hello.bin"), node.nfs_url(nfs.export_path, "hello.bin")
        )
        assert b"copied 300000 bytes" in out.stdout
        assert tool("nfs-cat", node.nfs_url(nfs.export_path, "hello.bin")).stdout == data
        listing = tool("nfs-ls", node.nfs_url(nfs.export_path)).stdout.decode()
        assert any(line.split()[-2:] == ["300000", "hello.bin"] for line in listing.splitlines())
        v4 = tool("nfs-ls", node.nfs_url("/volumes", version=4)).stdout.decode()
        assert "share" in v4.split()
        # the bytes are in the volume's own filesystem
        assert (node.pool_dir / "mnt" / vol.id / "export" / "hello.bin").read_bytes() == data

        # expand online (xfs): a file bigger than the old free space then fits
        old_free = usable_bytes(node, vol.id)
        big_size = old_free + 32 * MiB
        new_size = (old_free + 160 * MiB) // MiB * MiB
        digest = big_random_file(tmp_path / "big.bin", big_size)
        grown = c.expand_volume(vol.id, new_size)
        assert (grown.size_bytes, grown.state) == (new_size, "ready")
        assert usable_bytes(node, vol.id) >= new_size - 300_000 > big_size
        tool("nfs-cp", str(tmp_path / "big.bin"), node.nfs_url(nfs.export_path, "big.bin"))
        back = tool("nfs-cat", node.nfs_url(nfs.export_path, "big.bin")).stdout
        assert len(back) == big_size and hashlib.sha256(back).hexdigest() == digest
        assert tool("nfs-cat", node.nfs_url(nfs.export_path, "hello.bin")).stdout == data
        (tmp_path / "big.bin").unlink()

        # ext4 cannot grow online on this host: refused while published, the
        # volume left as it was; after unpublishing it grows, data intact
        ext = nfs_volume(c, "ext", 64 * MiB, fs_type="ext4")
        ext_target = c.publish(ext.id, "n1", "127.0.0.1").nfs
        tool("nfs-cp", str(tmp_path / "hello.bin"), node.nfs_url(ext_target.export_path, "h.bin"))
        if Pool.grows_online("ext4"):  # CAP_SYS_RESOURCE: online, as xfs
            assert c.expand_volume(ext.id, 256 * MiB).size_bytes == 256 * MiB
            c.unpublish(ext.id, "n1")
        else:
            expect(Code.FAILED_PRECONDITION, lambda: c.expand_volume(ext.id, 256 * MiB))
            after = c.get_volume(volume_id=ext.id)
            assert (after.state, after.size_bytes) == ("ready", 64 * MiB)
            # still fully usable: created again idempotently, written, snapshotted
            assert nfs_volume(c, "ext", 64 * MiB, fs_type="ext4").id == ext.id
            tool("nfs-cp", str(tmp_path / "hello.bin"), node.nfs_url(ext_target.export_path, "h2"))
            c.delete_snapshot(c.create_snapshot("ext-snap", ext.id).id)
            c.unpublish(ext.id, "n1")
            assert c.expand_volume(ext.id, 256 * MiB).size_bytes == 256 * MiB
        assert usable_bytes(node, ext.id) >= 256 * MiB - 2 * 300_000
        ext_target = c.publish(ext.id, "n1", "127.0.0.1").nfs
        assert tool("nfs-cat", node.nfs_url(ext_target.export_path, "h.bin")).stdout == data
        c.unpublish(ext.id, "n1")

        # unpublished: the export refuses the client
        c.unpublish(vol.id, "n1")
        for argv in (
            ("nfs-ls", node.nfs_url(nfs.export_path)),
            ("nfs-cat", node.nfs_url(nfs.export_path, "hello.bin")),
        ):
            result = tool(*argv, check=False)
            assert result.returncode != 0, output(result)
            assert b"hello" not in result.stdout
        # published to another address only: 127.0.0.1 is still refused
        c.publish(vol.id, "n2", "127.0.0.2")
        result = tool("nfs-ls", node.nfs_url(nfs.export_path), check=False)
        assert result.returncode != 0, output(result)
        c.unpublish(vol.id, "n2")


# ---------------------------------------------------- snapshots and clones


def test_nbd_snapshot_and_clones(node: BackendNode) -> None:
    with node.client() as c:
        src = nbd_volume(c, "src", 64 * MiB)
        src_uri = nbd_uri(c.publish(src.id, "n1", "127.0.0.1"))
        qemu_io(src_uri, "write -P 0xaa 0 4M", "write -P 0xa1 60M 4M")

        snap = c.create_snapshot("snap-a", src.id)
        assert (snap.name, snap.source_volume_id, snap.type) == ("snap-a", src.id, pb.NBD)
        assert snap.ready_to_use and snap.size_bytes == 64 * MiB and len(snap.id) == 32
        assert (node.pool_dir / "snapshots" / f"{snap.id}.img").exists()
        assert c.create_snapshot("snap-a", src.id).id == snap.id  # idempotent

        qemu_io(src_uri, "write -P 0xbb 0 4M")

        # clone from the snapshot: what the source held then
        from_snap = nbd_volume(c, "clone-snap", 64 * MiB, snapshot_id=snap.id)
        assert from_snap.source_snapshot_id == snap.id and from_snap.state == "ready"
        clone_uri = nbd_uri(c.publish(from_snap.id, "n1", "127.0.0.1"))
        qemu_io(clone_uri, "read -P 0xaa 0 4M", "read -P 0xa1 60M 4M")
        qemu_io(src_uri, "read -P 0xbb 0 4M")
        # clones are independent of their source
        qemu_io(clone_uri, "write -P 0xcc 8M 1M")
        qemu_io(src_uri, "read -P 0 8M 1M")

        # clone from the volume: what it holds now; a clone may be bigger
        from_vol = nbd_volume(c, "clone-vol", 96 * MiB, volume_id=src.id)
        assert from_vol.source_volume_id == src.id and from_vol.size_bytes == 96 * MiB
        vol_uri = nbd_uri(c.publish(from_vol.id, "n1", "127.0.0.1"))
        assert nbdinfo(vol_uri)["export-size"] == 96 * MiB
        qemu_io(vol_uri, "read -P 0xbb 0 4M", "read -P 0xa1 60M 4M", "read -P 0 64M 32M")

        # a clone smaller than its source, or of the other type, is refused
        expect(Code.INVALID_ARGUMENT, lambda: nbd_volume(c, "small", 32 * MiB, snapshot_id=snap.id))
        expect(Code.INVALID_ARGUMENT, lambda: nfs_volume(c, "other", 64 * MiB, snapshot_id=snap.id))
        expect(Code.INVALID_ARGUMENT, lambda: nfs_volume(c, "other", 64 * MiB, volume_id=src.id))
        # a snapshot name belongs to its source
        expect(Code.ALREADY_EXISTS, lambda: c.create_snapshot("snap-a", from_vol.id))

        # ListSnapshots by source volume
        other = c.create_snapshot("snap-b", from_vol.id)
        assert [s.id for s in c.list_snapshots(source_volume_id=src.id).snapshots] == [snap.id]
        assert [s.id for s in c.list_snapshots(source_volume_id=from_vol.id).snapshots] == [
            other.id
        ]
        assert {s.id for s in c.list_snapshots().snapshots} == {snap.id, other.id}
        listed = cli_json(node, "snapshot", "list", "--volume", "src")
        assert [s["id"] for s in listed] == [snap.id]

        # the snapshot outlives its source
        expect(Code.FAILED_PRECONDITION, lambda: c.delete_volume(src.id))
        c.unpublish(src.id, "n1")
        c.delete_volume(src.id)
        assert f"{src.id}.img" not in pool_images(node)
        assert [s.id for s in c.list_snapshots(source_volume_id=src.id).snapshots] == [snap.id]
        late = nbd_volume(c, "clone-late", 64 * MiB, snapshot_id=snap.id)
        late_uri = nbd_uri(c.publish(late.id, "n1", "127.0.0.1"))
        qemu_io(late_uri, "read -P 0xaa 0 4M", "read -P 0xa1 60M 4M")
        # ... and the snapshot goes without touching the clones
        c.delete_snapshot(snap.id)
        c.delete_snapshot(snap.id)  # idempotent
        assert f"{snap.id}.img" not in pool_images(node, "snapshots")
        assert [s.id for s in c.list_snapshots().snapshots] == [other.id]
        qemu_io(late_uri, "read -P 0xaa 0 4M")
        qemu_io(clone_uri, "read -P 0xaa 0 4M", "read -P 0xcc 8M 1M")
        expect(Code.NOT_FOUND, lambda: nbd_volume(c, "clone-gone", 64 * MiB, snapshot_id=snap.id))


def test_nfs_snapshot_and_clones(node: BackendNode, tmp_path: Path) -> None:
    with node.client() as c:
        src = nfs_volume(c, "docs", 64 * MiB)
        path = c.publish(src.id, "n1", "127.0.0.1").nfs.export_path
        before = random_file(tmp_path / "before.bin", 200_000)
        tool("nfs-cp", str(tmp_path / "before.bin"), node.nfs_url(path, "before.bin"))

        snap = c.create_snapshot("docs-snap", src.id)
        assert snap.ready_to_use and snap.type == pb.NFS and snap.fs_type == "xfs"

        after = random_file(tmp_path / "after.bin", 100_000)
        tool("nfs-cp", str(tmp_path / "after.bin"), node.nfs_url(path, "after.bin"))

        clone = nfs_volume(c, "docs-clone", 64 * MiB, snapshot_id=snap.id)
        assert clone.source_snapshot_id == snap.id and clone.fs_type == "xfs"
        clone_path = c.publish(clone.id, "n1", "127.0.0.1").nfs.export_path
        assert clone_path == "/volumes/docs-clone"
        assert tool("nfs-cat", node.nfs_url(clone_path, "before.bin")).stdout == before
        missing = tool("nfs-cat", node.nfs_url(clone_path, "after.bin"), check=False)
        assert missing.returncode != 0
        names = [
            line.split()[-1]
            for line in tool("nfs-ls", node.nfs_url(clone_path)).stdout.decode().splitlines()
            if line.strip()
        ]
        assert "before.bin" in names and "after.bin" not in names
        # the clone takes writes of its own, unseen by the source
        tool("nfs-cp", str(tmp_path / "after.bin"), node.nfs_url(clone_path, "own.bin"))
        assert tool("nfs-cat", node.nfs_url(path, "own.bin"), check=False).returncode != 0

        # clone from the volume: both files
        copy = nfs_volume(c, "docs-copy", 64 * MiB, volume_id=src.id)
        copy_path = c.publish(copy.id, "n1", "127.0.0.1").nfs.export_path
        assert tool("nfs-cat", node.nfs_url(copy_path, "before.bin")).stdout == before
        assert tool("nfs-cat", node.nfs_url(copy_path, "after.bin")).stdout == after

        # the snapshot outlives its source
        c.unpublish(src.id, "n1")
        c.delete_volume(src.id)
        again = nfs_volume(c, "docs-again", 64 * MiB, snapshot_id=snap.id)
        again_path = c.publish(again.id, "n1", "127.0.0.1").nfs.export_path
        assert tool("nfs-cat", node.nfs_url(again_path, "before.bin")).stdout == before
        assert tool("nfs-cat", node.nfs_url(again_path, "after.bin"), check=False).returncode != 0
        v4 = tool("nfs-ls", node.nfs_url("/volumes", version=4)).stdout.decode().split()
        assert {"docs-clone", "docs-copy", "docs-again"} <= set(v4) and "docs" not in v4


# ----------------------------------------------------------------- capacity


def test_capacity_limits(node: BackendNode, tmp_path: Path) -> None:
    with node.client() as c:
        # ext4 keeps its usable space close to the size asked for
        full = nfs_volume(c, "full", 64 * MiB, fs_type="ext4")
        nbr = nfs_volume(c, "neighbour", 64 * MiB, fs_type="ext4")
        full_path = c.publish(full.id, "n1", "127.0.0.1").nfs.export_path
        nbr_path = c.publish(nbr.id, "n1", "127.0.0.1").nfs.export_path
        keep = random_file(tmp_path / "keep.bin", 2 * MiB)
        tool("nfs-cp", str(tmp_path / "keep.bin"), node.nfs_url(nbr_path, "keep.bin"))

        # a file bigger than the volume does not fit
        assert usable_bytes(node, full.id) < 96 * MiB
        big_random_file(tmp_path / "too-big.bin", 96 * MiB)
        result = tool(
            "nfs-cp",
            str(tmp_path / "too-big.bin"),
            node.nfs_url(full_path, "too-big.bin"),
            check=False,
        )
        # libnfs 4.0's nfs-cp reports only "Failed to write to dest file", not the
        # NFS3ERR_NOSPC behind it; the filesystem being full shows that cause
        assert result.returncode != 0, output(result)
        assert "Failed to write" in output(result), output(result)
        assert usable_bytes(node, full.id) < 4 * MiB
        # ... and the neighbour is untouched and still takes writes
        assert tool("nfs-cat", node.nfs_url(nbr_path, "keep.bin")).stdout == keep
        more = random_file(tmp_path / "more.bin", 8 * MiB)
        tool("nfs-cp", str(tmp_path / "more.bin"), node.nfs_url(nbr_path, "more.bin"))
        assert tool("nfs-cat", node.nfs_url(nbr_path, "more.bin")).stdout == more
        assert tool("nfs-cat", node.nfs_url(nbr_path, "keep.bin")).stdout == keep

        # GetCapacity adds up
        blk = nbd_volume(c, "blk", 100 * MiB)
        cap = c.capacity()
        st = os.statvfs(node.pool_dir)
        assert cap.total_bytes == st.f_blocks * st.f_frsize
        assert 0 < cap.free_bytes <= cap.total_bytes
        volumes = all_volumes(c)
        assert cap.provisioned_bytes == sum(v.size_bytes for v in volumes) == 228 * MiB
        assert cap.overcommit_ratio == 1.0
        assert cap.available_bytes == cap.total_bytes - cap.provisioned_bytes

        # more than is available: RESOURCE_EXHAUSTED, and nothing made
        images = pool_images(node)
        too_much = (cap.available_bytes // MiB + 1) * MiB
        details = expect(Code.RESOURCE_EXHAUSTED, lambda: nbd_volume(c, "huge", too_much))
        assert "available" in details
        expect(Code.RESOURCE_EXHAUSTED, lambda: nfs_volume(c, "huge-fs", too_much))
        expect(Code.NOT_FOUND, lambda: c.get_volume(name="huge"))
        expect(Code.NOT_FOUND, lambda: c.get_volume(name="huge-fs"))
        assert pool_images(node) == images
        assert len(all_volumes(c)) == 3
        assert "RESOURCE_EXHAUSTED" in cli_fails(
            node, "volume", "create", "huge", "--size", f"{too_much // MiB}M"
        )
        # so is growing past it, the volume left as it was
        expect(Code.RESOURCE_EXHAUSTED, lambda: c.expand_volume(blk.id, 100 * MiB + too_much))
        left = c.get_volume(volume_id=blk.id)
        assert (left.size_bytes, left.state) == (100 * MiB, "ready")
        assert c.capacity().provisioned_bytes == 228 * MiB
        # exactly what is available still fits
        fits = nbd_volume(c, "fits", c.capacity().available_bytes // MiB * MiB)
        assert fits.state == "ready"
        c.delete_volume(fits.id)


# ------------------------------------------------------------------ delete


def test_delete(node: BackendNode) -> None:
    with node.client() as c:
        blk = nbd_volume(c, "d-blk", 32 * MiB)
        fs = nfs_volume(c, "d-fs", 64 * MiB, fs_type="ext4")
        blk_uri = nbd_uri(c.publish(blk.id, "n1", "127.0.0.1"))
        c.publish(fs.id, "n1", "127.0.0.1")
        mount_point = node.pool_dir / "mnt" / fs.id

        for vol in (blk, fs):
            details = expect(Code.FAILED_PRECONDITION, c.delete_volume, vol.id)
            assert "n1" in details
        assert "FAILED_PRECONDITION" in cli_fails(node, "volume", "delete", "d-fs")
        assert {f"{blk.id}.img", f"{fs.id}.img"} <= pool_images(node)
        assert mounted_under(mount_point) == [str(mount_point)]
        assert nbdinfo(blk_uri)["export-size"] == 32 * MiB

        c.unpublish(blk.id, "n1")
        c.unpublish(fs.id, "n1")
        c.delete_volume(blk.id)
        assert "deleted volume d-fs" in node.cli("volume", "delete", "d-fs").stdout
        assert pool_images(node) == set()
        assert mounted_under(node.pool_dir / "mnt") == []
        assert not mount_point.exists()
        for vol in (blk, fs):
            expect(Code.NOT_FOUND, c.get_volume, volume_id=vol.id)
        assert all_volumes(c) == []
        assert c.capacity().provisioned_bytes == 0
        # deleting what is gone, or never was, is fine
        c.delete_volume(blk.id)
        c.delete_volume(fs.id)
        c.delete_volume(uuid.uuid4().hex)
        c.delete_snapshot(uuid.uuid4().hex)


# ------------------------------------------------------------- bad input


def test_invalid_input_creates_nothing(node: BackendNode) -> None:
    bad_ids = [
        "",
        "abc",
        "0" * 31,
        "0" * 33,
        "A" * 32,
        "g" * 32,
        "../../etc/passwd",
        "0" * 31 + "/",
    ]
    with node.client() as c:

        def create(
            name: str = "ok", kind: pb.VolumeType = pb.NBD, size: int = MiB, **extra: Any
        ) -> Callable[[], object]:
            return lambda: c.create_volume(
                pb.CreateVolumeRequest(name=name, type=kind, size_bytes=size, **extra)
            )

        for name in ["../etc", "a/b", "", "x" * 200, "a b", ".hidden", "x..y", "-dash", "a\nb"]:
            expect(Code.INVALID_ARGUMENT, create(name))
            expect(Code.INVALID_ARGUMENT, create(name, pb.NFS, 64 * MiB))
        for size in (0, 64 * TiB + 1, 100 * TiB):
            expect(Code.INVALID_ARGUMENT, create(size=size))
        expect(Code.INVALID_ARGUMENT, create(kind=pb.VOLUME_TYPE_UNSPECIFIED))
        expect(Code.INVALID_ARGUMENT, create(kind=cast(pb.VolumeType, 7)))
        expect(Code.INVALID_ARGUMENT, create(parameters={"fs_type": "xfs"}))
        expect(Code.INVALID_ARGUMENT, create(kind=pb.NFS, parameters={"fs_type": "btrfs"}))
        expect(Code.INVALID_ARGUMENT, create(kind=pb.NFS, parameters={"mode": "0777"}))
        expect(Code.INVALID_ARGUMENT, create(kind=pb.NFS, parameters={"squash": "none"}))
        for bad in bad_ids[1:]:
            expect(Code.INVALID_ARGUMENT, create(snapshot_id=bad))
            expect(Code.INVALID_ARGUMENT, create(volume_id=bad))
        for bad in bad_ids:
            expect(Code.INVALID_ARGUMENT, c.get_volume, volume_id=bad or "x")
            expect(Code.INVALID_ARGUMENT, c.delete_volume, bad)
            expect(Code.INVALID_ARGUMENT, c.expand_volume, bad, 2 * MiB)
            expect(Code.INVALID_ARGUMENT, c.publish, bad, "n1", "127.0.0.1")
            expect(Code.INVALID_ARGUMENT, c.unpublish, bad, "n1")
            expect(Code.INVALID_ARGUMENT, c.create_snapshot, "s", bad)
            expect(Code.INVALID_ARGUMENT, c.delete_snapshot, bad)
        for bad in bad_ids[1:]:
            expect(Code.INVALID_ARGUMENT, c.list_snapshots, source_volume_id=bad)
            expect(Code.INVALID_ARGUMENT, c.list_volumes, token=bad)
        expect(Code.INVALID_ARGUMENT, lambda: c.get_volume(name="../etc"))
        expect(Code.INVALID_ARGUMENT, lambda: c.get_volume())  # neither id nor name

        # a clone from both a snapshot and a volume cannot even be said on the
        # wire (a oneof); the CLI, where both can be given, refuses it
        both = pb.CreateVolumeRequest(snapshot_id="0" * 32, volume_id="1" * 32)
        assert both.WhichOneof("source") == "volume_id" and both.snapshot_id == ""
        out = cli_fails(
            node,
            "volume",
            "create",
            "both",
            "--size",
            "1M",
            "--from-snapshot",
            "0" * 32,
            "--from-volume",
            "1" * 32,
        )
        assert "not both" in out

        # the CLI prints the status and exits non-zero
        for args in (
            ("volume", "create", "../etc", "--size", "1M"),
            ("volume", "create", "ok", "--type", "nfs", "--size", "64M", "--fs-type", "btrfs"),
            ("snapshot", "delete", "nope"),
        ):
            result = node.cli(*args, check=False)
            assert result.returncode == 1, (args, result.stdout, result.stderr)
            assert "INVALID_ARGUMENT" in result.stdout + result.stderr, (args, result.stdout)

        # nothing was made
        assert all_volumes(c) == []
        assert list(c.list_snapshots().snapshots) == []
        assert pool_images(node) == set() and pool_images(node, "snapshots") == set()
        assert mounted_under(node.pool_dir / "mnt") == []
        assert c.capacity().provisioned_bytes == 0

        # publishing: bad node ids and addresses
        vol = nbd_volume(c, "ok", MiB)
        for node_id in ["", "a b", "../n", "n/1", "x" * 200, ".n", "n..1"]:
            expect(Code.INVALID_ARGUMENT, c.publish, vol.id, node_id, "127.0.0.1")
            expect(Code.INVALID_ARGUMENT, c.unpublish, vol.id, node_id)
        for address in ["", "localhost", "127.0.0.1:80", "127.0.0.0/8", "1.2.3", "300.1.1.1"]:
            expect(Code.INVALID_ARGUMENT, c.publish, vol.id, "n1", address)
        expect(Code.INVALID_ARGUMENT, lambda: c.expand_volume(vol.id, 0))
        expect(Code.INVALID_ARGUMENT, lambda: c.expand_volume(vol.id, 64 * TiB + 1))
        expect(Code.INVALID_ARGUMENT, lambda: c.create_snapshot("../s", vol.id))
        out = cli_fails(node, "volume", "publish", "ok", "--node", "a b", "--address", "127.0.0.1")
        assert "INVALID_ARGUMENT" in out
        assert "INVALID_ARGUMENT" in cli_fails(node, "snapshot", "create", "../s", "--volume", "ok")
        assert list(c.get_volume(volume_id=vol.id).published_nodes) == []
        assert c.health().nbd_exports == 0
        assert [v.id for v in all_volumes(c)] == [vol.id]
        assert c.get_volume(volume_id=vol.id).size_bytes == MiB


# -------------------------------------------------------------------- auth


def test_tcp_api_needs_a_token(tmp_path: Path) -> None:
    token = "s3cret-token-" + uuid.uuid4().hex
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("not-the-token-" + uuid.uuid4().hex)

    listen = f"127.0.0.1:{free_port()}"
    node = make_node(tmp_path / "node")
    node.listen = listen
    node.token_file = token_file
    try:
        node.start()
        assert not node.socket.exists()  # the API is on TCP only
        for client in (
            BackendClient(listen, timeout=10),
            BackendClient(listen, token_file=wrong_file, timeout=10),
        ):
            with client:
                assert "bearer token" in expect(Code.UNAUTHENTICATED, client.health)
                expect(Code.UNAUTHENTICATED, client.list_volumes)
                expect(Code.UNAUTHENTICATED, nbd_volume, client, "intruder", MiB)
        # a token in the wrong form is no token either
        with BackendClient(listen, timeout=10) as bare:
            for metadata in ((("authorization", token),), (("authorization", f"Basic {token}"),)):
                err = rpc_error(bare.stub.Health, pb.HealthRequest(), metadata=metadata, timeout=10)
                assert err.code() == Code.UNAUTHENTICATED
        with node.client() as c:
            assert c.health().ok
            assert all_volumes(c) == []  # the intruder made nothing
            vol = nbd_volume(c, "mine", MiB)
            assert c.get_volume(name="mine").id == vol.id

        # the CLI: refused without the token, fine with it
        env = dict(os.environ, MOORAGE_BACKEND=listen, COLUMNS="200")
        base = [sys.executable, "-m", "moorage", "volume"]
        denied = subprocess.run(
            [*base, "list", "--json"], capture_output=True, text=True, cwd=REPO, env=env, timeout=60
        )
        assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stdout + denied.stderr
        allowed = subprocess.run(
            [*base, "--token-file", str(token_file), "list", "--json"],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=60,
        )
        assert allowed.returncode == 0, allowed.stdout + allowed.stderr
        assert [v["name"] for v in json.loads(allowed.stdout)] == ["mine"]
        assert node.stop() == 0

        # on TCP without a token (or client certificates) the daemon refuses to start
        node.token_file = None
        refused = subprocess.run(node.argv(), capture_output=True, text=True, cwd=REPO, timeout=120)
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0
        assert "needs --token-file or client certificates" in said
        assert "Traceback" not in said, said
        assert "reconciled" not in said and "ganesha" not in said, said  # nothing was started
    finally:
        node.teardown()


def test_the_api_on_a_unix_socket_and_tcp_at_once(tmp_path: Path) -> None:
    """``--listen`` twice: the operator's local socket beside TCP for the plugins,
    one API behind both, the token asked on each."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-" + uuid.uuid4().hex + "\n")
    token_file.chmod(0o600)
    tcp = f"127.0.0.1:{free_port()}"
    node = make_node(tmp_path / "node")
    node.also_listen = tcp
    node.token_file = token_file
    try:
        node.start()
        assert stat.S_IMODE(node.socket.stat().st_mode) == 0o600
        with BackendClient(tcp, token_file=token_file, timeout=10) as over_tcp:
            made = nbd_volume(over_tcp, "seen-on-both", MiB)
        with node.client() as local:  # the unix socket, with the token
            assert local.get_volume(name="seen-on-both").id == made.id
        with BackendClient(node.address, timeout=10) as bare:
            expect(Code.UNAUTHENTICATED, bare.list_volumes)
        assert node.stop() == 0

        # a second address that is not one is refused before anything starts
        node.also_listen = "no-port-here"
        refused = subprocess.run(node.argv(), capture_output=True, text=True, cwd=REPO, timeout=120)
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0 and "--listen 'no-port-here' is not HOST:PORT" in said, said
        assert "Traceback" not in said and "ganesha" not in said, said
    finally:
        node.teardown()


def test_an_nfs_volume_is_given_to_a_group_on_the_storage_node(
    node: BackendNode, tmp_path: Path
) -> None:
    """SetVolumeGroup (a pod's fsGroup, asked by the node plugin): every file of the
    export to the group, group-writable, directories setgid, links never followed."""
    outside = tmp_path / "outside"
    outside.write_text("not the volume's\n")
    before = outside.stat()
    with node.client() as c:
        vol = nfs_volume(c, "grouped", 300 * MiB)
        export = node.pool_dir / "mnt" / vol.id / "export"
        (export / "dir" / "deeper").mkdir(parents=True)
        (export / "dir" / "deeper" / "file").write_text("data\n")
        (export / "file").write_text("data\n")
        os.chmod(export / "file", 0o4700)  # setuid: never kept by a group change
        (export / "link").symlink_to(outside)
        (export / "dir" / "dirlink").symlink_to(tmp_path)

        shown = c.set_volume_group(vol.id, 4321)
        assert shown.id == vol.id
        for path in (export, export / "dir", export / "dir" / "deeper"):
            st = path.stat()
            assert st.st_gid == 4321 and st.st_mode & 0o2070 == 0o2070, (path, oct(st.st_mode))
        for path in (export / "file", export / "dir" / "deeper" / "file"):
            st = path.stat()
            assert st.st_gid == 4321 and st.st_mode & 0o060 == 0o060, (path, oct(st.st_mode))
        assert not (export / "file").stat().st_mode & stat.S_ISUID
        assert (export / "link").lstat().st_gid == 4321  # the link itself
        after = outside.stat()  # not what it points at
        assert (after.st_gid, after.st_mode) == (before.st_gid, before.st_mode)
        assert tmp_path.stat().st_gid != 4321

        # the root already belongs to the group: nothing is walked again
        (export / "later").write_text("made after\n")
        os.chmod(export / "later", 0o600)
        c.set_volume_group(vol.id, 4321)
        assert stat.S_IMODE((export / "later").stat().st_mode) == 0o600

        nbd = nbd_volume(c, "a-block-volume", MiB)
        assert "block volume" in expect(Code.INVALID_ARGUMENT, c.set_volume_group, nbd.id, 4321)
        too_big = 2**32 - 1  # (gid_t)-1: "no change" to chown
        assert "out of range" in expect(Code.INVALID_ARGUMENT, c.set_volume_group, vol.id, too_big)
        expect(Code.NOT_FOUND, c.set_volume_group, "0" * 32, 4321)
        expect(Code.INVALID_ARGUMENT, c.set_volume_group, "not-an-id", 4321)
