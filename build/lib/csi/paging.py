"""Listing volumes and snapshots across storage nodes, a page at a time.

A token is ``STORAGE-NODE/TOKEN``: the storage node to go on with (in
configuration order) and that storage node's own token there (empty: from
its start).  A token this plugin did not give out is ABORTED, as the spec
asks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from csi.errors import Aborted

MAX_PAGE = 1000
_BACKEND_TOKEN = re.compile(r"[0-9a-f]{32}")

T = TypeVar("T")
E = TypeVar("E")


def parse_token(token: str, names: Sequence[str]) -> tuple[int, str]:
    if not token:
        return 0, ""
    node, sep, rest = token.partition("/")
    if not sep or node not in names or (rest and not _BACKEND_TOKEN.fullmatch(rest)):
        raise Aborted(f"starting_token {token[:80]!r} is not one this plugin gave out")
    return names.index(node), rest


def make_token(node: str, backend_token: str) -> str:
    return f"{node}/{backend_token}"


def paginate(
    names: Sequence[str],
    max_entries: int,
    starting_token: str,
    page: Callable[[str, int, str], tuple[list[T], str]],
    convert: Callable[[str, T], E],
) -> tuple[list[E], str]:
    """Up to ``max_entries`` (0: all) from the token's place on; the next token."""
    out: list[E] = []
    index, token = parse_token(starting_token, names)
    want = max_entries or None
    while index < len(names):
        node = names[index]
        limit = MAX_PAGE if want is None else min(MAX_PAGE, want - len(out))
        items, token = page(node, limit, token)
        out.extend(convert(node, item) for item in items)
        if token:
            if want is not None and len(out) >= want:
                return out, make_token(node, token)
            continue
        index += 1
        if want is not None and len(out) >= want and index < len(names):
            return out, make_token(names[index], "")
    return out, ""
