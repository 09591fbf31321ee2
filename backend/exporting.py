"""What the exports of a volume should be, from the catalog, and making the exporter match.

A volume's NFS export (one per volume, its clients the published nodes'
addresses) and its NBD exports (one per published node) are always rendered
from the catalog's rows, so applying them is idempotent and the start-up
reconciliation can redo it after a crash.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sqlalchemy.orm import Session

from backend import validation
from backend.api.errors import FailedPrecondition, InvalidArgument
from backend.catalog.db import publications_of
from backend.catalog.models import Publication, PublicationState, Volume, VolumeType
from backend.ganesha.config import ExportConfig
from backend.pool import Pool
from nbd.exports import Export


@dataclass(frozen=True)
class ExporterStatus:
    ganesha_running: bool
    nbd_exports: int
    nbd_connections: int


class Exporter(Protocol):
    """What makes volumes reachable: ganesha's export files and the NBD export table."""

    def set_nfs_export(self, export: ExportConfig) -> None: ...
    def remove_nfs_export(self, export_id: int) -> None: ...
    def add_nbd_export(self, export: Export) -> None: ...
    def remove_nbd_export(self, name: str) -> None: ...
    # Hold the I/O of NBD clients on these images, once what they wrote is in
    # them (``nbd.holds``): Unavailable after ``timeout`` s; it ends at release
    # or after ``lease`` s.
    def hold_nbd_io(
        self, hold_id: str, images: Sequence[Path], lease: float, timeout: float
    ) -> None: ...
    def release_nbd_io(self, hold_id: str) -> None: ...
    def status(self) -> ExporterStatus: ...


def nbd_export_name(volume_id: str, node_id: str) -> str:
    return f"{volume_id}@{node_id}"


def nfs_pseudo_path(volume: Volume) -> str:
    return f"/volumes/{volume.name}"


def publication_problem(p: Publication) -> str | None:
    """Why a publication row cannot be exported (None: it can).

    Every row written today passed these checks before it was recorded; a row
    an older version wrote may not, and is then left out of the exports (never
    rendered, never a reason to refuse a start) until it is unpublished.
    """
    try:
        validation.node_id(p.node_id)
        validation.node_address(p.node_address)
    except InvalidArgument as e:
        return str(e)
    return None


def exportable(pubs: Sequence[Publication]) -> list[Publication]:
    """The publications that lead to an export: not being withdrawn, and valid."""
    return [
        p
        for p in pubs
        if p.state != PublicationState.UNPUBLISHING and publication_problem(p) is None
    ]


def nfs_export_id(v: Volume) -> int:
    if v.nfs_export_id is None:
        raise FailedPrecondition(f"volume {v.id} has no NFS export id")
    return v.nfs_export_id


@dataclass(frozen=True)
class Exports:
    """Renders volumes' exports from catalog rows and hands them to the exporter."""

    pool: Pool
    exporter: Exporter
    nbd_tls: bool

    def nfs_config(self, v: Volume, pubs: Sequence[Publication]) -> ExportConfig:
        live = exportable(pubs)
        return ExportConfig(
            export_id=nfs_export_id(v),
            path=self.pool.export_dir(v.id),
            pseudo=nfs_pseudo_path(v),
            clients=tuple(sorted(p.node_address for p in live if not p.read_only)),
            ro_clients=tuple(sorted(p.node_address for p in live if p.read_only)),
            squash=v.squash,  # type: ignore[arg-type]
        )

    def nbd_exports(self, v: Volume, pubs: Sequence[Publication]) -> list[Export]:
        return [
            Export(
                name=nbd_export_name(v.id, p.node_id),
                path=self.pool.image_path(v.id),
                read_only=p.read_only,
                description=f"moorage volume {v.name} for node {p.node_id}",
                allowed_clients=frozenset({ipaddress.ip_network(p.node_address)}),
                tls_required=self.nbd_tls,
                iops_limit=int((v.parameters or {}).get("iops_limit", 0)),
                bandwidth_limit=int((v.parameters or {}).get("bandwidth_limit", 0)),
            )
            for p in exportable(pubs)
        ]

    def apply(self, s: Session, v: Volume) -> None:
        """Make the exporter match the catalog for one volume (idempotent)."""
        pubs = publications_of(s, v.id)
        if v.type == VolumeType.NFS:
            if exportable(pubs):
                self.exporter.set_nfs_export(self.nfs_config(v, pubs))
            elif v.nfs_export_id is not None:
                self.exporter.remove_nfs_export(v.nfs_export_id)
            return
        wanted = {e.name: e for e in self.nbd_exports(v, pubs)}
        for p in pubs:
            name = nbd_export_name(v.id, p.node_id)
            if name not in wanted:
                self.exporter.remove_nbd_export(name)
        for export in wanted.values():
            self.exporter.add_nbd_export(export)
