"""The bearer token of backend API calls: read from its file, attached to calls.

A token file its group or others may read is refused by the storage node
(``refuse_shared``) and warned of, once, by a client.  The token rides in
call credentials over TLS, in plain ``authorization`` metadata in clear.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import grpc

from backend.api.errors import InvalidArgument

log = logging.getLogger("moorage.backend.auth")
# (file, mode) already warned of: a client may read its token file often
_warned: set[tuple[Path, int]] = set()


def read_token(path: Path, *, refuse_shared: bool = False) -> str:
    """The bearer token in ``path``.

    A file its group or others may read is refused with ``refuse_shared``
    (the storage node's ``--token-file``, unless ``--allow-shared-token-file``),
    else warned of once (a client's token file).
    """
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        problem = (
            f"token file {path} has mode {mode:04o} (its group or others may read it): "
            f"chmod 600 {path}"
        )
        if refuse_shared:
            raise InvalidArgument(f"{problem}, or pass --allow-shared-token-file")
        if (path, mode) not in _warned:
            _warned.add((path, mode))
            log.warning("%s", problem)
    token = path.read_text().strip()
    if len(token) < 16:
        raise InvalidArgument(f"token in {path} is shorter than 16 characters")
    return token


class BearerToken(grpc.AuthMetadataPlugin):
    """Client side: attaches the token to every call."""

    def __init__(self, token: str) -> None:
        self._token = token

    def __call__(
        self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback
    ) -> None:
        callback((("authorization", f"Bearer {self._token}"),), None)
