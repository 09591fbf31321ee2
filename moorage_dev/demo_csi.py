"""The CSI part of ``moorage demo``: the plugin driven through its socket as Kubernetes would.

A real ``moorage csi serve --mode all`` process in front of the demo's
storage node; a filesystem (nfs) and a block (nbd + xfs) volume go through
what kubelet and the sidecars do, on kubelet's paths under the demo's state
directory: create, controller publish, stage at the global mount, publish
into two pod directories, write in one and read in the other, snapshot and
restore, expand, then everything undone.  Each step is a row: its time and
what the mount table shows under the demo's kubelet directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
from rich.console import Console
from rich.table import Table

from csi import attach, mounts
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from hostio.atomicfile import write_atomically

T = TypeVar("T")
MIB = 1 << 20
Mode = pb.VolumeCapability.AccessMode
DRIVER = "csi.moorage.dev"


class Steps:
    def __init__(self, kubelet: Path, title: str) -> None:
        self.kubelet = kubelet
        self.table = Table(title=title)
        for column in ("step", "time", "mounts under the kubelet directory"):
            self.table.add_column(column)

    def mounts_now(self) -> str:
        root = str(self.kubelet) + "/"
        found = [e for e in mounts.mount_entries() if e.mount_point.startswith(root)]
        globals_ = [e.fstype for e in found if e.mount_point.endswith("/globalmount")]
        binds = sum(1 for e in found if "/pods/" in e.mount_point)
        if not found:
            return "none"
        shown = [f"1 global mount ({globals_[0]})"] if len(globals_) == 1 else []
        if len(globals_) > 1:
            shown.append(f"{len(globals_)} global mounts")
        if binds:
            shown.append(f"{binds} pod bind{'s' if binds > 1 else ''}")
        return ", ".join(shown)

    def run(self, name: str, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        result = fn()
        self.table.add_row(
            name, f"{(time.perf_counter() - start) * 1000:.0f} ms", self.mounts_now()
        )
        return result


def _start_plugin(state: Path, api_address: str) -> tuple[subprocess.Popen[bytes], Path]:
    csi_dir = state / "csi"
    csi_dir.mkdir(parents=True, exist_ok=True)
    config = csi_dir / "csi.toml"
    text = f'[[storage_nodes]]\nname = "demo"\naddress = "{api_address}"\n'
    write_atomically(config, text, mode=0o644)
    sock = csi_dir / "csi.sock"
    log = (csi_dir / "plugin.log").open("ab")
    argv = [
        sys.executable, "-m", "moorage", "csi", "serve", "--endpoint", f"unix://{sock}",
        "--mode", "all", "--node-id", "demo-worker", "--node-address", "127.0.0.1",
        "--config", str(config), "--state-dir", str(csi_dir / "state"),
        "--kubelet-dir", str(csi_dir / "kubelet"),
        # the demo's mounts are made and used in this mount namespace: no propagation needed
        "--allow-private-mounts",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the CSI plugin exited {proc.returncode}; see {csi_dir}/plugin.log")
        if sock.exists():
            with grpc.insecure_channel(f"unix://{sock}") as ch:
                try:
                    pb_grpc.IdentityStub(ch).GetPluginInfo(  # type: ignore[no-untyped-call]
                        pb.GetPluginInfoRequest(), timeout=2
                    )
                    return proc, sock
                except grpc.RpcError:
                    pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the CSI plugin did not answer on its socket within 30 s")


def csi_demo(state: Path, api_address: str, console: Console) -> None:
    """Runs in a worker thread while the storage node serves."""
    console.rule("[bold]CSI plugin (csi.moorage.dev)")
    proc, sock = _start_plugin(state, api_address)
    kubelet = state / "csi" / "kubelet"
    try:
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            controller = pb_grpc.ControllerStub(channel)  # type: ignore[no-untyped-call]
            node = pb_grpc.NodeStub(channel)  # type: ignore[no-untyped-call]
            info = node.NodeGetInfo(pb.NodeGetInfoRequest())
            console.print(
                f"plugin in all mode on {sock}; node id {info.node_id}, "
                f"up to {info.max_volumes_per_node} volumes on this node"
            )
            for kind in ("nfs", "nbd"):
                _lifecycle(controller, node, info.node_id, kubelet, kind, console)
    finally:
        proc.terminate()
        proc.wait(30)
        _leave_nothing(kubelet, state / "csi" / "state" / "attach")


def _leave_nothing(kubelet: Path, attach_dir: Path) -> None:
    """After a failure half way: unmount what is under the kubelet directory
    (binds first, deepest first) and detach what the plugin attached."""
    root = str(kubelet) + "/"
    found = sorted(
        (e.mount_point for e in mounts.mount_entries() if e.mount_point.startswith(root)),
        key=lambda p: ("/pods/" not in p, -len(p)),
    )
    for path in found:
        with contextlib.suppress(mounts.MountError):
            mounts.unmount(path)
    for a in attach.list_block_attachments(attach_dir):
        with contextlib.suppress(attach.AttachError):
            attach.detach_block(a.uri, attach_dir)
    shutil.rmtree(kubelet, ignore_errors=True)


def _lifecycle(
    controller: pb_grpc.ControllerStub,
    node: pb_grpc.NodeStub,
    node_id: str,
    kubelet: Path,
    kind: str,
    console: Console,
) -> None:
    if kind == "nfs":
        cap = pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(),
            access_mode=Mode(mode=Mode.MULTI_NODE_MULTI_WRITER),
        )
        title = "nfs volume, ReadWriteMany"
    else:
        cap = pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(fs_type="xfs"),
            access_mode=Mode(mode=Mode.SINGLE_NODE_MULTI_WRITER),
        )
        title = "block volume (nbd) with xfs, one node"
    steps = Steps(kubelet, title)
    pv = f"pvc-{uuid.uuid4()}"
    vol = steps.run(
        "CreateVolume 320 MiB",
        lambda: (
            controller.CreateVolume(
                pb.CreateVolumeRequest(
                    name=pv,
                    capacity_range=pb.CapacityRange(required_bytes=320 * MIB),
                    volume_capabilities=[cap],
                    parameters={"type": kind, "csi.storage.k8s.io/pvc/name": f"demo-{kind}"},
                )
            ).volume
        ),
    )
    handle = vol.volume_id
    ctx = steps.run(
        "ControllerPublishVolume",
        lambda: (
            controller.ControllerPublishVolume(
                pb.ControllerPublishVolumeRequest(
                    volume_id=handle, node_id=node_id, volume_capability=cap
                )
            ).publish_context
        ),
    )
    digest = hashlib.sha256(handle.encode()).hexdigest()
    staging = kubelet / "plugins/kubernetes.io/csi" / DRIVER / digest / "globalmount"
    staging.mkdir(parents=True, exist_ok=True)
    pods = [kubelet / "pods" / str(uuid.uuid4()) / "volumes/kubernetes.io~csi" / pv / "mount"]
    pods.append(kubelet / "pods" / str(uuid.uuid4()) / "volumes/kubernetes.io~csi" / pv / "mount")
    steps.run(
        "NodeStageVolume (attach, format once, global mount)",
        lambda: node.NodeStageVolume(
            pb.NodeStageVolumeRequest(
                volume_id=handle,
                publish_context=ctx,
                staging_target_path=str(staging),
                volume_capability=cap,
                volume_context=vol.volume_context,
            )
        ),
    )
    for n, target in enumerate(pods, 1):
        steps.run(
            f"NodePublishVolume into pod {n}",
            lambda t=target: node.NodePublishVolume(  # type: ignore[misc]
                pb.NodePublishVolumeRequest(
                    volume_id=handle,
                    publish_context=ctx,
                    staging_target_path=str(staging),
                    target_path=str(t),
                    volume_capability=cap,
                    volume_context=vol.volume_context,
                )
            ),
        )
    payload = os.urandom(1 << 20)

    def write_read() -> None:
        (pods[0] / "from-pod-1.bin").write_bytes(payload)
        if (pods[1] / "from-pod-1.bin").read_bytes() != payload:
            raise RuntimeError("pod 2 does not read what pod 1 wrote")

    steps.run("write 1 MiB in pod 1, read it in pod 2: same bytes", write_read)
    snap = steps.run(
        "CreateSnapshot",
        lambda: (
            controller.CreateSnapshot(
                pb.CreateSnapshotRequest(source_volume_id=handle, name=f"snap-{pv}")
            ).snapshot
        ),
    )
    restored = steps.run(
        "CreateVolume from the snapshot (restore)",
        lambda: (
            controller.CreateVolume(
                pb.CreateVolumeRequest(
                    name=f"restore-{pv}",
                    capacity_range=pb.CapacityRange(required_bytes=320 * MIB),
                    volume_capabilities=[cap],
                    parameters={"type": kind},
                    volume_content_source=pb.VolumeContentSource(
                        snapshot=pb.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)
                    ),
                )
            ).volume
        ),
    )
    before = os.statvfs(pods[0])

    def expand() -> None:
        grown = controller.ControllerExpandVolume(
            pb.ControllerExpandVolumeRequest(
                volume_id=handle,
                capacity_range=pb.CapacityRange(required_bytes=640 * MIB),
                volume_capability=cap,
            )
        )
        if grown.node_expansion_required:
            node.NodeExpandVolume(
                pb.NodeExpandVolumeRequest(
                    volume_id=handle,
                    volume_path=str(pods[0]),
                    staging_target_path=str(staging),
                    capacity_range=pb.CapacityRange(required_bytes=640 * MIB),
                    volume_capability=cap,
                )
            )

    steps.run("ControllerExpandVolume (+ NodeExpandVolume) to 640 MiB", expand)
    after = os.statvfs(pods[0])
    for n, target in enumerate(pods, 1):
        steps.run(
            f"NodeUnpublishVolume from pod {n}",
            lambda t=target: node.NodeUnpublishVolume(  # type: ignore[misc]
                pb.NodeUnpublishVolumeRequest(volume_id=handle, target_path=str(t))
            ),
        )
    steps.run(
        "NodeUnstageVolume (unmount, detach)",
        lambda: node.NodeUnstageVolume(
            pb.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(staging))
        ),
    )
    steps.run(
        "ControllerUnpublishVolume",
        lambda: controller.ControllerUnpublishVolume(
            pb.ControllerUnpublishVolumeRequest(volume_id=handle, node_id=node_id)
        ),
    )

    def delete_all() -> None:
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=restored.volume_id))
        controller.DeleteSnapshot(pb.DeleteSnapshotRequest(snapshot_id=snap.snapshot_id))
        controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=handle))

    steps.run("DeleteVolume x2, DeleteSnapshot", delete_all)
    console.print(steps.table)
    console.print(
        f"{kind}: df in the pod showed {before.f_blocks * before.f_frsize >> 20} MiB before the "
        f"expansion and {after.f_blocks * after.f_frsize >> 20} MiB after; volume {handle}, "
        f"restored copy {restored.volume_id}"
    )
