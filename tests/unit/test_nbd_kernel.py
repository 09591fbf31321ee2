"""Kernel attach (``nbd.kernel``): probing, and attaching through netlink or ioctl.

This CI kernel has no nbd driver: the probe and ``attach_kernel`` are proven
to fail cleanly here.  On a host that has one, the ``no_kernel_nbd`` fixture
hides it, so the same tests still prove the unavailable path.  The messages
sent are checked against hand-assembled bytes (``tests/netlink_bytes.py``).
"""

from __future__ import annotations

import os
import re
import socket
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nbd import kernel
from nbd.client import BlockSize, Negotiated
from nbd.constants import TransmissionFlag
from nbd.kernel import KernelNBDError, KernelNBDUnavailable
from nbd.kernel_monitor import LinkDeadMonitor
from nbd.netlink import DeviceStatus, GenlFamily, NetlinkMessage, parse_nlmsgs
from tests.netlink_bytes import FAMILY, PORT_ID, genlhdr, nlhdr, status_reply, u16, u32, u64

# ----------------------------------------------------------- probe, attach


def kernel_nbd_visible() -> bool:
    return (
        Path("/sys/module/nbd").exists()
        or any(re.fullmatch(r"nbd\d+", p.name) for p in Path("/dev").glob("nbd*"))
        or kernel._lookup_nbd_family()[0] is not None
    )


@pytest.fixture
def no_kernel_nbd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """This host as it is when it has no nbd driver (the CI kernel); hidden otherwise."""
    if kernel_nbd_visible():
        (tmp_path / "dev").mkdir()
        monkeypatch.setattr(kernel, "SYS_MODULE_NBD", tmp_path / "no-module")
        monkeypatch.setattr(kernel, "DEV_DIR", tmp_path / "dev")
        monkeypatch.setattr(
            kernel, "_lookup_nbd_family", lambda: (None, "generic netlink family 'nbd' hidden")
        )
        monkeypatch.setattr(kernel, "_modprobe", lambda: "hidden by the test")
    yield


def socketpair_negotiated(*, tls: bool = False) -> tuple[Negotiated, socket.socket]:
    a, b = socket.socketpair()
    flags = TransmissionFlag.HAS_FLAGS | TransmissionFlag.SEND_FLUSH
    return Negotiated(a, "disk", 1 << 20, flags, BlockSize(1, 4096, 1 << 25), tls), b


def children_of_this_process() -> set[str]:
    return {
        pid
        for task in Path(f"/proc/{os.getpid()}/task").iterdir()
        for pid in (task / "children").read_text().split()
    }


def test_probe_reports_unavailable_on_this_host(no_kernel_nbd: None) -> None:
    available, reason = kernel.kernel_nbd_available()
    assert available is False
    assert reason.startswith("kernel nbd unavailable: no nbd module loaded and modprobe nbd failed")
    assert kernel.kernel_nbd_available(load_module=False) == (
        False,
        "kernel nbd unavailable: no nbd module loaded",
    )


def test_attach_kernel_raises_unavailable_without_side_effects(no_kernel_nbd: None) -> None:
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        negotiated.sock.settimeout(3.5)
        before = children_of_this_process()
        with pytest.raises(KernelNBDUnavailable, match="kernel nbd unavailable"):
            kernel.attach_kernel(negotiated, io_timeout=30, dead_conn_timeout=60)
        # The socket is untouched: open, same timeout, still carrying bytes both ways.
        assert negotiated.sock.fileno() >= 0 and negotiated.sock.gettimeout() == 3.5
        negotiated.sock.sendall(b"ping")
        assert peer.recv(4) == b"ping"
        peer.sendall(b"pong")
        assert negotiated.sock.recv(4) == b"pong"
        assert children_of_this_process() == before
        assert not list(kernel.DEV_DIR.glob("nbd[0-9]*"))
        assert kernel._do_it_children == {}


def test_other_kernel_operations_raise_unavailable(no_kernel_nbd: None) -> None:
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        with pytest.raises(KernelNBDUnavailable):
            kernel.detach_kernel("/dev/nbd0")
        with pytest.raises(KernelNBDUnavailable):
            kernel.reconnect_kernel("/dev/nbd0", negotiated)
        with pytest.raises(KernelNBDUnavailable):
            kernel.resize_kernel("/dev/nbd0", 1 << 30)
        with pytest.raises(KernelNBDUnavailable):
            kernel.kernel_status()
        with pytest.raises(KernelNBDUnavailable):
            LinkDeadMonitor()


def test_attach_kernel_refuses_a_tls_socket_before_probing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def probe(**_: object) -> kernel.KernelSupport:
        raise AssertionError("probed although the socket is TLS")

    monkeypatch.setattr(kernel, "probe_kernel_nbd", probe)
    negotiated, peer = socketpair_negotiated(tls=True)
    with negotiated.sock, peer:
        with pytest.raises(KernelNBDError, match="cannot speak TLS") as info:
            kernel.attach_kernel(negotiated)
        assert not isinstance(info.value, KernelNBDUnavailable)
    # An SSLSocket is refused even if the flag says otherwise.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    a, b = socket.socketpair()
    with b, ctx.wrap_socket(a, do_handshake_on_connect=False, server_hostname="x") as tls_sock:
        plain = Negotiated(tls_sock, "disk", 1 << 20, TransmissionFlag.HAS_FLAGS, None, False)
        with pytest.raises(KernelNBDError, match="cannot speak TLS"):
            kernel.attach_kernel(plain)


def test_probe_prefers_netlink_and_falls_back_to_ioctl(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nbd0").touch()
    (dev / "nbd10").touch()
    (dev / "nbd1p1").touch()  # a partition, not a device
    monkeypatch.setattr(kernel, "DEV_DIR", dev)
    monkeypatch.setattr(kernel, "SYS_MODULE_NBD", tmp_path / "module")
    monkeypatch.setattr(kernel, "_modprobe", lambda: pytest.fail("modprobe with devices present"))
    monkeypatch.setattr(kernel, "_lookup_nbd_family", lambda: (None, "family 'nbd' absent"))
    support = kernel.probe_kernel_nbd()
    assert (support.netlink, support.ioctl, support.available) == (False, True, True)
    assert (
        support.reason == f"kernel nbd available through ioctl on {dev}/nbd0 (family 'nbd' absent)"
    )
    family = GenlFamily(FAMILY, "nbd", 1, {"nbd_mc_group": 7})
    monkeypatch.setattr(kernel, "_lookup_nbd_family", lambda: (family, ""))
    support = kernel.probe_kernel_nbd()
    assert (support.netlink, support.ioctl, support.family) == (True, True, family)
    assert kernel._nbd_devices() == [dev / "nbd0", dev / "nbd10"]


def test_kernel_block_size() -> None:
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        assert kernel.kernel_block_size(negotiated) == 512
        assert kernel.kernel_block_size(negotiated, 4096) == 4096
        strict = Negotiated(
            negotiated.sock,
            "d",
            1 << 20,
            TransmissionFlag(1),
            BlockSize(4096, 4096, 1 << 20),
            False,
        )
        assert kernel.kernel_block_size(strict) == 4096
        with pytest.raises(ValueError, match="below the server's minimum"):
            kernel.kernel_block_size(strict, 512)
        for bad in (1000, 256, 1 << 20):
            with pytest.raises(ValueError, match="power of two"):
                kernel.kernel_block_size(negotiated, bad)


def test_attach_kernel_refuses_a_server_maximum_below_the_drivers_requests(
    no_kernel_nbd: None,
) -> None:
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        small = Negotiated(
            negotiated.sock, "d", 1 << 20, TransmissionFlag(1), BlockSize(1, 4096, 1 << 22), False
        )
        with pytest.raises(KernelNBDError, match="maximum payload of 4194304 bytes") as info:
            kernel.attach_kernel(small)
        assert not isinstance(info.value, KernelNBDUnavailable)
        assert kernel.KERNEL_MAX_REQUEST == 32 * 1024 * 1024


def test_device_index() -> None:
    assert kernel.device_index("/dev/nbd0") == 0
    assert kernel.device_index("nbd12") == 12
    for bad in ("/dev/nbd", "/dev/loop0", "/dev/nbd1p1", "/tmp/nbd1"):
        with pytest.raises(ValueError):
            kernel.device_index(bad)


class FakeNetlink:
    """Stands in for the kernel: records requests, answers with canned replies."""

    sent: list[bytes] = []
    replies: list[bytes] = []

    def __init__(self, timeout: float = 10.0) -> None:
        pass

    def __enter__(self) -> FakeNetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def transact(self, build: Callable[[int], bytes]) -> list[NetlinkMessage]:
        FakeNetlink.sent.append(build(42))
        return parse_nlmsgs(b"".join(FakeNetlink.replies))


@pytest.fixture
def fake_netlink(monkeypatch: pytest.MonkeyPatch) -> type[FakeNetlink]:
    family = GenlFamily(FAMILY, "nbd", 1, {"nbd_mc_group": 7})
    support = kernel.KernelSupport(True, True, "test", family)
    monkeypatch.setattr(kernel, "probe_kernel_nbd", lambda **_: support)
    monkeypatch.setattr(kernel, "_lookup_nbd_family", lambda: (family, ""))
    monkeypatch.setattr(kernel, "GenericNetlink", FakeNetlink)
    FakeNetlink.sent, FakeNetlink.replies = [], []
    return FakeNetlink


def test_attach_kernel_sends_connect_for_the_negotiated_socket(
    fake_netlink: type[FakeNetlink],
) -> None:
    connect_reply = nlhdr(28, FAMILY, 0, 42, PORT_ID) + genlhdr(1, 1) + u16(8) + u16(1) + u32(3)
    fake_netlink.replies = [connect_reply]
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        device = kernel.attach_kernel(negotiated, io_timeout=30, dead_conn_timeout=60)
        assert device == "/dev/nbd3"
        assert fake_netlink.sent == [
            nlhdr(96, FAMILY, 5, 42)
            + genlhdr(1, 1)
            + u16(12) + u16(2) + u64(1 << 20)  # the negotiated size
            + u16(12) + u16(3) + u64(512)
            + u16(12) + u16(5) + u64(0x05)  # HAS_FLAGS | SEND_FLUSH as negotiated
            + u16(12) + u16(4) + u64(30)
            + u16(12) + u16(8) + u64(60)
            + u16(16) + u16(0x8007) + u16(12) + u16(0x8001)
            + u16(8) + u16(1) + u32(negotiated.sock.fileno())
        ]  # fmt: skip
        kernel.detach_kernel(device)
        # The request builders are nbd.netlink's; nbd.kernel imports them to send with
        # them, and these assertions still reach them through nbd.kernel.
        assert fake_netlink.sent[1] == kernel.nbd_disconnect_request(FAMILY, 42, 3)  # type: ignore[attr-defined]
        kernel.reconnect_kernel(device, negotiated, backend_identifier="b")
        assert fake_netlink.sent[2] == kernel.nbd_reconfigure_request(  # type: ignore[attr-defined]
            FAMILY, 42, 3, sock_fds=[negotiated.sock.fileno()], backend_identifier="b"
        )


def test_kernel_status_parses_the_reply(fake_netlink: type[FakeNetlink]) -> None:
    fake_netlink.replies = [status_reply(42, [(0, 1), (1, 0)], nested_flag=0)]
    assert kernel.kernel_status() == [DeviceStatus(0, True), DeviceStatus(1, False)]
    assert fake_netlink.sent == [kernel.nbd_status_request(FAMILY, 42)]  # type: ignore[attr-defined]


def test_ioctl_attach_configures_then_reports_a_failed_do_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The ioctl path: setup ioctls in order on the device, then NBD_DO_IT in a child.

    The "device" is a regular file, so the real child's NBD_DO_IT fails (ENOTTY)
    and its stderr comes back in the error.
    """
    dev, sys_block = tmp_path / "dev", tmp_path / "sys-block"
    dev.mkdir()
    (dev / "nbd0").touch()
    (sys_block / "nbd0").mkdir(parents=True)
    (sys_block / "nbd0" / "size").write_text("0\n")
    monkeypatch.setattr(kernel, "DEV_DIR", dev)
    monkeypatch.setattr(kernel, "SYS_BLOCK", sys_block)
    support = kernel.KernelSupport(False, True, "test")
    monkeypatch.setattr(kernel, "probe_kernel_nbd", lambda **_: support)
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(kernel, "_ioctl", lambda fd, request, arg: calls.append((request, arg)))
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        failed = re.escape(f"NBD_DO_IT failed on {dev}/nbd0: NBD_DO_IT on {dev}/nbd0: ")
        with pytest.raises(KernelNBDError, match=failed + r"\[Errno 25\] Inappropriate ioctl"):
            kernel.attach_kernel(negotiated, io_timeout=30)
        assert calls == [
            (0xAB01, 512),
            (0xAB02, 1 << 20),
            (0xAB0A, 0x05),
            (0xAB09, 30),
            (0xAB00, negotiated.sock.fileno()),
        ]
    assert kernel._do_it_children == {}


def test_the_interface_asked_for_is_the_one_used_or_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    family = GenlFamily(FAMILY, "nbd", 1, {})
    used: list[str] = []

    def attach_ioctl(*args: object) -> str:
        used.append("ioctl")
        return "/dev/nbd1"

    monkeypatch.setattr(kernel, "_attach_ioctl", attach_ioctl)
    monkeypatch.setattr(kernel, "GenericNetlink", FakeNetlink)
    FakeNetlink.sent = []
    FakeNetlink.replies = [nlhdr(28, FAMILY, 0, 42, PORT_ID) + genlhdr(1, 1) + u16(8) + u16(1)
                           + u32(0)]  # fmt: skip
    negotiated, peer = socketpair_negotiated()
    with negotiated.sock, peer:
        both = kernel.KernelSupport(True, True, "both", family)
        monkeypatch.setattr(kernel, "probe_kernel_nbd", lambda **_: both)
        assert kernel.attach_kernel(negotiated, interface="ioctl") == "/dev/nbd1"
        assert used == ["ioctl"] and FakeNetlink.sent == []  # netlink was there, not used
        assert kernel.attach_kernel(negotiated, interface="netlink") == "/dev/nbd0"
        assert used == ["ioctl"] and len(FakeNetlink.sent) == 1

        ioctl_only = kernel.KernelSupport(False, True, "ioctl only")
        monkeypatch.setattr(kernel, "probe_kernel_nbd", lambda **_: ioctl_only)
        with pytest.raises(kernel.KernelNBDUnavailable, match="no netlink interface"):
            kernel.attach_kernel(negotiated, interface="netlink")
        netlink_only = kernel.KernelSupport(True, False, "netlink only", family)
        monkeypatch.setattr(kernel, "probe_kernel_nbd", lambda **_: netlink_only)
        with pytest.raises(kernel.KernelNBDUnavailable, match="no ioctl interface"):
            kernel.attach_kernel(negotiated, interface="ioctl")
        with pytest.raises(ValueError, match="must be one of auto, netlink, ioctl"):
            kernel.attach_kernel(negotiated, interface="sysfs")
        assert used == ["ioctl"] and len(FakeNetlink.sent) == 1  # nothing more was attempted
