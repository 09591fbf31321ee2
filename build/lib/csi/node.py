"""The CSI Node service: stage once at the global mount, bind into each pod.

The RPCs check their requests, hold the volume for the duration of a call,
and keep the node state (``csi/nodestate.py``) written *before* each step,
so a restarted plugin can finish or undo what it started.  The mechanics
(attach, format, mount, bind) are in ``csi/stage.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import grpc

from csi import attach, capabilities, ephemeral, mounts, stage
from csi.config import NODE_TOPOLOGY_KEY, NodeConfig
from csi.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from csi.ids import NodeRef, node_id
from csi.locks import OperationLocks
from csi.nodestate import NodeState, Publication, StagedVolume
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.storagenodes import StorageNodes

log = logging.getLogger("moorage.csi.node")

NodeCap = pb.NodeServiceCapability
CAPABILITIES = (
    NodeCap.RPC.STAGE_UNSTAGE_VOLUME,
    NodeCap.RPC.GET_VOLUME_STATS,
    NodeCap.RPC.EXPAND_VOLUME,
    NodeCap.RPC.VOLUME_CONDITION,
    NodeCap.RPC.SINGLE_NODE_MULTI_WRITER,
    NodeCap.RPC.VOLUME_MOUNT_GROUP,
)
POD_KEYS = {
    "csi.storage.k8s.io/pod.name": "name",
    "csi.storage.k8s.io/pod.namespace": "namespace",
    "csi.storage.k8s.io/pod.uid": "uid",
}
EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"
# Each FUSE-attached volume is a process of its own; budget its memory.
FUSE_ATTACHMENT_BYTES = 64 << 20
MAX_FUSE_ATTACHMENTS = 1024


def _absolute(value: str, what: str) -> Path:
    if not value:
        raise InvalidArgument(f"{what} is missing")
    if not value.startswith("/") or "\0" in value or len(value.encode()) > 4096:
        raise InvalidArgument(f"{what} {value[:140]!r} is not an absolute path")
    return Path(os.path.normpath(value))


def _require(value: str, what: str) -> str:
    if not value:
        raise InvalidArgument(f"{what} is missing")
    if len(value.encode()) > 256:
        raise InvalidArgument(f"{what} is longer than 256 bytes")
    return value


def _capability(
    request: pb.NodeStageVolumeRequest | pb.NodePublishVolumeRequest,
) -> tuple[pb.VolumeCapability, str, tuple[str, ...]]:
    """The request's volume capability, checked: (capability, access type, mount flags)."""
    if not request.HasField("volume_capability"):
        raise InvalidArgument("volume_capability is missing")
    cap = request.volume_capability
    capabilities.check_present([cap])
    access = capabilities.access_type(cap)
    flags = stage.check_options(cap.mount.mount_flags) if access == "mount" else ()
    return cap, access, flags


def _pod(context: dict[str, str]) -> dict[str, str]:
    return {short: context[key] for key, short in POD_KEYS.items() if context.get(key)}


def _max_volumes(plan: attach.Plan) -> int:
    """How many volumes this host can attach: the nbd module's device count on
    the kernel path; on the FUSE path, what memory allows one process each."""
    if plan.block == "kernel-nbd":
        try:
            return int(Path("/sys/module/nbd/parameters/nbds_max").read_text())
        except (OSError, ValueError):
            return 16  # the module's default
    try:
        meminfo = Path("/proc/meminfo").read_text().split()
        total = int(meminfo[meminfo.index("MemTotal:") + 1]) * 1024
    except (OSError, ValueError):
        return 0
    return max(1, min(MAX_FUSE_ATTACHMENTS, total // FUSE_ATTACHMENT_BYTES))


class NodeService(pb_grpc.NodeServicer):
    def __init__(
        self,
        name: str,
        address: str,
        config: NodeConfig,
        state_dir: Path,
        plan: attach.Plan | None = None,
        storage_nodes: StorageNodes | None = None,
    ) -> None:
        """``storage_nodes``: where ephemeral volumes are made (None: not served)."""
        self.node_id = node_id(name, address)  # ValueError for a bad name or address
        self.me = NodeRef(name, self.node_id.rpartition("@")[2])
        self.storage_nodes = storage_nodes
        self.name = name
        self.topology = {**config.topology, NODE_TOPOLOGY_KEY: name}
        self.state = NodeState(state_dir)
        self.plan = plan or attach.probe()
        self.locks = OperationLocks()
        log.info(
            "node %s: block path %s (%s); NFS path %s (%s)",
            self.node_id,
            self.plan.block,
            self.plan.block_reason,
            self.plan.nfs,
            self.plan.nfs_reason,
        )
        for line in self.reconcile():
            log.warning("at start: %s", line)

    def reconcile(self) -> list[str]:
        """What a restart finds: half-made attachments are undone; volumes whose
        attachment or mount is gone (a reboot, a killed FUSE process) are
        reported, and are repaired by kubelet's next stage and publish."""
        report = attach.reconcile_block_attachments(self.state.attach_dir)
        for record in self.state.all():
            for path in [record.staging_path, *record.published]:
                problem = self._problem(record, Path(path))
                if problem is not None:
                    report.append(f"volume {record.volume_id}: {problem}")
        return report

    # -- who this node is

    def NodeGetInfo(
        self, request: pb.NodeGetInfoRequest, context: grpc.ServicerContext
    ) -> pb.NodeGetInfoResponse:
        return pb.NodeGetInfoResponse(
            node_id=self.node_id,
            max_volumes_per_node=_max_volumes(self.plan),
            accessible_topology=pb.Topology(segments=self.topology),
        )

    def NodeGetCapabilities(
        self, request: pb.NodeGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.NodeGetCapabilitiesResponse:
        return pb.NodeGetCapabilitiesResponse(
            capabilities=[NodeCap(rpc=NodeCap.RPC(type=t)) for t in CAPABILITIES]
        )

    # -- stage

    def NodeStageVolume(
        self, request: pb.NodeStageVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodeStageVolumeResponse:
        volume_id = _require(request.volume_id, "volume_id")
        staging = _absolute(request.staging_target_path, "staging_target_path")
        cap, access, flags = _capability(request)
        ctx = dict(request.publish_context)
        kind = ctx.get("type") or request.volume_context.get("type", "")
        read_only = cap.access_mode.mode in capabilities.READ_ONLY
        with self.locks.hold(volume_id):
            record = self.state.get(volume_id)
            if record is not None and (
                record.staging_path != str(staging) or record.access != access
            ):
                raise AlreadyExists(
                    f"volume {volume_id} is staged at {record.staging_path} for {record.access} "
                    "access"
                )
            if kind == "nbd":
                fs_type = request.volume_context.get("fsType", "")
                self._stage_nbd(
                    volume_id, staging, ctx, cap, access, flags, read_only, record, fs_type
                )
            elif kind in ("nfs", "nfs-external"):
                if access != "mount":
                    raise InvalidArgument("an NFS volume has no block access")
                record = record or StagedVolume(volume_id, str(staging), "nfs", access)
                record.read_only = read_only
                self.state.put(record)
                if kind == "nfs-external":
                    ctx = {"server": ctx["server"], "exportPath": ctx["exportPath"]}
                record.nfs_source = stage.mount_nfs(
                    ctx, staging, self.plan, flags, read_only, self._nfs_log(volume_id)
                )
                self.state.put(record)
            else:
                raise InvalidArgument(
                    f"publish_context type {kind[:20]!r} is not nbd or nfs: was the volume "
                    "published by ControllerPublishVolume?"
                )
        log.info("volume %s staged at %s", volume_id, staging)
        return pb.NodeStageVolumeResponse()

    def _stage_nbd(
        self,
        volume_id: str,
        staging: Path,
        ctx: dict[str, str],
        cap: pb.VolumeCapability,
        access: str,
        flags: tuple[str, ...],
        read_only: bool,
        record: StagedVolume | None,
        fs_type: str,
    ) -> None:
        uri = stage.nbd_uri(ctx)
        if record is None or record.uri != uri:
            if record is not None and record.uri:  # published anew under another export
                stage.detach_device(record.uri, self.state.attach_dir)
            record = StagedVolume(volume_id, str(staging), "nbd", access, uri=uri)
        record.read_only = read_only
        self.state.put(record)  # before attaching: a restart knows what to undo
        record.device = stage.attach_device(uri, self.state.attach_dir, self.plan)
        self.state.put(record)
        if access == "block":
            stage.bind_device(record.device, staging)
        else:
            record.fs_type = stage.mount_filesystem(
                record.device, staging, cap.mount.fs_type or fs_type, flags, read_only
            )
        self.state.put(record)

    def _nfs_log(self, volume_id: str) -> Path:
        digest = hashlib.sha256(volume_id.encode()).hexdigest()[:16]
        return self.state.root / "logs" / f"nfs-{digest}.log"

    def NodeUnstageVolume(
        self, request: pb.NodeUnstageVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodeUnstageVolumeResponse:
        volume_id = _require(request.volume_id, "volume_id")
        staging = _absolute(request.staging_target_path, "staging_target_path")
        with self.locks.hold(volume_id):
            record = self.state.get(volume_id)
            if record is None:
                return pb.NodeUnstageVolumeResponse()  # nothing of ours is staged
            still = [t for t in record.published if mounts.mount_entry(t) is not None]
            if still:
                raise FailedPrecondition(
                    f"volume {volume_id} is still published at {', '.join(still)}"
                )
            if record.access == "block":
                device_file = Path(record.staging_path) / stage.DEVICE_FILE
                stage.unmount(device_file)
                stage.remove_path(device_file)
            elif record.kind == "nfs":
                try:
                    attach.unmount_nfs(record.staging_path)
                except attach.AttachError as e:
                    raise FailedPrecondition(str(e)) from e
            else:
                stage.unmount(Path(record.staging_path))
            if record.uri:
                stage.detach_device(record.uri, self.state.attach_dir)
            self.state.remove(volume_id)
        log.info("volume %s unstaged from %s", volume_id, staging)
        return pb.NodeUnstageVolumeResponse()

    # -- publish

    def NodePublishVolume(
        self, request: pb.NodePublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodePublishVolumeResponse:
        volume_id = _require(request.volume_id, "volume_id")
        target = _absolute(request.target_path, "target_path")
        cap, access, flags = _capability(request)
        read_only = request.readonly or cap.access_mode.mode in capabilities.READ_ONLY
        pod = _pod(dict(request.volume_context))
        if request.volume_context.get(EPHEMERAL_KEY) == "true":
            if access != "mount":
                raise InvalidArgument("an ephemeral inline volume is a filesystem (mount access)")
            self._publish_ephemeral(request, target, flags, read_only, pod)
            return pb.NodePublishVolumeResponse()
        staging = _absolute(request.staging_target_path, "staging_target_path")
        with self.locks.hold(volume_id):
            record = self.state.get(volume_id)
            if record is None or record.staging_path != str(staging):
                raise FailedPrecondition(f"volume {volume_id} is not staged at {staging}")
            if record.access != access:
                raise InvalidArgument(
                    f"volume {volume_id} is staged for {record.access} access, not {access}"
                )
            known = record.published.get(str(target))
            if known is not None and known.read_only != read_only:
                raise AlreadyExists(
                    f"volume {volume_id} is published at {target} "
                    f"{'read-only' if known.read_only else 'read-write'}"
                )
            record.published[str(target)] = Publication(str(target), read_only, pod)
            self.state.put(record)
            if access == "block":
                stage.bind(staging / stage.DEVICE_FILE, target, read_only, is_file=True)
            else:
                stage.bind(staging, target, read_only, is_file=False)
                group = request.volume_capability.mount.volume_mount_group
                if group and not read_only:
                    stage.apply_mount_group(target, group)
        log.info(
            "volume %s published at %s%s%s",
            volume_id,
            target,
            " read-only" if read_only else "",
            f" for pod {pod.get('namespace', '?')}/{pod['name']}" if "name" in pod else "",
        )
        return pb.NodePublishVolumeResponse()

    def _publish_ephemeral(
        self,
        request: pb.NodePublishVolumeRequest,
        target: Path,
        flags: tuple[str, ...],
        read_only: bool,
        pod: dict[str, str],
    ) -> None:
        if self.storage_nodes is None:
            raise FailedPrecondition(
                "this node plugin has no storage nodes in its configuration, so it cannot "
                "make ephemeral inline volumes"
            )
        spec = ephemeral.parse(request.volume_context)
        volume_id = request.volume_id
        with self.locks.hold(volume_id):
            record = self.state.get(volume_id)
            if record is not None and record.staging_path != str(target):
                raise AlreadyExists(f"ephemeral volume {volume_id} is at {record.staging_path}")
            if record is None:
                record = StagedVolume(
                    volume_id, str(target), spec.kind, "mount", ephemeral=True,
                    fs_type=spec.fs_type,
                )  # fmt: skip
            record.published = {str(target): Publication(str(target), read_only, pod)}
            self.state.put(record)  # before the volume exists: a retry or unpublish finds it
            node, backend_id, ctx = ephemeral.create_and_publish(
                self.storage_nodes, volume_id, spec, self.me, self.topology
            )
            record.storage_node, record.backend_id = node, backend_id
            self.state.put(record)
            if spec.kind == "nbd":
                record.uri = stage.nbd_uri(ctx)
                self.state.put(record)
                record.device = stage.attach_device(record.uri, self.state.attach_dir, self.plan)
                self.state.put(record)
                stage.mount_filesystem(record.device, target, spec.fs_type, flags, read_only)
            else:
                record.nfs_source = stage.mount_nfs(
                    ctx, target, self.plan, flags, read_only, self._nfs_log(volume_id)
                )
                self.state.put(record)
        log.info(
            "ephemeral %s volume %s (%s:%s) published at %s%s",
            spec.kind,
            volume_id,
            node,
            backend_id,
            target,
            f" for pod {pod.get('namespace', '?')}/{pod['name']}" if "name" in pod else "",
        )

    def _unpublish_ephemeral(self, record: StagedVolume) -> None:
        if record.uri:
            stage.detach_device(record.uri, self.state.attach_dir)
        if record.backend_id and self.storage_nodes is not None:
            ephemeral.unpublish_and_delete(
                self.storage_nodes, record.storage_node, record.backend_id, self.me
            )
        elif record.backend_id:
            raise FailedPrecondition(
                f"ephemeral volume {record.volume_id} lives on storage node "
                f"{record.storage_node}, which this plugin's configuration no longer names"
            )
        self.state.remove(record.volume_id)
        log.info("ephemeral volume %s deleted", record.volume_id)

    def NodeUnpublishVolume(
        self, request: pb.NodeUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodeUnpublishVolumeResponse:
        """Unmount the pod's target and remove it.  A target that is not mounted
        (never published, or already unpublished) is success.  An ephemeral
        volume is then detached and deleted from its storage node."""
        volume_id = _require(request.volume_id, "volume_id")
        target = _absolute(request.target_path, "target_path")
        with self.locks.hold(volume_id):
            stage.unmount(target)
            stage.remove_path(target)
            record = self.state.get(volume_id)
            if record is not None and record.ephemeral and record.staging_path == str(target):
                self._unpublish_ephemeral(record)
            elif record is not None and record.published.pop(str(target), None) is not None:
                self.state.put(record, durable=False)  # the target is unmounted already
        log.info("volume %s unpublished from %s", volume_id, target)
        return pb.NodeUnpublishVolumeResponse()

    # -- stats and expansion

    def _record_at(self, volume_id: str, volume_path: str) -> tuple[StagedVolume, Path]:
        record = self.state.get(volume_id)
        if record is None:
            raise NotFound(f"volume {volume_id} is not staged on this node")
        if not volume_path.startswith("/"):  # kubelet's paths are absolute: none of ours
            raise NotFound(f"volume {volume_id} is not at {volume_path[:140]!r}")
        path = _absolute(volume_path, "volume_path")
        if str(path) != record.staging_path and str(path) not in record.published:
            raise NotFound(f"volume {volume_id} is neither staged nor published at {path}")
        if not path.exists():
            raise NotFound(f"{path} does not exist")
        return record, path

    def _problem(self, record: StagedVolume, path: Path) -> str | None:
        if record.uri:
            problem = attach.block_attachment_problem(record.uri, self.state.attach_dir)
            if problem is not None:
                return problem
        mounted = path
        if record.access == "block" and str(path) == record.staging_path:
            mounted = path / stage.DEVICE_FILE
        if mounts.mount_entry(mounted) is None:
            return f"{mounted} is not mounted any more: unpublish and publish (or restage) it"
        return None

    def NodeGetVolumeStats(
        self, request: pb.NodeGetVolumeStatsRequest, context: grpc.ServicerContext
    ) -> pb.NodeGetVolumeStatsResponse:
        volume_id = _require(request.volume_id, "volume_id")
        if not request.volume_path:
            raise InvalidArgument("volume_path is missing")
        record, path = self._record_at(volume_id, request.volume_path)
        problem = self._problem(record, path)
        usage: list[pb.VolumeUsage] = []
        if problem is None:
            try:
                usage = _usage(record, path)
            except OSError as e:
                problem = f"{path} cannot be read: {e.strerror}"
        condition = pb.VolumeCondition(abnormal=problem is not None, message=problem or "ok")
        return pb.NodeGetVolumeStatsResponse(usage=usage, volume_condition=condition)

    def NodeExpandVolume(
        self, request: pb.NodeExpandVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodeExpandVolumeResponse:
        volume_id = _require(request.volume_id, "volume_id")
        if not request.volume_path:
            raise InvalidArgument("volume_path is missing")
        with self.locks.hold(volume_id):
            record, path = self._record_at(volume_id, request.volume_path)
            if record.kind != "nbd":  # the storage node grew the NFS volume's filesystem
                st = os.statvfs(path)
                return pb.NodeExpandVolumeResponse(capacity_bytes=st.f_blocks * st.f_frsize)
            try:
                size = attach.refresh_block(record.uri, self.state.attach_dir)
            except attach.AttachError as e:
                raise FailedPrecondition(str(e)) from e
            if record.access == "mount":
                try:
                    mounts.grow_filesystem(record.staging_path, record.fs_type)
                except mounts.OnlineGrowUnsupported as e:
                    raise FailedPrecondition(str(e)) from e
                except (mounts.FilesystemError, mounts.MountError) as e:
                    raise FailedPrecondition(f"growing the filesystem failed: {e}") from e
        log.info("volume %s expanded on this node to %d bytes", volume_id, size)
        return pb.NodeExpandVolumeResponse(capacity_bytes=size)


def _usage(record: StagedVolume, path: Path) -> list[pb.VolumeUsage]:
    if record.access == "block":
        device = path / stage.DEVICE_FILE if str(path) == record.staging_path else path
        fd = os.open(device, os.O_RDONLY)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
        finally:
            os.close(fd)
        return [pb.VolumeUsage(unit=pb.VolumeUsage.BYTES, total=size)]
    st = os.statvfs(path)
    total = st.f_blocks * st.f_frsize
    available = st.f_bavail * st.f_frsize
    return [
        pb.VolumeUsage(
            unit=pb.VolumeUsage.BYTES,
            total=total,
            available=available,
            used=(st.f_blocks - st.f_bfree) * st.f_frsize,
        ),
        pb.VolumeUsage(
            unit=pb.VolumeUsage.INODES,
            total=st.f_files,
            available=st.f_favail,
            used=st.f_files - st.f_ffree,
        ),
    ]
