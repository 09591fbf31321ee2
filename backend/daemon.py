"""The storage-node daemon: catalog, pool, reconcile, ganesha, NBD, gRPC API.

One trio run owns the long-lived tasks (ganesha's supervisor, the NBD
server); the gRPC server runs its own worker threads and reaches the trio
side only through ``DaemonExporter``, which hops threads with the trio token.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import trio

from backend.api.auth import read_token
from backend.api.errors import InvalidArgument, Unavailable
from backend.api.interceptor import ErrorInterceptor
from backend.api.proto import backend_pb2_grpc as pb_grpc
from backend.catalog.db import Catalog
from backend.exporting import ExporterStatus
from backend.ganesha.config import CoreConfig, ExportConfig
from backend.ganesha.files import GaneshaFiles
from backend.ganesha.supervisor import GaneshaSupervisor
from backend.grpcservice import BackendServicer, BearerTokenInterceptor, record_call
from backend.grpcservice import log as api_log
from backend.metrics import StorageNodeCollector, serve_metrics
from backend.operation import ServiceConfig
from backend.pool import Pool
from backend.poolidentity import check_pool_identity
from backend.poolinit import ensure_pool_mounted
from backend.reconcile import reconcile
from backend.service import StorageService
from hostio.addresses import HostPort, HostPortError, parse_host_port
from nbd.exports import Export, ExportTable
from nbd.holds import HoldNotReached
from nbd.server import NBDServer, ServerConfig, default_workers, open_tcp_listeners
from nbd.tls import TLSFiles

log = logging.getLogger("moorage.backend")


@dataclass
class DaemonConfig:
    data_dir: Path
    pool_dir: Path | None = None
    # API addresses, each "unix:PATH" (mode 0600) or "HOST:PORT" (needs a token or
    # mutual TLS); none: unix:DATA_DIR/backend.sock.  More than one: the same API on
    # each (a local socket for the operator beside TCP for the plugins).
    listen: list[str] = field(default_factory=list)
    nbd_listen: str = "127.0.0.1:10809"
    # What clients are told to connect to (defaults to the listen address).
    nbd_advertise: str | None = None
    nfs_port: int = 2049
    # NFSv3's MOUNT protocol on a fixed port, so clients need not ask rpcbind.
    mount_port: int = 20048
    nfs_bind: str = "0.0.0.0"
    nfs_advertise: str | None = None
    db_url: str | None = None
    token_file: Path | None = None
    # Serve with a token file others than its owner may read (only warned of).
    allow_shared_token_file: bool = False
    api_tls_cert: Path | None = None
    api_tls_key: Path | None = None
    api_client_ca: Path | None = None
    nbd_tls_cert: Path | None = None
    nbd_tls_key: Path | None = None
    # Processes serving NBD connections, this one included (None: one per CPU, at most 8).
    nbd_workers: int | None = None
    grace_period: int = 90
    lease_lifetime: int = 60
    graceless: bool = False
    overcommit_ratio: float = 1.0
    # Health is not ok while the pool's free space is under this percentage.
    low_space_percent: float = 10.0
    # Prometheus metrics over HTTP on HOST:PORT (backend/metrics.py); None: off.
    metrics_listen: str | None = None
    # Also series by NBD export, whose names are volume ids and node names: the
    # metrics port has no authentication (backend/metrics.py).
    metrics_detail: bool = False
    # Unmount nfs volumes' filesystems when the daemon stops (they are
    # remounted at start either way).
    unmount_on_exit: bool = True
    # Start on a pool whose id the catalog does not hold (backend/poolidentity.py).
    claim_pool: bool = False

    @property
    def pool(self) -> Path:
        return (self.pool_dir or self.data_dir / "pool").absolute()

    @property
    def api_addresses(self) -> list[str]:
        return list(self.listen) or [f"unix:{(self.data_dir / 'backend.sock').absolute()}"]

    @property
    def api_address(self) -> str:
        """The first API address: what a local client of this node is given."""
        return self.api_addresses[0]


def split_host_port(
    spec: str, what: str, *, allow_zero: bool = False, allow_empty_host: bool = False
) -> HostPort:
    """``spec`` by the one HOST:PORT rule (``hostio.addresses``), else InvalidArgument."""
    try:
        return parse_host_port(spec, what, allow_zero=allow_zero, allow_empty_host=allow_empty_host)
    except HostPortError as e:
        raise InvalidArgument(str(e)) from None


@dataclass(frozen=True)
class TcpAddresses:
    """The daemon's TCP addresses besides the API's, checked before anything starts."""

    nbd_listen: HostPort  # port 0: any free port, advertised as bound
    nbd_advertise: HostPort | None
    metrics_listen: HostPort | None


def tcp_addresses(config: DaemonConfig) -> TcpAddresses:
    """Every HOST:PORT of ``config`` but the API's, checked; InvalidArgument naming the flag."""
    return TcpAddresses(
        nbd_listen=split_host_port(
            config.nbd_listen, "--nbd-listen", allow_zero=True, allow_empty_host=True
        ),
        nbd_advertise=split_host_port(config.nbd_advertise, "--nbd-advertise")
        if config.nbd_advertise
        else None,
        metrics_listen=split_host_port(
            config.metrics_listen, "--metrics-listen", allow_empty_host=True
        )
        if config.metrics_listen
        else None,
    )


class DaemonExporter:
    """The service's Exporter: ganesha files + reloads, and the NBD export table."""

    def __init__(
        self,
        files: GaneshaFiles,
        supervisor: GaneshaSupervisor,
        table: ExportTable,
        nbd: NBDServer,
        token: trio.lowlevel.TrioToken,
    ) -> None:
        self.files = files
        self.supervisor = supervisor
        self.table = table
        self.nbd = nbd
        self.token = token

    def _reload(self) -> None:
        if self.supervisor.pid is None:
            return  # not started yet: ganesha reads the files when it starts
        if not self.supervisor.reload_from_thread(wait=True):
            raise Unavailable("ganesha refused the export configuration (see its log)")

    def set_nfs_export(self, export: ExportConfig) -> None:
        if self.files.write_export(export):
            self._reload()

    def remove_nfs_export(self, export_id: int) -> None:
        if self.files.remove_export(export_id):
            self._reload()

    def add_nbd_export(self, export: Export) -> None:
        trio.from_thread.run(self._add_nbd_export, export, trio_token=self.token)

    def remove_nbd_export(self, name: str) -> None:
        trio.from_thread.run(self._remove_nbd_export, name, trio_token=self.token)

    def hold_nbd_io(
        self, hold_id: str, images: Sequence[Path], lease: float, timeout: float
    ) -> None:
        try:
            trio.from_thread.run(
                self.nbd.hold_io, hold_id, list(images), lease, timeout, trio_token=self.token
            )
        except HoldNotReached as e:
            raise Unavailable(f"NBD clients' I/O could not be held: {e}") from None

    def release_nbd_io(self, hold_id: str) -> None:
        trio.from_thread.run_sync(self.nbd.release_io, hold_id, trio_token=self.token)

    # The change is made at once; it is done when every NBD worker process has it.
    async def _add_nbd_export(self, export: Export) -> None:
        self.table.add(export)
        await self.nbd.sync_exports()

    async def _remove_nbd_export(self, name: str) -> None:
        self.table.remove(name)
        await self.nbd.sync_exports()

    def status(self) -> ExporterStatus:
        return ExporterStatus(
            ganesha_running=self.supervisor.ready,
            nbd_exports=len(self.table),
            nbd_connections=self.nbd.active_connections,
        )


def _grpc_server(config: DaemonConfig, service: StorageService) -> grpc.Server:
    interceptors: list[grpc.ServerInterceptor] = []  # type: ignore[type-arg]
    if config.token_file is not None:
        token = read_token(config.token_file, refuse_shared=not config.allow_shared_token_file)
        interceptors.append(BearerTokenInterceptor(token))
    # innermost: errors to statuses, every call timed
    interceptors.append(ErrorInterceptor(api_log, record_call))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="backend-api"),
        interceptors=interceptors,
        options=[("grpc.so_reuseport", 0)],
    )
    pb_grpc.add_BackendServicer_to_server(BackendServicer(service), server)  # type: ignore[no-untyped-call]
    for address in config.api_addresses:
        _add_port(config, server, address)
    return server


def _add_port(config: DaemonConfig, server: grpc.Server, address: str) -> None:
    if address.startswith("unix:"):
        path = Path(address[5:])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            _bind(address, lambda: server.add_insecure_port(address))
        finally:
            os.umask(old)
        return
    if config.api_tls_cert and config.api_tls_key:
        ca = config.api_client_ca.read_bytes() if config.api_client_ca else None
        creds = grpc.ssl_server_credentials(
            [(config.api_tls_key.read_bytes(), config.api_tls_cert.read_bytes())],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )
        if ca is None and config.token_file is None:
            raise InvalidArgument("a TCP API needs --token-file or client certificates")
        _bind(address, lambda: server.add_secure_port(address, creds))
    else:
        if config.token_file is None:
            raise InvalidArgument("a TCP API needs --token-file or client certificates")
        log.warning("API on %s without TLS: the bearer token crosses the network in clear", address)
        _bind(address, lambda: server.add_insecure_port(address))


def _bind(address: str, add_port: Callable[[], int]) -> None:
    """gRPC's add_*_port, its failure (a RuntimeError without the cause) named for the user."""
    try:
        add_port()
    except RuntimeError as e:
        raise Unavailable(
            f"cannot serve the API on {address}: the address is taken or not this host's"
        ) from e


def check_api_access(config: DaemonConfig) -> None:
    """Refuse an API on TCP open to anyone, or a token file others may read,
    before anything is started or mounted."""
    if config.token_file is not None:
        read_token(config.token_file, refuse_shared=not config.allow_shared_token_file)
    for address in config.api_addresses:
        if not address.startswith("unix:"):
            split_host_port(address, "--listen", allow_empty_host=True)
    if all(a.startswith("unix:") for a in config.api_addresses):
        return
    mutual_tls = bool(config.api_tls_cert and config.api_tls_key and config.api_client_ca)
    if config.token_file is None and not mutual_tls:
        raise InvalidArgument("a TCP API needs --token-file or client certificates")


async def run_daemon(
    config: DaemonConfig, *, task_status: trio.TaskStatus[StorageService] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the storage node until SIGTERM/SIGINT or cancellation."""
    check_api_access(config)
    addresses = tcp_addresses(config)
    data_dir = config.data_dir.absolute()
    data_dir.mkdir(parents=True, exist_ok=True)
    await trio.to_thread.run_sync(ensure_pool_mounted, config.pool)
    pool = Pool(config.pool)
    await trio.to_thread.run_sync(pool.ensure_layout)
    catalog = Catalog(config.db_url) if config.db_url else Catalog.for_data_dir(data_dir)
    await trio.to_thread.run_sync(catalog.migrate)
    # Before anything is mounted or reconciled: a catalog that is not this
    # pool's would make every volume look unknown.
    await trio.to_thread.run_sync(check_pool_identity, catalog, pool, config.claim_pool)

    ganesha_dir = data_dir / "ganesha"
    files = GaneshaFiles(ganesha_dir)
    core = CoreConfig(
        nfs_port=config.nfs_port,
        mount_port=config.mount_port,
        recovery_root=ganesha_dir / "recovery",
        grace_period=config.grace_period,
        lease_lifetime=config.lease_lifetime,
        graceless=config.graceless,
        bind_addr=config.nfs_bind,
    )
    files.write_main(core)
    supervisor = GaneshaSupervisor(files.main_file, core, pid_file=ganesha_dir / "ganesha.pid")

    nbd_tls = None
    if config.nbd_tls_cert and config.nbd_tls_key:
        nbd_tls = TLSFiles(config.nbd_tls_cert, config.nbd_tls_key)
    table = ExportTable()
    nbd = NBDServer(
        table,
        ServerConfig(
            tls_files=nbd_tls,
            tls_required=nbd_tls is not None,
            workers=config.nbd_workers or default_workers(),
        ),
    )
    nbd_host, nbd_port = addresses.nbd_listen
    exporter = DaemonExporter(files, supervisor, table, nbd, trio.lowlevel.current_trio_token())

    async with trio.open_nursery() as nursery:
        # Bound now (its port is advertised), accepting only once reconcile has
        # put every export back: a client reconnecting meanwhile waits in the
        # listen queue instead of being told its export does not exist, which
        # the FUSE block file takes as final (I/O fails at once).
        listeners = await open_tcp_listeners(nbd_host, nbd_port)
        bound_port = listeners[0].socket.getsockname()[1]
        adv_host, adv_port = addresses.nbd_advertise or (
            nbd_host if nbd_host not in ("", "0.0.0.0", "::") else "127.0.0.1",
            bound_port,
        )
        service = StorageService(
            catalog,
            pool,
            exporter,
            ServiceConfig(
                nbd_host=adv_host,
                nbd_port=adv_port,
                nbd_tls=nbd_tls is not None,
                nfs_server=config.nfs_advertise or core.probe_host,
                nfs_port=config.nfs_port,
                mount_port=config.mount_port,
                overcommit_ratio=config.overcommit_ratio,
                low_space_percent=config.low_space_percent,
            ),
        )
        repairs = await trio.to_thread.run_sync(reconcile, service, files)
        log.info("reconciled at start: %d repairs", len(repairs))
        await nursery.start(nbd.serve, listeners)

        ganesha_scope = trio.CancelScope()

        async def run_ganesha(task_status: trio.TaskStatus[None]) -> None:
            with ganesha_scope:
                await supervisor.run(task_status=task_status)

        await nursery.start(run_ganesha)
        if addresses.metrics_listen is not None:
            token = trio.lowlevel.current_trio_token()
            serve_metrics(
                addresses.metrics_listen,
                StorageNodeCollector(
                    service,
                    lambda: trio.from_thread.run_sync(table.stats, trio_token=token),
                    lambda: (supervisor.ready, supervisor.restarts),
                    detail=config.metrics_detail,
                ),
            )
        server = _grpc_server(config, service)
        server.start()
        log.info(
            "storage node up: API %s, NBD %s:%d, NFS port %d, pool %s",
            " and ".join(config.api_addresses),
            nbd_host,
            bound_port,
            config.nfs_port,
            config.pool,
        )
        task_status.started(service)
        try:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("signal %d: stopping", signum)
                    break
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(lambda: server.stop(grace=5).wait())
                nbd.shutdown()
                ganesha_scope.cancel()
                # ganesha must be gone before what it exported is unmounted.
                while supervisor.pid is not None:
                    await trio.sleep(0.1)
                if config.unmount_on_exit:
                    await trio.to_thread.run_sync(_unmount_all, pool)
                catalog.dispose()
            nursery.cancel_scope.cancel()


def _unmount_all(pool: Pool) -> None:
    for vol_id in sorted(pool.list_mounts()):
        try:
            pool.unmount_fs_volume(vol_id)
        except Exception as e:
            log.error("unmounting volume %s: %s", vol_id, e)
