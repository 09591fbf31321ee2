"""One NFSv3 export mounted on a directory through libnfs and FUSE.

For hosts without a kernel NFS client.  The mount runs in a process of its
own (``python -m fuse.nfsmount SERVER:PORT:/PATH MOUNTPOINT``) that lives as
long as the mount: :func:`serve` is that process's work, :func:`mount_nfs`
starts it (or serves in the caller) and :func:`unmount` ends it.  What it
serves is :class:`fuse.nfsfilesystem.NFSFilesystem`, whose requests run on
a pool of libnfs contexts (:mod:`fuse.nfscontexts`).

The kernel's read-ahead on the mount is raised to 1 MiB once FUSE_INIT is
answered (pyfuse3 answers 128 KiB, and the kernel lowers the window to
that), which makes its reads up to 1 MiB.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, overload

import pyfuse3
import trio

from fuse import cgroup
from fuse.nfscontexts import ContextPool
from fuse.nfsfilesystem import DEFAULT_CACHE_TIMEOUT, ROOT, NFSFilesystem
from fuse.process import (
    EarlyStop,
    ReadySignal,
    await_ready,
    configure_logging,
    raise_background_limit,
    run_fuse_loop,
    set_read_ahead,
)
from hostio import tools
from hostio.mountinfo import read_mountinfo

log = logging.getLogger("moorage.fuse.nfs")
# How long an NFS call waits for a server that went away before it fails
# with EIO (the same bound as the block path's, fuse.nbdconnections), and
# the most it may be.
DEFAULT_IO_TIMEOUT: Final = 120.0
MAX_IO_TIMEOUT: Final = 86400.0

FSTYPE: Final = "moorage-nfs"  # the FUSE subtype: /proc/mounts says fuse.moorage-nfs
DEFAULT_CONTEXTS: Final = 4
# Asynchronous FUSE requests the kernel keeps in flight (its default: 12).
BACKGROUND_LIMIT: Final = 32
# The kernel's read-ahead on the mount, and so the size of its reads.
READ_AHEAD_KIB: Final = 1024
_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")
_EXPORT_PATH = re.compile(r"/[A-Za-z0-9._/-]*")


class MountError(RuntimeError):
    """A mount or unmount that did not happen, with the reason."""


# ------------------------------------------------------------------ the export


@dataclass(frozen=True)
class NFSExport:
    """Where an export is: ``server:port:/path`` plus the MOUNT protocol's port."""

    server: str
    port: int
    path: str
    mount_port: int | None = None

    def __post_init__(self) -> None:
        # fsname becomes a mount option: no commas, spaces or quotes may reach it
        if not _HOST.fullmatch(self.server):
            raise ValueError(f"NFS server must be a host name or address: {self.server!r}")
        if not _EXPORT_PATH.fullmatch(self.path):
            raise ValueError(f"NFS export path must be an absolute path: {self.path!r}")
        for port in (self.port, self.mount_port):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"port out of range: {port}")

    @classmethod
    def parse(cls, text: str, mount_port: int | None = None) -> NFSExport:
        """``SERVER:PORT:/PATH`` (an IPv6 server in brackets)."""
        match = re.fullmatch(r"(\[[^\]]*\]|[^:]+):(\d+):(/.*)", text)
        if match is None:
            raise ValueError(f"expected SERVER:PORT:/PATH, not {text!r}")
        return cls(match[1], int(match[2]), match[3], mount_port)

    @property
    def host(self) -> str:
        """The server as a socket address (no brackets)."""
        return self.server.strip("[]")

    @property
    def fsname(self) -> str:
        return f"{FSTYPE}:{self.server}:{self.path}"


# ------------------------------------------------------------------ running a mount


def mount_options(export: NFSExport, *, allow_other: bool = True) -> set[str]:
    options = {f"fsname={export.fsname}", f"subtype={FSTYPE}", "default_permissions"}
    if allow_other:
        options.add("allow_other")
    return options


def serve(
    export: NFSExport,
    mountpoint: str | os.PathLike[str],
    *,
    contexts: int = DEFAULT_CONTEXTS,
    cache_timeout: float = DEFAULT_CACHE_TIMEOUT,
    timeout: float | None = None,
    allow_other: bool = True,
    ready: Callable[[], None] | None = None,
) -> None:
    """Mount and serve in this process until unmounted or sent SIGTERM/SIGINT.

    ``ready`` is called once the mount is in place.  SIGTERM/SIGINT unmount
    the directory before this returns (a second one abandons NFS calls still
    waiting on the server).
    """
    if not os.path.isdir(mountpoint):
        raise NotADirectoryError(errno.ENOTDIR, "mount point is not a directory", mountpoint)
    stop = EarlyStop()
    stop.install()
    pool: ContextPool | None = None
    try:
        pool = ContextPool.mount(export, contexts, timeout)
        root_fileid = pool.run_now(lambda c: c.lstat(ROOT).ino)
        if stop.signal is not None:
            return
        filesystem = NFSFilesystem(pool, root_fileid, cache_timeout)
        options = mount_options(export, allow_other=allow_other)
        pyfuse3.init(filesystem, os.fspath(mountpoint), options)
        raise_background_limit(mountpoint, BACKGROUND_LIMIT)
        filesystem.after_init = lambda: set_read_ahead(mountpoint, READ_AHEAD_KIB)
        try:
            trio.run(run_fuse_loop, ready, stop)
        finally:
            pyfuse3.close(unmount=True)
    finally:
        if pool is not None:
            pool.close()
        stop.restore()


@overload
def mount_nfs(
    server: str,
    port: int,
    mount_port: int | None,
    export_path: str,
    mountpoint: str | os.PathLike[str],
    *,
    foreground: Literal[True] = ...,
    contexts: int = ...,
    cache_timeout: float = ...,
    timeout: float | None = ...,
    allow_other: bool = ...,
    ready_timeout: float = ...,
    log_file: str | os.PathLike[str] | None = ...,
) -> None: ...


@overload
def mount_nfs(
    server: str,
    port: int,
    mount_port: int | None,
    export_path: str,
    mountpoint: str | os.PathLike[str],
    *,
    foreground: Literal[False],
    contexts: int = ...,
    cache_timeout: float = ...,
    timeout: float | None = ...,
    allow_other: bool = ...,
    ready_timeout: float = ...,
    log_file: str | os.PathLike[str] | None = ...,
) -> int: ...


def mount_nfs(
    server: str,
    port: int,
    mount_port: int | None,
    export_path: str,
    mountpoint: str | os.PathLike[str],
    *,
    foreground: bool = True,
    contexts: int = DEFAULT_CONTEXTS,
    cache_timeout: float = DEFAULT_CACHE_TIMEOUT,
    timeout: float | None = None,
    allow_other: bool = True,
    ready_timeout: float = 60.0,
    log_file: str | os.PathLike[str] | None = None,
) -> int | None:
    """Mount ``server:port:export_path`` on ``mountpoint`` over NFSv3.

    ``foreground``: serve in this process until unmounted (returns None).
    Otherwise start ``python -m fuse.nfsmount`` in a session of its own,
    wait until its mount is in place and return its pid; it serves until
    :func:`unmount` (or SIGTERM).  A mount that fails raises
    :class:`MountError` with the reason.  The background process logs to
    ``log_file`` (nowhere if None) and runs from "/": it outlives its caller
    and must hold neither the caller's stderr nor its working directory.
    """
    export = NFSExport(server, port, export_path, mount_port)
    if foreground:
        serve(
            export,
            mountpoint,
            contexts=contexts,
            cache_timeout=cache_timeout,
            timeout=timeout,
            allow_other=allow_other,
        )
        return None
    argv = [
        sys.executable,
        "-m",
        "fuse.nfsmount",
        f"{export.server}:{export.port}:{export.path}",
        os.path.abspath(mountpoint),
        "--contexts",
        str(contexts),
        "--cache-timeout",
        str(cache_timeout),
    ]
    if mount_port is not None:
        argv += ["--mount-port", str(mount_port)]
    if timeout is not None:
        argv += ["--timeout", str(timeout)]
    if not allow_other:
        argv.append("--no-allow-other")
    what = f"{export.fsname} on {os.fspath(mountpoint)}"
    return _start_mount_process(argv, mountpoint, what, ready_timeout, log_file)


def _start_mount_process(
    argv: list[str],
    mountpoint: str | os.PathLike[str],
    what: str,
    ready_timeout: float,
    log_file: str | os.PathLike[str] | None,
) -> int:
    """Run a mount process (``argv`` without ``--ready-fd``); its pid once it is ready."""
    mounted_before = is_mounted(mountpoint)
    log_fd = (
        os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        if log_file is not None
        else subprocess.DEVNULL
    )
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [*argv, "--ready-fd", str(write_end)],
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log_fd,
            cwd="/",
            start_new_session=True,
        )
        cgroup.adopt(proc.pid)  # in a container: out of its cgroups (fuse/cgroup.py)
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
        if log_fd != subprocess.DEVNULL:
            os.close(log_fd)

    def unmount_if_mounted() -> None:
        if not mounted_before and is_mounted(mountpoint):  # killed after mounting
            unmount(mountpoint, lazy=True)

    answer = await_ready(
        proc, read_end, ready_timeout, unmount_if_mounted, lambda: "it stopped before mounting"
    )
    if answer.failure is None:
        return proc.pid
    raise MountError(f"{what}: mount process {answer.failure}")


def is_mounted(mountpoint: str | os.PathLike[str]) -> bool:
    """Whether a moorage FUSE NFS mount sits on ``mountpoint`` (per /proc/self/mountinfo)."""
    target = os.path.abspath(mountpoint)
    try:
        entries = read_mountinfo()
    except FileNotFoundError:  # no /proc
        return False
    return any(e.mount_point == target and e.fstype == f"fuse.{FSTYPE}" for e in entries)


def unmount(mountpoint: str | os.PathLike[str], *, lazy: bool = False, timeout: float = 30) -> None:
    """Unmount a FUSE mount with ``fusermount3 -u``; the mount process then exits."""
    argv = ["fusermount3", "-u", *(["-z"] if lazy else []), os.fspath(mountpoint)]
    try:
        tools.run(argv, timeout=timeout)
    except tools.ToolError as e:
        raise MountError(str(e)) from e


# ------------------------------------------------------------------ command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fuse.nfsmount",
        description="Mount an NFSv3 export through libnfs and FUSE; runs until unmounted.",
    )
    parser.add_argument("export", help="SERVER:PORT:/PATH")
    parser.add_argument("mountpoint")
    parser.add_argument("--mount-port", type=int, help="the MOUNT protocol's port (no portmapper)")
    parser.add_argument("--ready-fd", type=int, help='write "ready" here, not to stdout')
    parser.add_argument("--contexts", type=int, default=DEFAULT_CONTEXTS, help="NFS connections")
    parser.add_argument("--cache-timeout", type=float, default=DEFAULT_CACHE_TIMEOUT)
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_IO_TIMEOUT,
        help="seconds an NFS call waits for a server that went away, then EIO "
        f"(default {DEFAULT_IO_TIMEOUT:.0f})",
    )
    parser.add_argument("--no-allow-other", dest="allow_other", action="store_false")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    configure_logging(args.debug)
    signal_ = ReadySignal(args.ready_fd)

    try:
        export = NFSExport.parse(args.export, args.mount_port)
        if args.contexts < 1:
            raise ValueError("--contexts must be at least 1")
        if not 0 < args.timeout <= MAX_IO_TIMEOUT:
            raise ValueError(f"--timeout must be more than 0 and at most {MAX_IO_TIMEOUT:.0f}")
        serve(
            export,
            args.mountpoint,
            contexts=args.contexts,
            cache_timeout=args.cache_timeout,
            timeout=args.timeout,
            allow_other=args.allow_other,
            ready=signal_.ready,
        )
    except (OSError, ValueError, RuntimeError) as e:
        log.error("%s", e)
        signal_.failed(e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
