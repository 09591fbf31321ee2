"""The one rule for the IP address a node is known by.

A storage node records the address of each node a volume is published to,
renders it into ganesha's export configuration (a ``CLIENT`` entry) and into
the allow list of the node's NBD export; the CSI plugin carries it in its node
ids (``NAME@ADDRESS``) and takes it from ``--node-address``.  Every one of
them checks the address with :func:`node_address`, so no layer can accept an
address another layer refuses (and leave a half-made publication behind).

It lives in ``nbd`` because that is the package every other one may import.
"""

from __future__ import annotations

import ipaddress

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
