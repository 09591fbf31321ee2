"""NodeGetInfo's ``max_volumes_per_node`` (``csi.attach.limits``): the counting
rules over a faked /sys/block, nbds_max and /proc/meminfo, and what the node
service counts as its own from its records.  The count over the plugin's socket,
with real attachments, is tests/integration/test_csi_volume_limits.py's."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from csi import attach
from csi.attach import limits
from csi.config import ConfigError, NodeConfig, parse_config
from csi.node import NodeService
from csi.nodestate import NodeState, StagedVolume
from csi.proto import csi_pb2 as pb
from nbd import kernel as nbd_kernel

KERNEL = attach.Plan("kernel-nbd", "faked", "kernel-nfs", "faked")
FUSE = attach.Plan("fuse-loop", "faked", "fuse-nfs", "faked")
NONE = attach.Plan(None, "faked", None, "faked")
KERNEL_NFS_ONLY = attach.Plan(None, "faked", "kernel-nfs", "faked")
FUSE_NFS_ONLY = attach.Plan(None, "faked", "fuse-nfs", "faked")
MIB = 1 << 20


@pytest.fixture
def sys_block(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    root = tmp_path / "sys-block"
    root.mkdir()
    monkeypatch.setattr(nbd_kernel, "SYS_BLOCK", root)
    nbds_max = tmp_path / "nbds_max"
    monkeypatch.setattr(limits, "NBDS_MAX", nbds_max)
    monkeypatch.setattr(limits, "nbd_netlink", lambda: False)  # ioctl unless a test says
    return root


def nbd(sys_block: Path, index: int, *, pid: int | None = None, size: int = 0) -> None:
    """An nbd device as sysfs shows it: ``pid`` only while connected; size in sectors."""
    device = sys_block / f"nbd{index}"
    device.mkdir()
    (device / "size").write_text(f"{size}\n")
    if pid is not None:
        (device / "pid").write_text(f"{pid}\n")


@pytest.fixture
def meminfo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "meminfo"
    monkeypatch.setattr(limits, "MEMINFO", path)
    return path


def write_meminfo(path: Path, *, total_mib: int, available_mib: int | None, free_mib: int) -> None:
    lines = [f"MemTotal:       {total_mib * 1024} kB", f"MemFree:        {free_mib * 1024} kB"]
    if available_mib is not None:
        lines.append(f"MemAvailable:   {available_mib * 1024} kB")
    lines.append("Buffers:          1024 kB")
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------ kernel nbd


def test_kernel_count_is_ours_plus_the_devices_nobody_uses(sys_block: Path) -> None:
    for i in range(8):
        nbd(sys_block, i)
    nbd(sys_block, 8, pid=4242, size=2048)  # ours (in the records) or anyone's: busy
    nbd(sys_block, 9, pid=4243, size=2048)
    (sys_block / "loop0").mkdir()  # not an nbd device
    limit = attach.volume_limit(KERNEL, ours=1)
    assert (limit.count, limit.free) == (9, 8)
    assert "ioctl: a pool of the 10 nbd device(s) present, 2 busy" in limit.reason


def test_a_device_taken_by_someone_else_lowers_the_count(sys_block: Path) -> None:
    for i in range(4):
        nbd(sys_block, i)
    before = attach.volume_limit(KERNEL, ours=0).count
    (sys_block / "nbd2" / "pid").write_text("777\n")  # nbd-client, not the plugin
    assert (before, attach.volume_limit(KERNEL, ours=0).count) == (4, 3)


def test_a_device_with_a_size_but_no_connection_yet_is_not_free(sys_block: Path) -> None:
    """The ioctl path sets the size before the connection's pid appears."""
    nbd(sys_block, 0)
    nbd(sys_block, 1, size=2048)
    (sys_block / "nbd2").mkdir()  # size unreadable: never offered
    assert attach.volume_limit(KERNEL, ours=0).free == 1


def test_over_netlink_the_pool_is_a_policy_not_nbds_max(
    sys_block: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A netlink connect without an index makes a device when none is unused,
    whatever nbds_max is: the pool is max(present, nbds_max, 16), less the busy."""
    monkeypatch.setattr(limits, "nbd_netlink", lambda: True)
    limits.NBDS_MAX.write_text("4\n")
    for i in range(4):
        nbd(sys_block, i)
    assert attach.volume_limit(KERNEL, ours=0).count == 16  # not 4
    for i in range(4):
        (sys_block / f"nbd{i}" / "pid").write_text("9\n")
    limit = attach.volume_limit(KERNEL, ours=4)
    assert (limit.count, limit.free) == (16, 12)
    assert "netlink" in limit.reason
    limits.NBDS_MAX.write_text("0\n")
    nbd(sys_block, 4, pid=10, size=8)  # made on connect
    assert attach.volume_limit(KERNEL, ours=5).count == 16
    limits.NBDS_MAX.write_text("32\n")
    assert attach.volume_limit(KERNEL, ours=5).count == 32
    for i in range(5, 40):
        nbd(sys_block, i)
    assert attach.volume_limit(KERNEL, ours=5).count == 40  # more than the policy exist


def test_over_ioctl_only_the_devices_present_count(sys_block: Path) -> None:
    """The ioctls attach existing devices only: nbds_max=0 adds no pool."""
    limits.NBDS_MAX.write_text("0\n")
    assert attach.volume_limit(KERNEL, ours=0).count == 1  # nothing to attach: the floor
    nbd(sys_block, 0)
    nbd(sys_block, 1, pid=3, size=8)
    limit = attach.volume_limit(KERNEL, ours=1)
    assert (limit.count, limit.free) == (2, 1)
    assert "ioctl" in limit.reason


def test_the_configured_nbd_pool_replaces_the_automatic_rule(
    sys_block: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """node.nbd_devices: over netlink the pool itself (above or below 16); over
    the ioctls at most the devices present."""
    limits.NBDS_MAX.write_text("16\n")
    for i in range(16):
        nbd(sys_block, i, pid=i + 1, size=8)  # a node holding 16 nbd volumes
    monkeypatch.setattr(limits, "nbd_netlink", lambda: True)
    assert attach.volume_limit(KERNEL, ours=16).count == 16
    limit = attach.volume_limit(KERNEL, ours=16, nbd_pool=64)
    assert (limit.count, limit.free) == (64, 48)
    assert "node.nbd_devices" in limit.reason
    assert attach.volume_limit(KERNEL, ours=16, nbd_pool=8).count == 16  # none free
    config = parse_config({"node": {"nbd_devices": 40}}).node
    node = NodeService("node-a", "127.0.0.1", config, tmp_path / "state", plan=KERNEL)
    assert node.volume_limit().free == 40 - 16
    monkeypatch.setattr(limits, "nbd_netlink", lambda: False)
    for i in range(16, 20):
        nbd(sys_block, i)
    assert attach.volume_limit(KERNEL, ours=16, nbd_pool=64).count == 20  # the 4 free ones
    assert attach.volume_limit(KERNEL, ours=0, nbd_pool=18).count == 2  # 18 of 20, 16 busy


def test_a_pid_check_that_fails_counts_the_device_busy(
    sys_block: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbd(sys_block, 0)
    nbd(sys_block, 1)
    real_exists = Path.exists

    def exists(path: Path) -> bool:
        if path == sys_block / "nbd1" / "pid":
            raise OSError(errno.EIO, "I/O error")
        return real_exists(path)

    monkeypatch.setattr(Path, "exists", exists)
    assert limits.nbd_devices() == limits.NBDDevices(free=1, busy=1)


def test_with_nothing_free_the_count_is_what_the_node_holds_and_never_0(sys_block: Path) -> None:
    """0 would tell kubelet "no limit": the floor is 1."""
    limits.NBDS_MAX.write_text("2\n")
    nbd(sys_block, 0, pid=1, size=8)
    nbd(sys_block, 1, pid=2, size=8)
    assert attach.volume_limit(KERNEL, ours=2).count == 2
    assert attach.volume_limit(KERNEL, ours=0).count == 1


# ------------------------------------------------------------------ FUSE path


def test_fuse_count_is_ours_plus_what_memory_available_allows(meminfo: Path) -> None:
    write_meminfo(meminfo, total_mib=8192, available_mib=1000, free_mib=200)
    limit = attach.volume_limit(FUSE, ours=3, attachment_bytes=64 * MIB)
    assert (limit.count, limit.free) == (3 + 1000 // 64, 1000 // 64)
    assert "1000 MiB available, 64 MiB per attachment" in limit.reason


def test_fuse_count_follows_memory_available_not_the_total(meminfo: Path) -> None:
    write_meminfo(meminfo, total_mib=8192, available_mib=4096, free_mib=100)
    roomy = attach.volume_limit(FUSE, ours=0).count
    write_meminfo(meminfo, total_mib=8192, available_mib=256, free_mib=100)
    tight = attach.volume_limit(FUSE, ours=0).count
    assert (roomy, tight) == (64, 4)


def test_the_budget_per_attachment_divides_memory(meminfo: Path) -> None:
    write_meminfo(meminfo, total_mib=8192, available_mib=1024, free_mib=100)
    assert attach.volume_limit(FUSE, ours=0, attachment_bytes=256 * MIB).count == 4
    assert attach.volume_limit(FUSE, ours=0, attachment_bytes=1 << 40).count == 1  # the floor


def test_memfree_stands_in_where_the_kernel_has_no_memavailable(meminfo: Path) -> None:
    write_meminfo(meminfo, total_mib=8192, available_mib=None, free_mib=640)
    assert attach.volume_limit(FUSE, ours=0).free == 10


def test_fuse_count_is_bounded(meminfo: Path) -> None:
    write_meminfo(meminfo, total_mib=1 << 20, available_mib=1 << 20, free_mib=1 << 20)
    assert attach.volume_limit(FUSE, ours=5).count == limits.MAX_FUSE_ATTACHMENTS


def test_unreadable_meminfo_leaves_only_what_the_node_holds(meminfo: Path) -> None:
    limit = attach.volume_limit(FUSE, ours=3)  # the file does not exist
    assert (limit.count, limit.free) == (3, 0)
    assert "unreadable" in limit.reason


def test_kernel_nfs_without_a_block_path_has_a_fixed_bound() -> None:
    """NFS volumes need no block device: the node is not capped at what it holds."""
    counts = [attach.volume_limit(KERNEL_NFS_ONLY, ours=n).count for n in (0, 1, 3)]
    assert counts == [limits.MAX_FUSE_ATTACHMENTS] * 3
    assert attach.volume_limit(KERNEL_NFS_ONLY, ours=2000).count == 2000


def test_fuse_nfs_without_a_block_path_counts_the_memory_budget(meminfo: Path) -> None:
    write_meminfo(meminfo, total_mib=8192, available_mib=1000, free_mib=200)
    limit = attach.volume_limit(FUSE_NFS_ONLY, ours=3)
    assert (limit.count, limit.free) == (3 + 1000 // 64, 1000 // 64)
    assert "fuse-nfs" in limit.reason


def test_no_block_path_counts_only_what_the_node_holds() -> None:
    assert attach.volume_limit(NONE, ours=0).count == 1
    assert attach.volume_limit(NONE, ours=4).count == 4


# ---------------------------------------------------- the node service's part


def record(volume_id: str, *, kind: str = "nbd", ephemeral: bool = False) -> StagedVolume:
    return StagedVolume(
        volume_id=volume_id,
        staging_path=f"/var/lib/kubelet/x/{volume_id}",
        kind=kind,
        access="mount",
        ephemeral=ephemeral,
    )


def test_the_node_counts_its_records_but_not_inline_ephemeral_volumes(
    sys_block: Path, tmp_path: Path
) -> None:
    """The scheduler counts PVC-backed volumes only; an inline ephemeral volume's
    device is busy, so it is not free either."""
    for i in range(4):
        nbd(sys_block, i)
    state = NodeState(tmp_path / "state")
    state.create()
    for r in (record("sn-a/v1"), record("sn-a/v2", kind="nfs"), record("e1", ephemeral=True)):
        state.put(r)
    (state.volumes / "damaged.json").write_text("{")  # unreadable: not counted
    node = NodeService("node-a", "127.0.0.1", NodeConfig(), tmp_path / "state", plan=KERNEL)
    limit = node.volume_limit()
    assert (limit.ours, limit.count) == (2, 6)


def test_the_configured_budget_reaches_the_count(meminfo: Path, tmp_path: Path) -> None:
    write_meminfo(meminfo, total_mib=8192, available_mib=1024, free_mib=100)
    config = parse_config({"node": {"fuse_attachment_mib": 128}}).node
    node = NodeService("node-a", "127.0.0.1", config, tmp_path / "state", plan=FUSE)
    assert node.volume_limit().count == 8


@pytest.mark.parametrize("value", [0, -1, (1 << 20) + 1, 1.5, True, "64"])
def test_a_bad_budget_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="fuse_attachment_mib"):
        parse_config({"node": {"fuse_attachment_mib": value}})


@pytest.mark.parametrize("value", [-1, 65537, 16.0, True, "16"])
def test_a_bad_nbd_pool_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="nbd_devices"):
        parse_config({"node": {"nbd_devices": value}})


def test_the_nbd_pool_is_automatic_unless_set() -> None:
    assert parse_config({"node": {}}).node.nbd_devices == 0
    assert parse_config({"node": {"nbd_devices": 0}}).node.nbd_devices == 0
    assert parse_config({"node": {"nbd_devices": 65536}}).node.nbd_devices == 65536


def test_node_get_info_answers_when_counting_fails(
    sys_block: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error while counting must not fail NodeGetInfo (kubelet would
    unregister the driver): the last good count, never 0."""
    for i in range(4):
        nbd(sys_block, i)
    node = NodeService("node-a", "127.0.0.1", NodeConfig(), tmp_path / "state", plan=KERNEL)
    node.state.create()
    node.state.put(record("sn-a/v1"))
    node.state.put(record("sn-a/v2"))

    def broken() -> object:
        raise OSError(errno.EIO, "I/O error")

    request = pb.NodeGetInfoRequest()
    with monkeypatch.context() as m:
        m.setattr(node.state, "scan", broken)
        first = node.NodeGetInfo(request, None).max_volumes_per_node  # type: ignore[arg-type]
    assert first == 2  # nothing counted yet: what the records directory lists
    good = node.NodeGetInfo(request, None).max_volumes_per_node  # type: ignore[arg-type]
    monkeypatch.setattr(limits, "nbd_devices", broken)
    after = node.NodeGetInfo(request, None).max_volumes_per_node  # type: ignore[arg-type]
    assert (good, after) == (6, 6)
