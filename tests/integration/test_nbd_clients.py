"""The NBD server against real clients: nbdinfo, qemu-io, qemu-img and nbdcopy.

Every test starts ``moorage nbd serve`` on a loopback port (the ``nbd_servers``
fixture) and drives it with the Debian client tools.  Where a client could
hide what went over the wire (qemu emulating a command the server lacks, say),
qemu's ``nbd_send_request`` trace shows which request the server really got.

Why this file is long: each real client gets its own cases (nbdinfo's listings, maps and
exit statuses, qemu-io, nbdcopy, a raw client for what the tools refuse to send, unix
socket and socket activation, multi-conn), and one qemu-io test walks a table of steps,
each with the request the server must receive.  The clients' harness is
``tests/nbd_tools.py``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from nbd import codec
from nbd.constants import ClientFlag, Command, Errno, Option, OptionReply
from tests.conftest import (
    REPO,
    NBDServerFactory,
    NBDServerProcess,
    free_port,
    run,
    sparse_image,
    wait_for_port,
)
from tests.nbd_tools import (
    FAST_ZERO,
    FLUSH,
    FUA,
    NO_HOLE,
    TIMEOUT,
    TRIM,
    WRITE,
    WRITE_ZEROES,
    MiB,
    QemuIOSession,
    Sent,
    allocated_bytes,
    allocation_map,
    connections_served,
    fill,
    is_hole,
    nbd_target,
    nbdinfo_json,
    qemu_io,
    read_range,
    sent_requests,
    sha256,
)

# ---------------------------------------------------------------- nbdinfo

RW_CAN = {
    "can_cache": True,
    "can_df": True,
    "can_fast_zero": True,
    "can_flush": True,
    "can_fua": True,
    "can_multi_conn": True,
    "can_trim": True,
    "can_zero": True,
}
RO_CAN = RW_CAN | {"can_fast_zero": False, "can_fua": False, "can_trim": False, "can_zero": False}


@pytest.fixture
def two_exports(tmp_path: Path, nbd_servers: NBDServerFactory) -> NBDServerProcess:
    rw = sparse_image(tmp_path / "rw.img", 64 * MiB)
    ro = sparse_image(tmp_path / "ro.img", 32 * MiB + 4096)
    return nbd_servers.start({"disk": rw, "rodisk": f"{ro}:ro"})


def test_nbdinfo_json_rw_export(two_exports: NBDServerProcess) -> None:
    info = nbdinfo_json(two_exports.uri("disk"))
    assert info["protocol"] == "newstyle-fixed"
    assert info["TLS"] is False
    assert info["structured"] is True
    (export,) = info["exports"]
    assert export["export-name"] == "disk"
    assert export["export-size"] == 64 * MiB
    assert export["is_read_only"] is False
    assert export["is_rotational"] is False
    assert {k: v for k, v in export.items() if k.startswith("can_")} == RW_CAN
    assert export["block_size_minimum"] == 1
    assert export["block_size_preferred"] == 4096
    assert export["block_size_maximum"] == 32 * MiB
    assert "base:allocation" in export["contexts"]


def test_nbdinfo_json_read_only_export(two_exports: NBDServerProcess) -> None:
    (export,) = nbdinfo_json(two_exports.uri("rodisk"))["exports"]
    assert export["export-name"] == "rodisk"
    assert export["export-size"] == 32 * MiB + 4096
    assert export["is_read_only"] is True
    assert {k: v for k, v in export.items() if k.startswith("can_")} == RO_CAN
    assert (export["block_size_minimum"], export["block_size_preferred"]) == (1, 4096)
    assert export["block_size_maximum"] == 32 * MiB
    assert "base:allocation" in export["contexts"]


def test_nbdinfo_min_block_size(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    img = sparse_image(tmp_path / "a.img", 8 * MiB)
    server = nbd_servers.start({"a": img}, "--min-block-size", "65536")
    (export,) = nbdinfo_json(server.uri("a"))["exports"]
    assert export["block_size_minimum"] == 65536
    assert export["block_size_preferred"] == 65536
    assert export["block_size_maximum"] == 32 * MiB


def test_nbdinfo_list_shows_every_export(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    exports: dict[str, Path | str] = {}
    sizes = {"alpha": 1 * MiB, "beta": 3 * MiB, "gamma.ro": 5 * MiB}
    for name, size in sizes.items():
        img = sparse_image(tmp_path / f"{name}.img", size)
        exports[name] = f"{img}:ro" if name.endswith(".ro") else img
    server = nbd_servers.start(exports)
    listed = nbdinfo_json(server.uri(""), "--list")["exports"]
    assert {e["export-name"]: e["export-size"] for e in listed} == sizes
    assert {e["export-name"]: e["is_read_only"] for e in listed} == {
        "alpha": False,
        "beta": False,
        "gamma.ro": True,
    }
    # The CLI gives exports no description: none is announced.
    assert not any("description" in e for e in listed)
    text = run(["nbdinfo", "--list", server.uri("")], timeout=TIMEOUT).stdout
    for name in sizes:
        assert f'export="{name}":' in text


_DESCRIBED_SERVER = """
import sys
from pathlib import Path
import trio
from nbd.exports import Export, ExportTable
from nbd.server import NBDServer

port, img = int(sys.argv[1]), Path(sys.argv[2])
table = ExportTable([
    Export(name="alpha", path=img, description="Alpha disk: scratch space"),
    Export(name="beta", path=img, read_only=True, description="Beta, read-only \u00e9t\u00e9"),
    Export(name="gamma", path=img),
])
trio.run(NBDServer(table).serve_tcp, "127.0.0.1", port)
"""


def test_nbdinfo_list_shows_descriptions(tmp_path: Path) -> None:
    """Descriptions (NBD_REP_SERVER and NBD_INFO_DESCRIPTION) as libnbd decodes them."""
    img = sparse_image(tmp_path / "d.img", 2 * MiB)
    port = free_port()
    log = tmp_path / "described.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _DESCRIBED_SERVER, str(port), str(img)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        wait_for_port(port, proc)
        uri = f"nbd://127.0.0.1:{port}/"
        listed = nbdinfo_json(uri, "--list")["exports"]
        assert {e["export-name"]: e.get("description") for e in listed} == {
            "alpha": "Alpha disk: scratch space",
            "beta": "Beta, read-only \u00e9t\u00e9",
            "gamma": None,
        }
        (alpha,) = nbdinfo_json(uri + "alpha")["exports"]
        assert alpha["description"] == "Alpha disk: scratch space"
        text = run(["nbdinfo", "--list", uri], timeout=TIMEOUT).stdout
        assert "description: Alpha disk: scratch space" in text
    finally:
        proc.kill()
        proc.wait()


def test_nbdinfo_can_and_is_exit_status(two_exports: NBDServerProcess) -> None:
    """``nbdinfo --can X`` / ``--is X``: exit 0 when true, 2 when false."""
    expected = {
        # flag: (rw export, ro export)
        "--can connect": (0, 0),
        "--can read": (0, 0),
        "--can write": (0, 2),
        "--can flush": (0, 0),
        "--can fua": (0, 2),
        "--can trim": (0, 2),
        "--can zero": (0, 2),
        "--can fast-zero": (0, 2),
        "--can df": (0, 0),
        "--can multi-conn": (0, 0),
        "--can cache": (0, 0),
        # Structured replies: the prerequisite for block status (base:allocation).
        "--can structured-reply": (0, 0),
        "--is read-only": (2, 0),
        "--is rotational": (2, 2),
        "--is tls": (2, 2),
    }
    got: dict[str, tuple[int, int]] = {}
    for flag in expected:
        codes = []
        for export in ("disk", "rodisk"):
            result = run(
                ["nbdinfo", *flag.split(), two_exports.uri(export)], timeout=TIMEOUT, check=False
            )
            codes.append(result.returncode)
        got[flag] = (codes[0], codes[1])
    assert got == expected


def test_nbdinfo_can_connect_fails_for_unknown_export(two_exports: NBDServerProcess) -> None:
    result = run(["nbdinfo", "--can", "connect", two_exports.uri("nope")], check=False)
    assert result.returncode not in (0, 2), result


def test_nbdinfo_map_reports_data_and_holes(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    size = 64 * MiB
    img = sparse_image(tmp_path / "map.img", size)
    data = [(0, 1 * MiB), (3 * MiB, 2 * MiB), (10 * MiB, 1 * MiB), (63 * MiB, 1 * MiB)]
    for offset, length in data:
        fill(img, offset, os.urandom(length))
    expected = []
    pos = 0
    for offset, length in data:
        if offset > pos:
            expected.append({"offset": pos, "length": offset - pos, "type": 3})
        expected.append({"offset": offset, "length": length, "type": 0})
        pos = offset + length
    assert pos == size
    server = nbd_servers.start({"rw": img, "ro": f"{img}:ro"})
    for export in ("rw", "ro"):
        out = run(["nbdinfo", "--map", "--json", server.uri(export)], timeout=TIMEOUT).stdout
        got = [{k: e[k] for k in ("offset", "length", "type")} for e in json.loads(out)]
        assert got == expected, export
        descr = {e["type"]: e["description"] for e in json.loads(out)}
        assert descr == {0: "data", 3: "hole,zero"}
    totals = run(["nbdinfo", "--map", "--totals", "--json", server.uri("rw")]).stdout
    by_type = {e["type"]: e["size"] for e in json.loads(totals)}
    assert by_type == {0: 5 * MiB, 3: size - 5 * MiB}


# ----------------------------------------------------------------- qemu-io


@dataclass(frozen=True)
class Step:
    command: str
    sent: Sent  # the request the server must receive
    # The model update: (offset, length, byte) written; byte 0 for zeroes.
    effect: tuple[int, int, int]
    hole: bool = False  # the range must end up unallocated in the image file

    @property
    def check(self) -> str:
        """A qemu-io read verifying the step's effect."""
        offset, length, byte = self.effect
        return f"read -P {byte:#x} {offset} {length}"


STEPS = [
    Step("write -P 0x11 0 1M", Sent(WRITE, 0, MiB, 0), (0, MiB, 0x11)),
    Step("write -f -P 0x22 1M 1M", Sent(WRITE, MiB, MiB, FUA), (MiB, MiB, 0x22)),
    # Larger than one inline request: served from a worker thread.
    Step("write -P 0x33 2M 4M", Sent(WRITE, 2 * MiB, 4 * MiB, 0), (2 * MiB, 4 * MiB, 0x33)),
    Step("write -z 2M 1M", Sent(WRITE_ZEROES, 2 * MiB, MiB, NO_HOLE), (2 * MiB, MiB, 0)),
    Step("write -z -u 3M 1M", Sent(WRITE_ZEROES, 3 * MiB, MiB, 0), (3 * MiB, MiB, 0), hole=True),
    Step(
        "write -z -u -n 4M 1M",
        Sent(WRITE_ZEROES, 4 * MiB, MiB, FAST_ZERO),
        (4 * MiB, MiB, 0),
        hole=True,
    ),
    Step(
        "write -z -n 5M 512k",
        Sent(WRITE_ZEROES, 5 * MiB, MiB // 2, NO_HOLE | FAST_ZERO),
        (5 * MiB, MiB // 2, 0),
    ),
    Step("write -P 0x44 6M 2M", Sent(WRITE, 6 * MiB, 2 * MiB, 0), (6 * MiB, 2 * MiB, 0x44)),
    Step("discard 6M 1M", Sent(TRIM, 6 * MiB, MiB, 0), (6 * MiB, MiB, 0), hole=True),
    # Unaligned and small: answered inline from the page cache.
    Step("write -P 0x55 8389608 3000", Sent(WRITE, 8 * MiB + 1000, 3000, 0), (8389608, 3000, 0x55)),
    Step("write -P 0x66 9M 1M", Sent(WRITE, 9 * MiB, MiB, 0), (9 * MiB, MiB, 0x66)),
    Step(
        "write -z -f -u 9M 1M",
        Sent(WRITE_ZEROES, 9 * MiB, MiB, FUA),
        (9 * MiB, MiB, 0),
        hole=True,
    ),
    Step(
        "write -z -f 10M 64k",
        Sent(WRITE_ZEROES, 10 * MiB, 65536, FUA | NO_HOLE),
        (10 * MiB, 65536, 0),
    ),
    Step("flush", Sent(FLUSH, 0, 0, 0), (0, MiB, 0x11)),
]


def test_qemu_io_commands_reach_the_image(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    """Each qemu-io command: the request the server got, the file, and a read-back."""
    size = 16 * MiB
    img = sparse_image(tmp_path / "q.img", size)
    server = nbd_servers.start({"q": img})
    target = nbd_target(server.uri("q"))
    model = bytearray(size)
    for step in STEPS:
        offset, length, byte = step.effect
        model[offset : offset + length] = bytes([byte]) * length
        result = qemu_io(target, step.command, step.check)
        sent = sent_requests(result.stderr)
        assert step.sent in sent, f"{step.command}: server got {sent}"
        # The image file itself holds exactly what the model says.
        assert read_range(img, 0, size) == bytes(model), step.command
        if step.hole:
            assert is_hole(img, offset, length), (step.command, allocation_map(img))
    assert img.stat().st_size == size
    # And through NBD, the whole image at once, against a file holding the model.
    expected = tmp_path / "expected.img"
    expected.write_bytes(bytes(model))
    out = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", str(expected), server.uri("q")])
    assert "Images are identical" in out.stdout
    # Spot checks of untouched and partly overwritten ranges through qemu-io.
    qemu_io(
        target,
        "read -P 0 8M 1000",
        "read -P 0x55 8389608 3000",
        "read -P 0 8392608 4000",
        "read -P 0 5M 512k",
        "read -P 0x33 5767168 512k",
        "read -P 0 11M 5M",
    )


def test_qemu_io_zeroing_allocation(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    """``write -z`` keeps the blocks allocated (NO_HOLE); ``write -z -u`` punches a hole."""
    img = sparse_image(tmp_path / "z.img", 16 * MiB)
    fill(img, 0, os.urandom(8 * MiB))
    before = allocated_bytes(img)
    assert before >= 8 * MiB
    server = nbd_servers.start({"z": img})
    result = qemu_io(
        nbd_target(server.uri("z")),
        "write -z 0 4M",
        "write -z -u 4M 4M",
        "flush",
        "read -P 0 0 8M",
    )
    sent = sent_requests(result.stderr)
    assert Sent(WRITE_ZEROES, 0, 4 * MiB, NO_HOLE) in sent
    assert Sent(WRITE_ZEROES, 4 * MiB, 4 * MiB, 0) in sent
    assert read_range(img, 0, 8 * MiB) == bytes(8 * MiB)
    assert is_hole(img, 4 * MiB, 4 * MiB), allocation_map(img)
    after = allocated_bytes(img)
    # The NO_HOLE half keeps its 4 MiB; the other half is given back.
    assert before - 4 * MiB - 256 * 1024 <= after <= before - 4 * MiB + 256 * 1024, (before, after)


def _raw_connect(port: int, export: str) -> socket.socket:
    """A minimal NBD client (fixed newstyle, NBD_OPT_GO, simple replies).

    qemu-io and libnbd refuse to send writes to an export advertised read-only,
    so only a raw client can check that the server refuses them itself.
    """
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    codec.decode_greeting(_recv_exact(sock, codec.GREETING.size))
    sock.sendall(codec.CLIENT_FLAGS.pack(ClientFlag.FIXED_NEWSTYLE | ClientFlag.NO_ZEROES))
    sock.sendall(codec.encode_option(Option.GO, codec.encode_info_request(export, [])))
    while True:
        _, reply, length = codec.decode_option_reply_header(
            _recv_exact(sock, codec.OPTION_REPLY_HEADER.size)
        )
        _recv_exact(sock, length)
        assert not reply & (1 << 31), f"NBD_OPT_GO failed: {reply:#x}"
        if reply == OptionReply.ACK:
            return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise AssertionError("server closed the connection")
        out += chunk
    return out


def _raw_request(
    sock: socket.socket, cmd: Command, cookie: int, offset: int, length: int, payload: bytes = b""
) -> tuple[int, bytes]:
    sock.sendall(codec.encode_request(cmd, cookie, offset, length) + payload)
    error, got_cookie = codec.decode_simple_reply(_recv_exact(sock, codec.SIMPLE_REPLY.size))
    assert got_cookie == cookie
    data = _recv_exact(sock, length) if cmd == Command.READ and error == 0 else b""
    return error, data


def test_read_only_export_refuses_writes(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    img = sparse_image(tmp_path / "ro.img", 8 * MiB)
    fill(img, 0, b"\xa5" * MiB)
    digest = sha256(img)
    server = nbd_servers.start({"ro": f"{img}:ro"})
    target = nbd_target(server.uri("ro"))
    # qemu sees the read-only flag: a writable open is refused outright...
    opened = qemu_io(target, "write -P 0xff 0 64k", check=False)
    assert opened.returncode != 0
    assert "Permission denied" in opened.stderr or "read-only" in opened.stderr, opened.stderr
    # ...and in read-only mode every write-like command fails.
    for command in ("write -P 0xff 0 64k", "write -z 0 64k", "discard 0 64k", "write -f 0 4k"):
        result = qemu_io(target, command, extra=["-r"], check=False)
        assert result.returncode != 0, command
        assert "read-only" in result.stderr, (command, result.stderr)
        assert not [
            s for s in sent_requests(result.stderr) if s.type in (WRITE, TRIM, WRITE_ZEROES)
        ]
    # Reads work and see the data.
    qemu_io(target, "read -P 0xa5 0 1M", "read -P 0 1M 7M", extra=["-r"])
    # The server refuses writes itself, whatever the client does.
    with _raw_connect(server.port, "ro") as sock:
        assert _raw_request(sock, Command.WRITE, 1, 0, 4096, b"\xff" * 4096)[0] == Errno.EPERM
        assert _raw_request(sock, Command.TRIM, 2, 0, MiB)[0] == Errno.EPERM
        assert _raw_request(sock, Command.WRITE_ZEROES, 3, 0, MiB)[0] == Errno.EPERM
        error, data = _raw_request(sock, Command.READ, 4, 0, 4096)
        assert (error, data) == (0, b"\xa5" * 4096)
        assert _raw_request(sock, Command.FLUSH, 5, 0, 0)[0] == 0
        sock.sendall(codec.encode_request(Command.DISC, 6, 0, 0))
    assert sha256(img) == digest


# ----------------------------------------------------------------- nbdcopy


def _scattered_image(path: Path, size: int, chunks: Sequence[int]) -> list[tuple[int, int]]:
    """A sparse image with random 4 MiB chunks at the given MiB offsets; returns them."""
    sparse_image(path, size)
    with path.open("r+b") as f:
        for mib in chunks:
            f.seek(mib * MiB)
            f.write(os.urandom(4 * MiB))
    return [(mib * MiB, 4 * MiB) for mib in chunks]


def _data_runs(path: Path) -> list[tuple[int, int]]:
    return [(o, n) for o, n, hole in allocation_map(path) if not hole]


@pytest.mark.parametrize("connections", [1, 4])
def test_nbdcopy_round_trip(
    tmp_path: Path, nbd_servers: NBDServerFactory, connections: int
) -> None:
    size = 256 * MiB
    src = tmp_path / "src.img"
    chunks = _scattered_image(src, size, [0, 17, 40, 77, 128, 201, 252])
    data_bytes = sum(n for _, n in chunks)
    export_img = sparse_image(tmp_path / "export.img", size)
    server = nbd_servers.start({"dst": export_img})
    uri = server.uri("dst")
    opts = [f"--connections={connections}", f"--threads={connections}"]

    # file -> export
    run(["nbdcopy", *opts, "--flush", str(src), uri], timeout=TIMEOUT)
    assert connections_served(server.log_text(), "dst") == connections
    assert sha256(export_img) == sha256(src)
    assert _data_runs(export_img) == chunks  # holes written as holes
    assert allocated_bytes(export_img) < data_bytes + 4 * MiB

    # export -> file
    out = tmp_path / "out.img"
    run(["nbdcopy", *opts, uri, str(out)], timeout=TIMEOUT)
    assert connections_served(server.log_text(), "dst") == 2 * connections
    run(["cmp", str(src), str(out)], timeout=TIMEOUT)
    # Holes came across as holes (block status / hole chunks), not as zeroes.
    assert allocated_bytes(out) < data_bytes + 16 * MiB, allocated_bytes(out)

    compared = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", str(src), uri])
    assert "Images are identical" in compared.stdout
    # ...and a difference is noticed (qemu-img reports the 512-byte sector).
    fill(src, 100 * MiB + 12800, b"\x01")
    differs = run(["qemu-img", "compare", "-f", "raw", "-F", "raw", str(src), uri], check=False)
    assert differs.returncode == 1, differs
    assert str(100 * MiB + 12800) in differs.stdout


def test_qemu_io_honours_min_block_size(tmp_path: Path, nbd_servers: NBDServerFactory) -> None:
    """With a 4 KiB minimum block size advertised, qemu read-modify-writes small writes."""
    img = sparse_image(tmp_path / "b.img", MiB)
    fill(img, 0, b"\x99" * 8192)
    server = nbd_servers.start({"b": img}, "--min-block-size", "4096")
    result = qemu_io(
        nbd_target(server.uri("b")),
        "write -P 0x07 100 200",
        "write -z 5000 3000",
        "read -P 0x99 0 100",
        "read -P 0x07 100 200",
        "read -P 0x99 300 4700",
        "read -P 0 5000 3000",
        "read -P 0x99 8000 192",
    )
    sent = sent_requests(result.stderr)
    assert sent and all(s.offset % 4096 == 0 and s.length % 4096 == 0 for s in sent), sent
    expected = bytearray(b"\x99" * 8192)
    expected[100:300] = b"\x07" * 200
    expected[5000:8000] = bytes(3000)
    assert read_range(img, 0, 8192) == bytes(expected)


def test_unix_socket(tmp_path: Path) -> None:
    img = sparse_image(tmp_path / "u.img", 4 * MiB)
    sock = tmp_path / "nbd.sock"
    log = tmp_path / "unix-server.log"
    argv = [sys.executable, "-m", "moorage", "-v", "nbd", "serve", "--export", f"u={img}"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*argv, "--unix", str(sock)], stdout=out, stderr=subprocess.STDOUT, cwd=REPO
        )
    try:
        deadline = time.monotonic() + TIMEOUT
        while not sock.is_socket():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no unix socket"
            time.sleep(0.05)
        assert sock.stat().st_mode & 0o777 == 0o600
        uri = f"nbd+unix:///u?socket={sock}"
        (export,) = nbdinfo_json(uri)["exports"]
        assert export["export-size"] == 4 * MiB
        qemu_io(nbd_target(uri), "write -P 0x42 1M 1M", "read -P 0x42 1M 1M")
        assert read_range(img, MiB, MiB) == b"\x42" * MiB
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)
    assert "unix: serving export u" in log.read_text()


def test_socket_activation(tmp_path: Path) -> None:
    """nbdinfo and nbdcopy spawn the server themselves, passing it a socket (LISTEN_FDS)."""
    img = sparse_image(tmp_path / "s.img", 8 * MiB)
    fill(img, 2 * MiB, os.urandom(MiB))
    server = [sys.executable, "-m", "moorage", "nbd", "serve", "--export", f"s={img}"]
    info = run(["nbdinfo", "--json", "--", "[", *server, "]"], timeout=TIMEOUT).stdout
    (export,) = json.loads(info)["exports"]
    assert export["export-name"] == "s"
    assert export["export-size"] == 8 * MiB
    out = run(["nbdinfo", "--map", "--json", "--", "[", *server, "]"], timeout=TIMEOUT).stdout
    assert [(e["offset"], e["length"], e["type"]) for e in json.loads(out)] == [
        (0, 2 * MiB, 3),
        (2 * MiB, MiB, 0),
        (3 * MiB, 5 * MiB, 3),
    ]
    copy = tmp_path / "copy.img"
    run(["nbdcopy", "--", "[", *server, "]", str(copy)], timeout=TIMEOUT)
    assert sha256(copy) == sha256(img)


# -------------------------------------------------------------- multi-conn


def test_multi_conn_write_on_one_flush_on_another(
    tmp_path: Path, nbd_servers: NBDServerFactory
) -> None:
    """Two connections at once: each sees the other's writes; a FLUSH on one covers both."""
    img = sparse_image(tmp_path / "m.img", 16 * MiB)
    server = nbd_servers.start({"m": img})
    uri = server.uri("m")
    assert run(["nbdinfo", "--can", "multi-conn", uri], check=False).returncode == 0
    before = connections_served(server.log_text(), "m")
    a = QemuIOSession(uri, tmp_path / "a.trace")
    b = QemuIOSession(uri, tmp_path / "b.trace")
    try:
        a.cmd("write -P 0x5a 0 1M")
        b.cmd("read -P 0x5a 0 1M")
        b.cmd("write -P 0xa5 1M 1M")
        a.cmd("read -P 0xa5 1M 1M")
        # Unflushed data on A; the flush goes over B.
        a.cmd("write -P 0x3c 2M 4M")
        a.cmd("write -P 0xc3 8388000 1000")
        b.cmd("flush")
        b.cmd("read -P 0x3c 2M 4M")
        b.cmd("read -P 0xc3 8388000 1000")
        assert connections_served(server.log_text(), "m") == before + 2
        a_sent, b_sent = a.trace(), b.trace()
        assert not [s for s in a_sent if s.type == FLUSH or s.flags & FUA], a_sent
        assert Sent(FLUSH, 0, 0, 0) in b_sent
        # The server is killed while both connections are open: nothing it still
        # holds (no flush on A's connection, no clean close) may be needed.
        server.stop(signal.SIGKILL)
    finally:
        a.close()
        b.close()
    assert read_range(img, 0, 2 * MiB) == b"\x5a" * MiB + b"\xa5" * MiB
    assert read_range(img, 2 * MiB, 4 * MiB) == b"\x3c" * (4 * MiB)
    assert read_range(img, 8388000, 1000) == b"\xc3" * 1000
