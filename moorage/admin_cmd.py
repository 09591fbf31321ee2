"""``moorage volume|snapshot|pool``: the admin CLI over the backend API."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import typer
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from backend.api.client import BackendClient
from backend.api.proto import backend_pb2 as pb
from hostio.sizes import format_size, parse_size
from moorage.output import CANNOT_START, FAILED, UNREACHABLE, fail, print_json

console = Console()
DEFAULT_BACKEND = "unix:.moorage/data/backend.sock"
_ID = re.compile(r"[0-9a-f]{32}")

volume_app = typer.Typer(help="Volumes on a storage node.", no_args_is_help=True)
snapshot_app = typer.Typer(help="Snapshots on a storage node.", no_args_is_help=True)
pool_app = typer.Typer(help="The storage node's pool.", no_args_is_help=True)

_state: dict[str, Any] = {}
# one Option shared by every command that prints a result
_JSON = typer.Option(False, "--json", help="Print the result as JSON.")


def _connection_options(
    backend: str = typer.Option(
        os.environ.get("MOORAGE_BACKEND", DEFAULT_BACKEND),
        "--backend",
        help="Backend API address (unix:PATH or HOST:PORT); env MOORAGE_BACKEND.",
    ),
    token_file: Path | None = typer.Option(None, "--token-file", help="Bearer token file."),
    tls_ca: Path | None = typer.Option(None, "--tls-ca", help="CA of the backend's certificate."),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="Client certificate."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="Client key."),
) -> None:
    _state.update(backend=backend, token=token_file, ca=tls_ca, cert=tls_cert, key=tls_key)


for _app in (volume_app, snapshot_app, pool_app):
    _app.callback()(_connection_options)


def unreachable(address: str, error: grpc.RpcError) -> str | None:
    """What to tell the user when ``error`` means nothing answered at ``address``.

    gRPC reports a storage node that is not there (no socket, connection
    refused, no route) as UNAVAILABLE "failed to connect"; the same code with
    other details comes from a storage node that answered.
    """
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else ""
    if code != grpc.StatusCode.UNAVAILABLE or "failed to connect" not in (details or ""):
        return None
    reason = (details or "").rsplit(": ", 1)[-1].strip()
    return (
        f"no storage node answered at {address} ({reason}); start one with "
        "`moorage backend serve --data-dir DIR`, or point to one with --backend ADDRESS "
        "or MOORAGE_BACKEND=ADDRESS"
    )


@contextmanager
def _client(command: str) -> Iterator[BackendClient]:
    """A client of the storage node at --backend; its errors as the CLI's conventions say."""
    address = _state.get("backend", DEFAULT_BACKEND)
    try:
        client = BackendClient(
            address,
            token_file=_state.get("token"),
            ca=_state.get("ca"),
            cert=_state.get("cert"),
            key=_state.get("key"),
        )
    except (OSError, ValueError) as e:
        raise fail(command, str(e), CANNOT_START) from e
    try:
        yield client
    except grpc.RpcError as e:
        message = unreachable(address, e)
        if message is not None:
            raise fail(command, message, UNREACHABLE) from e
        code = e.code().name if hasattr(e, "code") else "UNKNOWN"
        details = e.details() if hasattr(e, "details") else str(e)
        raise fail(command, f"{code}: {details}", FAILED) from e
    finally:
        client.close()


def _emit(message: Message | Sequence[Message], as_json: bool, table: Callable[[], Table]) -> None:
    if as_json:
        if not isinstance(message, Message):
            print_json([_dict(m) for m in message])
        else:
            print_json(_dict(message))
    else:
        console.print(table())


def _dict(m: Message) -> dict[str, Any]:
    return MessageToDict(
        m, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _volumes_table(volumes: list[pb.Volume]) -> Table:
    t = Table()
    t.add_column("ID", no_wrap=True, min_width=32)
    for col in ("NAME", "TYPE", "SIZE", "USED", "STATE", "PUBLISHED TO"):
        t.add_column(col)
    for v in volumes:
        t.add_row(
            v.id,
            v.name,
            pb.VolumeType.Name(v.type).lower() + (f"/{v.fs_type}" if v.fs_type else ""),
            format_size(v.size_bytes),
            format_size(v.used_bytes),
            v.state,
            ", ".join(v.published_nodes) or "-",
        )
    return t


def _resolve(client: BackendClient, ref: str) -> pb.Volume:
    """A volume by id or by name."""
    if _ID.fullmatch(ref):
        return client.get_volume(volume_id=ref)
    return client.get_volume(name=ref)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--size") from e


@volume_app.command("create")
def volume_create(
    name: str = typer.Argument(...),
    type_: str = typer.Option("nbd", "--type", help="nbd (block) or nfs (filesystem)."),
    size: str = typer.Option(..., "--size", help="e.g. 10G."),
    fs_type: str | None = typer.Option(None, "--fs-type", help="nfs: xfs or ext4."),
    squash: str | None = typer.Option(None, "--squash", help="nfs: root_squash, ..."),
    from_snapshot: str | None = typer.Option(None, "--from-snapshot", help="Snapshot id."),
    from_volume: str | None = typer.Option(None, "--from-volume", help="Volume id or name."),
    as_json: bool = _JSON,
) -> None:
    """Create a volume (the same call again returns the same volume)."""
    kinds = {"nbd": pb.NBD, "nfs": pb.NFS}
    if type_ not in kinds:
        raise typer.BadParameter("must be nbd or nfs", param_hint="--type")
    if from_snapshot and from_volume:
        raise typer.BadParameter(
            "give --from-snapshot or --from-volume, not both", param_hint="--from-volume"
        )
    params = {k: v for k, v in (("fs_type", fs_type), ("squash", squash)) if v is not None}
    with _client("volume create") as c:
        req = pb.CreateVolumeRequest(
            name=name, type=kinds[type_], size_bytes=_size(size), parameters=params
        )
        if from_snapshot:
            req.snapshot_id = from_snapshot
        elif from_volume:
            req.volume_id = _resolve(c, from_volume).id
        v = c.create_volume(req)
    _emit(v, as_json, lambda: _volumes_table([v]))


@volume_app.command("get")
def volume_get(
    ref: str = typer.Argument(..., metavar="VOLUME", help="Id or name."),
    as_json: bool = _JSON,
) -> None:
    """Show one volume."""
    with _client("volume get") as c:
        v = _resolve(c, ref)
    _emit(v, as_json, lambda: _volumes_table([v]))


@volume_app.command("list")
def volume_list(as_json: bool = _JSON) -> None:
    """List every volume (following pagination tokens)."""
    volumes: list[pb.Volume] = []
    with _client("volume list") as c:
        token = ""
        while True:
            page = c.list_volumes(max_entries=100, token=token)
            volumes.extend(page.volumes)
            token = page.next_token
            if not token:
                break
    _emit(list(volumes), as_json, lambda: _volumes_table(volumes))


@volume_app.command("delete")
def volume_delete(
    ref: str = typer.Argument(..., metavar="VOLUME", help="Id or name."),
    as_json: bool = _JSON,
) -> None:
    """Delete a volume (refused while it is published)."""
    with _client("volume delete") as c:
        v = _resolve(c, ref)
        c.delete_volume(v.id)
    if as_json:
        print_json({"id": v.id, "name": v.name, "deleted": True})
    else:
        console.print(f"deleted volume {v.name} ({v.id})")


@volume_app.command("expand")
def volume_expand(
    ref: str = typer.Argument(..., metavar="VOLUME", help="Id or name."),
    size: str = typer.Option(..., "--size", help="The new size, e.g. 20G."),
    as_json: bool = _JSON,
) -> None:
    """Grow a volume (and, for nfs, its filesystem, online)."""
    with _client("volume expand") as c:
        v = c.expand_volume(_resolve(c, ref).id, _size(size))
    _emit(v, as_json, lambda: _volumes_table([v]))


@volume_app.command("adopt")
def volume_adopt(
    image: str = typer.Argument(
        ..., metavar="IMAGE", help="A quarantined image, as `moorage pool orphans` names it."
    ),
    name: str = typer.Option(..., "--name", metavar="NAME", help="The volume's name."),
    kind: str = typer.Option(
        "", "--type", metavar="TYPE", help="nbd or nfs [nfs when the image holds a filesystem]."
    ),
    as_json: bool = _JSON,
) -> None:
    """Record a quarantined image as a volume again, with its size and type."""
    if kind not in ("", "nbd", "nfs"):
        raise typer.BadParameter("must be nbd or nfs", param_hint="--type")
    with _client("volume adopt") as c:
        v = c.adopt_volume(image, name, kind)
    _emit(v, as_json, lambda: _volumes_table([v]))


@volume_app.command("publish")
def volume_publish(
    ref: str = typer.Argument(..., metavar="VOLUME", help="Id or name."),
    node: str = typer.Option(..., "--node", help="Node id."),
    address: str = typer.Option(..., "--address", help="The node's IP address."),
    read_only: bool = typer.Option(False, "--read-only"),
    as_json: bool = _JSON,
) -> None:
    """Make a volume reachable by one node; prints how to reach it."""
    with _client("volume publish") as c:
        r = c.publish(_resolve(c, ref).id, node, address, read_only)

    def table() -> Table:
        t = Table()
        t.add_column("protocol")
        t.add_column("target")
        if r.WhichOneof("target") == "nfs":
            t.add_row("nfs", f"{r.nfs.server}:{r.nfs.port}:{r.nfs.export_path}")
        else:
            t.add_row(
                "nbd",
                f"nbd{'s' if r.nbd.tls else ''}://{r.nbd.host}:{r.nbd.port}/{r.nbd.export_name}",
            )
        return t

    _emit(r, as_json, table)


@volume_app.command("unpublish")
def volume_unpublish(
    ref: str = typer.Argument(..., metavar="VOLUME", help="Id or name."),
    node: str = typer.Option(..., "--node", help="Node id."),
    as_json: bool = _JSON,
) -> None:
    """Withdraw a volume from one node (its connections are closed)."""
    with _client("volume unpublish") as c:
        v = _resolve(c, ref)
        c.unpublish(v.id, node)
    if as_json:
        print_json({"id": v.id, "name": v.name, "node_id": node, "unpublished": True})
    else:
        console.print(f"unpublished volume {v.name} from {node}")


def _snapshots_table(snaps: list[pb.Snapshot]) -> Table:
    t = Table()
    t.add_column("ID", no_wrap=True, min_width=32)
    t.add_column("NAME")
    t.add_column("SOURCE VOLUME", no_wrap=True, min_width=32)
    for col in ("TYPE", "SIZE", "READY"):
        t.add_column(col)
    for s in snaps:
        t.add_row(
            s.id,
            s.name,
            s.source_volume_id,
            pb.VolumeType.Name(s.type).lower(),
            format_size(s.size_bytes),
            "yes" if s.ready_to_use else "no",
        )
    return t


@snapshot_app.command("create")
def snapshot_create(
    name: str = typer.Argument(...),
    volume: str = typer.Option(..., "--volume", help="Source volume id or name."),
    as_json: bool = _JSON,
) -> None:
    """Snapshot a volume (reflink where the pool supports it)."""
    with _client("snapshot create") as c:
        s = c.create_snapshot(name, _resolve(c, volume).id)
    _emit(s, as_json, lambda: _snapshots_table([s]))


@snapshot_app.command("list")
def snapshot_list(
    volume: str | None = typer.Option(None, "--volume", help="Only this volume's."),
    as_json: bool = _JSON,
) -> None:
    """List snapshots."""
    snaps: list[pb.Snapshot] = []
    with _client("snapshot list") as c:
        source = _resolve(c, volume).id if volume else ""
        token = ""
        while True:
            page = c.list_snapshots(max_entries=100, token=token, source_volume_id=source)
            snaps.extend(page.snapshots)
            token = page.next_token
            if not token:
                break
    _emit(list(snaps), as_json, lambda: _snapshots_table(snaps))


@snapshot_app.command("delete")
def snapshot_delete(
    snapshot_id: str = typer.Argument(..., metavar="SNAPSHOT_ID"),
    as_json: bool = _JSON,
) -> None:
    """Delete a snapshot."""
    with _client("snapshot delete") as c:
        c.delete_snapshot(snapshot_id)
    if as_json:
        print_json({"id": snapshot_id, "deleted": True})
    else:
        console.print(f"deleted snapshot {snapshot_id}")


@pool_app.command("status")
def pool_status(as_json: bool = _JSON) -> None:
    """Pool capacity, thin-provisioning headroom and the node's health."""
    with _client("pool status") as c:
        cap = c.capacity()
        health = c.health()
    if as_json:
        print_json({"capacity": _dict(cap), "health": _dict(health)})
        return
    t = Table(title="pool")
    t.add_column("")
    t.add_column("")
    t.add_row("total", format_size(cap.total_bytes))
    t.add_row("free", format_size(cap.free_bytes))
    t.add_row("provisioned", format_size(cap.provisioned_bytes))
    t.add_row("overcommit ratio", f"{cap.overcommit_ratio:g}")
    t.add_row("available for new volumes", format_size(cap.available_bytes))
    t.add_row("ganesha", "running" if health.ganesha_running else "NOT running")
    t.add_row("NBD exports / connections", f"{health.nbd_exports} / {health.nbd_connections}")
    t.add_row("health", health.message)
    console.print(t)


def _orphans_table(orphans: list[pb.Orphan]) -> Table:
    t = Table(title="quarantined images (POOL/quarantine)")
    for col in ("IMAGE", "FOUND AS", "SIZE", "ALLOCATED", "HOLDS", "QUARANTINED"):
        t.add_column(col, no_wrap=col == "IMAGE")
    for o in orphans:
        t.add_row(
            o.name,
            f"{o.kind} {o.original_id}",
            format_size(o.size_bytes),
            format_size(o.allocated_bytes),
            o.fs_type or "-",
            datetime.fromtimestamp(o.quarantined_unix, UTC).strftime("%Y-%m-%d %H:%M:%SZ"),
        )
    return t


@pool_app.command("orphans")
def pool_orphans(as_json: bool = _JSON) -> None:
    """Images the catalog did not know, quarantined at start (never deleted implicitly)."""
    with _client("pool orphans") as c:
        orphans = list(c.list_orphans().orphans)
    if not as_json and not orphans:
        console.print("no quarantined images")
        return
    _emit(orphans, as_json, lambda: _orphans_table(orphans))


@pool_app.command("purge-orphan")
def pool_purge_orphan(
    image: str = typer.Argument(..., metavar="IMAGE", help="A quarantined image's name."),
    yes: bool = typer.Option(False, "--yes", help="Really delete it: its data is gone for good."),
    as_json: bool = _JSON,
) -> None:
    """Delete one quarantined image (asks for --yes)."""
    if not yes:
        raise fail("pool purge-orphan", f"deleting {image} loses its data for good: add --yes")
    with _client("pool purge-orphan") as c:
        o = c.purge_orphan(image)
    if as_json:
        print_json({**_dict(o), "purged": True})
    else:
        console.print(f"purged {o.name} ({format_size(o.size_bytes)})")
