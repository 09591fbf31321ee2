"""The CSI Node service: stage once at the global mount, bind into each pod.

The RPCs check their requests, hold the volume for the duration of a call,
and keep the node state written *before* each step, so a restarted plugin
can finish or undo what it started.  Building the service touches nothing
on the host; :meth:`NodeService.recover` (the plugin's start) makes the
state directory, learns the host's attach paths and reconciles the state
with what exists.  The mechanics (attach, format, mount, bind) are the
stage steps', not the handlers'.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import grpc

from csi import attach, capabilities, ephemeral, mounts, nodereconcile, stage, volumestats
from csi.config import NODE_TOPOLOGY_KEY, NodeConfig
from csi.errors import AlreadyExists, CsiError, FailedPrecondition, InvalidArgument, NotFound
from csi.ids import NodeRef, node_id, parse_object_id
from csi.kubeletpaths import DEFAULT_ROOT, KubeletPaths, absolute, check_free, leave_alone
from csi.locks import OperationLocks
from csi.nodestate import NodeState, Publication, StagedVolume, UnreadableRecord
from csi.proto import csi_pb2 as pb
from csi.proto import csi_pb2_grpc as pb_grpc
from csi.storagenodes import StorageNodes
from csi.volumeconditions import VolumeConditions

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


class NodeService(pb_grpc.NodeServicer):
    def __init__(
        self,
        name: str,
        address: str,
        config: NodeConfig,
        state_dir: Path,
        plan: attach.Plan | None = None,
        storage_nodes: StorageNodes | None = None,
        kubelet_dir: Path = DEFAULT_ROOT,
    ) -> None:
        """Nothing on the host is looked at or changed here: :meth:`recover` does
        that, before the service answers a call.

        ``plan``: the attach paths to use (None: probe this host's at
        :meth:`recover`); ``storage_nodes``: where ephemeral volumes are made
        (None: not served); ``kubelet_dir``: kubelet's root, under which every
        path it hands us lies."""
        self.node_id = node_id(name, address)  # ValueError for a bad name or address
        self.me = NodeRef(name, self.node_id.rpartition("@")[2])
        self.storage_nodes = storage_nodes
        self.name = name
        self.topology = {**config.topology, NODE_TOPOLOGY_KEY: name}
        self.io_timeout = config.io_timeout  # a StorageClass's ioTimeout overrides it
        self.fuse_attachment_bytes = config.fuse_attachment_mib << 20
        self.nbd_devices = config.nbd_devices  # 0: csi.attach.limits' automatic pool
        self.paths = KubeletPaths(kubelet_dir)  # ValueError for a relative one
        self.state = NodeState(state_dir)
        self._plan = plan
        self.locks = OperationLocks()
        self._last_count: int | None = None  # NodeGetInfo's last good count
        # what NodeGetVolumeStats last answered, for the metrics
        self.conditions = VolumeConditions()

    @property
    def plan(self) -> attach.Plan:
        """The block and NFS paths this node uses (known once :meth:`recover` ran)."""
        if self._plan is None:
            raise RuntimeError("the node service has not recovered yet: call recover() first")
        return self._plan

    def recover(self) -> list[str]:
        """Before serving: make the state directory, learn which attach paths this
        host has (unless given), and reconcile the node state with what exists
        (:meth:`reconcile`, each line logged).  OSError when the state directory
        cannot be made."""
        self.state.create()
        if self._plan is None:
            self._plan = attach.probe()
        log.info(
            "node %s: block path %s (%s); NFS path %s (%s)",
            self.node_id,
            self._plan.block,
            self._plan.block_reason,
            self._plan.nfs,
            self._plan.nfs_reason,
        )
        report = self.reconcile()
        for line in report:
            log.warning("at start: %s", line)
        return report

    def reconcile(self) -> list[str]:
        """What a restart finds: half-made attachments are undone; unreadable
        records are reported and left; records of nothing, or of a refused
        path, are repaired (``csi.nodereconcile``); volumes whose attachment
        or mount is gone (a reboot, a killed FUSE process) are reported, and
        are repaired by kubelet's next stage and publish."""
        report = attach.reconcile_block_attachments(self.state.attach_dir)
        report += [str(e) for e in self.state.scan()[1]]
        records, repaired = nodereconcile.repair(self.state, self.paths)
        report += repaired
        for record in records:
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
            max_volumes_per_node=self._max_volumes(),
            accessible_topology=pb.Topology(segments=self.topology),
        )

    def _max_volumes(self) -> int:
        """The live count; when counting fails (a bad /sys, an I/O error on the
        state directory), the last good count, or at first what the records
        directory lists: an error here would unregister the driver (kubelet
        calls NodeGetInfo at registration), and 0 would mean "no limit"."""
        try:
            self._last_count = self.volume_limit().count
        except Exception:
            log.exception("counting this node's volume limit failed; answering the last count")
            if self._last_count is None:
                try:
                    held = sum(1 for n in os.listdir(self.state.volumes) if n.endswith(".json"))
                except OSError:
                    held = 0
                return max(1, held)
        return self._last_count

    def volume_limit(self) -> attach.VolumeLimit:
        """What this node holds and can still attach (``csi.attach.limits``).  Held:
        every recorded volume but inline ephemeral ones, which the scheduler does
        not count (their devices or memory are in use, so not free either)."""
        ours = sum(1 for r in self.state.scan()[0] if not r.ephemeral)
        limit = attach.volume_limit(self.plan, ours, self.fuse_attachment_bytes, self.nbd_devices)
        log.debug("max_volumes_per_node %d: %d held, %s", limit.count, ours, limit.reason)
        return limit

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
        staging = self.paths.staging(request.staging_target_path)
        cap, access, flags = _capability(request)
        ctx = dict(request.publish_context)
        kind = ctx.get("type") or request.volume_context.get("type", "")
        read_only = cap.access_mode.mode in capabilities.READ_ONLY
        io_timeout = stage.io_timeout(request.volume_context, self.io_timeout)
        with self.locks.hold(volume_id), nodereconcile.no_trace_of_failure(self.state, volume_id):
            record = self._get(volume_id)
            if record is not None and (
                record.staging_path != str(staging) or record.access != access
            ):
                raise AlreadyExists(
                    f"volume {volume_id} is staged at {record.staging_path} for {record.access} "
                    "access"
                )
            if record is None:
                check_free(staging, "staging_target_path")
            if kind == "nbd":
                fs_type = request.volume_context.get("fsType", "")
                self._stage_nbd(
                    volume_id,
                    staging,
                    ctx,
                    cap,
                    access,
                    flags,
                    read_only,
                    record,
                    fs_type,
                    io_timeout,
                )
            elif kind in ("nfs", "nfs-external"):
                if access != "mount":
                    raise InvalidArgument("an NFS volume has no block access")
                if kind == "nfs-external":  # the export alone: no port of ours
                    ctx = {k: ctx[k] for k in ("server", "exportPath") if k in ctx}
                stage.check_nfs(ctx, self.plan, flags)  # before anything is recorded
                record = record or StagedVolume(volume_id, str(staging), "nfs", access)
                record.read_only = read_only
                self.state.put(record)
                record.nfs_source = stage.mount_nfs(
                    ctx,
                    staging,
                    self.plan,
                    flags,
                    read_only,
                    self._nfs_log(volume_id),
                    io_timeout,
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
        io_timeout: float,
    ) -> None:
        uri = stage.nbd_uri(ctx)
        if record is None or record.uri != uri:
            if record is not None and record.uri:  # published anew under another export
                stage.detach_device(record.uri, self.state.attach_dir)
            record = StagedVolume(volume_id, str(staging), "nbd", access, uri=uri)
        record.read_only = read_only
        self.state.put(record)  # before attaching: a restart knows what to undo
        record.device = stage.attach_device(uri, self.state.attach_dir, self.plan, io_timeout)
        self.state.put(record)
        if access == "block":
            stage.bind_device(record.device, staging)
        else:
            record.fs_type = stage.mount_filesystem(
                record.device, staging, cap.mount.fs_type or fs_type, flags, read_only
            )
        self.state.put(record)

    def _get(self, volume_id: str) -> StagedVolume | None:
        try:
            return self.state.get(volume_id)
        except UnreadableRecord as e:
            raise FailedPrecondition(f"volume {volume_id}: {e}") from e

    def _nfs_log(self, volume_id: str) -> Path:
        digest = hashlib.sha256(volume_id.encode()).hexdigest()[:16]
        return self.state.root / "logs" / f"nfs-{digest}.log"

    def NodeUnstageVolume(
        self, request: pb.NodeUnstageVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodeUnstageVolumeResponse:
        volume_id = _require(request.volume_id, "volume_id")
        staging = self.paths.check(request.staging_target_path, "staging_target_path")
        with self.locks.hold(volume_id):
            record = self._get(volume_id)
            if record is None or record.ephemeral or record.staging_path != str(staging):
                elsewhere = f" (it is staged at {record.staging_path})" if record else ""
                leave_alone(staging, f"volume {volume_id} is not staged at {staging}{elsewhere}")
                return pb.NodeUnstageVolumeResponse()
            still = [t for t in record.published if mounts.mount_entry(t) is not None]
            if still:
                raise FailedPrecondition(
                    f"volume {volume_id} is still published at {', '.join(still)}"
                )
            if record.access == "block":
                device_file = staging / stage.DEVICE_FILE
                stage.unmount(device_file)
                stage.remove_path(device_file)
            elif record.kind == "nfs":
                try:
                    attach.unmount_nfs(staging)
                except attach.AttachError as e:
                    raise FailedPrecondition(str(e)) from e
            else:
                stage.unmount(staging)
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
        target = self.paths.check(request.target_path, "target_path")
        cap, access, flags = _capability(request)
        read_only = request.readonly or cap.access_mode.mode in capabilities.READ_ONLY
        pod = _pod(dict(request.volume_context))
        if request.volume_context.get(EPHEMERAL_KEY) == "true":
            if access != "mount":
                raise InvalidArgument("an ephemeral inline volume is a filesystem (mount access)")
            self._publish_ephemeral(request, target, flags, read_only, pod)
            return pb.NodePublishVolumeResponse()
        staging = absolute(request.staging_target_path, "staging_target_path")
        with self.locks.hold(volume_id):
            record = self._get(volume_id)
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
            group = request.volume_capability.mount.volume_mount_group
            gid = stage.mount_group_id(group) if group and not read_only else None
            fresh = known is None and not self._bind_of(record, target)
            if fresh:
                check_free(target, "target_path", file_ok=access == "block")
            by_storage_node = gid is not None and self._group_on_storage_node(record, gid)
            record.published[str(target)] = Publication(str(target), read_only, pod)
            self.state.put(record)
            try:
                if access == "block":
                    stage.bind(staging / stage.DEVICE_FILE, target, read_only, is_file=True)
                else:
                    stage.bind(staging, target, read_only, is_file=False)
                    if by_storage_node:
                        stage.revalidate(target)
                    elif gid is not None:
                        stage.apply_mount_group(target, gid)
            except BaseException:
                if fresh:  # a refused publish leaves nothing: no bind, no path, no record
                    self._undo_publish(record, target)
                raise
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
            record = self._get(volume_id)
            if record is not None and record.staging_path != str(target):
                raise AlreadyExists(f"ephemeral volume {volume_id} is at {record.staging_path}")
            if record is None:
                check_free(target, "target_path")
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
                record.device = stage.attach_device(
                    record.uri, self.state.attach_dir, self.plan, self.io_timeout
                )
                self.state.put(record)
                stage.mount_filesystem(record.device, target, spec.fs_type, flags, read_only)
            else:
                record.nfs_source = stage.mount_nfs(
                    ctx,
                    target,
                    self.plan,
                    flags,
                    read_only,
                    self._nfs_log(volume_id),
                    self.io_timeout,
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
        """Unmount the pod's target and remove it, when the node state records it
        for this volume (or it holds a bind of the volume's own staging mount).
        Nothing at the target is success (never published, or unpublished
        already); anything else there is NOT_FOUND, and left as it is.  An
        ephemeral volume is then detached and deleted from its storage node."""
        volume_id = _require(request.volume_id, "volume_id")
        target = self.paths.check(request.target_path, "target_path")
        with self.locks.hold(volume_id):
            record = self._get(volume_id)
            ephemeral = (
                record is not None and record.ephemeral and record.staging_path == str(target)
            )
            if record is None or not (
                ephemeral or str(target) in record.published or self._bind_of(record, target)
            ):
                leave_alone(target, f"volume {volume_id} is not published at {target}")
                return pb.NodeUnpublishVolumeResponse()
            stage.unmount(target)
            stage.remove_path(target)
            # kubelet asks no more about this path: its last condition goes too
            self.conditions.forget(volume_id, request.target_path)
            if ephemeral:
                self._unpublish_ephemeral(record)
            elif record.published.pop(str(target), None) is not None:
                self.state.put(record)
        log.info("volume %s unpublished from %s", volume_id, target)
        return pb.NodeUnpublishVolumeResponse()

    def _group_on_storage_node(self, record: StagedVolume, gid: int) -> bool:
        """An nfs volume's files are given to the pod's group by its storage node,
        which owns the export (this node's root may be squashed there); False when
        this node cannot ask it (no storage nodes configured, or not this one)."""
        ref = parse_object_id(record.volume_id)
        if record.kind != "nfs" or self.storage_nodes is None or ref is None:
            return False
        try:
            self.storage_nodes.get(ref.storage_node)
        except CsiError:
            return False
        self.storage_nodes.call(ref.storage_node, lambda c: c.set_volume_group(ref.backend_id, gid))
        return True

    def _undo_publish(self, record: StagedVolume, target: Path) -> None:
        try:
            if mounts.mount_entry(str(target)) is not None:
                stage.unmount(target)
            stage.remove_path(target)
        except (CsiError, OSError) as e:
            log.error("undoing the publish of %s at %s: %s", record.volume_id, target, e)
            return  # the publication stays recorded: NodeUnpublishVolume finds it
        record.published.pop(str(target), None)
        self.state.put(record)

    def _bind_of(self, record: StagedVolume, target: Path) -> bool:
        """Whether ``target`` holds a bind of the volume's staging mount."""
        staging = Path(record.staging_path)
        return not record.ephemeral and stage.is_bind_of(target, staging, record.access)

    # -- stats and expansion

    def _record_at(self, volume_id: str, volume_path: str) -> tuple[StagedVolume, Path]:
        record = self._get(volume_id)
        if record is None:
            raise NotFound(f"volume {volume_id} is not staged on this node")
        if not volume_path.startswith("/"):  # kubelet's paths are absolute: none of ours
            raise NotFound(f"volume {volume_id} is not at {volume_path[:140]!r}")
        path = absolute(volume_path, "volume_path")
        if str(path) != record.staging_path and str(path) not in record.published:
            raise NotFound(f"volume {volume_id} is neither staged nor published at {path}")
        if not path.exists():
            raise NotFound(f"{path} does not exist")
        return record, path

    def _problem(self, record: StagedVolume, path: Path) -> str | None:
        return volumestats.problem(record, path, self.state.attach_dir)

    def NodeGetVolumeStats(
        self, request: pb.NodeGetVolumeStatsRequest, context: grpc.ServicerContext
    ) -> pb.NodeGetVolumeStatsResponse:
        response = self._volume_stats(request)
        self.conditions.record(
            request.volume_id, request.volume_path, response.volume_condition.abnormal
        )
        if not response.usage:
            # kubelet (pkg/volume/csi/csi_client.go, NodeGetVolumeStats) fails an answer
            # without usage ("usage is nil") before it reads the condition, so an abnormal
            # volume would show in neither kubelet_volume_stats_health_status_abnormal nor
            # a pod event. Zeros are what kubelet itself starts from: nothing known.
            response.usage.append(pb.VolumeUsage(unit=pb.VolumeUsage.BYTES))
        return response

    def _volume_stats(self, request: pb.NodeGetVolumeStatsRequest) -> pb.NodeGetVolumeStatsResponse:
        volume_id = _require(request.volume_id, "volume_id")
        if not request.volume_path:
            raise InvalidArgument("volume_path is missing")
        try:
            self.state.get(volume_id)
        except UnreadableRecord as e:  # the volume's condition: its record says nothing
            condition = pb.VolumeCondition(abnormal=True, message=str(e))
            return pb.NodeGetVolumeStatsResponse(volume_condition=condition)
        try:
            record, path = self._record_at(volume_id, request.volume_path)
        except OSError as e:  # the mount's server is away (EIO after its I/O timeout)
            message = f"{request.volume_path[:200]} cannot be read: {e.strerror}"
            return pb.NodeGetVolumeStatsResponse(
                volume_condition=pb.VolumeCondition(abnormal=True, message=message)
            )
        problem = self._problem(record, path)
        usage: list[pb.VolumeUsage] = []
        if problem is None:
            try:
                usage = volumestats.usage(record, path)
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
