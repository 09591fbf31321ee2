"""``moorage nbd``: run the NBD server on its own."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path

import trio
import typer

from hostio.addresses import HostPortError, parse_host_port
from moorage.output import run_service
from nbd.exports import Export, ExportError, ExportTable, parse_networks
from nbd.server import (
    NBDServer,
    ServerConfig,
    default_workers,
    listeners_from_sockets,
    open_tcp_listeners,
    open_unix_listener,
    stdio_stream,
    systemd_listen_fds,
    tune_malloc,
)
from nbd.tls import TLSFiles

app = typer.Typer(help="The NBD server.", no_args_is_help=True)
log = logging.getLogger("moorage.nbd")


def parse_export(spec: str, allow: list[str], tls_required: bool) -> Export:
    """NAME=PATH[:ro] → Export."""
    name, sep, rest = spec.partition("=")
    if not sep or not rest:
        raise typer.BadParameter(f"{spec!r}: expected NAME=PATH[:ro]", param_hint="--export")
    read_only = False
    if rest.endswith(":ro"):
        rest, read_only = rest[:-3], True
    elif rest.endswith(":rw"):
        rest = rest[:-3]
    path = Path(rest)
    if not path.exists():
        raise typer.BadParameter(f"{spec!r}: {path} does not exist", param_hint="--export")
    try:
        return Export(
            name=name,
            path=path.resolve(),
            read_only=read_only,
            allowed_clients=parse_networks(allow) if allow else None,
            tls_required=tls_required,
        )
    except ExportError as e:
        raise typer.BadParameter(str(e), param_hint="--export") from e


def parse_listen(spec: str) -> tuple[str, int]:
    """``--listen``: no host is every address; port 0 any free port (the log says which)."""
    try:
        return parse_host_port(spec, "--listen", allow_zero=True, allow_empty_host=True)
    except HostPortError as e:
        raise typer.BadParameter(str(e), param_hint="--listen") from None


@app.command("serve")
def serve(
    export: list[str] = typer.Option(
        ..., "--export", "-e", help="NAME=PATH[:ro]; repeat for more exports."
    ),
    listen: str = typer.Option("127.0.0.1:10809", "--listen", help="TCP HOST:PORT."),
    unix: Path | None = typer.Option(None, "--unix", help="Listen on this unix socket instead."),
    stdio: bool = typer.Option(
        False, "--stdio", help="Serve one client on stdin/stdout (for tools that spawn servers)."
    ),
    allow: list[str] = typer.Option(
        [], "--allow", help="Client address or network allowed to open the exports; repeatable."
    ),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="Server certificate (PEM)."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="Server private key (PEM)."),
    tls_ca: Path | None = typer.Option(
        None, "--tls-verify-peer", help="CA (PEM) whose client certificates are required."
    ),
    tls_required: bool = typer.Option(
        False, "--tls-required", help="Refuse every client that does not use TLS."
    ),
    min_block_size: int = typer.Option(1, "--min-block-size", help="Advertised minimum block."),
    workers: int | None = typer.Option(
        None,
        "--workers",
        min=1,
        help="Processes serving connections, this one included [one per CPU, at most 8]; "
        "1: this process alone.",
    ),
) -> None:
    """Serve files or block devices over NBD.

    Sockets passed by systemd socket activation (LISTEN_FDS) are used instead
    of --listen when present.
    """
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter("--tls-cert and --tls-key go together")
    if tls_required and tls_cert is None:
        raise typer.BadParameter("--tls-required needs --tls-cert and --tls-key")
    exports = [parse_export(e, allow, tls_required) for e in export]
    if min_block_size != 1:
        try:
            exports = [
                Export(
                    name=e.name,
                    path=e.path,
                    read_only=e.read_only,
                    allowed_clients=e.allowed_clients,
                    tls_required=e.tls_required,
                    min_block_size=min_block_size,
                )
                for e in exports
            ]
        except ExportError as err:
            raise typer.BadParameter(str(err), param_hint="--min-block-size") from err
    table = ExportTable(exports)
    tls = TLSFiles(tls_cert, tls_key, tls_ca) if tls_cert and tls_key else None
    server = NBDServer(
        table,
        ServerConfig(
            tls_files=tls,
            tls_required=tls_required,
            # stdio serves one client: no workers
            workers=1 if stdio else (workers or default_workers()),
        ),
    )
    host, port = parse_listen(listen)
    tune_malloc()
    up = threading.Event()
    run_service(
        "nbd serve",
        _run,
        server,
        host,
        port,
        unix,
        stdio,
        up,
        expected=(OSError,),
        started=up.is_set,
    )


async def _run(
    server: NBDServer, host: str, port: int, unix: Path | None, stdio: bool, up: threading.Event
) -> None:
    if stdio:
        up.set()
        await server.handle_stream(stdio_stream())
        return
    activated = systemd_listen_fds()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, server)
        if activated:
            listeners = listeners_from_sockets(activated)
            log.info("serving on %d socket-activated listener(s)", len(listeners))
        elif unix is not None:
            listeners = [await open_unix_listener(str(unix))]
            log.info("listening on unix:%s", unix)
        else:
            listeners = await open_tcp_listeners(host, port)
            for lst in listeners:
                addr = lst.socket.getsockname()
                log.info("listening on %s:%d", addr[0], addr[1])
        sys.stdout.flush()
        up.set()
        await server.serve(listeners)
        nursery.cancel_scope.cancel()


async def _stop_on_signal(server: NBDServer) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            server.shutdown()
            return
