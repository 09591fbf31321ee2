"""The client of a storage node's API (the admin CLI's, the CSI plugin's): its channel,
credentials (bearer token, TLS) and reconnect backoff, one method per call."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType

import grpc

from backend.api.auth import BearerToken, read_token
from backend.api.proto import backend_pb2 as pb
from backend.api.proto import backend_pb2_grpc as pb_grpc

# A storage node that restarts is reached again within a couple of seconds:
# gRPC's default reconnect backoff grows to two minutes.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class BackendClient:
    def __init__(
        self,
        address: str,
        token_file: Path | None = None,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        timeout: float = 300.0,
        *,
        token: str | None = None,
        ca_pem: bytes | None = None,
        cert_pem: bytes | None = None,
        key_pem: bytes | None = None,
    ) -> None:
        """Credentials come from files, or as values (``token``, ``*_pem``) when a
        caller holds them in memory (the CSI plugin's per-request secrets)."""
        self.address = address
        self.timeout = timeout
        if token_file:
            token = read_token(token_file)
        ca_pem = ca.read_bytes() if ca else ca_pem
        cert_pem = cert.read_bytes() if cert else cert_pem
        key_pem = key.read_bytes() if key else key_pem
        # Over TLS the token rides in call credentials; in clear, in plain metadata.
        self._metadata: tuple[tuple[str, str], ...] = ()
        if ca_pem is not None or cert_pem is not None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem
            )
            if token:
                creds = grpc.composite_channel_credentials(
                    creds, grpc.metadata_call_credentials(BearerToken(token))
                )
            self.channel = grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            if token:
                self._metadata = (("authorization", f"Bearer {token}"),)
        self.stub = pb_grpc.BackendStub(self.channel)  # type: ignore[no-untyped-call]

    def __enter__(self) -> BackendClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, request: object, timeout: float | None = None) -> object:
        rpc = getattr(self.stub, method)
        return rpc(request, timeout=timeout or self.timeout, metadata=self._metadata)

    def create_volume(self, request: pb.CreateVolumeRequest) -> pb.Volume:
        return self._call("CreateVolume", request)  # type: ignore[return-value]

    def modify_volume(self, volume_id: str, parameters: dict[str, str]) -> pb.Volume:
        req = pb.ModifyVolumeRequest(volume_id=volume_id, parameters=parameters)
        return self._call("ModifyVolume", req)  # type: ignore[return-value]

    def delete_volume(self, volume_id: str) -> None:
        self._call("DeleteVolume", pb.DeleteVolumeRequest(volume_id=volume_id))

    def expand_volume(self, volume_id: str, size: int) -> pb.Volume:
        req = pb.ExpandVolumeRequest(volume_id=volume_id, size_bytes=size)
        return self._call("ExpandVolume", req)  # type: ignore[return-value]

    def set_volume_group(self, volume_id: str, gid: int) -> pb.Volume:
        req = pb.SetVolumeGroupRequest(volume_id=volume_id, gid=gid)
        return self._call("SetVolumeGroup", req)  # type: ignore[return-value]

    def get_volume(self, volume_id: str = "", name: str = "") -> pb.Volume:
        req = (
            pb.GetVolumeRequest(volume_id=volume_id)
            if volume_id
            else pb.GetVolumeRequest(name=name)
        )
        return self._call("GetVolume", req)  # type: ignore[return-value]

    def list_volumes(self, max_entries: int = 0, token: str = "") -> pb.ListVolumesResponse:
        req = pb.ListVolumesRequest(max_entries=max_entries, starting_token=token)
        return self._call("ListVolumes", req)  # type: ignore[return-value]

    def create_snapshot(self, name: str, source_volume_id: str) -> pb.Snapshot:
        req = pb.CreateSnapshotRequest(name=name, source_volume_id=source_volume_id)
        return self._call("CreateSnapshot", req)  # type: ignore[return-value]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._call("DeleteSnapshot", pb.DeleteSnapshotRequest(snapshot_id=snapshot_id))

    def list_snapshots(
        self,
        max_entries: int = 0,
        token: str = "",
        source_volume_id: str = "",
        snapshot_id: str = "",
    ) -> pb.ListSnapshotsResponse:
        req = pb.ListSnapshotsRequest(
            max_entries=max_entries,
            starting_token=token,
            source_volume_id=source_volume_id,
            snapshot_id=snapshot_id,
        )
        return self._call("ListSnapshots", req)  # type: ignore[return-value]

    def create_group_snapshot(self, name: str, source_volume_ids: list[str]) -> pb.GroupSnapshot:
        req = pb.CreateGroupSnapshotRequest(name=name, source_volume_ids=source_volume_ids)
        return self._call("CreateGroupSnapshot", req)  # type: ignore[return-value]

    def delete_group_snapshot(self, group_snapshot_id: str) -> None:
        req = pb.DeleteGroupSnapshotRequest(group_snapshot_id=group_snapshot_id)
        self._call("DeleteGroupSnapshot", req)

    def get_group_snapshot(self, group_snapshot_id: str) -> pb.GroupSnapshot:
        req = pb.GetGroupSnapshotRequest(group_snapshot_id=group_snapshot_id)
        return self._call("GetGroupSnapshot", req)  # type: ignore[return-value]

    def capacity(self) -> pb.Capacity:
        return self._call("GetCapacity", pb.GetCapacityRequest())  # type: ignore[return-value]

    def publish(
        self,
        volume_id: str,
        node_id: str,
        node_address: str,
        read_only: bool = False,
        multi_writer: bool = False,
        single_node: bool = False,
    ) -> pb.PublishVolumeResponse:
        req = pb.PublishVolumeRequest(
            volume_id=volume_id,
            node_id=node_id,
            node_address=node_address,
            read_only=read_only,
            multi_writer=multi_writer,
            single_node=single_node,
        )
        return self._call("PublishVolume", req)  # type: ignore[return-value]

    def unpublish(self, volume_id: str, node_id: str) -> None:
        self._call(
            "UnpublishVolume", pb.UnpublishVolumeRequest(volume_id=volume_id, node_id=node_id)
        )

    def health(self, timeout: float | None = None) -> pb.HealthResponse:
        return self._call("Health", pb.HealthRequest(), timeout)  # type: ignore[return-value]

    def list_orphans(self) -> pb.ListOrphansResponse:
        return self._call("ListOrphans", pb.ListOrphansRequest())  # type: ignore[return-value]

    def adopt_volume(self, orphan: str, name: str, kind: str = "") -> pb.Volume:
        types = {"": pb.VOLUME_TYPE_UNSPECIFIED, "nbd": pb.NBD, "nfs": pb.NFS}
        if kind not in types:
            raise ValueError(f"volume type {kind!r} is not nbd or nfs")
        req = pb.AdoptVolumeRequest(orphan=orphan, name=name, type=types[kind])
        return self._call("AdoptVolume", req)  # type: ignore[return-value]

    def purge_orphan(self, orphan: str) -> pb.Orphan:
        return self._call("PurgeOrphan", pb.PurgeOrphanRequest(orphan=orphan))  # type: ignore[return-value]
