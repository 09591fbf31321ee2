"""Handing a negotiated NBD socket to the kernel's nbd driver (``/dev/nbdN``).

Two interfaces, chosen at run time by probing:

- generic netlink, family ``"nbd"`` (``linux/nbd-netlink.h``, kernel 4.12+):
  CONNECT, DISCONNECT, RECONFIGURE, STATUS, and ``LINK_DEAD`` multicast
  notifications.  The kernel keeps its own reference to the socket, so no
  process has to stay alive for the device to work.
- the ioctl interface (``linux/nbd.h``) as a fallback: the setup ioctls, then
  ``NBD_DO_IT``, which blocks for the life of the device and so runs in a
  child process (in its own session); the device lives as long as that child.

This module probes, attaches, reconfigures and detaches; ``nbd.kernel_monitor``
listens for ``LINK_DEAD``.  Message building and parsing are pure functions
over bytes kept apart, so every encoding is testable without the driver: the
netlink messages in ``nbd.netlink`` (sent over ``nbd.netlink_socket``), the
ioctl numbers and setup sequence in ``nbd.kernel_ioctl``.

The kernel driver speaks neither TLS nor structured replies: sockets from a
TLS handshake are refused (see ``nbd.client``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hostio import tools
from nbd.client import Negotiated
from nbd.kernel_errors import KernelNBDError, KernelNBDUnavailable
from nbd.kernel_ioctl import (
    NBD_CLEAR_QUE,
    NBD_CLEAR_SOCK,
    NBD_DISCONNECT,
    NBD_DO_IT,
    ioctl_setup_plan,
)
from nbd.netlink import (
    NBD_GENL_FAMILY_NAME,
    DeviceStatus,
    FamilyNotFound,
    GenlFamily,
    NetlinkError,
    nbd_connect_request,
    nbd_disconnect_request,
    nbd_reconfigure_request,
    nbd_status_request,
    parse_connect_reply,
    parse_status_reply,
)
from nbd.netlink_socket import GenericNetlink, resolve_family

# Where the kernel shows its nbd state; module-level so tests can point elsewhere.
SYS_MODULE_NBD = Path("/sys/module/nbd")
SYS_BLOCK = Path("/sys/block")
DEV_DIR = Path("/dev")


# ------------------------------------------------------------------ probing


@dataclass(frozen=True, slots=True)
class KernelSupport:
    """What the probe found: which interfaces work, and why (not)."""

    netlink: bool
    ioctl: bool
    reason: str
    family: GenlFamily | None = None

    @property
    def available(self) -> bool:
        return self.netlink or self.ioctl


def _nbd_devices() -> list[Path]:
    found = [p for p in DEV_DIR.glob("nbd*") if re.fullmatch(r"nbd\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name[3:]))


def _lookup_nbd_family() -> tuple[GenlFamily | None, str]:
    try:
        return resolve_family(NBD_GENL_FAMILY_NAME), ""
    except FamilyNotFound as e:
        return None, str(e)
    except (OSError, KernelNBDError) as e:
        return None, f"generic netlink unusable: {e}"


def _modprobe() -> str | None:
    """Load the nbd module; None on success, else why it failed."""
    try:
        tools.run(["modprobe", "nbd"], timeout=30)
    except tools.ToolError as e:
        return str(e)
    return None


def probe_kernel_nbd(*, load_module: bool = True) -> KernelSupport:
    """Find out whether (and how) the kernel can take an NBD socket.

    Asking the controller for the "nbd" family is itself enough for a kernel
    with module autoloading to load nbd; ``modprobe nbd`` is tried after that
    when ``load_module`` is set and no trace of the module exists.
    """
    family, why_not = _lookup_nbd_family()
    if family is None and not (SYS_MODULE_NBD.exists() or (DEV_DIR / "nbd0").exists()):
        if not load_module:
            return KernelSupport(False, False, "kernel nbd unavailable: no nbd module loaded")
        failure = _modprobe()
        if failure is not None:
            return KernelSupport(
                False,
                False,
                f"kernel nbd unavailable: no nbd module loaded and modprobe nbd failed: {failure}",
            )
        family, why_not = _lookup_nbd_family()
    devices = _nbd_devices()
    if family is not None:
        return KernelSupport(
            True,
            bool(devices),
            f"kernel nbd available: generic netlink family {family.name!r} (id {family.id})",
            family,
        )
    if devices:
        return KernelSupport(
            False,
            True,
            f"kernel nbd available through ioctl on {devices[0]} ({why_not})",
        )
    return KernelSupport(
        False,
        False,
        f"kernel nbd unavailable: the nbd module is present but there is no /dev/nbd* "
        f"device and {why_not}",
    )


def kernel_nbd_available(*, load_module: bool = True) -> tuple[bool, str]:
    """(usable, reason): the reason says which interface, or why there is none."""
    support = probe_kernel_nbd(load_module=load_module)
    return support.available, support.reason


# ----------------------------------------------------------------- attaching


def device_index(device: str) -> int:
    """3 for "/dev/nbd3" or "nbd3"."""
    m = re.fullmatch(r"(?:/dev/)?nbd(\d+)", device)
    if m is None:
        raise ValueError(f"not an nbd device: {device!r}")
    return int(m.group(1))


def kernel_block_size(negotiated: Negotiated, requested: int | None = None) -> int:
    """The device's logical block size: 512 unless asked for more or the server's minimum is.

    The kernel takes powers of two from 512 to the page size.
    """
    minimum = negotiated.block_size.minimum if negotiated.block_size else 1
    size = requested if requested is not None else max(512, minimum)
    page = os.sysconf("SC_PAGE_SIZE")
    if size & (size - 1) or not 512 <= size <= page:
        raise ValueError(f"kernel nbd block size must be a power of two in 512..{page}, not {size}")
    if size < minimum:
        raise ValueError(f"block size {size} is below the server's minimum block size {minimum}")
    return size


# The driver's largest request (max_hw_sectors = 65536 sectors), whatever the server says.
KERNEL_MAX_REQUEST = 65536 * 512


def _check_server_limits(negotiated: Negotiated) -> None:
    """The kernel cannot be told a maximum payload: the server must take the driver's."""
    limits = negotiated.block_size
    if limits is not None and limits.maximum < KERNEL_MAX_REQUEST:
        raise KernelNBDError(
            f"the server's maximum payload of {limits.maximum} bytes is below the "
            f"{KERNEL_MAX_REQUEST} bytes the kernel nbd driver may send in one request"
        )


def _refuse_tls(negotiated: Negotiated) -> None:
    if negotiated.tls or isinstance(negotiated.sock, ssl.SSLSocket):
        raise KernelNBDError(
            "the kernel nbd driver cannot speak TLS: a socket from a TLS handshake can only "
            "be used from userspace (no TLS proxy is available)"
        )


def _netlink_family() -> GenlFamily:
    family, why_not = _lookup_nbd_family()
    if family is None:
        raise KernelNBDUnavailable(f"kernel nbd netlink interface unavailable: {why_not}")
    return family


# Which of the driver's interfaces attach uses: "auto" prefers netlink (dead-connection
# timeout, reconnect, resize) and falls back to the ioctls; the others insist on one.
KERNEL_INTERFACES = ("auto", "netlink", "ioctl")


def attach_kernel(
    negotiated: Negotiated,
    *,
    interface: str = "auto",
    index: int | None = None,
    block_size: int | None = None,
    io_timeout: int | None = None,
    dead_conn_timeout: int | None = None,
    client_flags: int | None = None,
    backend_identifier: str | None = None,
    load_module: bool = True,
) -> str:
    """Give the negotiated socket to the kernel; return the device path ("/dev/nbdN").

    Timeouts are in seconds; None leaves the kernel's default.  After success
    the kernel holds its own reference to the socket, and the caller may
    close ``negotiated.sock``.  Raises ``KernelNBDUnavailable`` (touching
    nothing) when the host has no nbd driver, or not the ``interface`` asked for
    (one of ``KERNEL_INTERFACES``).
    """
    if interface not in KERNEL_INTERFACES:
        raise ValueError(f"kernel nbd interface must be one of {', '.join(KERNEL_INTERFACES)}")
    _refuse_tls(negotiated)
    _check_server_limits(negotiated)
    bs = kernel_block_size(negotiated, block_size)
    support = probe_kernel_nbd(load_module=load_module)
    if interface == "netlink" and support.family is None:
        raise KernelNBDUnavailable(f"no netlink interface to the nbd driver: {support.reason}")
    if interface == "ioctl" and not support.ioctl:
        raise KernelNBDUnavailable(f"no ioctl interface to the nbd driver: {support.reason}")
    if support.family is not None and interface != "ioctl":
        family = support.family
        request = lambda seq: nbd_connect_request(  # noqa: E731
            family.id,
            seq,
            size=negotiated.size,
            block_size=bs,
            server_flags=int(negotiated.transmission_flags),
            sock_fds=[negotiated.sock.fileno()],
            index=index,
            timeout=io_timeout,
            dead_conn_timeout=dead_conn_timeout,
            client_flags=client_flags,
            backend_identifier=backend_identifier,
        )
        try:
            with GenericNetlink() as nl:
                replies = nl.transact(request)
        except NetlinkError as e:
            raise KernelNBDError(f"NBD_CMD_CONNECT failed: {e}") from e
        return f"/dev/nbd{parse_connect_reply(replies, family.id)}"
    if support.ioctl:
        return _attach_ioctl(negotiated, index, bs, io_timeout)
    raise KernelNBDUnavailable(support.reason)  # (interface "auto": neither works)


def detach_kernel(device: str) -> None:
    """Disconnect ``device`` (NBD_CMD_DISCONNECT, or NBD_DISCONNECT + NBD_CLEAR_SOCK)."""
    index = device_index(device)
    support = probe_kernel_nbd(load_module=False)
    if support.family is not None:
        family = support.family
        try:
            with GenericNetlink() as nl:
                nl.transact(lambda seq: nbd_disconnect_request(family.id, seq, index))
        except NetlinkError as e:
            raise KernelNBDError(f"NBD_CMD_DISCONNECT of /dev/nbd{index} failed: {e}") from e
        return
    if support.ioctl:
        _detach_ioctl(index)
        return
    raise KernelNBDUnavailable(support.reason)


def reconnect_kernel(
    device: str, negotiated: Negotiated, *, backend_identifier: str | None = None
) -> None:
    """Replace a dead connection of ``device`` with a freshly negotiated socket."""
    _refuse_tls(negotiated)
    index = device_index(device)
    family = _netlink_family()
    try:
        with GenericNetlink() as nl:
            nl.transact(
                lambda seq: nbd_reconfigure_request(
                    family.id,
                    seq,
                    index,
                    sock_fds=[negotiated.sock.fileno()],
                    backend_identifier=backend_identifier,
                )
            )
    except NetlinkError as e:
        raise KernelNBDError(f"NBD_CMD_RECONFIGURE of /dev/nbd{index} failed: {e}") from e


def resize_kernel(device: str, size: int, *, backend_identifier: str | None = None) -> None:
    """Tell the kernel the export grew (or shrank) to ``size`` bytes."""
    index = device_index(device)
    family = _netlink_family()
    try:
        with GenericNetlink() as nl:
            nl.transact(
                lambda seq: nbd_reconfigure_request(
                    family.id, seq, index, size=size, backend_identifier=backend_identifier
                )
            )
    except NetlinkError as e:
        raise KernelNBDError(f"resizing /dev/nbd{index} failed: {e}") from e


def kernel_status(index: int | None = None) -> list[DeviceStatus]:
    """The kernel's nbd devices (or just ``index``) and whether each is connected."""
    family = _netlink_family()
    try:
        with GenericNetlink() as nl:
            replies = nl.transact(lambda seq: nbd_status_request(family.id, seq, index))
    except NetlinkError as e:
        raise KernelNBDError(f"NBD_CMD_STATUS failed: {e}") from e
    return parse_status_reply(replies, family.id)


# ------------------------------------------------------- ioctl fallback


def _ioctl(fd: int, request: int, arg: int) -> None:
    # ctypes rather than fcntl.ioctl: that passes a C int, too small for NBD_SET_SIZE.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong]
    libc.ioctl.restype = ctypes.c_int
    if libc.ioctl(fd, request, arg) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# NBD_DO_IT blocks until the device is disconnected, so a child owns it; it
# inherits the device descriptor, which keeps the configuration alive.
_DO_IT_CHILD = """
import fcntl, sys
fd, do_it, clear_que, clear_sock = (int(a) for a in sys.argv[1:5])
try:
    fcntl.ioctl(fd, do_it)
    code = 0
except OSError as e:
    print(f"NBD_DO_IT on {sys.argv[5]}: {e}", file=sys.stderr)
    code = 1
for request in (clear_que, clear_sock):
    try:
        fcntl.ioctl(fd, request)
    except OSError:
        pass
sys.exit(code)
"""
_DO_IT_REQUESTS = (NBD_DO_IT, NBD_CLEAR_QUE, NBD_CLEAR_SOCK)
_do_it_children: dict[int, subprocess.Popen[bytes]] = {}


def _apply_plan(fd: int, plan: Sequence[tuple[str, int, int]]) -> tuple[str, OSError] | None:
    """Run the setup ioctls; the first failure as (ioctl name, error), else None."""
    for name, request, arg in plan:
        try:
            _ioctl(fd, request, arg)
        except OSError as e:
            return name, e
    return None


def _free_ioctl_indices() -> list[int]:
    free = []
    for dev in _nbd_devices():
        i = int(dev.name[3:])
        sys_dir = SYS_BLOCK / dev.name
        try:
            unused = not (sys_dir / "pid").exists() and int((sys_dir / "size").read_text()) == 0
        except (OSError, ValueError):
            continue
        if unused:
            free.append(i)
    return free


def _wait_started(index: int, device: Path, child: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the kernel shows the device running (its pid file), or the child fails."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            _, stderr = child.communicate()
            raise KernelNBDError(f"NBD_DO_IT failed on {device}: {stderr.decode().strip()}")
        if (SYS_BLOCK / f"nbd{index}" / "pid").exists():
            return
        time.sleep(0.05)
    child.kill()
    child.communicate()
    raise KernelNBDError(f"{device} did not start within {timeout}s")


def _attach_ioctl(
    negotiated: Negotiated, index: int | None, block_size: int, io_timeout: int | None
) -> str:
    candidates = [index] if index is not None else _free_ioctl_indices()
    if not candidates:
        raise KernelNBDError("no free /dev/nbd* device")
    plan = ioctl_setup_plan(
        size=negotiated.size,
        block_size=block_size,
        server_flags=int(negotiated.transmission_flags),
        sock_fd=negotiated.sock.fileno(),
        io_timeout=io_timeout,
    )
    busy: list[str] = []
    for i in candidates:
        device = DEV_DIR / f"nbd{i}"
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
        try:
            failed = _apply_plan(fd, plan)
            if failed is not None:
                name, e = failed
                if e.errno == errno.EBUSY and index is None:
                    busy.append(device.name)  # another attacher won the race; next one
                    continue
                raise KernelNBDError(f"{name} on {device} failed: {e}") from e
            child = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _DO_IT_CHILD,
                    str(fd),
                    *map(str, _DO_IT_REQUESTS),
                    str(device),
                ],
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            _wait_started(i, device, child, timeout=10.0)
        finally:
            os.close(fd)
        _do_it_children[i] = child
        return str(device)
    raise KernelNBDError(f"every free nbd device was busy: {', '.join(busy)}")


def _detach_ioctl(index: int) -> None:
    device = DEV_DIR / f"nbd{index}"
    fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    try:
        for name, request in (
            ("NBD_DISCONNECT", NBD_DISCONNECT),
            ("NBD_CLEAR_SOCK", NBD_CLEAR_SOCK),
        ):
            try:
                _ioctl(fd, request, 0)
            except OSError as e:
                raise KernelNBDError(f"{name} on {device} failed: {e}") from e
    finally:
        os.close(fd)
    child = _do_it_children.pop(index, None)
    if child is not None:
        try:
            child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()


# The errors live in nbd.kernel_errors only so the netlink layer can raise them
# too; they are what this module's functions raise, so they are exported here.
__all__ = [
    "KernelNBDError",
    "KernelNBDUnavailable",
    "KernelSupport",
    "attach_kernel",
    "detach_kernel",
    "device_index",
    "kernel_block_size",
    "kernel_nbd_available",
    "kernel_status",
    "probe_kernel_nbd",
    "reconnect_kernel",
    "resize_kernel",
]
