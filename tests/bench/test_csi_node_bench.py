"""The node plugin's overhead: stage + publish through the socket vs the same steps by hand.

Run with ``make bench``.  One storage node (loop pool) and one plugin in
``--mode all``.  For each round a fresh volume is created and published to
the node through the controller (not timed); then, timed:

- **nbd + ext4, 1 GiB**: ``NodeStageVolume`` + ``NodePublishVolume`` on the
  socket, vs by hand on the same kind of volume: attach the export through
  the FUSE block file + loop device (``csi.attach.attach_block``, as
  ``moorage attach nbd`` does), ``mkfs.ext4``, ``mount``, ``mount --bind``.
  Then ``NodeUnpublishVolume`` + ``NodeUnstageVolume`` vs ``umount`` x2 +
  detach.
- **nfs**: stage + publish vs a bare FUSE NFS mount
  (``csi.attach.mount_nfs_export``) + ``mount --bind``; and back.

Three rounds each, alternating; the median of each is printed with the
ratio plugin/by-hand (lower is better).  Nothing is asserted about speed.
"""

from __future__ import annotations

import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from csi import attach, mounts
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from tests.backend_node import BackendNode, make_node
from tests.csi_plugin import CsiPlugin, write_config

pytestmark = [pytest.mark.bench, pytest.mark.timeout(1800)]

MiB = 1 << 20
ROUNDS = 3
Mode = pb.VolumeCapability.AccessMode


def cap(kind: str) -> pb.VolumeCapability:
    if kind == "nbd":
        return pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
            access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER),
        )
    return pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(),
        access_mode=Mode(mode=Mode.MULTI_NODE_MULTI_WRITER),
    )


class Site:
    def __init__(self, node: BackendNode, plugin: CsiPlugin, root: Path) -> None:
        self.node, self.plugin, self.root = node, plugin, root
        self.channel = grpc.insecure_channel(plugin.endpoint)
        self.controller = pb_grpc.ControllerStub(self.channel)  # type: ignore[no-untyped-call]
        self.nodes = pb_grpc.NodeStub(self.channel)  # type: ignore[no-untyped-call]
        self.node_id = self.nodes.NodeGetInfo(pb.NodeGetInfoRequest()).node_id

    def volume(self, kind: str, size: int) -> tuple[str, dict[str, str], dict[str, str]]:
        vol = self.controller.CreateVolume(
            pb.CreateVolumeRequest(
                name=f"bench-{uuid.uuid4().hex[:12]}",
                capacity_range=pb.CapacityRange(required_bytes=size),
                volume_capabilities=[cap(kind)],
                parameters={"type": kind},
            )
        ).volume
        ctx = self.controller.ControllerPublishVolume(
            pb.ControllerPublishVolumeRequest(
                volume_id=vol.volume_id, node_id=self.node_id, volume_capability=cap(kind)
            )
        ).publish_context
        return vol.volume_id, dict(ctx), dict(vol.volume_context)

    def drop(self, volume_id: str) -> None:
        self.controller.ControllerUnpublishVolume(
            pb.ControllerUnpublishVolumeRequest(volume_id=volume_id, node_id=self.node_id)
        )
        self.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume_id))


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    node = make_node(tmp_path / "sn")
    plugin = None
    try:
        node.start()
        config = write_config(tmp_path / "csi.toml", [{"name": "sn-a", "address": node.address}])
        plugin = CsiPlugin(
            tmp_path, "all", config, node_id="bench", extra_args=["--kubelet-dir", str(tmp_path)]
        ).start()
        yield Site(node, plugin, tmp_path)
    finally:
        if plugin is not None:
            plugin.stop()
        node.teardown()


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=600)


def through_plugin(site: Site, kind: str, size: int, n: int) -> tuple[float, float]:
    volume_id, ctx, context = site.volume(kind, size)
    staging = site.root / f"plugin-{n}" / "globalmount"
    target = site.root / f"plugin-{n}" / "pod"
    staging.mkdir(parents=True)

    def up() -> None:
        site.nodes.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=volume_id,
                publish_context=ctx,
                staging_target_path=str(staging),
                volume_capability=cap(kind),
                volume_context=context,
            )
        )
        site.nodes.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=volume_id,
                publish_context=ctx,
                staging_target_path=str(staging),
                target_path=str(target),
                volume_capability=cap(kind),
                volume_context=context,
            )
        )

    def down() -> None:
        site.nodes.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target))
        )
        site.nodes.NodeUnstageVolume(
            pb.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=str(staging))
        )

    try:
        t_up = timed(up)
        (target / "probe").write_text("ok\n")
        t_down = timed(down)
    finally:
        site.drop(volume_id)
    return t_up, t_down


def by_hand(site: Site, kind: str, size: int, n: int) -> tuple[float, float]:
    volume_id, ctx, _ = site.volume(kind, size)
    staging = site.root / f"hand-{n}" / "globalmount"
    target = site.root / f"hand-{n}" / "pod"
    staging.mkdir(parents=True)
    target.mkdir(parents=True)
    state = site.root / f"hand-{n}" / "attach"
    plan = attach.probe()
    uri = f"nbd://{ctx.get('host')}:{ctx.get('port')}/{ctx.get('exportName')}"
    device = ""

    def up() -> None:
        nonlocal device
        if kind == "nbd":
            device = attach.attach_block(uri, state, plan)
            run(["mkfs.ext4", "-q", "-m", "0", "-E", "nodiscard", device])
            run(["mount", "-t", "ext4", device, str(staging)])
        else:
            attach.mount_nfs_export(
                ctx["server"], int(ctx["port"]), int(ctx["mountPort"]), ctx["exportPath"],
                staging, plan,
            )  # fmt: skip
        run(["mount", "--bind", str(staging), str(target)])

    def down() -> None:
        run(["umount", str(target)])
        run(["umount", str(staging)])
        if kind == "nbd":
            attach.detach_block(uri, state)

    try:
        t_up = timed(up)
        (target / "probe").write_text("ok\n")
        t_down = timed(down)
    finally:
        for path in (target, staging):
            mounts.unmount(path)
        if kind == "nbd":
            attach.detach_block(uri, state)
        site.drop(volume_id)
    return t_up, t_down


@pytest.mark.parametrize(("kind", "size"), [("nbd", 1 << 30), ("nfs", 64 * MiB)])
def test_stage_and_publish_vs_by_hand(site: Site, kind: str, size: int) -> None:
    plugin: list[tuple[float, float]] = []
    hand: list[tuple[float, float]] = []
    for n in range(ROUNDS):
        plugin.append(through_plugin(site, kind, size, n))
        hand.append(by_hand(site, kind, size, n))
    p_up = statistics.median(t for t, _ in plugin)
    h_up = statistics.median(t for t, _ in hand)
    p_down = statistics.median(t for _, t in plugin)
    h_down = statistics.median(t for _, t in hand)
    label = "nbd + ext4, 1 GiB" if kind == "nbd" else "nfs (FUSE NFS mount)"
    print(f"\n### {label}, median of {ROUNDS}\n")
    print("| step | plugin (s) | by hand (s) | plugin/by hand |\n|---|--:|--:|--:|")
    print(f"| stage + publish | {p_up:.3f} | {h_up:.3f} | {p_up / h_up:.2f}x |")
    print(f"| unpublish + unstage | {p_down:.3f} | {h_down:.3f} | {p_down / h_down:.2f}x |")
