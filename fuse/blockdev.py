"""An NBD export as a block device without kernel NBD: the FUSE block file plus a loop device.

What the CSI node and the CLI call.  :func:`attach_fuse_block` starts
``python -m fuse.blockfile`` (in a session of its own, so it outlives the
caller), waits until its mount is ready, and binds a loop device to the
export's file; :func:`detach_fuse_block` undoes it.  Each attachment is a
directory under ``STATE_DIR/fuse-block/`` named after the URI:

- ``attachment.json``: the record (URI, mount point, process, device),
  written atomically and durably before each step it describes is taken
  (``state`` "attaching" until the device exists), so a caller that
  restarts finds everything it made, whole or half-made.  A record that
  cannot be read is reported (:class:`UnreadableRecord`) and what it
  describes is left as it is, never taken for a half-made attachment;
- ``mnt/``: the FUSE mount (``mnt/disk`` is the export);
- ``blockfile.log``: the FUSE process's log.

The state directory must not be on a device this module attached: the FUSE
process must never write through its own loop device.

``workers`` (processes serving the FUSE file, :mod:`fuse.blockfile`) is kept
in the record as the process was started with it, and shown by
:func:`list_attachments`; it is not an attachment's lasting setting.  The CSI
node (``csi/attach/block.py``) passes none, so production runs one process,
and an attachment that an attach call repairs is started again with the
``workers`` of *that* call.  ``--workers`` serves benchmarks and tests until
it is shown to pay (docs/performance.md); a server without multi-conn gets
one process whatever was asked.  ``nbd_client`` (the block file's
``--nbd-client``) is the same kind of setting: the CSI node passes none
(``auto``: moorage's pipelined client on a plain socket, libnbd for TLS);
benchmarks and tests pass ``libnbd`` to compare.  It is kept in the record
as the process was started with it.

The loop device's logical block size is the export's minimum block size,
at least 512 (:func:`loop_block_size`, as the kernel nbd path has it): a
device with 512-byte sectors on an export with a 4 KiB minimum would take
requests the server refuses (EINVAL: mkfs, 512-byte direct I/O), so they
are refused at the device instead.  The FUSE process says the minimum in
its ready line (it is what the server told its connections); an export
whose minimum is above 4 KiB is refused.

Attach is idempotent (the same URI gives the attachment that exists, or
repairs a half-made one); detach is idempotent and refuses a device that is
still mounted (:class:`fuse.loop.LoopBusy`), since the FUSE process must
outlive every user of the device.  A process is recognised by its pid *and*
start time, so a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from fuse import cgroup
from fuse.blockfile import DEFAULT_WORKERS, DISK, FSTYPE, MAX_WORKERS, REFRESH, stop_bound
from fuse.loop import (
    LoopError,
    attach_loop,
    detach_loop,
    find_loops,
    loop_backing_file,
    refresh_capacity,
)
from fuse.nbdconnections import DEFAULT_CONNECTIONS, DEFAULT_IO_TIMEOUT, NBD_CLIENTS
from fuse.process import await_ready
from hostio import tools
from hostio.atomicfile import write_atomically
from hostio.mountinfo import read_mountinfo

log = logging.getLogger("moorage.fuse.blockdev")

SUBDIR: Final = "fuse-block"
RECORD: Final = "attachment.json"
LOG: Final = "blockfile.log"
MOUNTPOINT: Final = "mnt"
READY_TIMEOUT: Final = 60.0
MAX_LOOP_BLOCK_SIZE: Final = 4096  # what fuse.loop.attach_loop takes (the page size)
_URI_SCHEMES: Final = ("nbd://", "nbds://", "nbd+unix://", "nbds+unix://")


class BlockAttachError(RuntimeError):
    """An attach or detach that did not happen, with the reason."""


class UnreadableRecord(BlockAttachError):
    """An attachment record that exists but cannot be read.  What it describes
    (a process, a mount, a loop device) is unknown, so it is neither listed
    nor undone: it is reported, and left for the operator."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"attachment record {path} is unreadable ({reason[:200]}): its FUSE process "
            "and loop device are left as they are; repair or remove the file"
        )


@dataclass(frozen=True)
class Attachment:
    """An export attached as ``device`` through the FUSE process ``pid``."""

    device: str
    uri: str
    mountpoint: str
    pid: int
    pid_start: int = 0  # the process's start time (clock ticks after boot)
    connections: int = DEFAULT_CONNECTIONS
    io_timeout: float = DEFAULT_IO_TIMEOUT  # seconds I/O waits for a lost server
    workers: int = DEFAULT_WORKERS  # processes serving the FUSE file

    @property
    def file(self) -> str:
        """The export as a file: the loop device's backing file."""
        return os.path.join(self.mountpoint, DISK)

    @property
    def log_file(self) -> str:
        """The FUSE process's log (kept until detach)."""
        return os.path.join(os.path.dirname(self.mountpoint), LOG)


# ------------------------------------------------------------------ records


def _root(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / SUBDIR


def _key(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()[:16]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` atomically and durably."""
    write_atomically(path, json.dumps(data, indent=1, sort_keys=True))


def _read_record(directory: Path) -> dict[str, Any] | None:
    """The attachment's record; None if it has none; :class:`UnreadableRecord`."""
    path = directory / RECORD
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # a torn write cannot happen (rename), damage can
        raise UnreadableRecord(path, str(e)) from e
    try:
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        _attachment(data)
    except (KeyError, ValueError, TypeError) as e:
        raise UnreadableRecord(path, f"{type(e).__name__}: {e}") from e
    return data


def _attachment(data: dict[str, Any]) -> Attachment | None:
    if data.get("state") != "attached" or not data.get("device"):
        return None
    return Attachment(
        device=str(data["device"]),
        uri=str(data["uri"]),
        mountpoint=str(data["mountpoint"]),
        pid=int(data["pid"]),
        pid_start=int(data.get("pid_start", 0)),
        connections=int(data.get("connections", DEFAULT_CONNECTIONS)),
        io_timeout=float(data.get("io_timeout") or DEFAULT_IO_TIMEOUT),
        workers=int(data.get("workers") or DEFAULT_WORKERS),
    )


@contextlib.contextmanager
def _locked(state_dir: str | os.PathLike[str], key: str) -> Iterator[Path]:
    """The attachment's directory, with its lock held (one attach/detach at a time)."""
    root = _root(state_dir)
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"{key}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield root / key


def list_attachments(state_dir: str | os.PathLike[str]) -> list[Attachment]:
    """Every complete attachment recorded under ``state_dir`` (healthy or not)."""
    found = []
    root = _root(state_dir)
    if not root.is_dir():
        return []
    for directory in sorted(root.iterdir()):
        try:
            data = _read_record(directory) if directory.is_dir() else None
        except UnreadableRecord:
            continue  # reported by reconcile_attachments and record_problem
        attachment = _attachment(data) if data is not None else None
        if attachment is not None:
            found.append(attachment)
    return found


def record_problem(uri: str, state_dir: str | os.PathLike[str]) -> str | None:
    """Why the record of ``uri``'s attachment cannot be read (None: it can, or there is none)."""
    directory = _root(state_dir) / _key(uri)
    try:
        _read_record(directory)
    except UnreadableRecord as e:
        return str(e)
    return None


# ------------------------------------------------------------------ processes, mounts


def _start_time(pid: int) -> int | None:
    """The process's start time, or None if it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _alive(pid: int, start: int) -> bool:
    return pid > 0 and _start_time(pid) == start


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):  # not our child: init reaps it
        os.waitpid(pid, os.WNOHANG)


def _stop_process(pid: int, start: int, timeout: float) -> None:
    """SIGTERM (it unmounts and exits), then SIGKILL after ``timeout``."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        if not _alive(pid, start):
            break
        os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap(pid)
            if not _alive(pid, start):
                break
            time.sleep(0.05)
    _reap(pid)
    if _alive(pid, start):
        raise BlockAttachError(f"FUSE process {pid} does not exit")


def is_mounted(mountpoint: str | os.PathLike[str]) -> bool:
    """Whether a FUSE block file mount sits on ``mountpoint`` (per /proc/self/mountinfo)."""
    target = os.path.abspath(mountpoint)
    return any(e.mount_point == target and e.fstype == f"fuse.{FSTYPE}" for e in read_mountinfo())


def _unmount(mountpoint: str | os.PathLike[str], timeout: float = 30.0) -> None:
    """Lazily unmount what a dead FUSE process left (its connection is gone anyway)."""
    argv = ["fusermount3", "-u", "-z", os.fspath(mountpoint)]
    try:
        tools.run(argv, timeout=timeout)
    except tools.ToolError as e:
        # a failure that left nothing mounted there did what was asked
        if e.returncode is None or is_mounted(mountpoint):
            raise BlockAttachError(str(e)) from e


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def _start_blockfile(
    uri: str,
    directory: Path,
    connections: int,
    timeout: float,
    ready_timeout: float,
    workers: int = DEFAULT_WORKERS,
    nbd_client: str = "auto",
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """``python -m fuse.blockfile`` on ``directory/mnt``, once it is ready; with what
    its ready line said (the export's ``minimum_block_size``)."""
    mountpoint = directory / MOUNTPOINT
    argv = [sys.executable, "-m", "fuse.blockfile", uri, os.fspath(mountpoint)]
    argv += ["--connections", str(connections), "--timeout", str(timeout)]
    argv += ["--workers", str(workers), "--nbd-client", nbd_client]
    read_end, write_end = os.pipe()
    try:
        with (directory / LOG).open("ab") as log_file:
            proc = subprocess.Popen(
                [*argv, "--ready-fd", str(write_end)],
                pass_fds=(write_end,),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives whoever asked for it
                cwd="/",
            )
        cgroup.adopt(proc.pid)  # and, in a container, outlives its cgroups too
    except BaseException:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)

    def unmount_if_mounted() -> None:
        if is_mounted(mountpoint):
            _unmount(mountpoint)

    answer = await_ready(
        proc, read_end, ready_timeout, unmount_if_mounted, lambda: _log_tail(directory / LOG)
    )
    if answer.failure is None:
        return proc, answer.facts
    raise BlockAttachError(f"{uri}: FUSE block file {answer.failure}")


def loop_block_size(minimum: int) -> int:
    """The loop device's logical block size for an export whose minimum block size
    is ``minimum``: 512, or the minimum where it is larger (as the kernel nbd path
    has it), so that no request the device takes is one the server refuses.  A
    loop device takes at most :data:`MAX_LOOP_BLOCK_SIZE`: a larger minimum is
    refused (:class:`BlockAttachError`)."""
    size = max(512, minimum)
    if size > MAX_LOOP_BLOCK_SIZE:
        raise BlockAttachError(
            f"the export's minimum block size is {minimum} bytes: a loop device takes "
            f"at most {MAX_LOOP_BLOCK_SIZE}"
        )
    return size


# ------------------------------------------------------------------ attach, detach


def is_healthy(attachment: Attachment) -> bool:
    """Its process alive, its FUSE file mounted, and the loop device on that file."""
    return _healthy(attachment)


def _healthy(attachment: Attachment) -> bool:
    return (
        _alive(attachment.pid, attachment.pid_start)
        and is_mounted(attachment.mountpoint)
        and loop_backing_file(attachment.device) == attachment.file
    )


def _still_ours(device: str, directory: Path) -> bool:
    """Whether ``device``, recorded by the attachment in ``directory``, is still bound to
    its FUSE file after the FUSE process died: its mount is gone, and the path with it
    (sysfs then says ``/disk``, and the kernel cannot stat the file any more).  It is
    ours unless another attachment records the same device (the number was reused)."""
    if loop_backing_file(device) != f"/{DISK}":
        return False
    for other in directory.parent.iterdir():
        if other != directory and other.is_dir():
            try:
                data = _read_record(other)
            except UnreadableRecord:
                continue
            if data is not None and data.get("device") == device:
                return False
    return True


def _undo(directory: Path, data: dict[str, Any] | None, timeout: float | None = None) -> bool:
    """Take down whatever of an attachment exists; True if anything did.  The
    process gets ``timeout`` seconds after SIGTERM (by default its own
    :func:`fuse.blockfile.stop_bound` for the workers it was started with)."""
    mountpoint = directory / MOUNTPOINT
    file = os.fspath(mountpoint / DISK)
    did = False
    devices = set(find_loops(file))
    recorded = data.get("device") if data else None
    if recorded and (loop_backing_file(recorded) == file or _still_ours(str(recorded), directory)):
        devices.add(str(recorded))
    for device in sorted(devices):
        did |= detach_loop(device)  # LoopBusy (mounted) propagates: the caller unmounts first
    pid, start = (int(data.get("pid") or 0), int(data.get("pid_start") or 0)) if data else (0, 0)
    if _alive(pid, start):
        if timeout is None:
            timeout = stop_bound(_recorded_workers(data))
        _stop_process(pid, start, timeout)
        did = True
    if is_mounted(mountpoint):
        _unmount(mountpoint)
        did = True
    for name in (RECORD, LOG):
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    with contextlib.suppress(FileNotFoundError):
        mountpoint.rmdir()
    with contextlib.suppress(FileNotFoundError):
        directory.rmdir()
    return did or data is not None


def _recorded_workers(data: dict[str, Any] | None) -> int:
    try:
        return max(1, int((data or {}).get("workers") or DEFAULT_WORKERS))
    except (TypeError, ValueError):
        return MAX_WORKERS  # unknown: the longest a process may take


def attach_fuse_block(
    uri: str,
    state_dir: str | os.PathLike[str],
    *,
    connections: int = DEFAULT_CONNECTIONS,
    timeout: float = DEFAULT_IO_TIMEOUT,
    direct_io: bool = True,
    ready_timeout: float = READY_TIMEOUT,
    workers: int = DEFAULT_WORKERS,
    nbd_client: str = "auto",
) -> Attachment:
    """Attach the NBD export ``uri`` as a loop device through the FUSE block file.

    ``connections``: NBD connections when the server offers multi-conn.
    ``timeout``: how long I/O waits for a server that went away before it
    fails with EIO (a definitive answer, such as the export being gone, fails
    it at once; see :mod:`fuse.nbdconnections`).  ``direct_io``: the loop device
    bypasses the page cache of the file (see :mod:`fuse.loop`).  ``workers``:
    processes serving the FUSE file (see :mod:`fuse.blockfile`).  ``nbd_client``:
    one of :data:`fuse.nbdconnections.NBD_CLIENTS` (the block file's ``--nbd-client``).
    """
    if not uri.startswith(_URI_SCHEMES) or any(c in uri for c in "\0\n"):
        raise ValueError(f"not an NBD URI: {uri!r}")
    if connections < 1:
        raise ValueError(f"connections must be at least 1, not {connections}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    if nbd_client not in NBD_CLIENTS:
        raise ValueError(f"nbd_client must be one of {', '.join(NBD_CLIENTS)}, not {nbd_client!r}")
    key = _key(uri)
    with _locked(state_dir, key) as directory:
        data = _read_record(directory)
        existing = _attachment(data) if data is not None else None
        if existing is not None and existing.uri == uri and _healthy(existing):
            return existing
        if data is not None or directory.exists():
            log.warning("%s: repairing a broken or half-made attachment", uri)
            _undo(directory, data)
        (directory / MOUNTPOINT).mkdir(parents=True)
        record: dict[str, Any] = {
            "uri": uri,
            "mountpoint": os.fspath((directory / MOUNTPOINT).absolute()),
            "connections": connections,
            "io_timeout": timeout,
            "workers": workers,
            "nbd_client": nbd_client,
            "state": "attaching",
            "pid": None,
            "pid_start": None,
            "device": None,
        }
        _write_json(directory / RECORD, record)
        try:
            proc, facts = _start_blockfile(
                uri, directory, connections, timeout, ready_timeout, workers, nbd_client
            )
            record["pid"] = proc.pid
            record["pid_start"] = _start_time(proc.pid)
            _write_json(directory / RECORD, record)
            file = os.path.join(record["mountpoint"], DISK)
            read_only = not os.stat(file).st_mode & 0o200
            block_size = loop_block_size(facts.get("minimum_block_size", 1))
            record["device"] = attach_loop(
                file, read_only=read_only, direct_io=direct_io, block_size=block_size
            )
            record["state"] = "attached"
            _write_json(directory / RECORD, record)
        except BaseException:
            try:
                _undo(directory, record)
            except Exception as e:  # the attach's own error is the one to report
                log.error("%s: cleaning up a failed attach: %s", uri, e)
            raise
        attachment = _attachment(record)
        assert attachment is not None
        log.info("%s attached as %s", uri, attachment.device)
        return attachment


def _find(state_dir: str | os.PathLike[str], device_or_uri: str) -> str | None:
    if not device_or_uri.startswith("/dev/"):
        return _key(device_or_uri)
    root = _root(state_dir)
    if not root.is_dir():
        return None
    for directory in root.iterdir():
        try:
            data = _read_record(directory) if directory.is_dir() else None
        except UnreadableRecord:
            continue  # its device is unknown
        if data is not None and data.get("device") == device_or_uri:
            return directory.name
    return None


def detach_fuse_block(
    device_or_uri: str, state_dir: str | os.PathLike[str], *, timeout: float | None = None
) -> bool:
    """Detach the loop device, stop the FUSE process, unmount, forget the record.

    The process is SIGKILLed only ``timeout`` seconds after SIGTERM; by default
    after its own worst-case stop (:func:`fuse.blockfile.stop_bound`: 41 s for
    one process, 81 s with workers), so what it acknowledged is flushed.

    Idempotent: False when nothing of it was left.  A device still mounted
    raises :class:`fuse.loop.LoopBusy` and nothing is changed.
    """
    key = _find(state_dir, device_or_uri)
    if key is None:
        return False
    with _locked(state_dir, key) as directory:
        if not directory.exists():
            return False
        did = _undo(directory, _read_record(directory), timeout)
    # the lock file stays: unlinking it would let two attachers lock different files
    if did:
        log.info("%s detached", device_or_uri)
    return did


def refresh_size(attachment: Attachment) -> int:
    """Re-read the export's size (reconnecting) and resize the loop device; the new size."""
    refresh = os.path.join(attachment.mountpoint, REFRESH)
    fd = os.open(refresh, os.O_WRONLY)
    try:
        os.write(fd, b"1\n")  # returns once the FUSE process has the new size
    finally:
        os.close(fd)
    size = os.stat(attachment.file).st_size
    try:
        device_size = refresh_capacity(attachment.device)
    except OSError as e:
        raise LoopError(e.errno or errno.EIO, f"{attachment.device}: {e}") from e
    if device_size != size:
        raise BlockAttachError(
            f"{attachment.device}: {device_size} bytes after refresh, the export has {size}"
        )
    return size


def reconcile_attachments(state_dir: str | os.PathLike[str]) -> list[str]:
    """After a restart: undo half-made attachments; report broken ones (left as they are:
    a mounted filesystem may still be on them).  What was found, one line each."""
    report = []
    root = _root(state_dir)
    if not root.is_dir():
        return []
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        with _locked(state_dir, directory.name):
            try:
                data = _read_record(directory)
            except UnreadableRecord as e:
                report.append(str(e))
                continue
            attachment = _attachment(data) if data is not None else None
            if attachment is None:
                _undo(directory, data)
                report.append(f"{directory.name}: half-made attachment removed")
            elif not _healthy(attachment):
                report.append(f"{attachment.uri} on {attachment.device}: broken")
    return report
