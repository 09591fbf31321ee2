"""The FUSE NFS mount (``fuse.nfsmount``) against a real nfs-ganesha 4.3.

One ganesha per module (its supervisor runs ``trio.run`` in a thread of its
own) exports a directory of a fresh tmpfs over NFSv3 and v4, with
``no_root_squash``, on free loopback ports.  Every test mounts that export
with ``python -m fuse.nfsmount`` in a subprocess (attribute and entry
timeouts 0, so what another client changed is seen at once), works in a
directory of its own, and checks what it did through the mount against the
exported directory itself.  Teardown unmounts (lazily when busy), reaps the
mount process, kills what is left, and stops ganesha.

Why this file is long: the tests go through the file operations one by one, each checked
against the exported directory, and then the mount process's own life; they share one
real nfs-ganesha per module, whose harness (and the FUSE mounts') is
``tests/fuse_nfs_mount.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fuse import libnfs, nfsmount
from fuse.nfsmount import FSTYPE, MountError, mount_nfs, unmount
from fuse.process import fusectl
from tests.fuse_nfs_mount import (
    FuseMount,
    Ganesha,
    fuse_mount,
    fuse_nfs_mounts,
    mounted_here,
    process_alive,
    running_ganesha,
)
from tests.ganesha_env import ganesha_pids

MiB = 1 << 20
NOBODY = 65534


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def ganesha() -> Iterator[Ganesha]:
    with running_ganesha() as g:
        yield g


@pytest.fixture
def mount(ganesha: Ganesha) -> Iterator[FuseMount]:
    with fuse_mount(ganesha, uuid.uuid4().hex[:12]) as m:
        yield m


@dataclass
class Workspace:
    """One test's directory: through the mount, and on the exported file system."""

    mounted: Path
    backing: Path


@pytest.fixture
def work(ganesha: Ganesha, mount: FuseMount, request: pytest.FixtureRequest) -> Workspace:
    name = f"{request.node.name[:40]}-{uuid.uuid4().hex[:6]}"
    (ganesha.directory / name).mkdir()
    return Workspace(mount.mountpoint / name, ganesha.directory / name)


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


# ------------------------------------------------------------------ bindings


def test_struct_layouts_match_the_libnfs_4_0_0_headers() -> None:
    # sizeof/offsetof printed by a C program built against libnfs-dev 4.0.0-1+deb12u1
    assert ctypes.sizeof(libnfs._NFSStat64) == 136
    assert libnfs._NFSStat64.nfs_used.offset == 128
    assert ctypes.sizeof(libnfs._NFSStatvfs64) == 88
    assert ctypes.sizeof(libnfs._NFSDirent) == 160
    offsets = {
        "inode": 16,
        "type": 24,
        "mode": 28,
        "size": 32,
        "atime": 40,
        "uid": 88,
        "nlink": 96,
        "dev": 104,
        "used": 136,
        "atime_nsec": 144,
        "ctime_nsec": 152,
    }
    assert {f: getattr(libnfs._NFSDirent, f).offset for f in offsets} == offsets
    assert ctypes.sizeof(libnfs._NFSUrl) == 24


def another_client(ganesha: Ganesha) -> contextlib.AbstractContextManager[libnfs.NFSContext]:
    """A libnfs client of the export, beside the FUSE mount."""
    return libnfs.mounted(
        "127.0.0.1",
        ganesha.export.pseudo,
        nfs_port=ganesha.core.nfs_port,
        mount_port=ganesha.mount_port,
    )


def test_bindings_talk_nfsv3_to_the_export(ganesha: Ganesha) -> None:
    with another_client(ganesha) as nfs:
        name = f"/bind-{uuid.uuid4().hex[:8]}"
        assert nfs.lstat("/").ino == ganesha.directory.stat().st_ino
        f = nfs.create(name, os.O_RDWR | os.O_EXCL, 0o640)
        try:
            data = os.urandom(3 * MiB + 17)  # above readmax/writemax: libnfs splits it
            assert nfs.pwrite(f, 5, data) == len(data)
            nfs.fsync(f)
            assert nfs.pread(f, 5, len(data) + 100) == data
            assert nfs.fstat(f).size == len(data) + 5
        finally:
            nfs.close(f)
        with pytest.raises(FileExistsError):
            nfs.create(name, os.O_RDWR | os.O_EXCL, 0o600)
        backing = ganesha.directory / name[1:]
        assert stat.S_IMODE(backing.stat().st_mode) == 0o640
        nfs.lchown(name, 1234, -1)
        assert (backing.stat().st_uid, backing.stat().st_gid) == (1234, 0)
        entries = {e.name: e.stat for e in nfs.listdir("/")}
        assert entries[name[1:].encode()].ino == backing.stat().st_ino
        assert stat.S_ISREG(entries[name[1:].encode()].mode)
        assert stat.S_ISDIR(entries[b"."].mode)
        with pytest.raises(FileNotFoundError) as missing:
            nfs.open("/no-such-file", os.O_RDONLY)
        assert "NFS3ERR_NOENT" in str(missing.value)
        nfs.unlink(name)
        assert not backing.exists()


# ------------------------------------------------------------------ files and directories


def test_create_write_read_rename_delete(work: Workspace) -> None:
    path = work.mounted / "hello.txt"
    path.write_bytes(b"hello over fuse and nfs\n")
    assert (work.backing / "hello.txt").read_bytes() == b"hello over fuse and nfs\n"
    assert path.read_bytes() == b"hello over fuse and nfs\n"
    with path.open("ab") as f:
        f.write(b"appended\n")
    with path.open("r+b") as f:
        f.seek(6)
        f.write(b"OVER")
    assert path.read_bytes() == b"hello OVER fuse and nfs\nappended\n"
    st = path.stat()
    assert st.st_ino == (work.backing / "hello.txt").stat().st_ino
    assert st.st_size == len(b"hello OVER fuse and nfs\nappended\n")

    path.rename(work.mounted / "renamed.txt")
    assert not path.exists()
    assert sorted(os.listdir(work.backing)) == ["renamed.txt"]
    assert (work.mounted / "renamed.txt").read_bytes().startswith(b"hello OVER")

    # replacing a name the kernel knows: the name now leads to the moved file
    (work.mounted / "other.txt").write_text("to be replaced\n")
    moved_ino = (work.mounted / "renamed.txt").stat().st_ino
    assert (work.mounted / "other.txt").stat().st_ino != moved_ino
    (work.mounted / "renamed.txt").rename(work.mounted / "other.txt")
    assert (work.mounted / "other.txt").stat().st_ino == moved_ino
    (work.mounted / "other.txt").rename(work.mounted / "renamed.txt")

    os.link(work.mounted / "renamed.txt", work.mounted / "hard.txt")
    assert (work.mounted / "hard.txt").stat().st_nlink == 2
    assert (work.backing / "hard.txt").stat().st_ino == (work.backing / "renamed.txt").stat().st_ino

    (work.mounted / "renamed.txt").unlink()
    (work.mounted / "hard.txt").unlink()
    assert os.listdir(work.mounted) == []
    assert os.listdir(work.backing) == []


def test_directories_nest_rename_and_remove(work: Workspace) -> None:
    top = work.mounted / "a"
    (top / "b" / "c").mkdir(parents=True)
    (top / "b" / "c" / "deep.txt").write_text("deep\n")
    assert (work.backing / "a" / "b" / "c" / "deep.txt").read_text() == "deep\n"
    assert stat.S_ISDIR((top / "b").stat().st_mode)

    # paths of everything below a renamed directory follow it
    deep = top / "b" / "c" / "deep.txt"
    assert deep.read_text() == "deep\n"
    top.rename(work.mounted / "z")
    assert not top.exists()
    assert (work.mounted / "z" / "b" / "c" / "deep.txt").read_text() == "deep\n"
    (work.mounted / "z" / "b" / "c" / "deep.txt").unlink()
    (work.mounted / "z" / "b" / "c").rmdir()
    (work.mounted / "z" / "b").rmdir()
    (work.mounted / "z").rmdir()
    assert os.listdir(work.backing) == []

    (work.mounted / "d").mkdir(mode=0o750)
    assert stat.S_IMODE((work.backing / "d").stat().st_mode) == 0o750
    assert [e.name for e in os.scandir(work.mounted)] == ["d"]
    os.mkfifo(work.mounted / "fifo")
    assert stat.S_ISFIFO((work.backing / "fifo").stat().st_mode)
    assert stat.S_ISFIFO((work.mounted / "fifo").lstat().st_mode)


def test_symlink_and_readlink(work: Workspace) -> None:
    (work.mounted / "target.txt").write_text("through the link\n")
    os.symlink("target.txt", work.mounted / "link")
    os.symlink("../elsewhere/none", work.mounted / "dangling")
    assert os.readlink(work.mounted / "link") == "target.txt"
    assert os.readlink(work.backing / "link") == "target.txt"
    assert stat.S_ISLNK((work.mounted / "link").lstat().st_mode)
    assert (work.mounted / "link").read_text() == "through the link\n"
    assert os.readlink(work.mounted / "dangling") == "../elsewhere/none"
    assert not (work.mounted / "dangling").exists()
    assert sorted(os.listdir(work.mounted)) == ["dangling", "link", "target.txt"]


def test_chmod_chown_truncate_and_utime(work: Workspace) -> None:
    path = work.mounted / "attrs.bin"
    backing = work.backing / "attrs.bin"
    path.write_bytes(b"x" * 10_000)

    path.chmod(0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(backing.stat().st_mode) == 0o600
    os.chown(path, 1234, 5678)
    assert (path.stat().st_uid, path.stat().st_gid) == (1234, 5678)
    assert (backing.stat().st_uid, backing.stat().st_gid) == (1234, 5678)
    os.chown(path, -1, 42)
    assert (backing.stat().st_uid, backing.stat().st_gid) == (1234, 42)

    os.truncate(path, 4096)
    assert path.stat().st_size == 4096 == backing.stat().st_size
    with path.open("r+b") as f:
        os.ftruncate(f.fileno(), 100_000)  # grows, sparse
        assert os.fstat(f.fileno()).st_size == 100_000
    assert path.read_bytes() == b"x" * 4096 + bytes(100_000 - 4096)

    atime, mtime = 1_600_000_000_123_456_000, 1_700_000_000_654_321_000
    os.utime(path, ns=(atime, mtime))
    assert (path.stat().st_atime_ns, path.stat().st_mtime_ns) == (atime, mtime)
    assert backing.stat().st_mtime_ns == mtime
    # only mtime: atime stays
    os.utime(path, ns=(path.stat().st_atime_ns, 1_650_000_000_000_000_000))
    os.utime(path)  # now
    assert path.stat().st_mtime_ns > 1_700_000_000_000_000_000


def test_kernel_enforces_modes_and_callers_own_what_they_create(work: Workspace) -> None:
    secret = work.mounted / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    public = work.mounted / "public"
    public.write_text("anyone\n")
    public.chmod(0o644)
    work.mounted.chmod(0o755)

    denied = as_nobody("cat", str(secret))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    allowed = as_nobody("cat", str(public))
    assert allowed.returncode == 0 and allowed.stdout == "anyone\n", allowed
    cannot_write = as_nobody("sh", "-c", f"echo x >> {public}")
    assert cannot_write.returncode != 0 and "Permission denied" in cannot_write.stderr
    cannot_create = as_nobody("touch", str(work.mounted / "new"))
    assert cannot_create.returncode != 0, cannot_create

    shared = work.mounted / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    made = as_nobody("sh", "-c", f"echo mine > {shared}/by-nobody && mkdir {shared}/dir-nobody")
    assert made.returncode == 0, made
    for name in ("by-nobody", "dir-nobody"):
        st = (work.backing / "shared" / name).stat()
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
    # the sticky bit: nobody may not remove root's file from the shared directory
    (shared / "roots").write_text("root's\n")
    sticky = as_nobody("rm", "-f", str(shared / "roots"))
    assert sticky.returncode != 0 and (shared / "roots").exists(), sticky


def test_a_tree_of_1000_files(work: Workspace) -> None:
    started = time.monotonic()
    names = {f"d{i % 10}/file-{i:04d}.txt" for i in range(1000)}
    for d in range(10):
        (work.mounted / f"d{d}").mkdir()
    for name in sorted(names):
        (work.mounted / name).write_text(f"content of {name}\n")
    created = time.monotonic()

    listed = {f"{d.name}/{f.name}" for d in os.scandir(work.mounted) for f in os.scandir(d.path)}
    assert listed == names
    assert sum(len(os.listdir(work.mounted / f"d{d}")) for d in range(10)) == 1000
    assert {str(p.relative_to(work.backing)) for p in work.backing.rglob("*.txt")} == names
    for name in sorted(names):
        assert (work.mounted / name).read_text() == f"content of {name}\n"
    read = time.monotonic()

    for name in sorted(names):
        (work.mounted / name).unlink()
    for d in range(10):
        (work.mounted / f"d{d}").rmdir()
    assert os.listdir(work.mounted) == [] == os.listdir(work.backing)
    print(
        f"\n1000 files: create {created - started:.1f}s, list+read {read - created:.1f}s, "
        f"delete {time.monotonic() - read:.1f}s"
    )


def test_listing_is_neither_skipped_nor_repeated_while_entries_are_removed(
    work: Workspace,
) -> None:
    # 600 names need several READDIR requests from the kernel: offsets resume the listing
    names = {f"entry-with-a-fairly-long-name-{i:05d}" for i in range(600)}
    for name in names:
        (work.backing / name).touch()
    seen: list[str] = []
    with os.scandir(work.mounted) as entries:
        for entry in entries:
            seen.append(entry.name)
            os.unlink(entry.path)
    assert len(seen) == len(set(seen)) == 600
    assert set(seen) == names
    assert os.listdir(work.mounted) == []


def test_mount_reads_ahead_and_keeps_more_requests_in_flight(mount: FuseMount) -> None:
    """Read-ahead (and so the size of FUSE reads) and the background limit are raised.

    The read-ahead only once FUSE_INIT is answered: set before, the kernel
    lowers it again to what pyfuse3 answers.
    """
    dev = os.stat(mount.mountpoint).st_dev  # a request after FUSE_INIT
    bdi = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    assert int(bdi.read_text()) == nfsmount.READ_AHEAD_KIB
    (background,) = fusectl(os.minor(dev), {"max_background": None})
    assert int(background) == nfsmount.BACKGROUND_LIMIT


def test_statvfs_matches_the_exported_file_system(ganesha: Ganesha, mount: FuseMount) -> None:
    def figures(path: Path) -> tuple[int, int, int, int]:
        st = os.statvfs(path)
        return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, st.f_files, st.f_ffree

    size, avail, files, ffree = figures(mount.mountpoint)
    b_size, b_avail, b_files, b_ffree = figures(ganesha.directory)
    assert size == b_size == 512 * MiB
    assert abs(avail - b_avail) <= MiB
    assert files == b_files
    assert abs(ffree - b_ffree) <= 16

    filler = mount.mountpoint / f"filler-{uuid.uuid4().hex[:6]}"
    filler.write_bytes(b"\xa5" * (32 * MiB))
    try:
        used = avail - figures(mount.mountpoint)[1]
        assert 31 * MiB <= used <= 34 * MiB
        assert abs(figures(mount.mountpoint)[1] - figures(ganesha.directory)[1]) <= MiB
    finally:
        filler.unlink()

    df = subprocess.run(
        ["df", "-B1", "--output=source,fstype,size", str(mount.mountpoint)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.splitlines()[1]
    source, fstype, df_size = df.split()
    assert source == f"moorage-nfs:127.0.0.1:{ganesha.export.pseudo}"
    assert fstype == f"fuse.{FSTYPE}"
    assert int(df_size) == 512 * MiB


def test_a_second_mount_sees_the_first_ones_changes(ganesha: Ganesha, work: Workspace) -> None:
    with fuse_mount(ganesha, f"second-{uuid.uuid4().hex[:6]}") as second:
        there = second.mountpoint / work.mounted.name
        (work.mounted / "shared.txt").write_text("version one\n")
        assert (there / "shared.txt").read_text() == "version one\n"

        # rewritten in place, longer: size and data are fresh at the next open
        (work.mounted / "shared.txt").write_text("version two, a longer one\n")
        assert (there / "shared.txt").read_text() == "version two, a longer one\n"
        with (there / "shared.txt").open("a") as f:
            f.write("appended by the second mount\n")
        assert (work.mounted / "shared.txt").read_text().endswith("by the second mount\n")

        (work.mounted / "shared.txt").rename(work.mounted / "moved.txt")
        assert sorted(os.listdir(there)) == ["moved.txt"]
        with pytest.raises(FileNotFoundError):
            (there / "shared.txt").open()
        (work.mounted / "moved.txt").unlink()
        assert os.listdir(there) == []
        assert not (there / "moved.txt").exists()

        (work.mounted / "sub").mkdir()
        (work.mounted / "sub" / "x").write_bytes(b"1")
        assert (there / "sub" / "x").read_bytes() == b"1"
        (there / "sub" / "x").chmod(0o604)
        assert stat.S_IMODE((work.mounted / "sub" / "x").stat().st_mode) == 0o604


def test_changes_by_another_client_are_seen(ganesha: Ganesha, work: Workspace) -> None:
    # Another NFS client (not the exported directory itself: ganesha caches
    # what it serves and does not see changes made behind its back at once).
    with another_client(ganesha) as other:
        here = f"/{work.mounted.name}"

        def other_writes(name: str, data: bytes) -> None:
            f = other.create(f"{here}/{name}", os.O_WRONLY, 0o644)
            try:
                other.pwrite(f, 0, data)
                other.fsync(f)
            finally:
                other.close(f)

        (work.mounted / "x").write_text("first x\n")
        with (work.mounted / "x").open("rb") as first:
            first_ino = os.fstat(first.fileno()).st_ino
            other.rename(f"{here}/x", f"{here}/y")
            other_writes("x", b"a new x, longer than the first\n")
            # the open file is still the first x, though its path now names another
            assert os.fstat(first.fileno()).st_ino == first_ino
            assert os.fstat(first.fileno()).st_size == len("first x\n")
            assert first.read() == b"first x\n"
        assert (work.mounted / "x").read_text() == "a new x, longer than the first\n"
        assert (work.mounted / "x").stat().st_ino != first_ino
        assert (work.mounted / "y").stat().st_ino == first_ino

        (work.mounted / "dir").mkdir()
        (work.mounted / "dir" / "inside").write_text("inside\n")
        assert os.listdir(work.mounted / "dir") == ["inside"]
        other.rename(f"{here}/dir", f"{here}/dir2")
        other.mkdir(f"{here}/dir")
        assert os.listdir(work.mounted / "dir") == []
        assert os.listdir(work.mounted / "dir2") == ["inside"]
        assert (work.mounted / "dir2" / "inside").read_text() == "inside\n"
        other_writes("new-file", b"new\n")
        assert sorted(os.listdir(work.mounted)) == ["dir", "dir2", "new-file", "x", "y"]


def test_read_ahead_is_not_served_after_another_client_rewrites_the_file(
    ganesha: Ganesha, work: Workspace
) -> None:
    """Close-to-open: chunks read ahead for one open never answer a later open."""
    with another_client(ganesha) as other:
        path = f"/{work.mounted.name}/big"
        first, second = os.urandom(8 * MiB), os.urandom(8 * MiB)
        (work.mounted / "big").write_bytes(first)
        with (work.mounted / "big").open("rb") as f:
            assert f.read(4 * MiB) == first[: 4 * MiB]  # sequential: chunks fetched ahead
            handle = other.open(path, os.O_WRONLY)
            try:
                other.pwrite(handle, 0, second)
                other.fsync(handle)
            finally:
                other.close(handle)
        assert (work.mounted / "big").read_bytes() == second
        # And written through the mount while open for reading: the new bytes.
        with (work.mounted / "big").open("r+b") as f:
            assert f.read(2 * MiB) == second[: 2 * MiB]
            f.seek(2 * MiB)
            f.write(first[: 2 * MiB])
            f.flush()
            f.seek(2 * MiB)
            assert f.read(2 * MiB) == first[: 2 * MiB]


def test_errors_are_errnos(work: Workspace) -> None:
    with pytest.raises(FileNotFoundError):
        (work.mounted / "missing").open()
    with pytest.raises(FileNotFoundError):
        (work.mounted / "missing" / "below").write_text("x")
    (work.mounted / "full" / "inner").mkdir(parents=True)
    with pytest.raises(OSError) as not_empty:
        (work.mounted / "full").rmdir()
    assert not_empty.value.errno == errno.ENOTEMPTY
    with pytest.raises(FileExistsError):
        (work.mounted / "full").mkdir()
    (work.mounted / "file").write_text("x")
    with pytest.raises(FileExistsError):
        os.open(work.mounted / "file", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    with pytest.raises(NotADirectoryError):
        (work.mounted / "file" / "child").mkdir()
    with pytest.raises(IsADirectoryError):
        (work.mounted / "full").open("w")
    with pytest.raises(OSError) as not_dir:
        os.rmdir(work.mounted / "file")
    assert not_dir.value.errno == errno.ENOTDIR

    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, noreplace, exchange = -100, 1, 2

    def renameat2(old: Path, new: Path, flags: int) -> int:
        ret = libc.renameat2(at_fdcwd, bytes(old), at_fdcwd, bytes(new), flags)
        return 0 if ret == 0 else ctypes.get_errno()

    assert renameat2(work.mounted / "file", work.mounted / "full", noreplace) == errno.EEXIST
    assert renameat2(work.mounted / "file", work.mounted / "full", exchange) == errno.EINVAL
    assert renameat2(work.mounted / "file", work.mounted / "other", noreplace) == 0
    assert sorted(os.listdir(work.backing)) == ["full", "other"]


def test_100_mib_sequential_write_and_read(ganesha: Ganesha, work: Workspace) -> None:
    data = os.urandom(100 * MiB)
    digest = hashlib.sha256(data).hexdigest()
    path = work.mounted / "big.bin"

    view = memoryview(data)
    started = time.monotonic()
    with path.open("wb", buffering=0) as f:
        for offset in range(0, len(data), MiB):
            f.write(view[offset : offset + MiB])
        os.fsync(f.fileno())
    write_s = time.monotonic() - started
    back = bytearray(len(data))
    into = memoryview(back)
    started = time.monotonic()
    with path.open("rb", buffering=0) as f:  # a fresh open drops the page cache
        done = 0
        while n := f.readinto(into[done : done + MiB]):
            done += n
    read_s = time.monotonic() - started
    assert done == len(data)
    assert hashlib.sha256(back).hexdigest() == digest
    assert hashlib.sha256((work.backing / "big.bin").read_bytes()).hexdigest() == digest
    path.unlink()

    # the same through libnfs's own nfs-cp, from and to a tmpfs
    local = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        (local / "big.bin").write_bytes(data)
        name = f"{work.mounted.name}/nfs-cp.bin"
        started = time.monotonic()
        subprocess.run(
            ["nfs-cp", str(local / "big.bin"), ganesha.url(name)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        cp_write_s = time.monotonic() - started
        started = time.monotonic()
        subprocess.run(
            ["nfs-cp", ganesha.url(name), str(local / "back.bin")],
            check=True,
            capture_output=True,
            timeout=120,
        )
        cp_read_s = time.monotonic() - started
        assert hashlib.sha256((local / "back.bin").read_bytes()).hexdigest() == digest
    finally:
        shutil.rmtree(local)
    mib = len(data) / MiB
    print(
        f"\n100 MiB through the FUSE mount: write {mib / write_s:.0f} MiB/s, "
        f"read {mib / read_s:.0f} MiB/s; nfs-cp: write {mib / cp_write_s:.0f} MiB/s, "
        f"read {mib / cp_read_s:.0f} MiB/s"
    )


# ------------------------------------------------------------------ the mount process


def test_mount_nfs_in_the_background_then_unmount(ganesha: Ganesha) -> None:
    mountpoint = ganesha.base / "mnt" / f"api-{uuid.uuid4().hex[:6]}"
    mountpoint.mkdir(parents=True)
    pid = mount_nfs(
        "127.0.0.1",
        ganesha.core.nfs_port,
        ganesha.mount_port,
        ganesha.export.pseudo,
        mountpoint,
        foreground=False,
        cache_timeout=0,
    )
    try:
        assert mounted_here(mountpoint)
        assert os.getsid(pid) == pid  # its own session: it outlives its starter
        name = f"api-{uuid.uuid4().hex[:6]}.txt"
        (mountpoint / name).write_text("via mount_nfs\n")
        assert (ganesha.directory / name).read_text() == "via mount_nfs\n"
        (mountpoint / name).unlink()
        unmount(mountpoint)
        assert not mounted_here(mountpoint)
        deadline = time.monotonic() + 20
        while process_alive(pid):  # reaped by the subprocess module, not by us
            assert time.monotonic() < deadline, "the mount process outlived its mount"
            time.sleep(0.05)
        with pytest.raises(MountError, match=r"fusermount3 -u .* exited 1: "):
            unmount(mountpoint)
    finally:
        if mounted_here(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], timeout=30, check=False)
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_unmounts_and_exits(ganesha: Ganesha) -> None:
    with fuse_mount(ganesha, f"term-{uuid.uuid4().hex[:6]}") as m:
        assert os.listdir(m.mountpoint) is not None
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(20) == 0
        assert not mounted_here(m.mountpoint)
        assert "SIGTERM: unmounting" in m.log_text()


def test_a_refused_mount_says_why_and_leaves_nothing(ganesha: Ganesha) -> None:
    mountpoint = ganesha.base / "mnt" / f"refused-{uuid.uuid4().hex[:6]}"
    mountpoint.mkdir(parents=True)
    before = fuse_nfs_mounts()
    with pytest.raises(MountError, match="MNT3ERR_ACCES"):
        mount_nfs(
            "127.0.0.1",
            ganesha.core.nfs_port,
            ganesha.mount_port,
            "/volumes/not-exported",
            mountpoint,
            foreground=False,
        )
    with pytest.raises(MountError, match="not a directory"):
        mount_nfs(
            "127.0.0.1",
            ganesha.core.nfs_port,
            ganesha.mount_port,
            ganesha.export.pseudo,
            mountpoint / "missing",
            foreground=False,
        )
    assert fuse_nfs_mounts() == before
    leftovers = subprocess.run(
        ["pgrep", "-f", f"fuse.nfsmount .* {mountpoint}"], capture_output=True, timeout=10
    )
    assert leftovers.stdout == b""


def test_teardown_after_a_failure_leaves_no_mount_process_or_ganesha() -> None:
    class Boom(Exception):
        pass

    busy = None
    try:
        with pytest.raises(Boom), running_ganesha(size="64m") as g, fuse_mount(g, "failing") as m:
            # a file left open keeps the mount busy: teardown must get rid of it anyway
            busy = (m.mountpoint / "open.txt").open("wb")
            raise Boom
        assert m.proc.returncode is not None
        assert not mounted_here(m.mountpoint)
        assert ganesha_pids(g.files.main_file) == []
        assert not g.base.exists()
        assert not any(str(g.base) in line for line in fuse_nfs_mounts())
    finally:
        if busy is not None:
            with contextlib.suppress(OSError):
                busy.close()


def test_a_deleted_directory_still_bound_is_stale_and_lets_go(
    work: Workspace, tmp_path: Path
) -> None:
    """kubelet's subPath: a directory of the volume bind-mounted into a container,
    then deleted through the volume.  As with a kernel NFS client the bind answers
    ESTALE (ENOENT kept kubelet's clean-up from ever finishing), and it unmounts."""
    sub = work.mounted / "sub"
    sub.mkdir()
    (sub / "file").write_text("x")
    bound = tmp_path / "container-path"
    bound.mkdir()
    subprocess.run(["mount", "--bind", str(sub), str(bound)], check=True, timeout=30)
    try:
        assert (bound / "file").read_text() == "x"
        (sub / "file").unlink()
        sub.rmdir()
        with pytest.raises(OSError) as stale:
            os.stat(bound)
        assert stale.value.errno == errno.ESTALE
    finally:
        subprocess.run(["umount", str(bound)], check=True, timeout=30)
    bound.rmdir()  # nothing left mounted there
    assert not sub.exists()
