"""How an address is written: a node's IP address, and ``HOST:PORT``.

A storage node records the address of each node a volume is published to,
renders it into ganesha's export configuration (a ``CLIENT`` entry) and into
the allow list of the node's NBD export; the CSI plugin carries it in its node
ids (``NAME@ADDRESS``) and takes it from ``--node-address``.  Every one of
them checks the address with :func:`node_address`, so no layer can accept an
address another layer refuses (and leave a half-made publication behind).

Every ``HOST:PORT`` the programs are given (a listening address, a storage
node's API address, an address to advertise) is read by
:func:`parse_host_port`, one rule for all:

- HOST is a host name, an IPv4 address, or an IPv6 address in brackets
  (``[::1]:10809``, ``[fe80::1%eth0]:9000`` with its zone); an IPv6 address
  without brackets is refused, as ``::1:80`` reads both ways.
- PORT is decimal digits, 1 to 65535.  Port 0 means "any free port", which
  only a caller that listens and reports the port it was given may ask for
  (``allow_zero=True``); everywhere else it is refused.
- An empty HOST (``:9810``) means every address of this host, which only a
  listening address may mean (``allow_empty_host=True``).
"""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple

# What an error message shows of the value it refuses.
_SHOWN = 80
# Characters that end a token, a string or a block in ganesha's configuration
# (besides whitespace and control characters, refused by ``isprintable``).
_SYNTAX = frozenset("\"';{}#,=\\")


class AddressError(ValueError):
    """The value is not an address one node can be reached at; one line of why."""


def node_address(value: object, what: str = "node address") -> str:
    """``value`` as one node's IP address, in canonical form, or :class:`AddressError`.

    Refused: anything that is not a plain IPv4 or IPv6 address (names,
    networks, characters of configuration syntax, whitespace, control
    characters), addresses with a zone (``fe80::1%eth0``), the unspecified
    addresses (``0.0.0.0``, ``::``: every host), IPv4-mapped IPv6 addresses
    (``::ffff:10.0.0.1``: give the IPv4 address), the limited broadcast
    address and multicast addresses.  Loopback, private and public unicast
    addresses are accepted.
    """
    if not isinstance(value, str):
        raise AddressError(f"{what} must be a string, not {type(value).__name__}")
    shown = repr(value[:_SHOWN]) + ("..." if len(value) > _SHOWN else "")
    if not value:
        raise AddressError(f"{what} is empty")
    if not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
        raise AddressError(
            f"{what} {shown} holds whitespace, control or non-ASCII characters: "
            "give a plain IP address"
        )
    if _SYNTAX & set(value):
        raise AddressError(f"{what} {shown} holds quotes or punctuation: give a plain IP address")
    if "%" in value:
        raise AddressError(f"{what} {shown} carries a zone ('%...'): give the address alone")
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        raise AddressError(f"{what} {shown} is not an IPv4 or IPv6 address") from None
    if address.is_unspecified:
        raise AddressError(
            f"{what} {shown} is the unspecified address, which means every host, not one node"
        )
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        raise AddressError(
            f"{what} {shown} is an IPv4-mapped IPv6 address: give {address.ipv4_mapped} instead"
        )
    if address == ipaddress.IPv4Address("255.255.255.255"):
        raise AddressError(f"{what} {shown} is the broadcast address, not one node")
    if address.is_multicast:
        raise AddressError(f"{what} {shown} is a multicast address, not one node")
    return str(address)


class HostPortError(ValueError):
    """The value is not a ``HOST:PORT`` this caller takes; one line of why."""


class HostPort(NamedTuple):
    """A host (IPv6 without its brackets; "" for every address) and a port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


# A DNS name (RFC 1123 labels) or an IPv4 address: letters, digits, '-' and '_'
# between dots; a trailing dot allowed.
_LABEL = r"[A-Za-z0-9_][A-Za-z0-9_-]{0,62}"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}\Z){_LABEL}(\.{_LABEL})*\.?")
_PORT = re.compile(r"[0-9]{1,5}")
MAX_PORT = 65535


def _is_ip(text: str, kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> bool:
    if not text.isascii() or not text.isprintable() or any(c.isspace() for c in text):
        return False  # ipaddress takes any character in an IPv6 zone
    try:
        kind(text)
    except ValueError:
        return False
    return True


def parse_host_port(
    value: str, what: str = "address", *, allow_zero: bool = False, allow_empty_host: bool = False
) -> HostPort:
    """``value`` as host and port by the one rule above, or :class:`HostPortError`.

    ``allow_zero``: port 0 (any free port) is taken, for a caller that binds
    and tells which port it got.  ``allow_empty_host``: an empty host (every
    address) is taken, for a listening address.
    """
    shown = repr(value[:_SHOWN]) + ("..." if len(value) > _SHOWN else "")

    def refuse(why: str) -> HostPortError:
        return HostPortError(f"{what} {shown} is not HOST:PORT ({why})")

    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise refuse("no ']' after the IPv6 address")
        host, rest = value[1:end], value[end + 1 :]
        if not _is_ip(host, ipaddress.IPv6Address):
            raise refuse(f"{host[:_SHOWN]!r} in brackets is not an IPv6 address")
        if not rest.startswith(":"):
            raise refuse("no ':PORT' after the address")
        port = rest[1:]
    else:
        host, colon, port = value.rpartition(":")
        if not colon:
            raise refuse("no ':PORT'")
        if ":" in host:
            raise refuse("an IPv6 address goes in brackets: [ADDRESS]:PORT")
        if not host and not allow_empty_host:
            raise refuse("no host")
        dotted = bool(host) and host.rstrip(".0123456789") == ""
        if host and not (
            _is_ip(host, ipaddress.IPv4Address) if dotted else _HOST_NAME.fullmatch(host)
        ):
            raise refuse(f"{host[:_SHOWN]!r} is not a host name or an IP address")
    lowest = 0 if allow_zero else 1
    if not _PORT.fullmatch(port) or int(port) > MAX_PORT:
        raise refuse(f"the port must be a number from {lowest} to {MAX_PORT}")
    if int(port) < lowest:
        raise refuse("port 0, any free port, is taken only where the port bound is reported")
    return HostPort(host, int(port))
