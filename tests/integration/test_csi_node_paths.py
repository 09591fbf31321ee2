"""The node plugin touches only what it made, records only what it checked,
and says so when its own records cannot be read.

A real storage node on a loop pool and the plugin in ``--mode all`` with
``--kubelet-dir`` under the test's directory; the block path is the FUSE
block file + loop device.  Foreign things are real: files, directories and
tmpfs mounts inside kubelet's directory and outside it, ``/`` and ``/etc``.
Nothing here stalls a FUSE mount: the storage node stays up throughout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from csi import mounts, stage
from csi.nodestate import NodeState, StagedVolume
from csi.proto import csi_pb2 as pb
from tests.csi_site import Site, site_fixture  # noqa: F401  (the module-scoped site)

Mode = pb.VolumeCapability.AccessMode
MIB = 1 << 20
CALL = 120  # seconds: the bound on every call, never reached when things work
CAP = pb.VolumeCapability(
    mount=pb.VolumeCapability.MountVolume(fs_type="ext4"),
    access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER),
)
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


@contextlib.contextmanager
def tmpfs(path: Path) -> Iterator[Path]:
    """A tmpfs of nobody's on ``path``, with a file in it; unmounted after, whatever happened."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "foreign", str(path)], check=True, timeout=30
    )
    try:
        (path / "keep").write_text("in a foreign tmpfs\n")
        yield path
    finally:
        if mounts.mount_entry(path) is not None:
            subprocess.run(["umount", "-l", str(path)], check=True, timeout=30)


def mount_ids() -> set[int]:
    return {e.mount_id for e in mounts.mount_entries()}


def code_of(call: Callable[..., object], request: object) -> grpc.StatusCode:
    """The status code of one call (OK when it succeeds)."""
    try:
        call(request, timeout=CALL)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@dataclass
class Volume:
    """A real nbd volume, published to this node by the controller."""

    site: Site
    vol: pb.Volume
    ctx: dict[str, str]
    node_id: str

    @property
    def id(self) -> str:
        return self.vol.volume_id

    @property
    def staging(self) -> Path:
        return self.site.kubelet.global_mount(self.id)

    def stage_request(self, staging: str, ctx: dict[str, str] | None = None) -> object:
        return pb.NodeStageVolumeRequest(
            volume_id=self.id,
            publish_context=self.ctx if ctx is None else ctx,
            staging_target_path=staging,
            volume_capability=CAP,
            volume_context=self.vol.volume_context,
        )

    def stage(self) -> None:
        self.staging.mkdir(parents=True, exist_ok=True)
        self.site.nodes.NodeStageVolume(self.stage_request(str(self.staging)), timeout=CALL)

    def publish(self, target: Path) -> None:
        self.site.nodes.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=self.id,
                publish_context=self.ctx,
                staging_target_path=str(self.staging),
                target_path=str(target),
                volume_capability=CAP,
                volume_context=self.vol.volume_context,
            ),
            timeout=CALL,
        )

    def teardown(self, *targets: Path) -> None:
        nodes = self.site.nodes
        for target in targets:
            with contextlib.suppress(grpc.RpcError):
                nodes.NodeUnpublishVolume(
                    pb.NodeUnpublishVolumeRequest(volume_id=self.id, target_path=str(target)),
                    timeout=CALL,
                )
        with contextlib.suppress(grpc.RpcError):
            nodes.NodeUnstageVolume(
                pb.NodeUnstageVolumeRequest(
                    volume_id=self.id, staging_target_path=str(self.staging)
                ),
                timeout=CALL,
            )
        self.site.controller.ControllerUnpublishVolume(
            pb.ControllerUnpublishVolumeRequest(volume_id=self.id, node_id=self.node_id),
            timeout=CALL,
        )
        self.site.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=self.id), timeout=CALL)


def new_volume(site: Site) -> Volume:
    info = site.nodes.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=CALL)
    vol = site.controller.CreateVolume(
        pb.CreateVolumeRequest(
            name=f"pvc-{uuid.uuid4()}",
            capacity_range=pb.CapacityRange(required_bytes=64 * MIB),
            volume_capabilities=[CAP],
            parameters={"type": "nbd"},
        ),
        timeout=CALL,
    ).volume
    ctx = site.controller.ControllerPublishVolume(
        pb.ControllerPublishVolumeRequest(
            volume_id=vol.volume_id, node_id=info.node_id, volume_capability=CAP
        ),
        timeout=CALL,
    ).publish_context
    return Volume(site, vol, dict(ctx), info.node_id)


def record_file(site: Site, volume_id: str) -> Path:
    return (
        site.state_dir / "volumes" / f"{hashlib.sha256(volume_id.encode()).hexdigest()[:32]}.json"
    )


def recorded_ids(site: Site) -> list[str]:
    return [
        json.loads(p.read_text())["volume_id"] for p in (site.state_dir / "volumes").glob("*.json")
    ]


def test_unpublish_and_unstage_leave_what_they_did_not_make(site: Site) -> None:
    k = site.kubelet.root
    pod = k / "pods" / str(uuid.uuid4()) / "volumes/kubernetes.io~csi"
    outside = site.root / "outside"
    outside.mkdir(exist_ok=True)
    volume = new_volume(site)
    target = site.kubelet.pod_target(str(uuid.uuid4()), "pv-real")
    file_inside, dir_inside, link = pod / "file/mount", pod / "dir/mount", pod / "link/mount"
    file_outside = outside / "file"
    try:
        volume.stage()
        volume.publish(target)
        (target / "mine").write_text("the real volume's\n")
        file_inside.parent.mkdir(parents=True)
        file_inside.write_text("a file kubelet's tree holds\n")
        (dir_inside / "keep").parent.mkdir(parents=True)
        (dir_inside / "keep").write_text("in a directory\n")
        file_outside.write_text("outside kubelet's directory\n")
        with tmpfs(pod / "tmpfs/mount") as tmpfs_inside, tmpfs(outside / "tmpfs") as tmpfs_out:
            link.parent.mkdir(parents=True)
            link.symlink_to(tmpfs_out)
            expected = {
                file_inside: NOT_FOUND,
                dir_inside: NOT_FOUND,
                tmpfs_inside: NOT_FOUND,
                file_outside: INVALID,
                tmpfs_out: INVALID,
                link: INVALID,  # inside, but it leads outside
                Path("/"): INVALID,
                Path("/etc"): INVALID,
                k: INVALID,  # kubelet's directory itself
            }
            before = mount_ids()
            for volume_id in ("not-a-volume", volume.id):
                for path, code in expected.items():
                    unpublish = pb.NodeUnpublishVolumeRequest(
                        volume_id=volume_id, target_path=str(path)
                    )
                    unstage = pb.NodeUnstageVolumeRequest(
                        volume_id=volume_id, staging_target_path=str(path)
                    )
                    assert code_of(site.nodes.NodeUnpublishVolume, unpublish) == code, path
                    assert code_of(site.nodes.NodeUnstageVolume, unstage) == code, path
            # nothing was mounted or unmounted, nothing removed
            assert mount_ids() == before
            assert file_inside.read_text() == "a file kubelet's tree holds\n"
            assert (dir_inside / "keep").read_text() == "in a directory\n"
            assert file_outside.read_text() == "outside kubelet's directory\n"
            for fs in (tmpfs_inside, tmpfs_out):
                assert (fs / "keep").read_text() == "in a foreign tmpfs\n"
            assert link.is_symlink()
            assert (target / "mine").read_text() == "the real volume's\n"
        # a target never made, and one already unpublished, are success (kubelet retries)
        never = pb.NodeUnpublishVolumeRequest(volume_id=volume.id, target_path=str(pod / "x/mount"))
        assert code_of(site.nodes.NodeUnpublishVolume, never) == grpc.StatusCode.OK
    finally:
        volume.teardown(target)


def test_a_refused_stage_records_nothing_even_across_a_restart(site: Site) -> None:
    volume = new_volume(site)
    no_export = {**volume.ctx, "exportName": "no-such-export"}  # every attach of it fails
    k = site.kubelet.root
    not_a_dir = k / "plugins/kubernetes.io/csi/not-a-directory"
    not_a_dir.parent.mkdir(parents=True, exist_ok=True)
    not_a_dir.write_text("a file\n")
    outside = site.root / "outside-stage"
    outside.mkdir(exist_ok=True)
    try:
        for path in ("/", "/etc", str(outside), "relative/path", str(not_a_dir), str(k)):
            code = code_of(site.nodes.NodeStageVolume, volume.stage_request(path, no_export))
            assert code == INVALID, path
        with tmpfs(k / "plugins/kubernetes.io/csi/foreign/globalmount") as foreign:
            code = code_of(site.nodes.NodeStageVolume, volume.stage_request(str(foreign)))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            assert (foreign / "keep").read_text() == "in a foreign tmpfs\n"
        assert volume.id not in recorded_ids(site)
        # a valid path whose attach fails: no record of a stage that did not happen
        volume.staging.mkdir(parents=True, exist_ok=True)
        code = code_of(
            site.nodes.NodeStageVolume, volume.stage_request(str(volume.staging), no_export)
        )
        assert code not in (grpc.StatusCode.OK, grpc.StatusCode.ALREADY_EXISTS), code
        assert volume.id not in recorded_ids(site)
        seen = len(site.plugin.log_text())
        site.restart()
        assert volume.id not in recorded_ids(site)
        assert volume.id not in site.plugin.log_text()[seen:]  # nothing found at start
        # the volume stages, at its own path, with its real context
        volume.stage()
        assert mounts.mount_entry(volume.staging) is not None
        assert Path("/etc").is_dir() and not_a_dir.read_text() == "a file\n"
    finally:
        volume.teardown()


def test_a_record_of_a_stage_at_root_is_repaired_at_start(site: Site) -> None:
    """What an older plugin recorded for a stage at "/" whose attach failed."""
    volume = new_volume(site)
    uri = stage.nbd_uri(volume.ctx)
    root_mount = mounts.mount_entry("/")
    try:
        site.plugin.stop()
        NodeState(site.state_dir).put(StagedVolume(volume.id, "/", "nbd", "mount", uri=uri))
        site.plugin.start()
        assert not record_file(site, volume.id).exists()
        log = site.plugin.log_text()
        assert f"at start: volume {volume.id}: its record is of a stage at a refused path" in log
        assert "nothing unmounted" in log
        assert mounts.mount_entry("/") == root_mount
        volume.stage()  # not ALREADY_EXISTS "staged at /"
        assert mounts.mount_entry(volume.staging) is not None
    finally:
        volume.teardown()


def test_unstage_at_another_path_leaves_the_staged_volume_mounted(site: Site) -> None:
    volume = new_volume(site)
    other = site.kubelet.global_mount(f"other-{volume.id}")
    other.mkdir(parents=True)
    try:
        volume.stage()
        (volume.staging / "kept").write_text("staged here\n")
        unstage = pb.NodeUnstageVolumeRequest(volume_id=volume.id, staging_target_path=str(other))
        # not staged at that path: success, as the spec says, and nothing done
        assert code_of(site.nodes.NodeUnstageVolume, unstage) == grpc.StatusCode.OK
        assert mounts.mount_entry(volume.staging) is not None
        with tmpfs(other.parent / "busy") as busy:
            unstage.staging_target_path = str(busy)
            assert code_of(site.nodes.NodeUnstageVolume, unstage) == NOT_FOUND
            assert (busy / "keep").read_text() == "in a foreign tmpfs\n"
        unstage.staging_target_path = "/"
        assert code_of(site.nodes.NodeUnstageVolume, unstage) == INVALID
        assert (volume.staging / "kept").read_text() == "staged here\n"
        # its own path unstages it
        unstage.staging_target_path = str(volume.staging)
        assert code_of(site.nodes.NodeUnstageVolume, unstage) == grpc.StatusCode.OK
        assert mounts.mount_entry(volume.staging) is None
    finally:
        volume.teardown()


def test_unreadable_records_are_reported_and_left_as_they_are(site: Site) -> None:
    volume = new_volume(site)
    target = site.kubelet.pod_target(str(uuid.uuid4()), "pv-unreadable")
    node_record = record_file(site, volume.id)
    saved: dict[Path, bytes] = {}
    try:
        volume.stage()
        volume.publish(target)
        (target / "before").write_text("written before\n")
        [attach_record] = [
            p
            for p in (site.state_dir / "attach/fuse-block").glob("*/attachment.json")
            if json.loads(p.read_text())["uri"] == stage.nbd_uri(volume.ctx)
        ]
        saved = {p: p.read_bytes() for p in (node_record, attach_record)}
        site.plugin.stop()
        node_record.write_text("{ damaged")
        attach_record.write_text("[]")
        site.plugin.start()
        log = site.plugin.log_text()
        assert f"at start: node state file {node_record} is unreadable" in log
        assert f"at start: attachment record {attach_record} is unreadable" in log
        stats = pb.NodeGetVolumeStatsRequest(volume_id=volume.id, volume_path=str(target))
        condition = site.nodes.NodeGetVolumeStats(stats, timeout=CALL).volume_condition
        assert condition.abnormal and str(node_record) in condition.message, condition
        # what the record describes is left as it is: unpublish refuses, the pod works on
        unpublish = pb.NodeUnpublishVolumeRequest(volume_id=volume.id, target_path=str(target))
        assert code_of(site.nodes.NodeUnpublishVolume, unpublish) == (
            grpc.StatusCode.FAILED_PRECONDITION
        )
        assert mounts.mount_entry(target) is not None
        (target / "after").write_text("written after\n")
        os.sync()
        # the node record repaired: the attachment record is what is wrong now
        node_record.write_bytes(saved[node_record])
        condition = site.nodes.NodeGetVolumeStats(stats, timeout=CALL).volume_condition
        assert condition.abnormal and str(attach_record) in condition.message, condition
        assert (target / "before").read_text() == "written before\n"
    finally:
        for path, data in saved.items():
            path.write_bytes(data)
        volume.teardown(target)
