"""CSI node steps that only a kernel with nbd.ko and the NFS client can take.

Run inside the kernel lane's guest by tests/kernel/test_csi_in_guest.py
(``MOORAGE_IN_GUEST`` set), against the host's storage node; never collected
on the host, whose kernel has neither.  The site (plugin in ``--mode all``,
kubelet's paths) is tests/csi_site.py's, as for tests/integration/test_csi_node.py.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from csi import attach, mounts
from csi.proto import csi_pb2 as pb
from tests.csi_site import (
    MIB,
    Mode,
    Site,
    mount_cap,
    mounted,
    site_fixture,  # noqa: F401  (the module-scoped site)
)


def _entry(path: os.PathLike[str] | str) -> mounts.MountEntry:
    found = mounts.mount_entry(str(path))
    assert found is not None, f"{path} is not mounted"
    return found


def test_the_plugin_takes_the_kernel_paths_here() -> None:
    plan = attach.probe()
    assert (plan.block, plan.nfs) == ("kernel-nbd", "kernel-nfs"), plan


def test_ext4_grows_online_on_a_kernel_nbd_device(site: Site) -> None:
    cap = mount_cap(Mode.SINGLE_NODE_WRITER, "ext4")
    m = mounted(site, "nbd", cap, 256 * MIB)
    try:
        device = _entry(m.staging).source
        assert device.startswith("/dev/nbd"), device
        data = os.urandom(16 * MIB)
        (m.target / "kept").write_bytes(data)
        os.sync()
        before = os.statvfs(m.target)
        assert m.controller_expand(site, 512 * MIB).node_expansion_required
        # while the pod runs: the filesystem stays mounted
        assert m.node_expand(site, 512 * MIB).capacity_bytes == 512 * MIB
        sectors = Path(f"/sys/block/{device[5:]}/size").read_text()
        assert int(sectors) * 512 == 512 * MIB
        after = os.statvfs(m.target)  # what df in the pod shows
        assert after.f_blocks * after.f_frsize >= before.f_blocks * before.f_frsize + 200 * MIB
        assert _entry(m.staging).source == device  # grown in place, never remounted
        assert hashlib.sha256((m.target / "kept").read_bytes()).digest() == (
            hashlib.sha256(data).digest()
        )
        (m.target / "after").write_bytes(os.urandom(300 * MIB))  # room only the growth gave
    finally:
        m.teardown(site)


def _nfs_mount(site: Site, flags: list[str], fstype: str, version: str) -> None:
    cap = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(mount_flags=flags),
        access_mode=Mode(mode=Mode.MULTI_NODE_MULTI_WRITER),
    )
    m = mounted(site, "nfs", cap, 64 * MIB)
    try:
        staged = _entry(m.staging)
        assert staged.fstype == fstype, staged
        assert f"vers={version}" in staged.super_options + staged.mount_options, staged
        (m.target / "written").write_text(f"over NFS {version}\n")
        assert (m.staging / "written").read_text() == f"over NFS {version}\n"
    finally:
        m.teardown(site)


def test_the_seeds_mount_options_give_a_kernel_nfs_4_1_mount(site: Site) -> None:
    # the seed's StorageClass: mountOptions: [nfsvers=4.1]
    _nfs_mount(site, ["nfsvers=4.1"], "nfs4", "4.1")


def test_nfsvers_3_gives_a_kernel_nfs_3_mount(site: Site) -> None:
    # NFSv3 locking needs rpc.statd, which a node without it is told to do without
    _nfs_mount(site, ["nfsvers=3", "nolock"], "nfs", "3")
