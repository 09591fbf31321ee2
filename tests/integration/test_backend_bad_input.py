"""No bad request can destroy, corrupt or wedge a storage node's data (issue 17).

Against one real ``moorage backend serve`` for the module: a publish to an
address that ganesha's model, the NBD export table or plain sense refuses is
refused before anything is recorded (the volume stays deletable and
publishable elsewhere, and the node restarts clean); a publication row an older
version wrote with such an address does not stop the node from starting and
can be unpublished; request bytes that are no protobuf message, and inputs too
large to echo, get INVALID_ARGUMENT.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any, cast

import grpc
import pytest

from backend.api.proto import backend_pb2 as pb
from backend.catalog.db import Catalog, record_operation
from backend.catalog.models import OperationKind, Publication, PublicationState
from tests.backend_node import BackendNode, make_node

MiB = 1 << 20
Code = grpc.StatusCode
GOOD_ADDRESS = "127.0.0.1"

# Every kind of address issue 17 names: none is one node's address.
BAD_ADDRESSES = {
    "unspecified-v4": "0.0.0.0",
    "unspecified-v6": "::",
    "zone": "fe80::1%eth0",
    "ipv4-mapped": "::ffff:10.77.0.12",
    "broadcast": "255.255.255.255",
    "multicast-v4": "224.0.0.1",
    "multicast-v6": "ff02::1",
    "quote": '10.0.0.1"',
    "semicolon": "10.0.0.1;",
    "brace": "10.0.0.1}",
    "space": "10.0.0.1 1",
    "newline": "10.0.0.1\n",
    "control": "10.0.0.1\x01",
}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendNode]:
    """One storage node for the module; torn down (daemon, ganesha, pool) whatever happens."""
    n = make_node(tmp_path_factory.mktemp("bad-input") / "node")
    try:
        n.start()
        yield n
    finally:
        n.teardown()


def running(node: BackendNode) -> BackendNode:
    """The node, started again if a failed test left it stopped."""
    if node.proc is None or node.proc.poll() is not None:
        node.start()
    return node


def expect(code: grpc.StatusCode, fn: Callable[..., object], *args: Any) -> str:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)
    err = cast(grpc.Call, info.value)
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    return err.details() or ""


def new_volume(node: BackendNode, kind: pb.VolumeType, prefix: str) -> pb.Volume:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    size = 64 * MiB if kind == pb.NFS else 16 * MiB
    with node.client() as c:
        return c.create_volume(pb.CreateVolumeRequest(name=name, type=kind, size_bytes=size))


def publications(node: BackendNode, volume_id: str) -> list[tuple[str, str]]:
    with node.client() as c:
        v = c.get_volume(volume_id=volume_id)
    return [(p.node_id, p.node_address) for p in v.publications]


def pending_operations(node: BackendNode) -> list[str]:
    """Journal entries still pending, read through the catalog file (the daemon
    writes each one in its own committed transaction)."""
    from backend.catalog.db import pending_operations as pending

    catalog = Catalog.for_data_dir(node.data_dir)
    try:
        with catalog.session() as s:
            return [f"{o.kind.value} {o.target_id}" for o in pending(s)]
    finally:
        catalog.dispose()


# ------------------------------------------------------------ bad addresses


def test_a_publish_to_a_bad_address_is_refused_and_records_nothing(node: BackendNode) -> None:
    node = running(node)
    volumes = [new_volume(node, pb.NBD, "bad-nbd"), new_volume(node, pb.NFS, "bad-nfs")]
    with node.client() as c:
        for case, bad in BAD_ADDRESSES.items():
            for v in volumes:
                with pytest.raises(grpc.RpcError) as info:
                    c.publish(v.id, "n1", bad)
                    pytest.fail(f"{case}: publishing to {bad!r} succeeded")
                err = cast(grpc.Call, info.value)
                assert err.code() == Code.INVALID_ARGUMENT, (case, err.code(), err.details())
                details = err.details() or ""
                assert "\n" not in details and len(details) < 300, (case, details)
                assert publications(node, v.id) == [], case
            assert pending_operations(node) == [], case
            # nothing holds the volumes: published elsewhere (single node, so
            # no leftover publication could share them) and unpublished again
            for v in volumes:
                c.publish(v.id, "n2", GOOD_ADDRESS, single_node=True)
                assert publications(node, v.id) == [("n2", GOOD_ADDRESS)], case
                c.unpublish(v.id, "n2")
        for v in volumes:
            c.delete_volume(v.id)


def test_after_a_refused_publish_the_volume_can_be_deleted(node: BackendNode) -> None:
    node = running(node)
    with node.client() as c:
        for kind in (pb.NBD, pb.NFS):
            v = new_volume(node, kind, "delete")
            expect(Code.INVALID_ARGUMENT, c.publish, v.id, "n1", "0.0.0.0")
            c.delete_volume(v.id)
            expect(Code.NOT_FOUND, c.get_volume, v.id)


def test_names_and_node_ids_are_matched_whole(node: BackendNode) -> None:
    node = running(node)
    v = new_volume(node, pb.NBD, "whole")
    with node.client() as c:
        request = pb.CreateVolumeRequest(name=v.name + "\n", type=pb.NBD, size_bytes=16 * MiB)
        expect(Code.INVALID_ARGUMENT, c.create_volume, request)
        expect(Code.INVALID_ARGUMENT, c.get_volume, "", v.name + "\n")
        details = expect(Code.INVALID_ARGUMENT, c.publish, v.id, "nodeb\n", GOOD_ADDRESS)
        assert "\n" not in details
        assert publications(node, v.id) == []
        c.delete_volume(v.id)


def test_the_cli_refuses_a_bad_address_in_one_line(node: BackendNode) -> None:
    node = running(node)
    v = new_volume(node, pb.NFS, "cli")
    for bad in ("0.0.0.0", "fe80::1%eth0", "::ffff:10.77.0.12", "10.0.0.1;"):
        result = node.cli(
            "volume", "publish", v.name, "--node", "n1", "--address", bad, check=False
        )
        assert result.returncode != 0, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "INVALID_ARGUMENT" in lines[0], result.stderr
    assert publications(node, v.id) == []
    node.cli("volume", "delete", v.name)


def test_after_refused_publishes_the_node_restarts_clean(node: BackendNode) -> None:
    node = running(node)
    v = new_volume(node, pb.NFS, "restart")
    with node.client() as c:
        for bad in BAD_ADDRESSES.values():
            expect(Code.INVALID_ARGUMENT, c.publish, v.id, "n1", bad)
    assert node.stop() == 0, node.log_tail()
    node.start()
    with node.client() as c:
        assert c.get_volume(volume_id=v.id).state == "ready"
        c.publish(v.id, "n1", GOOD_ADDRESS)
        c.unpublish(v.id, "n1")
        c.delete_volume(v.id)


# ------------------------------------------------------ legacy catalog rows


def test_a_legacy_bad_publication_neither_blocks_start_nor_stays_forever(
    node: BackendNode,
) -> None:
    """Rows an older version wrote, before the address rule: a published one
    with the unspecified address, one under a node id with a newline, and a
    publish interrupted half-way (journal pending) to an IPv4-mapped address."""
    node = running(node)
    fs = new_volume(node, pb.NFS, "legacy-nfs")
    blk = new_volume(node, pb.NBD, "legacy-nbd")
    half = new_volume(node, pb.NBD, "legacy-half")
    assert node.stop() == 0, node.log_tail()
    catalog = Catalog.for_data_dir(node.data_dir)
    try:
        with catalog.session() as s:
            for vol_id, node_id, address, state in (
                (fs.id, "legacy-a", "0.0.0.0", PublicationState.PUBLISHED),
                (blk.id, "nodeb\n", "10.0.0.9", PublicationState.PUBLISHED),
                (half.id, "legacy-c", "::ffff:10.0.0.1", PublicationState.PUBLISHING),
            ):
                s.add(
                    Publication(
                        volume_id=vol_id,
                        node_id=node_id,
                        node_address=address,
                        read_only=False,
                        multi_writer=False,
                        state=state,
                    )
                )
            record_operation(s, OperationKind.PUBLISH, half.id, {"node": "legacy-c"})
    finally:
        catalog.dispose()

    node.start()  # the rows are reported, not a reason to stay down
    log = node.log_tail(400)
    assert "legacy-a" in log and "not exported" in log, log
    assert pending_operations(node) == []
    # the interrupted publish never succeeded and never can: withdrawn
    assert publications(node, half.id) == []
    with node.client() as c:
        # the volume with a legacy row can still be published to a good node
        c.publish(fs.id, "n1", GOOD_ADDRESS)
        assert sorted(publications(node, fs.id)) == [
            ("legacy-a", "0.0.0.0"),
            ("n1", GOOD_ADDRESS),
        ]
        # the legacy rows go by their exact node id; an invalid id no row has is refused
        c.unpublish(fs.id, "legacy-a")
        expect(Code.INVALID_ARGUMENT, c.unpublish, blk.id, "nodec\n")
        c.unpublish(blk.id, "nodeb\n")
        assert publications(node, blk.id) == []
        c.unpublish(fs.id, "n1")
        for v in (fs, blk, half):
            c.delete_volume(v.id)
    assert node.stop() == 0, node.log_tail()
    node.start()


# ------------------------------------------------------ undecodable and huge


def test_undecodable_request_bytes_are_invalid_argument(node: BackendNode) -> None:
    node = running(node)
    with grpc.insecure_channel(node.address) as channel:
        for method, garbage in (
            ("CreateVolume", b"\xff" * 7777),
            ("PublishVolume", b"\x0a\x02\xff\xfe"),  # volume_id: not UTF-8
            ("DeleteVolume", b"\x0a\x05ab"),  # truncated
        ):
            call = channel.unary_unary(
                f"/moorage.backend.v1.Backend/{method}",
                request_serializer=bytes,
                response_deserializer=bytes,
            )
            with pytest.raises(grpc.RpcError) as info:
                call(garbage, timeout=60)
            err = cast(grpc.Call, info.value)
            assert err.code() == Code.INVALID_ARGUMENT, (method, err.code(), err.details())
    log = node.log_tail(200)
    assert sum("undecodable request (7777 bytes)" in line for line in log.splitlines()) == 1, log
    assert "Exception deserializing request" not in log
    with node.client() as c:
        assert c.health().ok


def test_a_huge_input_is_invalid_argument_not_resource_exhausted(node: BackendNode) -> None:
    node = running(node)
    huge = "k" * 10_000
    with node.client() as c:
        for request in (
            pb.CreateVolumeRequest(
                name="huge", type=pb.NBD, size_bytes=16 * MiB, parameters={huge: "1"}
            ),
            pb.CreateVolumeRequest(
                name="huge", type=pb.NFS, size_bytes=64 * MiB, parameters={huge: "1"}
            ),
            pb.CreateVolumeRequest(
                name="huge",
                type=pb.NBD,
                size_bytes=16 * MiB,
                parameters={f"{i}{huge}": "1" for i in range(20)},
            ),
            pb.CreateVolumeRequest(
                name="huge", type=pb.NBD, size_bytes=16 * MiB, labels={huge: "v"}
            ),
            pb.CreateVolumeRequest(name=huge, type=pb.NBD, size_bytes=16 * MiB),
        ):
            details = expect(Code.INVALID_ARGUMENT, c.create_volume, request)
            assert len(details) <= 1000, len(details)
        v = new_volume(node, pb.NBD, "huge-modify")
        details = expect(Code.INVALID_ARGUMENT, c.modify_volume, v.id, {huge: "1"})
        assert len(details) <= 1000
        expect(Code.INVALID_ARGUMENT, c.publish, v.id, huge, GOOD_ADDRESS)
        expect(Code.INVALID_ARGUMENT, c.publish, v.id, "n1", huge)
        assert publications(node, v.id) == []
        c.delete_volume(v.id)
        expect(Code.NOT_FOUND, c.get_volume, "", "huge")
