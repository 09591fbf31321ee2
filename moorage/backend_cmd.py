"""``moorage backend``: run a storage node and manage its pool."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import trio
import typer

from backend.api.errors import BackendError
from backend.catalog.db import Catalog
from backend.daemon import DaemonConfig, run_daemon
from backend.poolidentity import init_identity
from backend.poolinit import init_loop_pool, release_loop_pool
from hostio.sizes import parse_size
from moorage.output import fail, run_service
from nbd.server import tune_malloc

app = typer.Typer(help="The storage node daemon and its pool.", no_args_is_help=True)
pool_app = typer.Typer(help="Pool set-up.", no_args_is_help=True)
app.add_typer(pool_app, name="pool")
log = logging.getLogger("moorage.backend")


@app.command("serve")
def serve(
    data_dir: Path = typer.Option(..., "--data-dir", help="Catalog, ganesha files, socket."),
    pool: Path | None = typer.Option(None, "--pool", help="Pool directory [DATA_DIR/pool]."),
    listen: list[str] | None = typer.Option(
        None,
        "--listen",
        help="API address: unix:PATH [unix:DATA_DIR/backend.sock] or HOST:PORT; repeat it to "
        "serve the API on more than one.",
    ),
    nbd_listen: str = typer.Option("127.0.0.1:10809", "--nbd-listen", help="NBD HOST:PORT."),
    nbd_advertise: str | None = typer.Option(
        None, "--nbd-advertise", help="NBD HOST:PORT given to clients."
    ),
    nfs_port: int = typer.Option(2049, "--nfs-port", help="ganesha's NFS port."),
    mount_port: int = typer.Option(20048, "--mount-port", help="NFSv3 MOUNT port."),
    nfs_bind: str = typer.Option("0.0.0.0", "--nfs-bind", help="ganesha's bind address."),
    nfs_advertise: str | None = typer.Option(
        None, "--nfs-advertise", help="NFS server address given to clients."
    ),
    db_url: str | None = typer.Option(
        None, "--db-url", help="SQLAlchemy URL of the catalog [SQLite in DATA_DIR]."
    ),
    token_file: Path | None = typer.Option(
        None, "--token-file", help="API bearer token file (mode 0600 or stricter)."
    ),
    allow_shared_token_file: bool = typer.Option(
        False,
        "--allow-shared-token-file",
        help="Accept a token file its group or others may read (warned of).",
    ),
    api_tls_cert: Path | None = typer.Option(None, "--api-tls-cert"),
    api_tls_key: Path | None = typer.Option(None, "--api-tls-key"),
    api_client_ca: Path | None = typer.Option(
        None, "--api-client-ca", help="Require client certificates signed by this CA."
    ),
    nbd_tls_cert: Path | None = typer.Option(None, "--nbd-tls-cert"),
    nbd_tls_key: Path | None = typer.Option(None, "--nbd-tls-key"),
    nbd_workers: int | None = typer.Option(
        None,
        "--nbd-workers",
        min=1,
        help="Processes serving NBD connections, this one included [one per CPU, at most 8]; "
        "1: this process alone.",
    ),
    grace_period: int = typer.Option(90, "--grace-period", help="NFSv4 grace period (s)."),
    lease_lifetime: int = typer.Option(60, "--lease-lifetime", help="NFSv4 lease (s)."),
    graceless: bool = typer.Option(False, "--graceless", help="Skip the NFSv4 grace period."),
    overcommit: float = typer.Option(
        1.0, "--overcommit", help="Thin provisioning: sizes may add up to pool x this."
    ),
    low_space_percent: float = typer.Option(
        10.0,
        "--low-space-percent",
        help="Health is not ok while the pool's free space is under this percentage (0: never).",
    ),
    metrics_listen: str | None = typer.Option(
        None, "--metrics-listen", help="Serve Prometheus metrics on HOST:PORT."
    ),
    metrics_detail: bool = typer.Option(
        False,
        "--metrics-detail",
        help="Also metrics by NBD export, named by volume id and node (no authentication).",
    ),
    claim_pool: bool = typer.Option(
        False,
        "--claim-pool",
        help="Start although the catalog does not hold the pool's id (unknown images are "
        "quarantined, never deleted).",
    ),
) -> None:
    """Run the storage node: NFS through ganesha, NBD, and the backend API."""
    config = DaemonConfig(
        data_dir=data_dir,
        pool_dir=pool,
        listen=list(listen or []),
        nbd_listen=nbd_listen,
        nbd_advertise=nbd_advertise,
        nfs_port=nfs_port,
        mount_port=mount_port,
        nfs_bind=nfs_bind,
        nfs_advertise=nfs_advertise,
        db_url=db_url,
        token_file=token_file,
        allow_shared_token_file=allow_shared_token_file,
        api_tls_cert=api_tls_cert,
        api_tls_key=api_tls_key,
        api_client_ca=api_client_ca,
        nbd_tls_cert=nbd_tls_cert,
        nbd_tls_key=nbd_tls_key,
        nbd_workers=nbd_workers,
        grace_period=grace_period,
        lease_lifetime=lease_lifetime,
        graceless=graceless,
        overcommit_ratio=overcommit,
        low_space_percent=low_space_percent,
        metrics_listen=metrics_listen,
        metrics_detail=metrics_detail,
        claim_pool=claim_pool,
    )
    tune_malloc()
    up = threading.Event()
    run_service(
        "backend serve", _serve, config, up, expected=(BackendError, OSError), started=up.is_set
    )


async def _serve(config: DaemonConfig, up: threading.Event) -> None:
    """The storage node until a signal; ``up`` is set once it serves."""
    async with trio.open_nursery() as nursery:
        await nursery.start(run_daemon, config)
        up.set()


@pool_app.command("init")
def pool_init(
    directory: Path = typer.Argument(..., help="The pool directory to create and mount."),
    loop_size: str = typer.Option(..., "--loop-size", help="Size of the pool image, e.g. 20G."),
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="Also record the pool's id in this data dir's catalog."
    ),
    db_url: str | None = typer.Option(
        None, "--db-url", help="Also record the pool's id in the catalog at this URL."
    ),
) -> None:
    """Make a sparse xfs (reflink) image, loop-mount it on DIR, and give it an id.

    The id goes into DIR/moorage-pool.json and, given --data-dir or --db-url,
    into that catalog; otherwise the first `backend serve` records it.
    """
    try:
        size = parse_size(loop_size)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--loop-size") from e
    try:
        image = init_loop_pool(directory, size)
        catalog = None
        if db_url is not None:
            catalog = Catalog(db_url)
        elif data_dir is not None:
            data_dir.mkdir(parents=True, exist_ok=True)
            catalog = Catalog.for_data_dir(data_dir)
        if catalog is not None:
            catalog.migrate()
        try:
            pool_id = init_identity(directory.resolve(), catalog)
        finally:
            if catalog is not None:
                catalog.dispose()
    except BackendError as e:
        raise fail("backend pool init", str(e)) from e
    typer.echo(f"pool {directory.resolve()} ({pool_id}) mounted from {image}")


@pool_app.command("release")
def pool_release(
    directory: Path = typer.Argument(..., help="The pool directory."),
) -> None:
    """Unmount a loop pool and everything in it (the image stays)."""
    try:
        release_loop_pool(directory)
    except BackendError as e:
        raise fail("backend pool release", str(e)) from e
    typer.echo(f"pool {directory.resolve()} released")
