"""The storage node's publications: make a volume reachable by one node, and undo it.

A publication is a catalog row per (volume, node); the exports that follow
from it (an NBD export per node, the NFS export's client list) are always
rendered from those rows.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from backend import validation
from backend.api.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from backend.catalog.db import get_publication, publications_of, record_operation
from backend.catalog.models import (
    OperationKind,
    Publication,
    PublicationState,
    Volume,
    VolumeState,
    VolumeType,
)
from backend.exporting import nbd_export_name, nfs_pseudo_path, publication_problem
from backend.failpoints import failpoint
from backend.operation import Intent, ServiceContext, close_journal
from backend.views import NbdTargetInfo, NfsTargetInfo
from nbd.exports import ExportError

log = logging.getLogger("moorage.backend")


class Publications:
    """Every operation on publications, over the service's shared context."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    def publish_volume(
        self,
        volume_id: str,
        node_id: str,
        node_address: str,
        read_only: bool,
        multi_writer: bool = False,
        single_node: bool = False,
    ) -> NfsTargetInfo | NbdTargetInfo:
        """Make the volume reachable by one node.  ``single_node``: refuse when
        another node holds a publication (decided under the catalog lock, so two
        callers racing for two nodes cannot both win).

        Validate, then record, then act: everything the exports will be made
        of is checked before the row is written, and a row whose exports then
        cannot be applied is withdrawn again, so a refused publish leaves no trace.
        """
        vol_id = validation.object_id(volume_id, "volume id")
        node = validation.node_id(node_id)
        address = validation.node_address(node_address)

        def decide(s: Session) -> Intent[NfsTargetInfo | NbdTargetInfo]:
            v = s.get(Volume, vol_id)
            if v is None:
                raise NotFound(f"volume {vol_id} not found")
            if v.state not in (VolumeState.READY, VolumeState.EXPANDING):
                raise FailedPrecondition(f"volume {vol_id} is {v.state.value}")
            pub = get_publication(s, vol_id, node)
            if pub is not None:
                if (
                    pub.read_only != read_only
                    or pub.node_address != address
                    or pub.multi_writer != multi_writer
                ):
                    raise AlreadyExists(
                        f"volume {vol_id} is published to {node} with other parameters"
                    )
                if pub.state == PublicationState.UNPUBLISHING:
                    raise FailedPrecondition(f"volume {vol_id} is being unpublished from {node}")
            else:
                others = [p.node_id for p in publications_of(s, vol_id) if p.node_id != node]
                if single_node and others:
                    raise FailedPrecondition(
                        f"volume {vol_id} is single-node and already published to {others[0]}"
                    )
                if v.type == VolumeType.NBD and not read_only:
                    writers = [
                        p.node_id
                        for p in publications_of(s, vol_id)
                        if not p.read_only and not (multi_writer and p.multi_writer)
                    ]
                    if writers:
                        raise FailedPrecondition(
                            f"block volume {vol_id} is already published read-write to {writers[0]}"
                        )
                new = Publication(
                    volume_id=vol_id,
                    node_id=node,
                    node_address=address,
                    read_only=read_only,
                    multi_writer=multi_writer,
                    state=PublicationState.PUBLISHING,
                )
                self._check_exports(v, [*publications_of(s, vol_id), new])
                s.add(new)
                record_operation(s, OperationKind.PUBLISH, vol_id, {"node": node})
                return Intent(self._target(v, node), lambda: self._finish_new_publish(vol_id, node))
            return Intent(self._target(v, node), lambda: self.finish_publish(vol_id, node))

        return self.ctx.operation([vol_id], decide, failpoint_at="publish.intent")

    def _check_exports(self, v: Volume, pubs: list[Publication]) -> None:
        """Render what the exports of ``v`` would be with ``pubs``, recording nothing:
        what ganesha's model or the NBD export table would refuse is refused now."""
        try:
            if v.type == VolumeType.NFS:
                self.ctx.exports.nfs_config(v, pubs)
            else:
                self.ctx.exports.nbd_exports(v, pubs)
        except ExportError as e:
            raise InvalidArgument(f"volume {v.id} cannot be exported so: {e}") from None

    def _finish_new_publish(self, vol_id: str, node: str) -> None:
        """Finish a publication this call recorded; if its exports cannot be
        applied, withdraw the row (and its journal entry) and re-raise."""
        try:
            self.finish_publish(vol_id, node)
        except Exception as e:
            self._withdraw_publish(vol_id, node, e)
            raise

    def _withdraw_publish(self, vol_id: str, node: str, error: Exception) -> None:
        log.error("publishing volume %s to %r failed, withdrawn: %s", vol_id, node[:80], error)
        with self.ctx.catalog.session() as s:
            pub = get_publication(s, vol_id, node)
            if pub is not None and pub.state == PublicationState.PUBLISHING:
                s.delete(pub)
            close_journal(s, vol_id, OperationKind.PUBLISH, error=str(error)[:500], node=node)
        try:  # take back whatever part of the exports was applied
            self.ctx.apply_exports(vol_id)
        except Exception:
            log.exception("volume %s: re-applying its exports after the withdrawal failed", vol_id)

    def finish_publish(self, vol_id: str, node: str) -> None:
        """Export a recorded publication and mark it published (idempotent: a
        retried publish and the start-up reconciliation run it again).

        A row still publishing that cannot be exported, one an older version
        recorded before checking what its exports could be made of, never
        succeeded and never can: it is withdrawn (InvalidArgument).
        """
        problem = None
        with self.ctx.catalog.read_session() as s:
            pub = get_publication(s, vol_id, node)
            if pub is not None and pub.state == PublicationState.PUBLISHING:
                problem = publication_problem(pub)
        if problem is not None:
            error = InvalidArgument(f"publication to {node[:80]!r} withdrawn: {problem}")
            self._withdraw_publish(vol_id, node, error)
            raise error
        self.ctx.apply_exports(vol_id)
        failpoint("publish.exported")
        with self.ctx.catalog.session() as s:
            pub = get_publication(s, vol_id, node)
            if pub is not None and pub.state == PublicationState.PUBLISHING:
                pub.state = PublicationState.PUBLISHED
            gone = None if pub is not None else "the publication is gone"
            close_journal(s, vol_id, OperationKind.PUBLISH, error=gone, node=node)

    def _target(self, v: Volume, node: str) -> NfsTargetInfo | NbdTargetInfo:
        if v.type == VolumeType.NFS:
            return NfsTargetInfo(
                self.ctx.config.nfs_server,
                self.ctx.config.nfs_port,
                nfs_pseudo_path(v),
                self.ctx.config.mount_port,
            )
        return NbdTargetInfo(
            self.ctx.config.nbd_host,
            self.ctx.config.nbd_port,
            nbd_export_name(v.id, node),
            self.ctx.config.nbd_tls,
        )

    def unpublish_volume(self, volume_id: str, node_id: str) -> None:
        vol_id = validation.object_id(volume_id, "volume id")
        refused: InvalidArgument | None = None
        try:
            node = validation.node_id(node_id)
        except InvalidArgument as e:
            # A row an older version recorded under a node id today's rules
            # refuse can still be removed, by exactly that id.
            node, refused = node_id, e

        def decide(s: Session) -> Intent[None]:
            pub = get_publication(s, vol_id, node)
            if pub is None:
                if refused is not None:
                    raise refused
                return Intent(None)  # not published there: nothing to undo
            if pub.state != PublicationState.UNPUBLISHING:
                pub.state = PublicationState.UNPUBLISHING
                record_operation(s, OperationKind.UNPUBLISH, vol_id, {"node": node})
            return Intent(None, lambda: self.finish_unpublish(vol_id, node))

        self.ctx.operation([vol_id], decide, failpoint_at="unpublish.intent")

    def finish_unpublish(self, vol_id: str, node: str) -> None:
        self.ctx.apply_exports(vol_id)
        failpoint("unpublish.exported")
        with self.ctx.catalog.session() as s:
            pub = get_publication(s, vol_id, node)
            if pub is not None:
                s.delete(pub)
            close_journal(s, vol_id, OperationKind.UNPUBLISH, node=node)
        log.info("volume %s unpublished from %r", vol_id, node)
