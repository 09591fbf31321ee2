"""The site of the CSI node tests, shared by the modules that use it: a storage
node (a new one on a loop pool, or the one ``MOORAGE_TEST_STORAGE_NODE`` names:
the kernel lane's guest runs these tests against the host's), the plugin in
``--mode all`` over its unix socket, kubelet's paths under a temporary root,
and the steps kubelet takes (create and publish, stage, publish into a pod,
tear down), each a protobuf message spelled out field by field.

``site`` is a module-scoped fixture (``site_fixture``): a module imports it to share
one plugin among its tests; its teardown checks that nothing is left mounted under its root.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from csi import attach, mounts
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from tests.backend_node import (
    BackendNode,
    RemoteNode,
    plugin_entry,
    storage_node,
    this_node_address,
)
from tests.csi_plugin import CsiPlugin, Kubelet, write_config

Mode = pb.VolumeCapability.AccessMode
MIB = 1 << 20


@dataclass
class Site:
    node: BackendNode | RemoteNode
    plugin: CsiPlugin
    controller: pb_grpc.ControllerStub
    nodes: pb_grpc.NodeStub
    kubelet: Kubelet
    state_dir: Path

    @property
    def root(self) -> Path:
        """The site's directory (kubelet's root is ROOT/kubelet)."""
        return self.kubelet.root.parent

    def restart(self) -> None:
        """The plugin stopped and started again on the same state."""
        self.plugin.stop()
        self.plugin.start()

    @property
    def local_node(self) -> BackendNode:
        """The storage node, for a test that stops and starts it: one this test runs."""
        assert isinstance(self.node, BackendNode), "this test stops its own storage node"
        return self.node

    def plugin_plan_nfs(self) -> str | None:
        """The NFS path this host's plugin uses (the same probe it runs)."""
        return attach.probe().nfs


@contextlib.contextmanager
def open_site(root: Path, node_config: str = "") -> Iterator[Site]:
    """The storage node and the plugin under ``root``; nothing left mounted after.
    ``node_config``: TOML appended to the plugin's configuration (its ``[node]`` table)."""
    with contextlib.ExitStack() as stack:
        node = stack.enter_context(storage_node(root / "sn"))
        config = write_config(root / "csi.toml", [plugin_entry(node, "sn-a")], node_config)
        state_dir = root / "state"
        plugin = CsiPlugin(
            root,
            "all",
            config,
            node_id="worker-1",
            node_address=this_node_address(),
            extra_args=["--state-dir", str(state_dir)],
        )
        stack.callback(plugin.stop)
        plugin.start()
        with plugin.channel() as channel:
            yield Site(
                node,
                plugin,
                pb_grpc.ControllerStub(channel),  # type: ignore[no-untyped-call]
                pb_grpc.NodeStub(channel),  # type: ignore[no-untyped-call]
                Kubelet(root / "kubelet"),
                state_dir,
            )
    leftover_mounts = [e.mount_point for e in mounts.mount_entries() if str(root) in e.mount_point]
    assert not leftover_mounts, leftover_mounts


@pytest.fixture(scope="module", name="site")
def site_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with open_site(tmp_path_factory.mktemp("csi-node")) as opened:
        yield opened


def mount_cap(mode: pb.VolumeCapability.AccessMode.Mode, fs: str = "") -> pb.VolumeCapability:
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(fs_type=fs), access_mode=Mode(mode=mode)
    )


def block_cap(mode: pb.VolumeCapability.AccessMode.Mode) -> pb.VolumeCapability:
    return pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(), access_mode=Mode(mode=mode))


def mounted_at(path: Path) -> int:
    return sum(1 for e in mounts.mount_entries() if e.mount_point == str(path))


def create_publish(
    site: Site,
    kind: str,
    cap: pb.VolumeCapability,
    size: int,
    content: pb.VolumeContentSource | None = None,
) -> tuple[pb.Volume, dict[str, str], str]:
    info = site.nodes.NodeGetInfo(pb.NodeGetInfoRequest())
    vol = site.controller.CreateVolume(
        pb.CreateVolumeRequest(
            name=f"pvc-{uuid.uuid4()}",
            capacity_range=pb.CapacityRange(required_bytes=size),
            volume_capabilities=[cap],
            parameters={"type": kind},
            volume_content_source=content,
        )
    ).volume
    ctx = site.controller.ControllerPublishVolume(
        pb.ControllerPublishVolumeRequest(
            volume_id=vol.volume_id, node_id=info.node_id, volume_capability=cap
        )
    ).publish_context
    return vol, dict(ctx), info.node_id


@dataclass
class Mounted:
    vol: pb.Volume
    ctx: dict[str, str]
    node_id: str
    cap: pb.VolumeCapability
    staging: Path
    target: Path

    def stage(self, site: Site) -> None:
        self.staging.mkdir(parents=True, exist_ok=True)
        site.nodes.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=self.vol.volume_id,
                publish_context=self.ctx,
                staging_target_path=str(self.staging),
                volume_capability=self.cap,
                volume_context=self.vol.volume_context,
            )
        )

    def publish(self, site: Site) -> None:
        site.nodes.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=self.vol.volume_id,
                publish_context=self.ctx,
                staging_target_path=str(self.staging),
                target_path=str(self.target),
                volume_capability=self.cap,
                volume_context=self.vol.volume_context,
            )
        )

    def controller_expand(self, site: Site, size: int) -> pb.ControllerExpandVolumeResponse:
        response: pb.ControllerExpandVolumeResponse = site.controller.ControllerExpandVolume(
            pb.ControllerExpandVolumeRequest(
                volume_id=self.vol.volume_id,
                capacity_range=pb.CapacityRange(required_bytes=size),
                volume_capability=self.cap,
            )
        )
        return response

    def node_expand(self, site: Site, size: int) -> pb.NodeExpandVolumeResponse:
        """kubelet's NodeExpandVolume while the pod runs: the filesystem stays mounted."""
        response: pb.NodeExpandVolumeResponse = site.nodes.NodeExpandVolume(
            pb.NodeExpandVolumeRequest(
                volume_id=self.vol.volume_id,
                volume_path=str(self.target),
                capacity_range=pb.CapacityRange(required_bytes=size),
                staging_target_path=str(self.staging),
                volume_capability=self.cap,
            )
        )
        return response

    def stats(self, site: Site) -> pb.NodeGetVolumeStatsResponse:
        response: pb.NodeGetVolumeStatsResponse = site.nodes.NodeGetVolumeStats(
            pb.NodeGetVolumeStatsRequest(volume_id=self.vol.volume_id, volume_path=str(self.target))
        )
        return response

    def teardown(self, site: Site) -> None:
        handle = self.vol.volume_id
        with contextlib.suppress(grpc.RpcError):
            site.nodes.NodeUnpublishVolume(
                pb.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(self.target))
            )
        with contextlib.suppress(grpc.RpcError):
            site.nodes.NodeUnstageVolume(
                pb.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(self.staging))
            )
        site.controller.ControllerUnpublishVolume(
            pb.ControllerUnpublishVolumeRequest(volume_id=handle, node_id=self.node_id)
        )
        site.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=handle))


def made(
    site: Site,
    kind: str,
    cap: pb.VolumeCapability,
    size: int,
    content: pb.VolumeContentSource | None = None,
) -> Mounted:
    """A volume made (from ``content`` when given) and published to this node, with
    kubelet's staging path and a new pod's target for it; neither staged nor
    published yet (so a test can tear it down whatever staging does)."""
    vol, ctx, node_id = create_publish(site, kind, cap, size, content)
    pod = str(uuid.uuid4())
    return Mounted(
        vol,
        ctx,
        node_id,
        cap,
        site.kubelet.global_mount(vol.volume_id),
        site.kubelet.pod_target(pod, f"pv-{pod[:8]}"),
    )


def mounted(
    site: Site,
    kind: str,
    cap: pb.VolumeCapability,
    size: int,
    content: pb.VolumeContentSource | None = None,
) -> Mounted:
    """A volume made (from ``content`` when given), staged and published into a pod."""
    m = made(site, kind, cap, size, content)
    m.stage(site)
    m.publish(site)
    return m


def nbd_uri_of(ctx: Mapping[str, str]) -> str:
    return f"nbd://{ctx['host']}:{ctx['port']}/{ctx['exportName']}"
