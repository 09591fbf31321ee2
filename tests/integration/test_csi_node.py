"""The CSI node service on kubelet's own paths, under a temporary root.

A real storage node on a loop pool, the plugin in ``--mode all`` over its
unix socket, and the calls kubelet makes, in kubelet's order, on kubelet's
paths (global mount under ``plugins/kubernetes.io/csi/csi.moorage.dev/<sha256
of the volume handle>/globalmount``, pod targets under
``pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount``, raw block under
``plugins/kubernetes.io/csi/volumeDevices/``): Create → ControllerPublish →
Stage → Publish into two pods → write in one, read in the other → Unpublish →
Unstage → ControllerUnpublish → Delete, the mount table checked at each step.
Here the block path is the FUSE block file + loop device and the NFS path the
FUSE NFS mount (this kernel has neither nbd nor an NFS client).

Why this file is long: each test is a sequence of CSI calls in kubelet's order, every
request a protobuf message spelled out field by field; the site they share (a real
storage node, the plugin in ``--mode all``) is ``tests/csi_site.py``'s.

The kernel lane's guest runs this module too, on the kernel paths against the host's
storage node (tests/kernel/test_csi_in_guest.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path

import grpc
import pytest

from csi import attach, mounts
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from tests.backend_node import this_node_address
from tests.csi_plugin import CsiPlugin, Kubelet
from tests.csi_site import (
    MIB,
    Mode,
    Mounted,
    Site,
    block_cap,
    create_publish,
    made,
    mount_cap,
    mounted,
    mounted_at,
    nbd_uri_of,
    site_fixture,  # noqa: F401  (the module-scoped site)
)

CASES = {
    "nbd-ext4": ("nbd", mount_cap(Mode.SINGLE_NODE_WRITER, "ext4"), 64 * MIB),
    "nbd-xfs": ("nbd", mount_cap(Mode.SINGLE_NODE_MULTI_WRITER, "xfs"), 320 * MIB),
    "nbd-raw-block": ("nbd", block_cap(Mode.SINGLE_NODE_WRITER), 16 * MIB),
    "nfs-rwx": ("nfs", mount_cap(Mode.MULTI_NODE_MULTI_WRITER), 64 * MIB),
}


@pytest.mark.parametrize("case", list(CASES))
def test_volume_lifecycle_on_kubelets_paths(site: Site, case: str) -> None:
    kind, cap, size = CASES[case]
    block = cap.WhichOneof("access_type") == "block"
    pv = f"pvc-{uuid.uuid4()}"
    pods = [str(uuid.uuid4()), str(uuid.uuid4())]
    info = site.nodes.NodeGetInfo(pb.NodeGetInfoRequest())
    vol = site.controller.CreateVolume(
        pb.CreateVolumeRequest(
            name=pv,
            capacity_range=pb.CapacityRange(required_bytes=size),
            volume_capabilities=[cap],
            parameters={"type": kind},
        )
    ).volume
    handle = vol.volume_id
    ctx = site.controller.ControllerPublishVolume(
        pb.ControllerPublishVolumeRequest(
            volume_id=handle, node_id=info.node_id, volume_capability=cap
        )
    ).publish_context
    staging = site.kubelet.block_staging(pv) if block else site.kubelet.global_mount(handle)
    staging.mkdir(parents=True, exist_ok=True)  # kubelet makes the staging directory
    targets = [
        site.kubelet.block_target(p, pv) if block else site.kubelet.pod_target(p, pv) for p in pods
    ]
    try:
        check_lifecycle(site, handle, vol, ctx, cap, size, block, staging, pods, targets)
    finally:  # whatever failed, leave nothing mounted or attached for the next case
        for target in targets:
            with contextlib.suppress(grpc.RpcError):
                site.nodes.NodeUnpublishVolume(
                    pb.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(target))
                )
        with contextlib.suppress(grpc.RpcError):
            site.nodes.NodeUnstageVolume(
                pb.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(staging))
            )
        site.controller.ControllerUnpublishVolume(
            pb.ControllerUnpublishVolumeRequest(volume_id=handle, node_id=info.node_id)
        )
        site.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=handle))


def check_lifecycle(
    site: Site,
    handle: str,
    vol: pb.Volume,
    ctx: Mapping[str, str],
    cap: pb.VolumeCapability,
    size: int,
    block: bool,
    staging: Path,
    pods: list[str],
    targets: list[Path],
) -> None:
    stage_req = pb.NodeStageVolumeRequest(
        volume_id=handle,
        publish_context=ctx,
        staging_target_path=str(staging),
        volume_capability=cap,
        volume_context=vol.volume_context,
    )
    site.nodes.NodeStageVolume(stage_req)
    site.nodes.NodeStageVolume(stage_req)  # idempotent
    staged_at = staging / "device" if block else staging
    assert mounted_at(staged_at) == 1

    for pod, target in zip(pods, targets, strict=True):
        req = pb.NodePublishVolumeRequest(
            volume_id=handle,
            publish_context=ctx,
            staging_target_path=str(staging),
            target_path=str(target),
            volume_capability=cap,
            volume_context={
                **vol.volume_context,
                "csi.storage.k8s.io/pod.name": f"app-{pod[:8]}",
                "csi.storage.k8s.io/pod.namespace": "default",
                "csi.storage.k8s.io/pod.uid": pod,
            },
        )
        site.nodes.NodePublishVolume(req)
        site.nodes.NodePublishVolume(req)  # idempotent
        assert mounted_at(target) == 1
    # one global mount, one bind per pod
    assert mounted_at(staged_at) == 1

    payload = os.urandom(64 * 1024)
    if block:
        fd = os.open(targets[0], os.O_WRONLY)
        try:
            os.pwrite(fd, payload, 4 * MIB)
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(targets[1], os.O_RDONLY)
        try:
            assert os.pread(fd, len(payload), 4 * MIB) == payload
        finally:
            os.close(fd)
    else:
        (targets[0] / "written-in-pod-1").write_bytes(payload)
        assert (targets[1] / "written-in-pod-1").read_bytes() == payload

    stats = site.nodes.NodeGetVolumeStats(
        pb.NodeGetVolumeStatsRequest(volume_id=handle, volume_path=str(targets[1]))
    )
    assert not stats.volume_condition.abnormal, stats.volume_condition.message
    total = {u.unit: u.total for u in stats.usage}
    # a filesystem's metadata takes some of a block device; an NFS volume's own
    # filesystem is at least what was asked for (xfs images are 300 MiB or more)
    if block:
        assert total[pb.VolumeUsage.BYTES] == size, stats
    elif vol.volume_context["type"] == "nbd":
        assert size * 8 // 10 <= total[pb.VolumeUsage.BYTES] <= size, stats
    else:
        assert total[pb.VolumeUsage.BYTES] >= size, stats
    if not block:
        assert total[pb.VolumeUsage.INODES] > 0

    for target in targets:
        unpublish = pb.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(target))
        site.nodes.NodeUnpublishVolume(unpublish)
        site.nodes.NodeUnpublishVolume(unpublish)  # idempotent
        assert mounted_at(target) == 0 and not target.exists()
    unstage = pb.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(staging))
    site.nodes.NodeUnstageVolume(unstage)
    site.nodes.NodeUnstageVolume(unstage)  # idempotent
    assert mounted_at(staged_at) == 0
    assert attach.list_block_attachments(site.state_dir / "attach") == []


def test_publish_before_stage_and_bad_paths_are_refused(site: Site) -> None:
    cap = mount_cap(Mode.SINGLE_NODE_WRITER)
    with pytest.raises(grpc.RpcError) as e:
        site.nodes.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id="sn-a:" + "0" * 32,
                staging_target_path=str(site.kubelet.root / "nowhere"),
                target_path=str(site.kubelet.root / "pod"),
                volume_capability=cap,
            )
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    for bad in ("relative/path", ""):
        with pytest.raises(grpc.RpcError) as e:
            site.nodes.NodeStageVolume(
                pb.NodeStageVolumeRequest(
                    volume_id="sn-a:" + "0" * 32,
                    staging_target_path=bad,
                    volume_capability=cap,
                    publish_context={"type": "nbd", "host": "127.0.0.1", "port": "1"},
                )
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        site.nodes.NodeGetVolumeStats(
            pb.NodeGetVolumeStatsRequest(volume_id="sn-a:" + "0" * 32, volume_path="/tmp")
        )
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


# --------------------------------------------- restarts, reboots, expansion


def test_a_killed_plugin_leaves_pods_working_and_cleans_up_after_restart(site: Site) -> None:
    volumes = [
        mounted(site, "nbd", mount_cap(Mode.SINGLE_NODE_WRITER, "ext4"), 64 * MIB),
        mounted(site, "nfs", mount_cap(Mode.MULTI_NODE_MULTI_WRITER), 64 * MIB),
    ]
    try:
        for m in volumes:
            (m.target / "before").write_text("written before the kill\n")
        assert site.plugin.proc is not None
        site.plugin.proc.kill()  # SIGKILL: no clean-up of any kind
        site.plugin.proc.wait()
        for m in volumes:  # the pods' mounts keep working without the plugin
            assert (m.target / "before").read_text() == "written before the kill\n"
            (m.target / "during").write_text("written while the plugin was down\n")
            os.sync()
        site.plugin.start()  # the same state directory; the stale socket is replaced
        for m in volumes:
            stats = m.stats(site)
            assert not stats.volume_condition.abnormal, stats.volume_condition.message
            assert (m.target / "during").read_text() == "written while the plugin was down\n"
    finally:
        for m in volumes:
            m.teardown(site)
    assert not any(str(site.kubelet.root) in e.mount_point for e in mounts.mount_entries())
    assert attach.list_block_attachments(site.state_dir / "attach") == []


def test_after_a_reboot_staging_again_brings_the_data_back(site: Site) -> None:
    m = mounted(site, "nbd", mount_cap(Mode.SINGLE_NODE_WRITER, "xfs"), 320 * MIB)
    try:
        (m.target / "kept").write_text("across the reboot\n")
        os.sync()
        # a reboot, behind the plugin's back: mounts and the attachment are gone
        mounts.unmount(m.target)
        mounts.unmount(m.staging)
        attach.detach_block(nbd_uri_of(m.ctx), site.state_dir / "attach")
        stats = m.stats(site)
        assert stats.volume_condition.abnormal, "a volume whose device is gone looks healthy"
        assert "not attached" in stats.volume_condition.message, stats.volume_condition.message
        # the plugin starts after the reboot: it reports what it finds missing
        site.plugin.stop()
        site.plugin.start()
        assert f"at start: volume {m.vol.volume_id}: " in site.plugin.log_text()
        # kubelet stages and publishes again after the reboot
        m.stage(site)
        m.publish(site)
        assert (m.target / "kept").read_text() == "across the reboot\n"
        assert not m.stats(site).volume_condition.abnormal
    finally:
        m.teardown(site)


@pytest.mark.parametrize("kind", ["nbd", "nfs"])
def test_expansion_is_seen_inside_the_pod(site: Site, kind: str) -> None:
    cap = (
        mount_cap(Mode.SINGLE_NODE_WRITER, "xfs")
        if kind == "nbd"
        else mount_cap(Mode.MULTI_NODE_MULTI_WRITER)
    )
    m = mounted(site, kind, cap, 320 * MIB)
    try:
        before = os.statvfs(m.target)
        grown = m.controller_expand(site, 640 * MIB)
        assert grown.capacity_bytes == 640 * MIB
        assert grown.node_expansion_required == (kind == "nbd")
        if grown.node_expansion_required:
            assert m.node_expand(site, 640 * MIB).capacity_bytes == 640 * MIB
        after = os.statvfs(m.target)  # what df in the pod shows
        assert after.f_blocks * after.f_frsize >= before.f_blocks * before.f_frsize + 250 * MIB
    finally:
        m.teardown(site)


def test_ephemeral_volume_is_made_for_the_pod_and_deleted_after(site: Site) -> None:
    pod = str(uuid.uuid4())
    volume_id = f"csi-{hashlib.sha256(pod.encode()).hexdigest()}"
    target = site.kubelet.pod_target(pod, "scratch")
    req = pb.NodePublishVolumeRequest(
        volume_id=volume_id,
        target_path=str(target),
        volume_capability=mount_cap(Mode.SINGLE_NODE_WRITER),
        volume_context={
            "csi.storage.k8s.io/ephemeral": "true",
            "csi.storage.k8s.io/pod.name": "scratch-user",
            "csi.storage.k8s.io/pod.namespace": "default",
            "csi.storage.k8s.io/pod.uid": pod,
            "size": "64Mi",
            "fsType": "ext4",
        },
    )
    site.nodes.NodePublishVolume(req)
    site.nodes.NodePublishVolume(req)  # idempotent
    try:
        (target / "scratch").write_bytes(b"x" * 4096)
        with site.node.client() as c:
            names = [v.name for v in c.list_volumes(1000).volumes]
        made = [n for n in names if n.startswith("eph-")]
        assert len(made) == 1, names
    finally:
        unpublish = pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target))
        site.nodes.NodeUnpublishVolume(unpublish)
        site.nodes.NodeUnpublishVolume(unpublish)
    with site.node.client() as c:
        assert not [v.name for v in c.list_volumes(1000).volumes if v.name.startswith("eph-")]
    assert mounted_at(target) == 0
    assert attach.list_block_attachments(site.state_dir / "attach") == []
    bad = pb.NodePublishVolumeRequest(
        volume_id=volume_id + "-2",
        target_path=str(target),
        volume_capability=mount_cap(Mode.SINGLE_NODE_WRITER),
        volume_context={"csi.storage.k8s.io/ephemeral": "true", "colour": "blue"},
    )
    with pytest.raises(grpc.RpcError) as e:
        site.nodes.NodePublishVolume(bad)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_fuse_nfs_mount_refuses_flags_it_cannot_honour(site: Site) -> None:
    if site.plugin_plan_nfs() != "fuse-nfs":
        pytest.fail("this test is about the FUSE NFS path, which this host must use")
    ok_flags = ["hard", "nfsvers=4.1", "noatime"]
    cap = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(mount_flags=ok_flags),
        access_mode=Mode(mode=Mode.MULTI_NODE_MULTI_WRITER),
    )
    m = mounted(site, "nfs", cap, 64 * MIB)
    try:
        (m.target / "with-flags").write_text("ok\n")
    finally:
        m.teardown(site)
    soft = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(mount_flags=["soft", "timeo=10"]),
        access_mode=Mode(mode=Mode.MULTI_NODE_MULTI_WRITER),
    )
    vol, ctx, node_id = create_publish(site, "nfs", soft, 64 * MIB)
    staging = site.kubelet.global_mount(vol.volume_id)
    staging.mkdir(parents=True, exist_ok=True)
    try:
        with pytest.raises(grpc.RpcError) as e:
            site.nodes.NodeStageVolume(
                pb.NodeStageVolumeRequest(
                    volume_id=vol.volume_id,
                    publish_context=ctx,
                    staging_target_path=str(staging),
                    volume_capability=soft,
                    volume_context=vol.volume_context,
                )
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "soft" in (e.value.details() or "")
        assert mounted_at(staging) == 0
    finally:
        Mounted(vol, ctx, node_id, soft, staging, staging / "unused").teardown(site)


def test_nfs_mount_carries_the_per_mount_flags_asked_for(site: Site) -> None:
    """A StorageClass's mountOptions noatime/nosuid/nodev/noexec on the NFS mount,
    FUSE (this host) or kernel (the kernel lane's guest): in the mount table, where
    Kubernetes' suite looks, and in effect."""
    flags = ["noatime", "nosuid", "nodev", "noexec"]
    cap = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(mount_flags=["nfsvers=4.1", *flags]),
        access_mode=Mode(mode=Mode.MULTI_NODE_MULTI_WRITER),
    )
    m = mounted(site, "nfs", cap, 64 * MIB)
    try:
        for path in (m.staging, m.target):
            entry = mounts.mount_entry(str(path))
            assert entry is not None, path
            assert set(flags) <= set(entry.mount_options), (path, entry.mount_options)
            assert "rw" in entry.mount_options and "relatime" not in entry.mount_options
        script = m.target / "run.sh"
        script.write_text("#!/bin/sh\necho ran\n")
        script.chmod(0o755)
        with pytest.raises(PermissionError):
            subprocess.run([str(script)], check=False)
    finally:
        m.teardown(site)


def test_read_only_publish_refuses_writes_and_records_the_pod(site: Site) -> None:
    m = mounted(site, "nbd", mount_cap(Mode.SINGLE_NODE_WRITER, "ext4"), 64 * MIB)
    reader = m.target.parent.parent / "reader" / "mount"
    try:
        (m.target / "shared").write_text("from the writer\n")
        site.nodes.NodePublishVolume(
            pb.NodePublishVolumeRequest(
                volume_id=m.vol.volume_id,
                publish_context=m.ctx,
                staging_target_path=str(m.staging),
                target_path=str(reader),
                volume_capability=m.cap,
                readonly=True,
                volume_context={
                    **m.vol.volume_context,
                    "csi.storage.k8s.io/pod.name": "reader-0",
                    "csi.storage.k8s.io/pod.namespace": "shop",
                    "csi.storage.k8s.io/pod.uid": "uid-reader-0",
                },
            )
        )
        assert (reader / "shared").read_text() == "from the writer\n"
        with pytest.raises(OSError) as e:
            (reader / "nope").write_text("x")
        assert e.value.errno == errno.EROFS
        # the pod is in the node state, as podInfoOnMount gave it
        states = [p.read_text() for p in (site.state_dir / "volumes").glob("*.json")]
        assert any('"uid-reader-0"' in t and '"reader-0"' in t for t in states), states
    finally:
        site.nodes.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=m.vol.volume_id, target_path=str(reader))
        )
        m.teardown(site)


def test_ephemeral_volume_survives_a_plugin_restart_and_is_deleted_after(site: Site) -> None:
    pod = str(uuid.uuid4())
    volume_id = f"csi-{hashlib.sha256(pod.encode()).hexdigest()}"
    target = site.kubelet.pod_target(pod, "scratch")
    site.nodes.NodePublishVolume(
        pb.NodePublishVolumeRequest(
            volume_id=volume_id,
            target_path=str(target),
            volume_capability=mount_cap(Mode.SINGLE_NODE_WRITER),
            volume_context={"csi.storage.k8s.io/ephemeral": "true", "type": "nfs"},
        )
    )
    try:
        (target / "kept").write_text("ok\n")
        assert site.plugin.proc is not None
        site.plugin.proc.kill()
        site.plugin.proc.wait()
        site.plugin.start()
        assert (target / "kept").read_text() == "ok\n"
    finally:
        site.nodes.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target))
        )
    with site.node.client() as c:
        assert not [v.name for v in c.list_volumes(1000).volumes if v.name.startswith("eph-")]
    assert mounted_at(target) == 0


def _publish_with_group(nodes: pb_grpc.NodeStub, m: Mounted, target: Path, group: str) -> None:
    grouped = pb.VolumeCapability()
    grouped.CopyFrom(m.cap)
    grouped.mount.volume_mount_group = group
    nodes.NodePublishVolume(
        pb.NodePublishVolumeRequest(
            volume_id=m.vol.volume_id,
            publish_context=m.ctx,
            staging_target_path=str(m.staging),
            target_path=str(target),
            volume_capability=grouped,
            volume_context=m.vol.volume_context,
        )
    )


def _as_user(where: Path, uid: int, gid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` as a pod's user and group, started in ``where`` (entered before the
    user changes: the test's directories above it are root's alone)."""
    return subprocess.run(argv, cwd=where, user=uid, group=gid, extra_groups=[gid],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_a_pods_fs_group_on_an_nfs_volume_that_squashes_root(site: Site) -> None:
    """The pod's fsGroup (VOLUME_MOUNT_GROUP) on an NFS volume whose export
    squashes root (the default): the storage node gives the files to the group,
    and a process of the pod's user and group writes there through the node's mount."""
    m = mounted(site, "nfs", mount_cap(Mode.MULTI_NODE_MULTI_WRITER), 64 * MIB)
    pod = m.target.parent.parent / "grouped" / "mount"
    try:
        assert m.vol.volume_context.get("squash", "root_squash") == "root_squash"
        # root on this node is nobody there: it cannot give the files to a group itself
        with pytest.raises(PermissionError):
            os.chown(m.target, -1, 2000)
        _publish_with_group(site.nodes, m, pod, "2000")
        _publish_with_group(site.nodes, m, pod, "2000")  # idempotent
        st = pod.stat()
        assert st.st_gid == 2000 and st.st_mode & 0o2070 == 0o2070, oct(st.st_mode)
        wrote = _as_user(pod, 1999, 2000, "sh", "-c", "echo from-the-pod > by-the-pod")
        assert wrote.returncode == 0, wrote.stderr
        assert (m.target / "by-the-pod").stat().st_gid == 2000
    finally:
        with contextlib.suppress(grpc.RpcError):
            site.nodes.NodeUnpublishVolume(
                pb.NodeUnpublishVolumeRequest(volume_id=m.vol.volume_id, target_path=str(pod))
            )
        m.teardown(site)


def test_a_refused_publish_leaves_nothing_behind(
    site: Site, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A node plugin that cannot reach the storage node (no storage nodes in its
    configuration) gives a pod's fsGroup itself; on an export that squashes root
    that is refused, and neither a bind nor the target nor a record of it stays
    (kubelet would otherwise find a mount it never got, a pod stuck Terminating)."""
    root = tmp_path_factory.mktemp("no-storage-nodes")
    alone = CsiPlugin(root, "node", None, node_address=this_node_address()).start()
    try:
        with alone.channel() as channel:
            nodes = pb_grpc.NodeStub(channel)  # type: ignore[no-untyped-call]
            _refused_publish_leaves_nothing(site, nodes, alone)
    finally:
        alone.stop()


def _refused_publish_leaves_nothing(site: Site, nodes: pb_grpc.NodeStub, alone: CsiPlugin) -> None:
    cap = mount_cap(Mode.MULTI_NODE_MULTI_WRITER)
    info = nodes.NodeGetInfo(pb.NodeGetInfoRequest())
    vol = site.controller.CreateVolume(
        pb.CreateVolumeRequest(
            name=f"pvc-{uuid.uuid4()}",
            capacity_range=pb.CapacityRange(required_bytes=64 * MIB),
            volume_capabilities=[cap],
            parameters={"type": "nfs"},
        )
    ).volume
    kubelet = Kubelet(alone.root / "kubelet")
    m = Mounted(
        vol,
        dict(
            site.controller.ControllerPublishVolume(
                pb.ControllerPublishVolumeRequest(
                    volume_id=vol.volume_id, node_id=info.node_id, volume_capability=cap
                )
            ).publish_context
        ),
        info.node_id,
        cap,
        kubelet.global_mount(vol.volume_id),
        kubelet.pod_target(str(uuid.uuid4()), "first"),
    )
    pod = m.target.parent.parent / "grouped" / "mount"
    try:
        m.staging.mkdir(parents=True)
        nodes.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=vol.volume_id,
                publish_context=m.ctx,
                staging_target_path=str(m.staging),
                volume_capability=cap,
                volume_context=vol.volume_context,
            )
        )
        for _ in range(2):  # and again, as kubelet retries
            with pytest.raises(grpc.RpcError) as e:
                _publish_with_group(nodes, m, pod, "1000")
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
            assert "cannot give" in (e.value.details() or "")
            assert mounted_at(pod) == 0 and not pod.exists()
            states = [p.read_text() for p in (alone.root / "state-node" / "volumes").glob("*.json")]
            assert states and not any(str(pod) in t for t in states), states
        # a group that is no group is refused before anything is done
        with pytest.raises(grpc.RpcError) as e:
            _publish_with_group(nodes, m, pod, "no-such-group-anywhere")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not pod.exists()
    finally:
        with contextlib.suppress(grpc.RpcError):  # what a failing run may have left
            nodes.NodeUnpublishVolume(
                pb.NodeUnpublishVolumeRequest(volume_id=vol.volume_id, target_path=str(pod))
            )
        with contextlib.suppress(grpc.RpcError):
            nodes.NodeUnstageVolume(
                pb.NodeUnstageVolumeRequest(
                    volume_id=vol.volume_id, staging_target_path=str(m.staging)
                )
            )
        site.controller.ControllerUnpublishVolume(
            pb.ControllerUnpublishVolumeRequest(volume_id=vol.volume_id, node_id=info.node_id)
        )
        site.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=vol.volume_id))


@pytest.mark.parametrize(("fs", "size"), [("ext4", 64 * MIB), ("xfs", 320 * MIB)])
def test_a_snapshot_restored_larger_mounts_beside_its_source_and_fills_its_size(
    site: Site, fs: str, size: int
) -> None:
    """What Kubernetes' storage suite does: restore a snapshot into a larger PVC
    and stage it on the node where the source is still mounted.  The copy carries
    its source's filesystem UUID (xfs refuses a duplicate unless mounted nouuid)
    and its source's size (grown at staging: df in the pod shows the larger size)."""
    cap = mount_cap(Mode.SINGLE_NODE_WRITER, fs)
    source = mounted(site, "nbd", cap, size)
    restored: Mounted | None = None
    snapshot_id = ""
    try:
        (source.target / "kept").write_text("from before the snapshot\n")
        os.sync()
        snapshot_id = site.controller.CreateSnapshot(
            pb.CreateSnapshotRequest(
                source_volume_id=source.vol.volume_id, name=f"snap-{uuid.uuid4()}"
            )
        ).snapshot.snapshot_id
        content = pb.VolumeContentSource(
            snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snapshot_id)
        )
        restored = made(site, "nbd", cap, 2 * size, content)
        restored.stage(site)
        restored.publish(site)
        assert (restored.target / "kept").read_text() == "from before the snapshot\n"
        grown = os.statvfs(restored.target)
        original = os.statvfs(source.target)
        assert (
            grown.f_blocks * grown.f_frsize
            >= original.f_blocks * original.f_frsize + size * 8 // 10
        )
        (restored.target / "new").write_text("in the copy only\n")
        assert not (source.target / "new").exists()
    finally:
        if restored is not None:
            restored.teardown(site)
        if snapshot_id:
            site.controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snapshot_id))
        source.teardown(site)
