"""nbd.libnbd (ctypes over libnbd.so.0, pooled by nbd.libnbd_pool) against real servers: moorage,
qemu-nbd and nbdkit.

What the bindings report is checked against ``nbdinfo --json`` (libnbd's own tool) for the
same export, and what they write against the image file behind the server.

Why this file is long: it covers the bindings' whole surface (connecting and queries,
every I/O command, TLS, the connection pool, memory over 100,000 requests), and most
tests run on the shared ``peer`` fixture that starts moorage, qemu-nbd or nbdkit; split
by topic, each file would need that fixture again.
"""

from __future__ import annotations

import errno
import gc
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nbd import libnbd
from nbd.libnbd import (
    LIBNBD_SIZE_MAXIMUM,
    LIBNBD_SIZE_MINIMUM,
    LIBNBD_SIZE_PREFERRED,
    LIBNBD_TLS_DISABLE,
    LIBNBD_TLS_REQUIRE,
    CmdFlag,
    Extent,
    NBDClient,
    NBDError,
    NBDUnavailable,
)
from nbd.libnbd_pool import ConnectionPool
from tests.conftest import REPO, NBDServerFactory, free_port, sparse_image, wait_for_port
from tests.nbd_tools import (
    MiB,
    allocated_bytes,
    allocation_map,
    connections_served,
    fill,
    nbdinfo_json,
    read_range,
)

SIZE = 64 * MiB
KiB = 1024


# ------------------------------------------------------------------ servers


@dataclass(frozen=True)
class Peer:
    """A running NBD server with one export, and the image behind it (None for RAM)."""

    kind: str
    port: int
    export: str
    image: Path | None

    @property
    def uri(self) -> str:
        return f"nbd://127.0.0.1:{self.port}/{self.export}"

    @property
    def backing(self) -> Path:
        assert self.image is not None, f"{self.kind} has no image file"
        return self.image


class Processes:
    """Server processes this test started; all stopped at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], port: int) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{Path(argv[0]).name}-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        try:
            wait_for_port(port, proc)
        except Exception as e:
            raise AssertionError(f"{argv} did not start: {log.read_text()}") from e
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


def qemu_nbd_argv(port: int, image: Path, *extra: str) -> list[str]:
    return [
        "qemu-nbd",
        "-f",
        "raw",
        "-x",
        "disk",
        "-p",
        str(port),
        "-b",
        "127.0.0.1",
        "--persistent",
        "--shared=4",
        "--discard=unmap",  # TRIM punches holes, so block status can show them
        *extra,
        str(image),
    ]


def nbdkit_argv(port: int, *plugin: str) -> list[str]:
    return ["nbdkit", "-f", "--exit-with-parent", "-i", "127.0.0.1", "-p", str(port), *plugin]


RO_PATTERN = b"\xa5" * (64 * KiB)


def start_peer(kind: str, tmp: Path, servers: NBDServerFactory, procs: Processes) -> Peer:
    image = sparse_image(tmp / f"{kind}.img", SIZE)
    read_only = kind.endswith("-ro")
    if read_only:
        fill(image, MiB, RO_PATTERN)
    if kind.startswith("moorage"):
        server = servers.start({"disk": f"{image}:ro" if read_only else image})
        return Peer(kind, server.port, "disk", image)
    port = free_port()
    if kind.startswith("qemu-nbd"):
        procs.start(qemu_nbd_argv(port, image, *(["-r"] if read_only else [])), port)
        return Peer(kind, port, "disk", image)
    assert kind == "nbdkit"
    procs.start(nbdkit_argv(port, "memory", str(SIZE)), port)
    return Peer(kind, port, "", None)


@pytest.fixture(params=["moorage", "qemu-nbd", "nbdkit"])
def peer(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    nbd_servers: NBDServerFactory,
    processes: Processes,
) -> Peer:
    return start_peer(str(request.param), tmp_path, nbd_servers, processes)


IMAGE_PEERS = pytest.mark.parametrize("peer", ["moorage", "qemu-nbd"], indirect=True)
READ_ONLY_PEERS = pytest.mark.parametrize("peer", ["moorage-ro", "qemu-nbd-ro"], indirect=True)


def connect(peer: Peer) -> NBDClient:
    return NBDClient.open(peer.uri)


def flags_over(extents: list[Extent], start: int, offset: int, length: int) -> list[int]:
    """Flags of the extents (reported from ``start`` on) that overlap [offset, offset+length)."""
    flags, pos = [], start
    for e in extents:
        if pos < offset + length and offset < pos + e.length:
            flags.append(e.flags)
        pos += e.length
    assert pos >= offset + length, f"extents {extents} from {start} stop short"
    return flags


# ------------------------------------------------------------- connecting


CAN = ["can_cache", "can_df", "can_fast_zero", "can_flush", "can_fua", "can_multi_conn"]
CAN += ["can_trim", "can_zero", "is_read_only", "is_rotational"]


def test_queries_match_nbdinfo(peer: Peer) -> None:
    info = nbdinfo_json(peer.uri)
    (export,) = info["exports"]
    by_uri = connect(peer)
    by_address = NBDClient()
    by_address.add_meta_context("base:allocation")
    by_address.set_export_name(peer.export)
    by_address.connect_tcp("127.0.0.1", peer.port)
    for client in (by_uri, by_address):
        with client:
            assert client.get_size() == export["export-size"] == SIZE
            assert client.get_export_name() == export["export-name"] == peer.export
            assert client.get_protocol() == info["protocol"] == "newstyle-fixed"
            assert client.get_tls_negotiated() is info["TLS"] is False
            assert client.get_structured_replies_negotiated() is info["structured"]
            assert {k: getattr(client, k)() for k in CAN} == {k: export[k] for k in CAN}
            assert client.can_meta_context("base:allocation") is (
                "base:allocation" in export["contexts"]
            )
            assert client.can_meta_context("qemu:dirty-bitmap:nope") is False
            for kind, key in (
                (LIBNBD_SIZE_MINIMUM, "block_size_minimum"),
                (LIBNBD_SIZE_PREFERRED, "block_size_preferred"),
                (LIBNBD_SIZE_MAXIMUM, "block_size_maximum"),
            ):
                assert client.get_block_size(kind) == export.get(key, 0)
            assert client.is_connected()
        assert not client.is_connected()


def test_connect_to_closed_port_raises_libnbd_error() -> None:
    port = free_port()  # nothing listens there
    client = NBDClient()
    with pytest.raises(NBDError) as caught:
        client.connect_tcp("127.0.0.1", port)
    e = caught.value
    assert e.errno == errno.ECONNREFUSED
    assert isinstance(e, ConnectionRefusedError)
    assert e.message.startswith("nbd_connect_tcp: connect: ")
    assert "Connection refused" in str(e)
    client.close()
    with pytest.raises(ConnectionRefusedError, match=r"nbd_connect_uri"):
        NBDClient.open(f"nbd://127.0.0.1:{port}/x")


def test_connect_unix_socket(tmp_path: Path, processes: Processes) -> None:
    sock = tmp_path / "nbdkit.sock"
    argv = ["nbdkit", "-f", "--exit-with-parent", "-U", str(sock), "memory", "1M"]
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    processes.procs.append(proc)
    deadline = time.monotonic() + 20
    while not sock.is_socket():
        assert proc.poll() is None and time.monotonic() < deadline, "nbdkit did not listen"
        time.sleep(0.025)
    with NBDClient() as client:
        client.connect_unix(sock)
        assert client.get_size() == MiB
        client.pwrite(b"unix", 100)
        assert client.pread(4, 100) == b"unix"


@pytest.mark.parametrize("peer", ["nbdkit"], indirect=True)
def test_close_is_idempotent_and_a_closed_handle_refuses_calls(peer: Peer) -> None:
    client = connect(peer)
    client.shutdown()
    with pytest.raises(NBDError, match="must be connected"):
        client.pread(1, 0)
    client.close()
    client.close()
    with pytest.raises(NBDError, match="closed") as caught:
        client.get_size()
    assert caught.value.errno == errno.EBADF


def test_missing_library_raises_nbd_unavailable_on_first_use() -> None:
    code = (
        "import nbd.libnbd as m\n"
        "import nbd.libnbd_ctypes\n"
        "nbd.libnbd_ctypes.SONAME = 'libnbd-absent.so.0'\n"
        "try:\n"
        "    m.NBDClient()\n"
        "except m.NBDUnavailable as e:\n"
        "    print('unavailable:', e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("unavailable: libnbd is not usable: cannot load libnbd-absent.so.0")
    assert issubclass(NBDUnavailable, NBDError)


# -------------------------------------------------------------------- I/O


def test_round_trips_at_any_offset_and_size(peer: Peer) -> None:
    model = bytearray(4 * MiB)
    with connect(peer) as client:

        @settings(
            max_examples=40,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(
            offset=st.integers(0, len(model) - 1),
            size=st.integers(1, 256 * KiB),
            seed=st.integers(0, 2**32),
            into=st.booleans(),
        )
        def round_trip(offset: int, size: int, seed: int, into: bool) -> None:
            size = min(size, len(model) - offset)
            data = random.Random(seed).randbytes(size)
            client.pwrite(data if seed % 2 else bytearray(data), offset)
            model[offset : offset + size] = data
            # Read a wider window back: the neighbours must be untouched.
            lo, hi = max(0, offset - 777), min(len(model), offset + size + 777)
            if into:
                frame = bytearray(hi - lo + 16)
                assert client.pread_into(memoryview(frame)[8:-8], lo) == hi - lo
                assert frame[:8] == frame[-8:] == bytes(8)
                assert frame[8:-8] == model[lo:hi]
            else:
                assert client.pread(hi - lo, lo) == model[lo:hi]

        round_trip()
        client.flush()
        assert client.pread(len(model), 0) == model
    if peer.image is not None:
        assert read_range(peer.image, 0, len(model)) == model


@IMAGE_PEERS
def test_fua_write_and_flush_reach_the_image(peer: Peer) -> None:
    with connect(peer) as client:
        assert client.can_fua() and client.can_flush()
        client.pwrite(b"\x11" * 4096, 3 * MiB, CmdFlag.FUA)
        assert read_range(peer.backing, 3 * MiB, 4096) == b"\x11" * 4096
        client.pwrite(memoryview(b"\x00\x22\x22\x00")[1:3], 5 * MiB + 1)  # read-only buffer
        client.flush()
        assert read_range(peer.backing, 5 * MiB, 4) == b"\x00\x22\x22\x00"


def test_trim_then_block_status_shows_a_hole(peer: Peer) -> None:
    with connect(peer) as client:
        client.pwrite(os.urandom(2 * MiB), MiB)
        client.flush()
        assert client.can_trim()
        extents = client.block_status(4 * MiB, 0)
        assert not any(f & libnbd.LIBNBD_STATE_HOLE for f in flags_over(extents, 0, MiB, 2 * MiB))
        client.trim(MiB, 2 * MiB)
        extents = client.block_status(MiB, 2 * MiB)
        assert extents[0].is_hole and extents[0].is_zero
        assert all(f & libnbd.LIBNBD_STATE_HOLE for f in flags_over(extents, 2 * MiB, 2 * MiB, MiB))
        assert client.pread(MiB, 2 * MiB) == bytes(MiB)
        # The data in front of the trimmed range is still there.
        assert not client.block_status(MiB, MiB)[0].is_hole
    if peer.image is not None:
        holes = [(o, n) for o, n, hole in allocation_map(peer.image) if hole]
        assert any(o <= 2 * MiB and 3 * MiB <= o + n for o, n in holes), holes


@IMAGE_PEERS
def test_zero_with_no_hole_keeps_the_range_allocated(peer: Peer) -> None:
    """NO_HOLE reaches the server: the zeroed range keeps its blocks; without it they go.

    Block status cannot show the difference here: both servers zero with
    FALLOC_FL_ZERO_RANGE and map with SEEK_DATA, and ext4 reports the unwritten extents
    that ZERO_RANGE leaves as holes though their blocks stay allocated.  So allocation is
    read from the image's st_blocks, and block status must only say "reads as zero".
    """
    image = peer.backing
    with connect(peer) as client:
        assert client.can_zero()
        client.pwrite(b"\x7f" * (2 * MiB), 4 * MiB)
        client.flush()
        allocated = allocated_bytes(image)
        assert allocated >= 2 * MiB
        client.zero(2 * MiB, 4 * MiB, CmdFlag.NO_HOLE)
        client.flush()
        assert client.pread(2 * MiB, 4 * MiB) == bytes(2 * MiB)
        extents = client.block_status(2 * MiB, 4 * MiB)
        assert all(
            f & libnbd.LIBNBD_STATE_ZERO for f in flags_over(extents, 4 * MiB, 4 * MiB, 2 * MiB)
        )
        assert allocated_bytes(image) == allocated
        # The same command allowed to punch (no NO_HOLE) gives the blocks back.
        client.zero(MiB, 5 * MiB)
        client.flush()
        assert client.pread(2 * MiB, 4 * MiB) == bytes(2 * MiB)
        assert allocated_bytes(image) <= allocated - MiB
    assert read_range(image, 4 * MiB, 2 * MiB) == bytes(2 * MiB)


def test_cache_and_fast_zero_are_accepted(peer: Peer) -> None:
    with connect(peer) as client:
        assert client.can_cache() and client.can_fast_zero()
        client.cache(MiB, 0)
        client.trim(MiB, 10 * MiB)
        try:
            client.zero(MiB, 10 * MiB, CmdFlag.FAST_ZERO)
        except NBDError as e:  # the protocol lets a server refuse a zero it cannot do fast
            assert e.errno == errno.ENOTSUP, e
        assert client.pread(MiB, 10 * MiB) == bytes(MiB)


def test_read_past_the_end_is_einval(peer: Peer) -> None:
    with connect(peer) as client:
        for count, offset in ((4096, SIZE - 100), (1, SIZE), (4096, SIZE + 4096)):
            with pytest.raises(NBDError) as caught:
                client.pread(count, offset)
            assert caught.value.errno == errno.EINVAL
            assert "out of bounds" in caught.value.message
        with pytest.raises(NBDError) as caught:
            client.pread_into(bytearray(4096), SIZE - 100)
        assert caught.value.errno == errno.EINVAL
        # The handle is still good after a refused request.
        assert client.pread(100, SIZE - 100) == bytes(100)


@READ_ONLY_PEERS
def test_write_to_read_only_export_is_eperm(peer: Peer) -> None:
    with connect(peer) as client:
        assert client.is_read_only()
        writes: list[Callable[[], None]] = [
            lambda: client.pwrite(b"nope", MiB),
            lambda: client.pwrite(b"nope", MiB, CmdFlag.FUA),
        ]
        for call in writes:
            with pytest.raises(NBDError) as caught:
                call()
            assert caught.value.errno == errno.EPERM
            assert isinstance(caught.value, PermissionError)
            assert "server does not support write operations" in caught.value.message
        # A read-only export advertises neither TRIM nor WRITE_ZEROES, and libnbd
        # refuses a command the server did not advertise, with EINVAL.
        unadvertised: list[Callable[[], None]] = [
            lambda: client.trim(4096, MiB),
            lambda: client.zero(4096, MiB),
        ]
        for call in unadvertised:
            with pytest.raises(NBDError, match="server does not support") as refused:
                call()
            assert refused.value.errno == errno.EINVAL
        assert client.pread(len(RO_PATTERN), MiB) == RO_PATTERN
    assert read_range(peer.backing, MiB, len(RO_PATTERN)) == RO_PATTERN


@pytest.mark.parametrize("peer", ["moorage"], indirect=True)
def test_an_exception_in_the_extent_callback_surfaces(
    peer: Peer, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Boom(Exception):
        pass

    def explode(length: int, flags: int) -> Extent:
        raise Boom(length)

    with connect(peer) as client:
        monkeypatch.setattr(libnbd, "Extent", explode)
        with pytest.raises(Boom) as caught:
            client.block_status(MiB, 0)
        assert isinstance(caught.value.__cause__, NBDError)
        monkeypatch.undo()
        assert client.block_status(MiB, 0)  # the handle survives
        assert client.pread(10, 0) == bytes(10)


# -------------------------------------------------------------------- TLS


@dataclass(frozen=True)
class Certs:
    server_args: list[str]
    ca_cert: Path
    client_dir: Path  # CA + client certificate and key
    anonymous_dir: Path  # CA only


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    ca = trustme.CA()
    root = tmp_path / "pki"
    client_dir, anonymous_dir = root / "client", root / "anon"
    for d in (client_dir, anonymous_dir):
        d.mkdir(parents=True)
        ca.cert_pem.write_to_path(str(d / "ca-cert.pem"))
    ca.cert_pem.write_to_path(str(root / "ca-cert.pem"))
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.cert_chain_pems[0].write_to_path(str(root / "server-cert.pem"))
    server.private_key_pem.write_to_path(str(root / "server-key.pem"))
    client = ca.issue_cert("nbd-client.test")
    client.cert_chain_pems[0].write_to_path(str(client_dir / "client-cert.pem"))
    client.private_key_pem.write_to_path(str(client_dir / "client-key.pem"))
    for key in (root / "server-key.pem", client_dir / "client-key.pem"):
        key.chmod(0o600)
    args = ["--tls-cert", str(root / "server-cert.pem"), "--tls-key", str(root / "server-key.pem")]
    return Certs(args, root / "ca-cert.pem", client_dir, anonymous_dir)


def tls_client(port: int, certificates: Path, tls: int = LIBNBD_TLS_REQUIRE) -> NBDClient:
    client = NBDClient()
    client.set_tls(tls)
    client.set_tls_certificates(certificates)
    client.set_tls_verify_peer(True)
    client.add_meta_context("base:allocation")
    client.set_export_name("t")
    try:
        client.connect_tcp("127.0.0.1", port)
    except BaseException:
        client.close()
        raise
    return client


def test_tls_required_server(tmp_path: Path, nbd_servers: NBDServerFactory, certs: Certs) -> None:
    img = sparse_image(tmp_path / "t.img", 8 * MiB)
    server = nbd_servers.start({"t": img}, *certs.server_args, "--tls-required")
    with tls_client(server.port, certs.anonymous_dir) as client:
        assert client.supports_tls()
        assert client.get_tls_negotiated() is True
        assert client.get_size() == 8 * MiB
        client.pwrite(b"\x5e" * 3 * MiB, 0, CmdFlag.FUA)  # several TLS records per request
        assert client.pread(3 * MiB, 0) == b"\x5e" * 3 * MiB
        assert client.block_status(8 * MiB, 0)[0] == Extent(3 * MiB, 0)
    assert read_range(img, 0, 3 * MiB) == b"\x5e" * 3 * MiB
    # Without TLS the server refuses the export.
    with pytest.raises(NBDError, match="TLS") as caught:
        tls_client(server.port, certs.anonymous_dir, tls=LIBNBD_TLS_DISABLE)
    assert "handshake" in caught.value.message or "TLS" in caught.value.message
    assert connections_served(server.log_text(), "t") == 1


def test_tls_client_certificate(
    tmp_path: Path, nbd_servers: NBDServerFactory, certs: Certs
) -> None:
    img = sparse_image(tmp_path / "t.img", 8 * MiB)
    server = nbd_servers.start(
        {"t": img},
        *certs.server_args,
        "--tls-required",
        "--tls-verify-peer",
        str(certs.ca_cert),
    )
    with tls_client(server.port, certs.client_dir) as client:
        assert client.get_tls_negotiated()
        client.pwrite(b"mtls", 0)
        assert client.pread(4, 0) == b"mtls"
    with pytest.raises(NBDError):
        tls_client(server.port, certs.anonymous_dir)
    assert connections_served(server.log_text(), "t") == 1


# ------------------------------------------------------------- multi-conn


def test_pool_uses_every_connection_when_multi_conn(
    tmp_path: Path, nbd_servers: NBDServerFactory
) -> None:
    img = sparse_image(tmp_path / "m.img", 16 * MiB)
    server = nbd_servers.start({"m": img})
    with ConnectionPool(server.uri("m"), 4) as pool:
        assert len(pool) == 4
        errors: list[BaseException] = []

        def writer(n: int) -> None:
            try:
                with pool.client() as client:
                    client.pwrite(bytes([n + 1]) * MiB, n * MiB)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors
        pool.flush()
        # Every connection sees what the others wrote.
        for client in pool.clients:
            for n in range(8):
                assert client.pread(16, n * MiB + 4096) == bytes([n + 1]) * 16
    assert connections_served(server.log_text(), "m") == 4
    assert read_range(img, 7 * MiB, MiB) == b"\x08" * MiB


def test_pool_keeps_one_connection_without_multi_conn(processes: Processes) -> None:
    port = free_port()
    argv = nbdkit_argv(port, "--filter=multi-conn", "memory", "16M", "multi-conn-mode=disable")
    processes.start(argv, port)
    with ConnectionPool(f"nbd://127.0.0.1:{port}/", 4) as pool:
        assert len(pool) == 1
        assert not pool.clients[0].can_multi_conn()
        with pool.client() as client:
            client.pwrite(b"single", 0)
        pool.flush()
        with pool.client() as client:
            assert client.pread(6, 0) == b"single"
    assert not pool.clients[0].is_connected()


# ----------------------------------------------------------------- memory


def vm_rss() -> int:
    """This process's resident set size in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.parametrize("peer", ["nbdkit"], indirect=True)
def test_no_memory_growth_over_100k_requests(peer: Peer) -> None:
    """Read buffers, write views, extent callbacks, strings libnbd mallocs for us and error
    objects are all released: over 100,000 requests the RSS stays flat after a warm-up."""
    block = bytes(range(256)) * 2
    writable = bytearray(block)
    into = bytearray(512)
    name = "e" * 200  # nbdkit serves any export name; a long one makes a leaked copy show
    with NBDClient.open(f"nbd://127.0.0.1:{peer.port}/{name}") as client:

        def requests(start: int, stop: int) -> None:
            for i in range(start, stop):
                offset = (i % 8192) * 512
                client.pwrite(block if i % 2 else memoryview(writable), offset)
                match i % 3:
                    case 0:
                        assert client.pread(512, offset) == block
                    case 1:
                        client.pread_into(into, offset)
                    case _:
                        assert client.block_status(64 * KiB, offset)[0].flags == 0
                assert client.get_export_name() == name
                if i % 1000 == 0:
                    with pytest.raises(NBDError):  # the error path allocates too
                        client.pread(512, SIZE)
            assert into == block

        requests(0, 10_000)
        gc.collect()
        before = vm_rss()
        requests(10_000, 100_000)
        gc.collect()
        after = vm_rss()
    assert after - before < 8 * MiB, f"RSS grew by {(after - before) / MiB:.1f} MiB"
