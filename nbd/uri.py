"""NBD URIs (``nbd://``, ``nbds://``, ``nbd+unix://``, ``nbds+unix://``): parsing, no I/O.

The address form of an export, as libnbd and qemu spell it; ``nbd.client.connect_uri``
connects to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from nbd.constants import MAX_STRING

NBD_DEFAULT_PORT = 10809


@dataclass(frozen=True, slots=True)
class NBDURI:
    """A parsed NBD URI (the ``nbd://``, ``nbds://``, ``nbd+unix://`` schemes)."""

    export_name: str
    tls: bool
    host: str | None = None
    port: int = NBD_DEFAULT_PORT
    socket_path: str | None = None
    query: dict[str, str] = field(default_factory=dict)


_SCHEMES = {
    "nbd": (False, False),
    "nbds": (True, False),
    "nbd+unix": (False, True),
    "nbds+unix": (True, True),
}


def parse_nbd_uri(uri: str) -> NBDURI:
    """Parse ``nbd[s]://host[:port]/export`` or ``nbd[s]+unix:///export?socket=PATH``."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"not an NBD URI (scheme {parts.scheme!r}): {uri!r}")
    tls, unix = _SCHEMES[scheme]
    if parts.fragment:
        raise ValueError(f"NBD URI must not have a fragment: {uri!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"NBD URI must not carry user information: {uri!r}")
    query: dict[str, str] = {}
    for key, values in parse_qs(parts.query, keep_blank_values=True, strict_parsing=False).items():
        if len(values) != 1:
            raise ValueError(f"NBD URI query parameter {key!r} given {len(values)} times")
        query[key] = values[0]
    # The export name is the path without its first "/"; "nbd://h//x" names "/x".
    path = unquote(parts.path)
    export = path[1:] if path.startswith("/") else path
    if len(export.encode()) > MAX_STRING or "\0" in export:
        raise ValueError(f"invalid export name in NBD URI: {uri!r}")
    if unix:
        if parts.netloc:
            raise ValueError(f"an nbd+unix URI has no host: {uri!r}")
        socket_path = query.pop("socket", "")
        if not socket_path:
            raise ValueError(f"an nbd+unix URI needs ?socket=PATH: {uri!r}")
        return NBDURI(export_name=export, tls=tls, socket_path=socket_path, query=query)
    if "socket" in query:
        raise ValueError(f"?socket= is only allowed with nbd+unix: {uri!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"NBD URI has no host: {uri!r}")
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"invalid port in NBD URI {uri!r}: {e}") from e
    return NBDURI(
        export_name=export,
        tls=tls,
        host=host,
        port=NBD_DEFAULT_PORT if port is None else port,
        query=query,
    )


__all__ = ["NBDURI", "NBD_DEFAULT_PORT", "parse_nbd_uri"]
