"""The kernel's own NBD client (nbd.ko, attached through netlink by ``moorage attach``)
against moorage's NBD server, in the lane's guest.

A second NBD client conformance check beside libnbd, qemu-nbd and nbdkit's
tests: the kernel sends what a filesystem makes it send (FUA and flushes from
the journal, trims from mkfs and fstrim), and the filesystems it made read
back equal and check clean.
"""

from __future__ import annotations

import json

import pytest

from backend.api.proto import backend_pb2 as pb
from tests.kernel.conftest import Store
from tests.kernel.guest import Lane

MIB = 1 << 20
SIZE = 512 * MIB  # xfsprogs 6 makes no filesystem under 300 MiB


def test_the_probe_picks_the_kernel_paths_in_the_guest(guest: Lane) -> None:
    plan = json.loads(guest.moorage("attach", "probe", "--json").stdout)
    assert plan["block"] == "kernel-nbd", plan
    assert plan["nfs"] == "kernel-nfs", plan
    assert guest.kernel_release.endswith("-cloud-amd64")


def _attach(guest: Lane, target: pb.PublishVolumeResponse, interface: str = "auto") -> str:
    """``moorage attach nbd`` in the guest: the device it made (/dev/nbdN)."""
    nbd = target.nbd
    uri = f"nbd://{nbd.host}:{nbd.port}/{nbd.export_name}"
    out = guest.moorage("attach", "nbd", uri, "--json", "--kernel-interface", interface)
    attached = json.loads(out.stdout)
    device = str(attached["device"])
    assert device.startswith("/dev/nbd"), attached
    return device


def _reads_back_equal(guest: Lane, device: str, mnt: str, volume: pb.Volume) -> None:
    """``data`` on ``device``, mounted read-only, has the sum written before."""
    out = guest.sh(
        f"mount -o ro {device} {mnt}\n"
        f"sha256sum {mnt}/data | cut -d' ' -f1\n"
        f"cat /tmp/{volume.name}.sum\n"
        f"umount {mnt}\n",
        timeout=300,
    ).stdout.split()
    assert out[0] == out[1], out


def _release(guest: Lane, store: Store, volume: pb.Volume, device: str, mnt: str) -> None:
    guest.run("umount", mnt, check=False)
    guest.moorage("detach", device, check=False)
    store.unpublish(volume)
    store.delete(volume)


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_a_filesystem_on_kernel_nbd_reads_back_equal_and_checks_clean(
    guest: Lane, store: Store, fs: str
) -> None:
    volume = store.volume("nbd", SIZE)
    device = _attach(guest, store.publish(volume))
    mnt = f"/mnt/{volume.name}"
    check = {"ext4": f"e2fsck -fn {device}", "xfs": f"xfs_repair -n {device}"}[fs]
    try:
        guest.sh(
            f"mkfs.{fs} -q {device}\n"
            f"mkdir -p {mnt} && mount {device} {mnt}\n"
            f"head -c {64 * MIB} /dev/urandom > {mnt}/data\n"
            f"sha256sum {mnt}/data | cut -d' ' -f1 > /tmp/{volume.name}.sum\n"
            f"sync {mnt}/data\n"
            f"rm -f {mnt}/data.old && fstrim -v {mnt}\n"
            f"umount {mnt}\n"
            f"{check}\n",
            timeout=600,
        )
        # detached and attached again: what is read comes from the server
        guest.moorage("detach", device)
        device = _attach(guest, store.publish(volume))
        _reads_back_equal(guest, device, mnt, volume)
    finally:
        _release(guest, store, volume, device, mnt)


def test_the_ioctl_interface_attaches_when_asked_and_netlink_reads_it_back(
    guest: Lane, store: Store
) -> None:
    """The older interface (the fallback for a kernel without nbd's netlink family):
    NBD_SET_* ioctls, then NBD_DO_IT in a process of its own."""
    volume = store.volume("nbd", 256 * MIB)
    device = _attach(guest, store.publish(volume), interface="ioctl")
    mnt = f"/mnt/{volume.name}"
    sysfs = f"/sys/block/{device[5:]}"
    try:
        # given through netlink only: an ioctl-made device has no backend identifier
        assert guest.run("test", "-e", f"{sysfs}/backend", check=False).rc == 1
        do_it = guest.run("cat", f"{sysfs}/pid").stdout.strip()
        assert "NBD_DO_IT" in guest.run("cat", f"/proc/{do_it}/cmdline").stdout
        guest.sh(
            f"mkfs.ext4 -q {device} && mkdir -p {mnt} && mount {device} {mnt}\n"
            f"head -c {16 * MIB} /dev/urandom > {mnt}/data\n"
            f"sha256sum {mnt}/data | cut -d' ' -f1 > /tmp/{volume.name}.sum\n"
            f"umount {mnt} && e2fsck -fn {device}\n",
            timeout=300,
        )
        guest.moorage("detach", device)
        assert guest.run("cat", f"{sysfs}/size").stdout.strip() == "0"
        device = _attach(guest, store.publish(volume), interface="netlink")
        assert "nbd://" in guest.run("cat", f"/sys/block/{device[5:]}/backend").stdout
        _reads_back_equal(guest, device, mnt, volume)
    finally:
        _release(guest, store, volume, device, mnt)
