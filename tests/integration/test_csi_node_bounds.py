"""A staged block volume whose storage node or export goes away never hangs the node.

Through the CSI calls kubelet makes (the site of ``test_csi_node.py``: a
real storage node, the plugin in ``--mode all``, the FUSE block path): a pod
writes to a staged nbd volume, then its export goes away while it is staged
(ControllerUnpublishVolume, as an attach/detach controller that gave up on
the node would) or its storage node stops for longer than the volume's
``ioTimeout``.  The writer gets an error within the bound, ``sync`` returns,
NodeUnpublish and NodeUnstage finish, and another volume keeps working.

Every wait here is bounded; a test that fails leaves the site's teardown to
kill what is left (which fails a FUSE process's requests).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import grpc

from csi.proto import csi_pb2 as pb
from tests.csi_site import (
    MIB,
    Mode,
    Mounted,
    Site,
    mount_cap,
    mounted,
    site_fixture,  # noqa: F401  (the module-scoped site)
)
from tests.fuse_nfs_mount import mount_processes

# Far longer than any test may wait: only a definitive answer explains an error before it.
LONG_IO_TIMEOUT = "600"
PROMPTLY = 60.0
NFS_IO_TIMEOUT = 20  # a generous bound for "at once" on a loaded machine


class Writer(threading.Thread):
    """Writes and fsyncs a file in a loop until an error (kept) or stopped."""

    def __init__(self, directory: Path) -> None:
        super().__init__(daemon=True)
        self.directory = directory
        self.written = 0
        self.error: OSError | None = None
        self.stopping = threading.Event()
        self.started_writing = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                path = self.directory / f"w-{self.written % 8}.bin"
                with path.open("wb") as f:
                    f.write(os.urandom(256 * 1024))
                    f.flush()
                    os.fsync(f.fileno())
                self.written += 1
                if self.written >= 3:
                    self.started_writing.set()
        except OSError as e:
            self.error = e


def _staged_with_io_timeout(on: Site, io_timeout: str, kind: str = "nbd") -> Mounted:
    """An nbd (ext4) or nfs volume whose StorageClass says ioTimeout, staged and published."""
    cap = mount_cap(Mode.SINGLE_NODE_WRITER, "ext4" if kind == "nbd" else "")
    info = on.nodes.NodeGetInfo(pb.NodeGetInfoRequest())
    vol = on.controller.CreateVolume(
        pb.CreateVolumeRequest(
            name=f"pvc-{uuid.uuid4()}",
            capacity_range=pb.CapacityRange(required_bytes=64 * MIB),
            volume_capabilities=[cap],
            parameters={"type": kind, "ioTimeout": io_timeout},
        )
    ).volume
    assert vol.volume_context["ioTimeout"] == io_timeout
    ctx = on.controller.ControllerPublishVolume(
        pb.ControllerPublishVolumeRequest(
            volume_id=vol.volume_id, node_id=info.node_id, volume_capability=cap
        )
    ).publish_context
    pod = str(uuid.uuid4())
    m = Mounted(
        vol,
        dict(ctx),
        info.node_id,
        cap,
        on.kubelet.global_mount(vol.volume_id),
        on.kubelet.pod_target(pod, f"pv-{pod[:8]}"),
    )
    m.stage(on)
    m.publish(on)
    return m


def _attach_records(on: Site) -> list[dict[str, object]]:
    return [
        json.loads(p.read_text()) for p in (on.state_dir / "attach").glob("*/*/attachment.json")
    ]


def _fails_promptly(writer: Writer) -> None:
    writer.join(PROMPTLY)
    assert not writer.is_alive(), f"the pod's writer still waits after {PROMPTLY}s"
    assert writer.error is not None
    assert writer.error.errno in (errno.EIO, errno.EROFS), writer.error


def _node_lets_go(on: Site, m: Mounted) -> None:
    """sync returns; NodeUnpublish and NodeUnstage finish; nothing of it stays mounted."""
    assert subprocess.run(["sync"], timeout=PROMPTLY).returncode == 0
    on.nodes.NodeUnpublishVolume(
        pb.NodeUnpublishVolumeRequest(volume_id=m.vol.volume_id, target_path=str(m.target)),
        timeout=PROMPTLY,
    )
    on.nodes.NodeUnstageVolume(
        pb.NodeUnstageVolumeRequest(volume_id=m.vol.volume_id, staging_target_path=str(m.staging)),
        timeout=PROMPTLY,
    )
    with open("/proc/self/mounts") as f:
        table = f.read()
    assert str(m.staging) not in table and str(m.target) not in table


def _restart(on: Site) -> None:
    """Start the storage node again, and wait until the plugin reaches it (its channel
    may be in gRPC's reconnect backoff from the time the node was away)."""
    on.local_node.start()
    deadline = time.monotonic() + PROMPTLY
    while True:
        try:
            on.controller.ListVolumes(pb.ListVolumesRequest(), timeout=10)
            return
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the plugin does not reach the storage node"
            time.sleep(0.5)


def _still_works(on: Site, other: Mounted) -> None:
    data = os.urandom(MIB)
    path = other.target / "still-works.bin"
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    assert path.read_bytes() == data


def test_an_export_withdrawn_while_staged_fails_the_pods_io_at_once(site: Site) -> None:
    m = _staged_with_io_timeout(site, LONG_IO_TIMEOUT)
    other = mounted(site, "nbd", mount_cap(Mode.SINGLE_NODE_WRITER, "ext4"), 64 * MIB)
    writer = Writer(m.target)
    try:
        timeouts = {r.get("uri"): r.get("io_timeout") for r in _attach_records(site)}
        assert float(LONG_IO_TIMEOUT) in timeouts.values(), timeouts
        writer.start()
        assert writer.started_writing.wait(PROMPTLY)
        # the attach/detach controller gives up on the node: the export goes
        site.controller.ControllerUnpublishVolume(
            pb.ControllerUnpublishVolumeRequest(volume_id=m.vol.volume_id, node_id=m.node_id)
        )
        _fails_promptly(writer)
        _node_lets_go(site, m)
        _still_works(site, other)
    finally:
        writer.stopping.set()
        for v in (m, other):
            with contextlib.suppress(grpc.RpcError):
                v.teardown(site)


def _gone_longer_than_the_bound(on: Site, kind: str, io_timeout: str) -> float:
    """A writer on a staged volume whose storage node stops for good: the writer gets
    an error within the bound, then the node lets go (``_node_lets_go``).  Returns how
    long letting go took; the storage node is started again after."""
    m = _staged_with_io_timeout(on, io_timeout, kind)
    writer = Writer(m.target)
    stopped = False
    try:
        writer.start()
        assert writer.started_writing.wait(PROMPTLY)
        on.local_node.stop()
        stopped = True
        _fails_promptly(writer)
        started = time.monotonic()
        _node_lets_go(on, m)
        return time.monotonic() - started
    finally:
        writer.stopping.set()
        if stopped:
            _restart(on)
        with contextlib.suppress(grpc.RpcError):
            m.teardown(on)


def test_a_storage_node_gone_longer_than_io_timeout_fails_io_then_lets_go(site: Site) -> None:
    _gone_longer_than_the_bound(site, "nbd", "5")


def test_an_nfs_volume_whose_storage_node_is_gone_lets_go_once_the_bound_passed(
    site: Site,
) -> None:
    """Past the bound, unpublish and unstage wait on nothing: each bounded wait of the
    FUSE NFS mount is spent by then (kubelet's pod deletion waits on these calls)."""
    took = _gone_longer_than_the_bound(site, "nfs", str(NFS_IO_TIMEOUT))
    assert took < NFS_IO_TIMEOUT, f"unpublish and unstage took {took:.0f} s after the bound"


def test_unpublishing_an_nfs_volume_never_looks_into_its_mount(site: Site) -> None:
    """NodeUnpublishVolume only unbinds: it resolves the pod's target from the mount
    table, never by stat-ing into the volume, so a mount whose server is away (here:
    its FUSE process stopped, which answers nothing) costs it no wait at all."""
    m = _staged_with_io_timeout(site, LONG_IO_TIMEOUT, "nfs")
    (fuse,) = mount_processes(m.staging)
    os.kill(fuse, signal.SIGSTOP)
    try:
        time.sleep(2)  # past the mount's attribute cache: a stat would reach the process
        site.nodes.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=m.vol.volume_id, target_path=str(m.target)),
            timeout=PROMPTLY,
        )
        with open("/proc/self/mounts") as f:
            assert str(m.target) not in f.read()
    finally:
        os.kill(fuse, signal.SIGCONT)
        with contextlib.suppress(grpc.RpcError):
            m.teardown(site)


def test_a_storage_node_back_within_io_timeout_is_a_pause(site: Site) -> None:
    """Stopped and started again (its exports come back with it): the writer goes on,
    and what it wrote reads back equal after the volume is staged anew."""
    m = _staged_with_io_timeout(site, "300")
    sums: dict[str, str] = {}
    writer = ChecksumWriter(m.target, sums)
    try:
        writer.start()
        assert writer.started_writing.wait(PROMPTLY)
        site.local_node.stop()
        _restart(site)
        before = writer.written
        deadline = time.monotonic() + PROMPTLY
        while writer.written < before + 5:
            assert writer.error is None, writer.error
            assert time.monotonic() < deadline, "the writer did not resume"
            time.sleep(0.1)
        writer.stopping.set()
        writer.join(PROMPTLY)
        assert writer.error is None, writer.error
        # unstage and stage again: what is read comes from the storage node
        site.nodes.NodeUnpublishVolume(
            pb.NodeUnpublishVolumeRequest(volume_id=m.vol.volume_id, target_path=str(m.target))
        )
        site.nodes.NodeUnstageVolume(
            pb.NodeUnstageVolumeRequest(
                volume_id=m.vol.volume_id, staging_target_path=str(m.staging)
            )
        )
        m.stage(site)
        m.publish(site)
        for name, digest in sums.items():
            assert hashlib.sha256((m.target / name).read_bytes()).hexdigest() == digest, name
    finally:
        writer.stopping.set()
        with contextlib.suppress(grpc.RpcError):
            m.teardown(site)


class ChecksumWriter(Writer):
    """A Writer that writes new files and remembers each one's digest once fsynced."""

    def __init__(self, directory: Path, sums: dict[str, str]) -> None:
        super().__init__(directory)
        self.sums = sums

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                data = os.urandom(128 * 1024)
                name = f"c-{self.written:05d}.bin"
                with (self.directory / name).open("wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                self.sums[name] = hashlib.sha256(data).hexdigest()
                self.written += 1
                if self.written >= 3:
                    self.started_writing.set()
        except OSError as e:
            self.error = e
