"""The ganesha configuration as a typed, validated model, and its renderer.

nfs-ganesha 4.3 segfaults on a configuration syntax error at SIGHUP reload, so
nothing reaches a configuration file except through these classes: every value
is checked on construction against an allowlist that cannot express a quote,
brace, semicolon, comment or line break, and the renderer only ever emits
validated values.

Option names were checked against ganesha 4.3 (Debian ``nfs-ganesha 4.3-2``):
a rendered configuration starts without a single ``config_errs_to_log`` line.
A broken main file is no safer at start than at reload: ganesha 4.3 then logs
the error and runs on its defaults (port 2049, NLM on, every protocol).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final, Literal, get_args

from backend.api.errors import InvalidArgument
from hostio.addresses import AddressError, node_address

Access = Literal["RW", "RO"]
Squash = Literal["root_squash", "no_root_squash", "all_squash"]
Transport = Literal["TCP", "UDP"]
# Only levels at least as verbose as EVENT: the supervisor's log shows when
# ganesha is up, and an operator reading it needs the EVENT lines.
LogLevel = Literal["EVENT", "INFO", "DEBUG", "MID_DEBUG", "FULL_DEBUG"]

MAX_EXPORT_ID: Final = 65534  # 0 is the pseudo root ganesha builds itself
MAX_PATH_LENGTH: Final = 1024
_MAX_COMPONENT_LENGTH: Final = 255

# One path component.  Ganesha's own ``%dir`` grammar accepts exactly these
# characters, and none of them means anything inside a quoted string.
_COMPONENT = re.compile(r"[A-Za-z0-9._-]+")


# ------------------------------------------------------------------ validation


def safe_path(value: Path | str, what: str) -> Path:
    """An absolute, normalised path made only of ``[A-Za-z0-9._-]`` components.

    Rejects ``.`` and ``..``, empty components (``//``), the root itself, and
    anything a ganesha configuration could read as syntax.
    """
    if not isinstance(value, str | PurePosixPath):
        raise InvalidArgument(f"{what} must be a path, not {type(value).__name__}")
    text = str(value)
    if len(text) > MAX_PATH_LENGTH:
        raise InvalidArgument(f"{what} is longer than {MAX_PATH_LENGTH} characters")
    if not text.startswith("/"):
        raise InvalidArgument(f"{what} must be an absolute path: {text!r}")
    parts = text[1:].split("/")
    if parts and parts[-1] == "" and len(parts) > 1:
        parts = parts[:-1]  # one trailing slash is harmless
    if parts == [""]:
        raise InvalidArgument(f"{what} must not be the root directory")
    for part in parts:
        if part in ("", ".", ".."):
            raise InvalidArgument(f"{what} must be normalised (no '', '.', '..'): {text!r}")
        if len(part) > _MAX_COMPONENT_LENGTH or not _COMPONENT.fullmatch(part):
            raise InvalidArgument(
                f"{what} may only contain letters, digits, '.', '_', '-' and '/': {text!r}"
            )
    return Path("/" + "/".join(parts))


def client_address(value: str) -> str:
    """One client: an IPv4/IPv6 address or network, in its canonical form.

    An address must pass the rule every layer applies to a node's address
    (``hostio/addresses.py``, also behind ``backend.validation.node_address``):
    ``0.0.0.0`` and ``::`` are refused (ganesha reads a bare ``0.0.0.0`` as
    "every client", which nobody writing an address means), and so are zone
    ids (``fe80::1%eth0``), IPv4-mapped, broadcast and multicast addresses.
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"client must be a string, not {type(value).__name__}")
    if "/" not in value:
        try:
            return node_address(value, "client")
        except AddressError as e:
            raise InvalidArgument(str(e)) from None
    shown = repr(value[:80])
    if not value.isascii() or not re.fullmatch(r"[0-9A-Fa-f:./]+", value):
        raise InvalidArgument(f"client must be an IP address or CIDR network: {shown}")
    try:
        network = ipaddress.ip_network(value, strict=True)
    except ValueError as e:
        raise InvalidArgument(f"client is not a valid IP address or network: {shown}") from e
    return network.with_prefixlen


def _int(value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int:
        raise InvalidArgument(f"{what} must be an integer, not {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidArgument(f"{what} must be between {low} and {high}, not {value}")
    return value


def _protocols(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list | frozenset | set) or not value:
        raise InvalidArgument(f"{what} must be a non-empty tuple of NFS versions (3, 4)")
    versions = [_int(v, f"{what} entry", 3, 4) for v in value]
    if len(set(versions)) != len(versions):
        raise InvalidArgument(f"{what} lists a version twice: {tuple(versions)}")
    return tuple(sorted(versions))


def _choice(value: object, what: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise InvalidArgument(f"{what} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{what} must be true or false, not {value!r}")
    return value


# ------------------------------------------------------------------ the model


@dataclass(frozen=True, kw_only=True)
class CoreConfig:
    """The server-wide part of ``ganesha.conf``: ports, protocols, NFSv4 grace."""

    nfs_port: int
    recovery_root: Path
    protocols: tuple[int, ...] = (3, 4)
    grace_period: int = 90
    lease_lifetime: int = 60
    # Skip the grace period entirely (tests); a storage node keeps it so
    # clients can reclaim their locks after a restart.
    graceless: bool = False
    bind_addr: str = "0.0.0.0"
    # None: ganesha picks a port and registers it with rpcbind.
    mount_port: int | None = None
    enable_udp: bool = False
    log_level: LogLevel = "EVENT"

    def __post_init__(self) -> None:
        _int(self.nfs_port, "nfs_port", 1, 65535)
        if self.mount_port is not None:
            _int(self.mount_port, "mount_port", 1, 65535)
            if self.mount_port == self.nfs_port:
                raise InvalidArgument("mount_port must differ from nfs_port")
        object.__setattr__(self, "protocols", _protocols(self.protocols, "protocols"))
        _int(self.lease_lifetime, "lease_lifetime", 1, 120)
        _int(self.grace_period, "grace_period", 0, 180)
        if self.grace_period < self.lease_lifetime:
            # ganesha warns and clients may lose state they could have reclaimed
            raise InvalidArgument(
                f"grace_period ({self.grace_period}s) must be at least "
                f"lease_lifetime ({self.lease_lifetime}s)"
            )
        _bool(self.graceless, "graceless")
        _bool(self.enable_udp, "enable_udp")
        object.__setattr__(self, "recovery_root", safe_path(self.recovery_root, "recovery_root"))
        if not isinstance(self.bind_addr, str):
            raise InvalidArgument("bind_addr must be a string")
        try:
            bind = ipaddress.ip_address(self.bind_addr)
        except ValueError as e:
            raise InvalidArgument(f"bind_addr is not an IP address: {self.bind_addr!r}") from e
        if isinstance(bind, ipaddress.IPv6Address) and bind.scope_id:
            raise InvalidArgument(f"bind_addr must not carry a zone id: {self.bind_addr!r}")
        object.__setattr__(self, "bind_addr", str(bind))
        _choice(self.log_level, "log_level", get_args(LogLevel))

    @property
    def probe_host(self) -> str:
        """Where a local probe reaches the NFS port (loopback for a wildcard bind)."""
        bind = ipaddress.ip_address(self.bind_addr)
        if bind.is_unspecified:
            return "::1" if bind.version == 6 else "127.0.0.1"
        return self.bind_addr


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """One export: a directory, where it sits in the pseudo filesystem, who may mount it.

    ``clients`` empty means nobody: the export is rendered with
    ``Access_Type = None`` and no ``CLIENT`` block.
    """

    export_id: int
    path: Path
    pseudo: str
    clients: tuple[str, ...] = ()
    access: Access = "RW"
    # Clients that may only read (a volume published read-only to a node),
    # whatever ``access`` the others get.
    ro_clients: tuple[str, ...] = ()
    squash: Squash = "root_squash"
    protocols: tuple[int, ...] = (3, 4)
    transports: tuple[Transport, ...] = ("TCP",)

    def __post_init__(self) -> None:
        _int(self.export_id, "export_id", 1, MAX_EXPORT_ID)
        object.__setattr__(self, "path", safe_path(self.path, "export path"))
        if not isinstance(self.pseudo, str):
            raise InvalidArgument("pseudo must be a string")
        object.__setattr__(self, "pseudo", str(safe_path(self.pseudo, "pseudo path")))
        if isinstance(self.clients, str) or not isinstance(self.clients, tuple | list):
            raise InvalidArgument("clients must be a tuple of IP addresses or networks")
        canonical: list[str] = []
        for client in self.clients:
            c = client_address(client)
            if c not in canonical:
                canonical.append(c)
        object.__setattr__(self, "clients", tuple(canonical))
        if isinstance(self.ro_clients, str) or not isinstance(self.ro_clients, tuple | list):
            raise InvalidArgument("ro_clients must be a tuple of IP addresses or networks")
        readers: list[str] = []
        for client in self.ro_clients:
            c = client_address(client)
            if c in canonical:
                raise InvalidArgument(f"client {c} is listed both read-write and read-only")
            if c not in readers:
                readers.append(c)
        object.__setattr__(self, "ro_clients", tuple(readers))
        _choice(self.access, "access", get_args(Access))
        _choice(self.squash, "squash", get_args(Squash))
        object.__setattr__(self, "protocols", _protocols(self.protocols, "export protocols"))
        if not isinstance(self.transports, tuple | list) or not self.transports:
            raise InvalidArgument("transports must be a non-empty tuple of TCP/UDP")
        transports = tuple(_choice(t, "transport", get_args(Transport)) for t in self.transports)
        if len(set(transports)) != len(transports):
            raise InvalidArgument(f"transports lists one twice: {transports}")
        object.__setattr__(self, "transports", transports)


# ------------------------------------------------------------------ rendering


@dataclass
class _Block:
    """A block being rendered; values are already validated, tokens are fixed."""

    name: str
    lines: list[str] = field(default_factory=list)

    def option(self, name: str, value: str) -> None:
        self.lines.append(f"{name} = {value};")

    def block(self, inner: _Block) -> None:
        self.lines.extend(inner.render())

    def render(self) -> list[str]:
        return [f"{self.name} {{", *(f"    {line}" for line in self.lines), "}"]


def _bool_token(value: bool) -> str:
    return "true" if value else "false"


def _quoted(value: str | Path) -> str:
    # Validated values contain no '"' or '\\'; assert it anyway, cheaply.
    text = str(value)
    if not _COMPONENT.fullmatch(text.replace("/", "x")):
        raise InvalidArgument(f"refusing to render unvalidated value {text!r}")
    return f'"{text}"'


def _list(values: tuple[int, ...] | tuple[str, ...]) -> str:
    return ", ".join(str(v) for v in values)


HEADER: Final = "# Generated by moorage from its catalog; edits are overwritten."


def render_main(core: CoreConfig, export_dir: Path) -> str:
    """``ganesha.conf``: core parameters, then every ``*.conf`` file under ``export_dir``."""
    export_dir = safe_path(export_dir, "export directory")

    nfs_core = _Block("NFS_CORE_PARAM")
    nfs_core.option("NFS_Port", str(core.nfs_port))
    if core.mount_port is not None:
        nfs_core.option("MNT_Port", str(core.mount_port))
    nfs_core.option("Bind_addr", core.bind_addr)
    nfs_core.option("Protocols", _list(core.protocols))
    nfs_core.option("Enable_NLM", "false")
    nfs_core.option("Enable_RQUOTA", "false")
    nfs_core.option("Enable_UDP", _bool_token(core.enable_udp))
    # v3 clients mount the same path v4 clients see
    nfs_core.option("Mount_Path_Pseudo", "true")

    nfsv4 = _Block("NFSv4")
    nfsv4.option("Graceless", _bool_token(core.graceless))
    nfsv4.option("Grace_Period", str(core.grace_period))
    nfsv4.option("Lease_Lifetime", str(core.lease_lifetime))
    nfsv4.option("RecoveryBackend", "fs")
    nfsv4.option("RecoveryRoot", _quoted(core.recovery_root))
    # sec=sys clients without idmapd: owners travel as numbers, not "nobody"
    nfsv4.option("Only_Numeric_Owners", "true")

    krb5 = _Block("NFS_KRB5")
    krb5.option("Active_krb5", "false")

    log = _Block("LOG")
    log.option("Default_Log_Level", core.log_level)

    defaults = _Block("EXPORT_DEFAULTS")
    defaults.option("Access_Type", "None")  # an export grants access only to its CLIENTs

    lines = [HEADER]
    for block in (nfs_core, nfsv4, krb5, log, defaults):
        lines.extend(block.render())
    # Only *.conf: temporary files being written beside them are not read.
    lines.append(f'%dir "{export_dir}/*.conf"')
    return "\n".join(lines) + "\n"


def render_export(export: ExportConfig) -> str:
    """One ``EXPORT`` block, for its own file under the ``%dir`` directory."""
    block = _Block("EXPORT")
    block.option("Export_Id", str(export.export_id))
    block.option("Path", _quoted(export.path))
    block.option("Pseudo", _quoted(export.pseudo))
    block.option("Protocols", _list(export.protocols))
    block.option("Transports", _list(export.transports))
    block.option("Access_Type", "None")  # default deny: only the CLIENT block grants
    block.option("Squash", export.squash)
    block.option("SecType", "sys")
    # ganesha caches an object's attributes; the storage node changes some behind
    # its back (a pod's fsGroup given to an nfs volume's files): ask the
    # filesystem each time, as a kernel nfsd does
    block.option("Attr_Expiration_Time", "0")
    fsal = _Block("FSAL")
    fsal.option("Name", "VFS")
    block.block(fsal)
    if export.clients:
        client = _Block("CLIENT")
        client.option("Clients", _list(export.clients))
        client.option("Access_Type", export.access)
        block.block(client)
    if export.ro_clients:
        readers = _Block("CLIENT")
        readers.option("Clients", _list(export.ro_clients))
        readers.option("Access_Type", "RO")
        block.block(readers)
    return "\n".join([HEADER, *block.render()]) + "\n"
