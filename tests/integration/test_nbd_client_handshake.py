"""The pure-Python client handshake (``nbd.client``) against real servers.

moorage's own server (``nbd_servers``) and qemu-nbd are the peers; nbdinfo
(libnbd) is the reference for what each advertises.  After the handshake the
socket must be in transmission phase, with simple replies only (what the
kernel driver speaks): a raw NBD_CMD_READ built with ``nbd.codec`` gets a
simple reply and the image's bytes.  Scripted peers on a socketpair cover what
the real servers never do (no NBD_OPT_GO, bad magic).

Why this file is long: it puts the one client handshake in front of three kinds of peer
(moorage's server and qemu-nbd checked against nbdinfo, a TLS-only server with a trustme
CA, and scripted peers, each a small server written inline), and the later sections
reuse the first one's Peer, patterned image and raw socket helpers.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme

from nbd import codec
from nbd.client import (
    HandshakeError,
    Negotiated,
    connect,
    connect_uri,
    handshake,
)
from nbd.constants import (
    ClientFlag,
    Command,
    HandshakeFlag,
    Info,
    Option,
    OptionReply,
    TransmissionFlag,
)
from nbd.kernel import KernelNBDError, KernelNBDUnavailable, attach_kernel
from tests.conftest import NBDServerFactory, free_port, run, sparse_image, wait_for_port

MiB = 1 << 20
IMAGE_SIZE = 8 * MiB
DATA_OFFSET = 3 * MiB + 512
TIMEOUT = 30


@dataclass(frozen=True)
class Peer:
    """A server under test: where it listens and what the image holds."""

    name: str
    host: str
    port: int
    export: str
    image: Path

    def uri(self, export: str | None = None) -> str:
        return f"nbd://{self.host}:{self.port}/{self.export if export is None else export}"


def patterned_image(path: Path) -> Path:
    sparse_image(path, IMAGE_SIZE)
    with path.open("r+b") as f:
        f.seek(DATA_OFFSET)
        f.write(os.urandom(128 * 1024))
        f.seek(IMAGE_SIZE - 4096)
        f.write(b"tail" * 1024)
    return path


def nbdinfo_json(uri: str) -> dict[str, Any]:
    info: dict[str, Any] = json.loads(run(["nbdinfo", "--json", uri], timeout=TIMEOUT).stdout)
    (export,) = info["exports"]
    assert isinstance(export, dict)
    return export


@pytest.fixture
def moorage_peer(tmp_path: Path, nbd_servers: NBDServerFactory) -> Peer:
    image = patterned_image(tmp_path / "moorage.img")
    server = nbd_servers.start({"disk": image, "rodisk": f"{image}:ro"})
    return Peer("moorage", "127.0.0.1", server.port, "disk", image)


def start_qemu_nbd(image: Path, *listen: str) -> subprocess.Popen[bytes]:
    """qemu-nbd serving ``image`` as "disk"; its output goes to a log beside the image."""
    argv = ["qemu-nbd", "-f", "raw", "-x", "disk", *listen, "--persistent", "--shared=8"]
    with image.with_suffix(".qemu-nbd.log").open("wb") as log:
        return subprocess.Popen([*argv, str(image)], stdout=log, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def qemu_peer(tmp_path: Path) -> Iterator[Peer]:
    image = patterned_image(tmp_path / "qemu.img")
    port = free_port()
    proc = start_qemu_nbd(image, "-b", "127.0.0.1", "-p", str(port))
    try:
        wait_for_port(port, proc)
        yield Peer("qemu-nbd", "127.0.0.1", port, "disk", image)
    finally:
        stop(proc)


@pytest.fixture(params=["moorage", "qemu-nbd"])
def peer(request: pytest.FixtureRequest) -> Peer:
    fixture = "moorage_peer" if request.param == "moorage" else "qemu_peer"
    value = request.getfixturevalue(fixture)
    assert isinstance(value, Peer)
    return value


def read_raw(negotiated: Negotiated, offset: int, length: int, cookie: int) -> bytes:
    """NBD_CMD_READ on the bare socket; expects a simple reply and the data after it."""
    sock = negotiated.sock
    sock.sendall(codec.encode_request(Command.READ, cookie, offset, length))
    error, got_cookie = codec.decode_simple_reply(recv_exact(sock, codec.SIMPLE_REPLY.size))
    assert (error, got_cookie) == (0, cookie)
    return recv_exact(sock, length)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, f"server closed the connection after {len(buf)} of {n} bytes"
        buf += chunk
    return buf


def disconnect(negotiated: Negotiated) -> None:
    negotiated.sock.sendall(codec.encode_request(Command.DISC, 0, 0, 0))
    negotiated.sock.close()


# Transmission flags as nbdinfo names them (DF aside: it needs structured replies).
CAN_FLAGS = {
    "can_cache": TransmissionFlag.SEND_CACHE,
    "can_fast_zero": TransmissionFlag.SEND_FAST_ZERO,
    "can_flush": TransmissionFlag.SEND_FLUSH,
    "can_fua": TransmissionFlag.SEND_FUA,
    "can_multi_conn": TransmissionFlag.CAN_MULTI_CONN,
    "can_trim": TransmissionFlag.SEND_TRIM,
    "can_zero": TransmissionFlag.SEND_WRITE_ZEROES,
    "is_read_only": TransmissionFlag.READ_ONLY,
    "is_rotational": TransmissionFlag.ROTATIONAL,
}


# ----------------------------------------------------------- real servers


def test_handshake_matches_nbdinfo(peer: Peer) -> None:
    reference = nbdinfo_json(peer.uri())
    negotiated = connect(peer.host, peer.port, peer.export, TIMEOUT)
    try:
        assert negotiated.via == "go" and negotiated.tls is False
        assert negotiated.size == reference["export-size"] == IMAGE_SIZE
        flags = negotiated.transmission_flags
        assert flags & TransmissionFlag.HAS_FLAGS
        for key, flag in CAN_FLAGS.items():
            assert bool(flags & flag) == reference[key], key
        # nbdinfo negotiated structured replies, so it may do DF; this client must not.
        assert reference["can_df"] is True
        assert not flags & TransmissionFlag.SEND_DF
        assert negotiated.block_size is not None
        assert (
            negotiated.block_size.minimum,
            negotiated.block_size.preferred,
            negotiated.block_size.maximum,
        ) == (
            reference["block_size_minimum"],
            reference["block_size_preferred"],
            reference["block_size_maximum"],
        )
        assert negotiated.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert negotiated.sock.gettimeout() is None
    finally:
        disconnect(negotiated)


def test_read_only_export_flags(moorage_peer: Peer) -> None:
    reference = nbdinfo_json(moorage_peer.uri("rodisk"))
    negotiated = connect(moorage_peer.host, moorage_peer.port, "rodisk", TIMEOUT)
    try:
        assert negotiated.read_only and reference["is_read_only"] is True
        for key, flag in CAN_FLAGS.items():
            assert bool(negotiated.transmission_flags & flag) == reference[key], key
    finally:
        disconnect(negotiated)


def test_unknown_export_is_refused(peer: Peer) -> None:
    with pytest.raises(HandshakeError, match="unknown export 'no-such-export'") as info:
        connect(peer.host, peer.port, "no-such-export", TIMEOUT)
    assert info.value.reply == OptionReply.ERR_UNKNOWN
    assert "NBD_REP_ERR_UNKNOWN" in str(info.value)


def test_socket_is_in_transmission_phase_with_simple_replies(peer: Peer) -> None:
    image = peer.image.read_bytes()
    negotiated = connect(peer.host, peer.port, peer.export, TIMEOUT)
    negotiated.sock.settimeout(TIMEOUT)
    try:
        assert (
            read_raw(negotiated, DATA_OFFSET, 64 * 1024, cookie=1)
            == image[DATA_OFFSET : DATA_OFFSET + 64 * 1024]
        )
        assert read_raw(negotiated, 0, 4096, cookie=2) == bytes(4096)  # a hole
        assert read_raw(negotiated, IMAGE_SIZE - 4096, 4096, cookie=0xFFFF_FFFF_FFFF) == (
            b"tail" * 1024
        )
    finally:
        disconnect(negotiated)


def test_connect_uri_over_a_unix_socket(tmp_path: Path) -> None:
    image = patterned_image(tmp_path / "unix.img")
    path = tmp_path / "qemu-nbd.sock"
    proc = start_qemu_nbd(image, "-k", str(path))
    try:
        wait_for_path(path, proc)
        negotiated = connect_uri(f"nbd+unix:///disk?socket={path}", TIMEOUT)
        try:
            assert negotiated.size == IMAGE_SIZE
            data = read_raw(negotiated, DATA_OFFSET, 4096, cookie=9)
            assert data == image.read_bytes()[DATA_OFFSET : DATA_OFFSET + 4096]
        finally:
            disconnect(negotiated)
    finally:
        stop(proc)


def wait_for_path(path: Path, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"qemu-nbd exited {proc.returncode}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


# --------------------------------------------------------------------- TLS


@dataclass(frozen=True)
class PKI:
    ca: trustme.CA
    cert: Path
    key: Path

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        self.ca.configure_trust(ctx)
        return ctx


@pytest.fixture
def pki(tmp_path: Path) -> PKI:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = tmp_path / "server-cert.pem", tmp_path / "server-key.pem"
    server.cert_chain_pems[0].write_to_path(str(cert))
    server.private_key_pem.write_to_path(str(key))
    os.chmod(key, 0o600)
    return PKI(ca, cert, key)


@pytest.fixture
def tls_peer(tmp_path: Path, nbd_servers: NBDServerFactory, pki: PKI) -> Peer:
    image = patterned_image(tmp_path / "tls.img")
    server = nbd_servers.start(
        {"disk": image}, "--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-required"
    )
    return Peer("moorage-tls", "127.0.0.1", server.port, "disk", image)


def test_tls_required_server_refuses_plaintext(tls_peer: Peer) -> None:
    with pytest.raises(HandshakeError, match="requires TLS") as info:
        connect(tls_peer.host, tls_peer.port, tls_peer.export, TIMEOUT)
    assert info.value.reply == OptionReply.ERR_TLS_REQD


def test_tls_handshake_with_the_right_ca(tls_peer: Peer, pki: PKI) -> None:
    negotiated = connect(
        tls_peer.host,
        tls_peer.port,
        tls_peer.export,
        TIMEOUT,
        tls_context=pki.client_context(),
        tls_required=True,
    )
    try:
        assert negotiated.tls is True
        assert isinstance(negotiated.sock, ssl.SSLSocket)
        assert negotiated.size == IMAGE_SIZE and negotiated.via == "go"
        image = tls_peer.image.read_bytes()
        assert (
            read_raw(negotiated, DATA_OFFSET, 8192, cookie=5)
            == image[DATA_OFFSET : DATA_OFFSET + 8192]
        )
        # The kernel cannot take a TLS session: refused, and not as "unavailable".
        with pytest.raises(KernelNBDError, match="cannot speak TLS") as refused:
            attach_kernel(negotiated)
        assert not isinstance(refused.value, KernelNBDUnavailable)
        assert read_raw(negotiated, 0, 512, cookie=6) == bytes(512)
    finally:
        disconnect(negotiated)


def test_tls_handshake_with_the_wrong_ca_fails(tls_peer: Peer) -> None:
    ctx = ssl.create_default_context()
    trustme.CA().configure_trust(ctx)
    with pytest.raises(HandshakeError, match="TLS handshake with the server failed"):
        connect(tls_peer.host, tls_peer.port, tls_peer.export, TIMEOUT, tls_context=ctx)


def test_tls_is_optional_unless_required(moorage_peer: Peer, pki: PKI) -> None:
    # moorage without a certificate answers STARTTLS with ERR_UNSUP.
    negotiated = connect(
        moorage_peer.host,
        moorage_peer.port,
        "disk",
        TIMEOUT,
        tls_context=pki.client_context(),
    )
    try:
        assert negotiated.tls is False and not isinstance(negotiated.sock, ssl.SSLSocket)
        assert negotiated.size == IMAGE_SIZE
    finally:
        disconnect(negotiated)
    with pytest.raises(HandshakeError, match="TLS is required but the server refused") as info:
        connect(
            moorage_peer.host,
            moorage_peer.port,
            "disk",
            TIMEOUT,
            tls_context=pki.client_context(),
            tls_required=True,
        )
    assert info.value.reply == OptionReply.ERR_UNSUP


# ---------------------------------------------------------- scripted peers


def scripted(server: Callable[[socket.socket], None]) -> tuple[socket.socket, threading.Thread]:
    """A client socket whose other end runs ``server`` in a thread."""
    client, other = socket.socketpair()
    client.settimeout(10)
    other.settimeout(10)

    def run_server() -> None:
        with other:
            server(other)

    thread = threading.Thread(target=run_server, daemon=True)
    thread.start()
    return client, thread


def read_option(sock: socket.socket) -> tuple[int, bytes]:
    option, length = codec.decode_option_header(recv_exact(sock, 16))
    return option, recv_exact(sock, length) if length else b""


@pytest.mark.parametrize("no_zeroes", [True, False])
def test_falls_back_to_export_name_when_go_is_unsupported(no_zeroes: bool) -> None:
    seen: list[tuple[int, bytes]] = []
    flags = HandshakeFlag.FIXED_NEWSTYLE | (HandshakeFlag.NO_ZEROES if no_zeroes else 0)

    def server(sock: socket.socket) -> None:
        sock.sendall(codec.encode_greeting(flags))
        seen.append((-1, recv_exact(sock, 4)))
        option, data = read_option(sock)
        seen.append((option, data))
        sock.sendall(codec.encode_option_reply(option, OptionReply.ERR_UNSUP, b"no GO here"))
        option, data = read_option(sock)
        seen.append((option, data))
        sock.sendall(codec.encode_export_name_reply(5 * MiB, 0x0B, no_zeroes))
        sock.sendall(b"transmission")

    client, thread = scripted(server)
    with client:
        negotiated = handshake(client, "old")
        assert negotiated.via == "export_name"
        assert negotiated.size == 5 * MiB
        assert negotiated.transmission_flags == 0x0B and negotiated.read_only
        assert negotiated.block_size is None
        # Nothing of the reply (the 124 zeroes included) is left unread.
        assert recv_exact(client, 12) == b"transmission"
    thread.join(5)
    client_flags = ClientFlag.FIXED_NEWSTYLE | (ClientFlag.NO_ZEROES if no_zeroes else 0)
    assert seen == [
        (-1, codec.CLIENT_FLAGS.pack(client_flags)),
        (Option.GO, codec.encode_info_request("old", [Info.BLOCK_SIZE])),
        (Option.EXPORT_NAME, b"old"),
    ]


def test_export_name_refusal_is_a_hang_up() -> None:
    def server(sock: socket.socket) -> None:
        sock.sendall(codec.encode_greeting(HandshakeFlag.FIXED_NEWSTYLE))
        recv_exact(sock, 4)
        option, _ = read_option(sock)
        sock.sendall(codec.encode_option_reply(option, OptionReply.ERR_UNSUP))
        read_option(sock)  # EXPORT_NAME for an export it does not have: hang up

    client, thread = scripted(server)
    with client, pytest.raises(HandshakeError, match="unknown export 'gone', or access denied"):
        handshake(client, "gone")
    thread.join(5)


@pytest.mark.parametrize(
    ("greeting", "message"),
    [
        (b"NBDMAGIC" + b"IHAVEOPX" + b"\0\x01", "bad magic in the server greeting"),
        (b"HTTP/1.1 400 Bad Re", "bad magic in the server greeting"),
        (b"NBDMAGIC" + (0x00420281861253).to_bytes(8, "big") + b"\0\0", "oldstyle"),
    ],
)
def test_not_a_newstyle_server(greeting: bytes, message: str) -> None:
    def server(sock: socket.socket) -> None:
        sock.sendall(greeting[: codec.GREETING.size])
        sock.recv(64)

    client, thread = scripted(server)
    with client, pytest.raises(HandshakeError, match=message):
        handshake(client, "disk")
    thread.join(5)


def test_server_hanging_up_mid_greeting() -> None:
    client, thread = scripted(lambda sock: sock.sendall(b"NBDMAG"))
    with client, pytest.raises(HandshakeError, match="closed the connection"):
        handshake(client, "disk")
    thread.join(5)


def test_go_without_export_info_and_a_mismatched_reply_are_errors() -> None:
    def server(sock: socket.socket) -> None:
        sock.sendall(codec.encode_greeting(HandshakeFlag.FIXED_NEWSTYLE))
        recv_exact(sock, 4)
        option, _ = read_option(sock)
        sock.sendall(codec.encode_option_reply(option, OptionReply.ACK))
        sock.recv(64)

    client, thread = scripted(server)
    with client, pytest.raises(HandshakeError, match="without NBD_INFO_EXPORT"):
        handshake(client, "disk")
    thread.join(5)

    def wrong_option(sock: socket.socket) -> None:
        sock.sendall(codec.encode_greeting(HandshakeFlag.FIXED_NEWSTYLE))
        recv_exact(sock, 4)
        read_option(sock)
        sock.sendall(codec.encode_option_reply(Option.LIST, OptionReply.ACK))
        sock.recv(64)

    client, thread = scripted(wrong_option)
    with client, pytest.raises(HandshakeError, match="answered option 3 to NBD_OPT_GO"):
        handshake(client, "disk")
    thread.join(5)


def test_refusal_sends_abort() -> None:
    after_refusal: list[tuple[int, bytes]] = []

    def server(sock: socket.socket) -> None:
        sock.sendall(codec.encode_greeting(HandshakeFlag.FIXED_NEWSTYLE))
        recv_exact(sock, 4)
        option, _ = read_option(sock)
        sock.sendall(codec.encode_option_reply(option, OptionReply.ERR_POLICY, b"not you"))
        after_refusal.append(read_option(sock))

    client, thread = scripted(server)
    with client, pytest.raises(HandshakeError, match=r"policy refuses .*\(not you\)") as info:
        handshake(client, "disk")
    thread.join(5)
    assert info.value.reply == OptionReply.ERR_POLICY
    assert after_refusal == [(Option.ABORT, b"")]


# -------------------------------------------------------------------- URIs


def test_connect_uri_requires_a_context_for_nbds() -> None:
    with pytest.raises(ValueError, match="requires TLS"):
        connect_uri("nbds://127.0.0.1/disk")
