"""NBD over TLS (NBD_OPT_STARTTLS) with libnbd and qemu as clients.

Certificates come from ``trustme``: a test CA, a server certificate for
127.0.0.1, and a client certificate.  libnbd (``nbds://...?tls-certificates=DIR``)
and qemu (``tls-creds-x509,dir=DIR``) both read ``ca-cert.pem``, and for client
authentication ``client-cert.pem`` and ``client-key.pem``, from that directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from tests.conftest import NBDServerFactory, NBDServerProcess, run, sparse_image
from tests.nbd_tools import (
    TIMEOUT,
    MiB,
    connections_served,
    nbd_target,
    nbdinfo_json,
    qemu_io,
    read_range,
    sha256,
)


@dataclass(frozen=True)
class PKI:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_dir: Path  # CA + client certificate and key
    anonymous_dir: Path  # CA only: verifies the server, presents no certificate
    wrong_ca_dir: Path  # a CA that did not sign the server certificate


@pytest.fixture
def pki(tmp_path: Path) -> PKI:
    ca = trustme.CA()
    root = tmp_path / "pki"
    client_dir, anonymous_dir, wrong_ca_dir = root / "client", root / "anon", root / "wrong"
    for d in (client_dir, anonymous_dir, wrong_ca_dir):
        d.mkdir(parents=True)
    server = ca.issue_cert("127.0.0.1", "localhost")
    server_cert, server_key = root / "server-cert.pem", root / "server-key.pem"
    server.cert_chain_pems[0].write_to_path(str(server_cert))
    server.private_key_pem.write_to_path(str(server_key))
    client = ca.issue_cert("nbd-client.test")
    for d in (root, client_dir, anonymous_dir):
        ca.cert_pem.write_to_path(str(d / "ca-cert.pem"))
    client.cert_chain_pems[0].write_to_path(str(client_dir / "client-cert.pem"))
    client.private_key_pem.write_to_path(str(client_dir / "client-key.pem"))
    trustme.CA().cert_pem.write_to_path(str(wrong_ca_dir / "ca-cert.pem"))
    for key in (server_key, client_dir / "client-key.pem"):
        os.chmod(key, 0o600)
    return PKI(
        ca_cert=root / "ca-cert.pem",
        server_cert=server_cert,
        server_key=server_key,
        client_dir=client_dir,
        anonymous_dir=anonymous_dir,
        wrong_ca_dir=wrong_ca_dir,
    )


def tls_uri(server: NBDServerProcess, export: str, certs: Path) -> str:
    return f"{server.uri(export, scheme='nbds')}?tls-certificates={certs}"


def qemu_tls_target(server: NBDServerProcess, export: str, certs: Path) -> list[str]:
    return [
        "--object",
        f"tls-creds-x509,id=tls0,endpoint=client,dir={certs}",
        "--image-opts",
        f"driver=nbd,server.type=inet,server.host=127.0.0.1,server.port={server.port},"
        f"export={export},tls-creds=tls0",
    ]


def server_args(pki: PKI, *extra: str) -> list[str]:
    return ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), *extra]


def test_tls_required_nbdinfo(tmp_path: Path, nbd_servers: NBDServerFactory, pki: PKI) -> None:
    img = sparse_image(tmp_path / "t.img", 8 * MiB)
    server = nbd_servers.start({"t": img}, *server_args(pki, "--tls-required"))
    info = nbdinfo_json(tls_uri(server, "t", pki.anonymous_dir))
    assert info["TLS"] is True
    assert info["structured"] is True
    (export,) = info["exports"]
    assert export["export-name"] == "t"
    assert export["export-size"] == 8 * MiB
    assert export["can_fua"] is True and export["is_read_only"] is False
    assert "base:allocation" in export["contexts"]
    tls = run(["nbdinfo", "--is", "tls", tls_uri(server, "t", pki.anonymous_dir)], check=False)
    assert tls.returncode == 0, tls
    listed = nbdinfo_json(tls_uri(server, "", pki.anonymous_dir), "--list")
    assert listed["TLS"] is True
    assert [e["export-name"] for e in listed["exports"]] == ["t"]
    assert ": serving export t (8388608 bytes, TLS)" in server.log_text()


def test_tls_required_refuses_plaintext(
    tmp_path: Path, nbd_servers: NBDServerFactory, pki: PKI
) -> None:
    img = sparse_image(tmp_path / "t.img", 8 * MiB)
    server = nbd_servers.start({"t": img}, *server_args(pki, "--tls-required"))
    for argv in (
        ["nbdinfo", server.uri("t")],
        ["nbdinfo", "--list", server.uri("")],
        ["nbdinfo", "--can", "connect", server.uri("t")],
    ):
        result = run(argv, check=False)
        assert result.returncode not in (0, 2), (argv, result)
    plain = qemu_io(nbd_target(server.uri("t")), "write -P 0x77 0 64k", check=False)
    assert plain.returncode != 0
    assert "TLS negotiation required" in plain.stderr, plain.stderr
    assert "server reported: TLS is required" in plain.stderr, plain.stderr
    assert connections_served(server.log_text(), "t") == 0
    assert read_range(img, 0, 64 * 1024) == bytes(64 * 1024)
    # The server is still fine for a TLS client afterwards.
    qemu_io(qemu_tls_target(server, "t", pki.anonymous_dir), "read -P 0 0 64k")


def test_tls_qemu_io_read_write(tmp_path: Path, nbd_servers: NBDServerFactory, pki: PKI) -> None:
    img = sparse_image(tmp_path / "t.img", 16 * MiB)
    server = nbd_servers.start({"t": img}, *server_args(pki, "--tls-required"))
    target = qemu_tls_target(server, "t", pki.anonymous_dir)
    result = qemu_io(
        target,
        "write -P 0x5e 0 3M",  # several TLS records per request
        "write -f -P 0x6f 5M 4096",
        "write -z -u 1M 1M",
        "discard 2M 64k",
        "flush",
        "read -P 0x5e 0 1M",
        "read -P 0 1M 1M",
        "read -P 0 2M 64k",
        "read -P 0x5e 2162688 983040",
        "read -P 0x6f 5M 4096",
    )
    assert "nbd_send_request" in result.stderr
    expected = b"\x5e" * MiB + bytes(MiB + 64 * 1024) + b"\x5e" * (MiB - 64 * 1024)
    assert read_range(img, 0, 3 * MiB) == expected
    assert read_range(img, 5 * MiB, 4096) == b"\x6f" * 4096
    assert ": serving export t (16777216 bytes, TLS)" in server.log_text()


def test_tls_nbdcopy_round_trip(tmp_path: Path, nbd_servers: NBDServerFactory, pki: PKI) -> None:
    """Large requests through the TLS stream, on two connections at once."""
    size = 32 * MiB
    src = tmp_path / "src.img"
    sparse_image(src, size)
    with src.open("r+b") as f:
        f.write(os.urandom(12 * MiB))
        f.seek(20 * MiB)
        f.write(os.urandom(8 * MiB))
    img = sparse_image(tmp_path / "t.img", size)
    server = nbd_servers.start({"t": img}, *server_args(pki, "--tls-required"))
    uri = tls_uri(server, "t", pki.anonymous_dir)
    opts = ["--connections=2", "--threads=2"]
    run(["nbdcopy", *opts, "--flush", str(src), uri], timeout=TIMEOUT)
    assert sha256(img) == sha256(src)
    out = tmp_path / "out.img"
    run(["nbdcopy", *opts, uri, str(out)], timeout=TIMEOUT)
    assert sha256(out) == sha256(src)
    assert connections_served(server.log_text(), "t") == 4


def test_tls_optional_serves_both(tmp_path: Path, nbd_servers: NBDServerFactory, pki: PKI) -> None:
    img = sparse_image(tmp_path / "t.img", 8 * MiB)
    server = nbd_servers.start({"t": img}, *server_args(pki))
    plain = nbdinfo_json(server.uri("t"))
    assert plain["TLS"] is False
    assert plain["exports"][0]["export-size"] == 8 * MiB
    secure = nbdinfo_json(tls_uri(server, "t", pki.anonymous_dir))
    assert secure["TLS"] is True
    assert secure["exports"][0]["export-size"] == 8 * MiB
    assert run(["nbdinfo", "--is", "tls", server.uri("t")], check=False).returncode == 2
    tls = run(["nbdinfo", "--is", "tls", tls_uri(server, "t", pki.anonymous_dir)], check=False)
    assert tls.returncode == 0
    # Data written over one kind of connection is read over the other.
    qemu_io(nbd_target(server.uri("t")), "write -P 0x1a 0 1M")
    qemu_io(qemu_tls_target(server, "t", pki.anonymous_dir), "read -P 0x1a 0 1M")
    qemu_io(qemu_tls_target(server, "t", pki.anonymous_dir), "write -P 0x2b 1M 1M")
    qemu_io(nbd_target(server.uri("t")), "read -P 0x2b 1M 1M", "read -P 0x1a 0 1M")
    log = server.log_text()
    assert ": serving export t (8388608 bytes, TLS)" in log
    assert ": serving export t (8388608 bytes)" in log


def test_tls_client_certificate_required(
    tmp_path: Path, nbd_servers: NBDServerFactory, pki: PKI
) -> None:
    img = sparse_image(tmp_path / "t.img", 8 * MiB)
    server = nbd_servers.start(
        {"t": img},
        *server_args(pki, "--tls-required", "--tls-verify-peer", str(pki.ca_cert)),
    )
    # With a certificate signed by the CA: accepted.
    info = nbdinfo_json(tls_uri(server, "t", pki.client_dir))
    assert info["TLS"] is True
    qemu_io(
        qemu_tls_target(server, "t", pki.client_dir), "write -P 0x3c 0 64k", "read -P 0x3c 0 64k"
    )
    served = connections_served(server.log_text(), "t")
    # Without one: refused, by libnbd and by qemu.
    refused = run(["nbdinfo", tls_uri(server, "t", pki.anonymous_dir)], check=False)
    assert refused.returncode not in (0, 2), refused
    anon = qemu_io(qemu_tls_target(server, "t", pki.anonymous_dir), "read 0 4k", check=False)
    assert anon.returncode != 0, anon
    assert connections_served(server.log_text(), "t") == served
    assert "TLS handshake failed" in server.log_text()


def test_tls_client_rejects_unknown_server_ca(
    tmp_path: Path, nbd_servers: NBDServerFactory, pki: PKI
) -> None:
    img = sparse_image(tmp_path / "t.img", 8 * MiB)
    server = nbd_servers.start({"t": img}, *server_args(pki, "--tls-required"))
    result = run(["nbdinfo", tls_uri(server, "t", pki.wrong_ca_dir)], check=False)
    assert result.returncode not in (0, 2), result
    assert connections_served(server.log_text(), "t") == 0
    # The same client with the right CA gets in.
    assert nbdinfo_json(tls_uri(server, "t", pki.anonymous_dir))["TLS"] is True
