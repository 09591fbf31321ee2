"""The kernel's NFS client against moorage's storage node (nfs-ganesha), in the
lane's guest: NFSv4.1 through ``moorage mount nfs`` (the kernel-nfs path, with
the mount options a node uses), NFSv3 with explicit NFS and MOUNT ports, the
same files seen through both, and files held open across a storage node's
restart.
"""

from __future__ import annotations

import json
import time

from backend.api.proto import backend_pb2 as pb
from tests.kernel.conftest import Store
from tests.kernel.guest import Lane

MIB = 1 << 20
SIZE = 512 * MIB


def _target(store: Store, volume: pb.Volume) -> pb.NfsTarget:
    return store.publish(volume).nfs


def _mounted_options(guest: Lane, mnt: str) -> tuple[str, str]:
    for line in guest.run("cat", "/proc/mounts").stdout.splitlines():
        fields = line.split()
        if fields[1] == mnt:
            return fields[2], fields[3]
    raise AssertionError(f"{mnt} is not mounted")


def test_nfs_4_1_and_3_mounts_of_one_volume_see_the_same_files(guest: Lane, store: Store) -> None:
    volume = store.volume("nfs", SIZE)
    nfs = _target(store, volume)
    v4, v3 = f"/mnt/{volume.name}-v4", f"/mnt/{volume.name}-v3"
    guest.run("mkdir", "-p", v4, v3)
    try:
        out = guest.moorage("mount", "nfs", f"{nfs.server}:{nfs.port}:{nfs.export_path}", v4)
        fstype, options = _mounted_options(guest, v4)
        assert fstype == "nfs4", (fstype, out.stdout)
        assert "vers=4.1" in options and "soft" in options, options
        guest.sh(
            f"mount -t nfs -o vers=3,proto=tcp,port={nfs.port},mountport={nfs.mount_port},"
            f"mountproto=tcp,nolock {nfs.server}:{nfs.export_path} {v3}"
        )
        assert _mounted_options(guest, v3)[0] == "nfs"
        sums = guest.sh(
            f"head -c {32 * MIB} /dev/urandom > {v4}/from-v4\n"
            f"sync {v4}/from-v4\n"
            f"head -c {8 * MIB} /dev/urandom > {v3}/from-v3\n"
            f"sync {v3}/from-v3\n"
            f"cd {v4} && sha256sum from-v4 from-v3\n"
            f"cd {v3} && sha256sum from-v4 from-v3\n",
            timeout=300,
        ).stdout.split()
        # (sum, name) pairs: as read through v4.1, then through v3
        assert sums[:4] == sums[4:], sums
    finally:
        guest.sh(f"umount {v3} || true")
        guest.moorage("unmount", v4, check=False)
        store.unpublish(volume)
        store.delete(volume)


HOLDER = """
exec 3>>{file}
echo before >&3
touch {ready}
while [ ! -e {go} ]; do sleep 0.2; done
echo after >&3
exec 3>&-
cat {file}
"""


def test_a_file_held_open_keeps_working_across_a_storage_node_restart(
    guest: Lane, store: Store
) -> None:
    """The storage node stops and starts again while a process holds a file open
    on the kernel NFSv4.1 mount: the same descriptor writes after it (no ESTALE)."""
    volume = store.volume("nfs", SIZE)
    nfs = _target(store, volume)
    mnt = f"/mnt/{volume.name}"
    guest.run("mkdir", "-p", mnt)
    file, ready, go = f"{mnt}/held", f"/tmp/{volume.name}.ready", f"/tmp/{volume.name}.go"
    try:
        guest.moorage("mount", "nfs", f"{nfs.server}:{nfs.port}:{nfs.export_path}", mnt)
        script = HOLDER.format(file=file, ready=ready, go=go)
        guest.spawn("holder", "sh", "-euc", script, log=f"/tmp/{volume.name}.log")
        deadline = time.monotonic() + 60
        while guest.run("test", "-e", ready, check=False).rc != 0:
            assert time.monotonic() < deadline, "the holder did not open its file"
            time.sleep(0.5)
        assert store.node.stop() == 0
        store.node.start()
        guest.run("touch", go)
        assert guest.wait("holder", 120) == 0, guest.run("cat", f"/tmp/{volume.name}.log").stdout
        assert guest.run("cat", f"/tmp/{volume.name}.log").stdout.split() == ["before", "after"]
    finally:
        guest.run("touch", go)
        guest.wait("holder", 60)
        guest.moorage("unmount", mnt, check=False)
        store.unpublish(volume)
        store.delete(volume)


def test_the_guest_has_no_route_beyond_the_lane(guest: Lane) -> None:
    """The guest's only route is the lane's subnet: it reaches the storage node and
    nothing beyond it (no default route, no other interface)."""
    routes = guest.run("ip", "-j", "route").stdout
    assert [r["dst"] for r in json.loads(routes)] == ["10.252.0.0/24"], routes
