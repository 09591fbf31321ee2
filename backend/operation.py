"""What every operation of the storage node shares, and how each starts and ends.

Each operation that changes something runs through ``ServiceContext.operation``:
hold the locks of the objects it touches; under the catalog-wide decision lock,
in one transaction, check the request against the catalog and record the intent
(the row in its transitional state plus a pending journal entry); then, with
the intent committed, do the file, mount and export work (a ``finish_*``
method, each step idempotent) and close the journal entry.  The start-up
reconciliation re-runs the same ``finish_*`` step of any operation a crash
interrupted.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from backend.api.errors import InvalidArgument, ResourceExhausted
from backend.catalog.db import Catalog, finish_operation
from backend.catalog.models import Operation, OperationKind, OperationState, Volume
from backend.exporting import Exporter, Exports
from backend.failpoints import failpoint
from backend.keylocks import KeyLocks
from backend.pool import Pool
from backend.views import capacity_info

T = TypeVar("T")


@dataclass(frozen=True)
class ServiceConfig:
    nbd_host: str = "127.0.0.1"
    nbd_port: int = 10809
    nbd_tls: bool = False
    nfs_server: str = "127.0.0.1"
    nfs_port: int = 2049
    mount_port: int = 20048
    overcommit_ratio: float = 1.0
    # Health is not ok while the pool's free space is under this share of it (0: never).
    low_space_percent: float = 10.0

    def __post_init__(self) -> None:
        if not 0.1 <= self.overcommit_ratio <= 100:
            raise InvalidArgument("overcommit ratio must be between 0.1 and 100")
        if not 0 <= self.low_space_percent <= 100:
            raise InvalidArgument("low space percent must be between 0 and 100")


@dataclass(frozen=True)
class Intent(Generic[T]):
    """What an operation decided: its answer, and the work left once the intent is
    committed (None: nothing left, e.g. the volume is already made or already gone)."""

    answer: T
    then: Callable[[], object] | None = None


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass
class ServiceContext:
    """The state every operation shares: the catalog, the pool, the exporter,
    the configuration, and the locks that order the operations."""

    catalog: Catalog
    pool: Pool
    exporter: Exporter
    config: ServiceConfig
    # Decisions that read then write the catalog (capacity, names, export ids).
    decisions: threading.Lock = field(default_factory=threading.Lock)
    # One per object an operation touches (an id, a name).
    locks: KeyLocks = field(default_factory=KeyLocks)
    exports: Exports = field(init=False)

    def __post_init__(self) -> None:
        self.exports = Exports(self.pool, self.exporter, self.config.nbd_tls)

    def operation(
        self, keys: Sequence[str], decide: Callable[[Session], Intent[T]], failpoint_at: str
    ) -> T:
        """The one way an operation starts.

        The locks of ``keys`` (object ids, names) are held for the whole
        operation.  ``decide`` runs under the decision lock in one catalog
        transaction: it checks the request against the catalog and records the
        intent.  Once that is committed, the failpoint ``failpoint_at`` and then the
        work the intent left run, still under the object locks.
        """
        with ExitStack() as held:
            for key in keys:
                held.enter_context(self.locks.hold(key))
            with self.decisions, self.catalog.session() as s:
                intent = decide(s)
            if intent.then is not None:
                failpoint(failpoint_at)
                intent.then()
        return intent.answer

    def check_capacity(self, s: Session, extra: int) -> None:
        """ResourceExhausted unless ``extra`` more bytes may be promised (in a decision)."""
        cap = capacity_info(s, self.pool, self.config.overcommit_ratio)
        if extra > cap.available_bytes:
            raise ResourceExhausted(
                f"{extra} bytes requested but only {cap.available_bytes} available "
                f"(pool {cap.total_bytes} bytes x overcommit {cap.overcommit_ratio}, "
                f"{cap.provisioned_bytes} provisioned)"
            )

    def apply_exports(self, vol_id: str) -> None:
        """Make the exporter match the catalog for one volume (idempotent)."""
        with self.catalog.read_session() as s:
            v = s.get(Volume, vol_id)
            if v is not None:
                self.exports.apply(s, v)


def pending_operation(
    s: Session, target: str, *kinds: OperationKind, node: str | None = None
) -> Operation | None:
    """The newest pending journal entry of ``target`` of one of ``kinds``;
    with ``node``, only one recorded for that node (a publication's)."""
    ops = s.scalars(
        select(Operation)
        .where(Operation.target_id == target, Operation.kind.in_(kinds))
        .where(Operation.state == OperationState.PENDING)
        .order_by(Operation.id.desc())
    )
    for op in ops:
        if node is None or (op.payload or {}).get("node") == node:
            return op
    return None


def close_journal(
    s: Session,
    target: str,
    *kinds: OperationKind,
    error: str | None = None,
    node: str | None = None,
) -> None:
    """Mark the pending journal entry of ``target`` done (or failed with ``error``)."""
    op = pending_operation(s, target, *kinds, node=node)
    if op is not None:
        finish_operation(op, error=error)
