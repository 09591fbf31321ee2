"""ControllerPublishVolume opens a volume to the node it names, and to no other.

The storage node runs in its own network namespace with two client
namespaces beside it (``tests/access_site.py``); the CSI
controller publishes to node A by the node id node A's plugin would report
(``NAME@ADDRESS``), and the real clients (nbdinfo, libnfs's nfs-ls) are run
from A and from B.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from tests.access_site import (
    A_IP,
    B_IP,
    NBD_NO_EXPORT,
    NFS_MOUNT_REFUSED,
    Site,
    refused,
    site_fixture,  # noqa: F401  (the module-scoped site)
    succeeds,
)
from tests.csi_plugin import CsiPlugin, write_config

Mode = pb.VolumeCapability.AccessMode
NODE_A = f"node-a@{A_IP}"
NODE_B = f"node-b@{B_IP}"


@pytest.fixture(scope="module")
def controller(site: Site) -> Iterator[pb_grpc.ControllerStub]:
    root = site.scratch / "csi"
    config = write_config(
        root.with_suffix(".toml"), [{"name": "sn-a", "address": site.node.address}]
    )
    plugin = CsiPlugin(root, "controller", config).start()
    try:
        with grpc.insecure_channel(plugin.endpoint) as channel:
            yield pb_grpc.ControllerStub(channel)  # type: ignore[no-untyped-call]
    finally:
        plugin.stop()


def create_and_publish(
    stub: pb_grpc.ControllerStub, name: str, kind: str, mode: pb.VolumeCapability.AccessMode.Mode
) -> tuple[str, dict[str, str]]:
    cap = pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(), access_mode=Mode(mode=mode))
    vol = stub.CreateVolume(
        pb.CreateVolumeRequest(
            name=name,
            capacity_range=pb.CapacityRange(required_bytes=64 << 20),
            volume_capabilities=[cap],
            parameters={"type": kind},
        )
    ).volume
    req = pb.ControllerPublishVolumeRequest(
        volume_id=vol.volume_id, node_id=NODE_A, volume_capability=cap
    )
    context = dict(stub.ControllerPublishVolume(req).publish_context)
    return vol.volume_id, context


def unpublish(stub: pb_grpc.ControllerStub, volume_id: str) -> None:
    stub.ControllerUnpublishVolume(
        pb.ControllerUnpublishVolumeRequest(volume_id=volume_id, node_id=NODE_A)
    )


def test_nbd_volume_published_to_a_is_refused_to_b(
    site: Site, controller: pb_grpc.ControllerStub
) -> None:
    vid, ctx = create_and_publish(controller, "csi-access-nbd", "nbd", Mode.SINGLE_NODE_WRITER)
    uri = f"nbd://{ctx['host']}:{ctx['port']}/{ctx['exportName']}"
    assert int(succeeds(site.a, "nbdinfo", "--size", uri)) == 64 << 20
    refused(site.b, NBD_NO_EXPORT, "nbdinfo", "--size", uri)
    unpublish(controller, vid)
    refused(site.a, NBD_NO_EXPORT, "nbdinfo", "--size", uri)


def test_nfs_volume_published_to_a_is_refused_to_b(
    site: Site, controller: pb_grpc.ControllerStub
) -> None:
    vid, ctx = create_and_publish(controller, "csi-access-nfs", "nfs", Mode.MULTI_NODE_MULTI_WRITER)
    url = (
        f"nfs://{ctx['server']}{ctx['exportPath']}?nfsport={ctx['port']}"
        f"&mountport={ctx['mountPort']}&version=3"
    )
    succeeds(site.a, "nfs-ls", url)
    refused(site.b, NFS_MOUNT_REFUSED, "nfs-ls", url)
    unpublish(controller, vid)
    refused(site.a, NFS_MOUNT_REFUSED, "nfs-ls", url)
