"""The set of exports an NBD server offers, and who may open which.

The table can change while the server runs: the storage node adds one export
per publication and removes it on unpublish.  Removing an export closes every
connection that has it open.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import trio

from nbd.constants import MAX_PAYLOAD, MAX_STRING
from nbd.shared import SharedExport
from nbd.throttle import Throttle

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Export names appear in logs, URIs and file names of the storage node: keep
# them to a conservative alphabet.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,254}")


class ExportError(ValueError):
    """An export definition is invalid."""


def parse_networks(specs: Iterable[str]) -> frozenset[IPNetwork]:
    nets: set[IPNetwork] = set()
    for spec in specs:
        try:
            nets.add(ipaddress.ip_network(spec.strip(), strict=False))
        except ValueError as e:
            raise ExportError(f"not an address or network: {spec!r}") from e
    return frozenset(nets)


@dataclass(frozen=True)
class Export:
    """One export: a name the client asks for, and the image behind it."""

    name: str
    path: Path
    read_only: bool = False
    description: str = ""
    # None: any client may open it.  Otherwise only clients whose address is
    # inside one of these networks; connections over a unix socket or stdio
    # have no address and are refused such exports.
    allowed_clients: frozenset[IPNetwork] | None = None
    tls_required: bool = False
    min_block_size: int = 1
    # Limits for the export as a whole, over all its connections (0: none).
    # Changing only these keeps the export's connections open.
    iops_limit: int = 0
    bandwidth_limit: int = 0

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ExportError(
                f"invalid export name {self.name!r}: 1-255 characters of "
                "letters, digits and ._:@+- starting with a letter or digit"
            )
        if len(self.description.encode()) > MAX_STRING:
            raise ExportError("export description longer than 4096 bytes")
        mbs = self.min_block_size
        if mbs < 1 or mbs > 65536 or mbs & (mbs - 1):
            raise ExportError("minimum block size must be a power of two between 1 and 64 KiB")
        if MAX_PAYLOAD % mbs:
            raise ExportError("minimum block size must divide the maximum payload")
        if self.iops_limit < 0 or self.bandwidth_limit < 0:
            raise ExportError("I/O limits cannot be negative")

    def same_but_limits(self, other: Export) -> bool:
        """True when the two differ at most in their I/O limits."""
        return (
            dataclasses.replace(
                self, iops_limit=other.iops_limit, bandwidth_limit=other.bandwidth_limit
            )
            == other
        )

    def allows(self, address: IPAddress | None) -> bool:
        if self.allowed_clients is None:
            return True
        if address is None:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        return any(address in net for net in self.allowed_clients)


@dataclass
class ExportStats:
    """What an export's connections did, counted as requests arrive (for metrics)."""

    requests: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    errors: int = 0
    # nanoseconds from reading each request's header to queueing its reply, summed
    service_ns: int = 0


@dataclass
class ExportRuntime:
    """What every connection of one export shares: its I/O limits and its counters.

    With ``shared``, the throttle's buckets and the counters are in memory
    shared with the other serving processes (``stats`` is then this process's
    row there, duck-typed as an ``ExportStats``).
    """

    throttle: Throttle
    stats: ExportStats = field(default_factory=ExportStats)
    shared: SharedExport | None = None


RuntimeFactory = Callable[["Export"], ExportRuntime]
# (export, its runtime, True) when added or changed; (..., False) when removed
Watcher = Callable[["Export", "ExportRuntime", bool], None]


def private_runtime(export: Export) -> ExportRuntime:
    return ExportRuntime(Throttle(export.iops_limit, export.bandwidth_limit))


@dataclass
class _Entry:
    export: Export
    runtime: ExportRuntime
    connections: set[trio.CancelScope] = field(default_factory=set)


def _same_slot(a: ExportRuntime, b: ExportRuntime) -> bool:
    return a.shared is not None and b.shared is not None and a.shared.slot == b.shared.slot


class ExportTable:
    """Name → export, safe to change from the trio thread while serving."""

    def __init__(self, exports: Iterable[Export] = ()) -> None:
        self._entries: dict[str, _Entry] = {}
        self._factory: RuntimeFactory = private_runtime
        self._watchers: list[Watcher] = []
        for e in exports:
            self.add(e)

    def share(self, factory: RuntimeFactory, watcher: Watcher) -> None:
        """From now on new exports get their runtime from ``factory`` and every
        change is told to ``watcher``; exports already here get new runtimes
        (call it before any connection is open)."""
        if any(e.connections for e in self._entries.values()):
            raise RuntimeError("cannot share an export table with connections open")
        self._factory = factory
        self._watchers.append(watcher)
        for entry in self._entries.values():
            entry.runtime = factory(entry.export)
            watcher(entry.export, entry.runtime, True)

    def unshare(self, watcher: Watcher) -> None:
        """Undo ``share`` once the serving is over: every export gets a private
        runtime again (its limits kept, its counters started anew)."""
        self._factory = private_runtime
        self._watchers.remove(watcher)
        for entry in self._entries.values():
            entry.runtime = private_runtime(entry.export)

    def _tell(self, export: Export, runtime: ExportRuntime, present: bool = True) -> None:
        for watcher in self._watchers:
            watcher(export, runtime, present)

    def add(self, export: Export, runtime: ExportRuntime | None = None) -> None:
        """Add an export, or replace a different one of the same name (closing its
        connections).  Adding an export identical to the one present changes nothing;
        one that differs only in its I/O limits applies them to the open connections.

        ``runtime``: the export's shared state as another process made it
        (a worker's table); by default the table's runtime factory makes one.
        """
        current = self._entries.get(export.name)
        if current is not None:
            same_place = runtime is None or _same_slot(current.runtime, runtime)
            if current.export == export and same_place:
                return
            if current.export.same_but_limits(export) and same_place:
                current.export = export
                if runtime is None:
                    current.runtime.throttle.configure(export.iops_limit, export.bandwidth_limit)
                else:  # a worker's buckets are shared: the master has set them
                    current.runtime.throttle.reload()
                self._tell(export, current.runtime)
                return
        # Made before the export it replaces goes: a refused export changes nothing.
        runtime = runtime or self._factory(export)
        if current is not None:
            self.remove(export.name)
        self._entries[export.name] = _Entry(export, runtime)
        self._tell(export, runtime)

    def remove(self, name: str) -> bool:
        """Remove an export and close its open connections.  False if absent."""
        entry = self._entries.pop(name, None)
        if entry is None:
            return False
        for scope in entry.connections:
            scope.cancel()
        self._tell(entry.export, entry.runtime, False)
        return True

    def runtime(self, name: str) -> ExportRuntime | None:
        entry = self._entries.get(name)
        return entry.runtime if entry else None

    def get(self, name: str) -> Export | None:
        entry = self._entries.get(name)
        return entry.export if entry else None

    def __iter__(self) -> Iterator[Export]:
        return iter([e.export for e in self._entries.values()])

    def __len__(self) -> int:
        return len(self._entries)

    def visible_to(self, address: IPAddress | None) -> list[Export]:
        """The exports this client may open (what NBD_OPT_LIST shows it)."""
        return [e.export for e in self._entries.values() if e.export.allows(address)]

    def lookup(self, name: str, address: IPAddress | None) -> Export | None:
        """The export if it exists and this client may open it, else None.

        A client that may not open an export is told it does not exist.
        """
        export = self.get(name)
        if export is None or not export.allows(address):
            return None
        return export

    def open_connection(self, export: Export, scope: trio.CancelScope) -> ExportRuntime | None:
        """Register a connection in transmission on ``export``; returns what
        the export's connections share (limits, counters).

        Returns None if the export was removed or replaced meanwhile.
        """
        entry = self._entries.get(export.name)
        if entry is None or not entry.export.same_but_limits(export):
            return None
        entry.connections.add(scope)
        if entry.runtime.shared is not None:
            entry.runtime.shared.row.connections += 1
        return entry.runtime

    def close_connection(
        self, export: Export, scope: trio.CancelScope, runtime: ExportRuntime | None = None
    ) -> None:
        """The end of a connection ``open_connection`` registered (``runtime``: what it
        returned, whose shared count of connections goes down even if the export went)."""
        entry = self._entries.get(export.name)
        if entry is not None and scope in entry.connections:
            entry.connections.discard(scope)
            runtime = runtime or entry.runtime
        if runtime is not None and runtime.shared is not None:
            runtime.shared.row.connections -= 1

    def stats(self) -> list[tuple[str, ExportStats, int]]:
        """(name, counters, open connections) of every export, copied; an export
        shared with worker processes is counted over all of them."""
        out = []
        for name, e in self._entries.items():
            shared = e.runtime.shared
            if shared is None:
                out.append((name, dataclasses.replace(e.runtime.stats), len(e.connections)))
                continue
            sums, connections = shared.region.totals(shared.slot)
            out.append((name, ExportStats(**sums), connections))
        return out
