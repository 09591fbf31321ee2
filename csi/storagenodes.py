"""The storage nodes a controller drives: one backend API client each.

Credentials come from the configuration file, or from a request's
``secrets`` (a StorageClass's provisioner / controller-publish secrets),
which then win.  The keys of such a secret:

==========  ================================================
``token``   the backend API's bearer token
``tlsCA``   PEM: the CA that signed the storage node's certificate
``tlsCert`` PEM: this client's certificate (with ``tlsKey``)
``tlsKey``  PEM: its private key
==========  ================================================

Secrets are never logged: only their key names appear in errors.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import grpc

from backend.api.client import BackendClient
from csi.config import PluginConfig, StorageNodeConfig
from csi.errors import CsiError, InvalidArgument, NotFound, from_backend

SECRET_KEYS = ("token", "tlsCA", "tlsCert", "tlsKey")
MAX_SECRET_CLIENTS = 32
PROBE_TIMEOUT = 5.0

T = TypeVar("T")


@dataclass(frozen=True)
class Health:
    name: str
    ok: bool
    message: str


def _secret_key(node: str, secrets: Mapping[str, str]) -> str:
    digest = hashlib.sha256()
    for key in SECRET_KEYS:
        digest.update(f"{key}\0{secrets.get(key, '')}\0".encode())
    return f"{node}/{digest.hexdigest()}"


def _check_secrets(secrets: Mapping[str, str]) -> None:
    if ("tlsCert" in secrets) != ("tlsKey" in secrets):
        raise InvalidArgument("secrets: tlsCert and tlsKey go together")
    if "token" in secrets and len(secrets["token"].strip()) < 16:
        raise InvalidArgument("secrets: token is shorter than 16 characters")


class StorageNodes:
    """Clients of every configured storage node, made once and shared by all calls."""

    def __init__(self, config: PluginConfig) -> None:
        self.config = config
        self._clients: dict[str, BackendClient] = {}
        # Clients made from request secrets, least recently used dropped first.
        self._secret_clients: OrderedDict[str, BackendClient] = OrderedDict()
        self._lock = threading.Lock()
        # The last answer of each node's Health call (csi/storagenodehealth.py asks).
        self._seen: dict[str, Health] = {}

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.config.storage_nodes]

    def get(self, name: str) -> StorageNodeConfig:
        node = self.config.storage_node(name)
        if node is None:
            raise NotFound(f"storage node {name!r} is not configured")
        return node

    def client(self, name: str, secrets: Mapping[str, str] | None = None) -> BackendClient:
        node = self.get(name)
        ours = {k: v for k, v in (secrets or {}).items() if k in SECRET_KEYS}
        with self._lock:
            if ours:
                _check_secrets(ours)
                key = _secret_key(name, ours)
                client = self._secret_clients.get(key)
                if client is None:
                    client = BackendClient(
                        node.address,
                        timeout=node.timeout,
                        token=ours.get("token", "").strip() or None,
                        ca_pem=ours["tlsCA"].encode() if "tlsCA" in ours else None,
                        cert_pem=ours["tlsCert"].encode() if "tlsCert" in ours else None,
                        key_pem=ours["tlsKey"].encode() if "tlsKey" in ours else None,
                    )
                    self._secret_clients[key] = client
                    while len(self._secret_clients) > MAX_SECRET_CLIENTS:
                        self._secret_clients.popitem(last=False)[1].close()
                self._secret_clients.move_to_end(key)
                return client
            client = self._clients.get(name)
            if client is None:
                try:
                    client = BackendClient(
                        node.address,
                        token_file=node.token_file,
                        ca=node.tls_ca,
                        cert=node.tls_cert,
                        key=node.tls_key,
                        timeout=node.timeout,
                    )
                except OSError as e:
                    raise CsiError(
                        f"storage node {name}: cannot read its credentials: {e.strerror}"
                    ) from e
                self._clients[name] = client
            return client

    @contextmanager
    def calling(self, name: str) -> Iterator[None]:
        """Turn a failed backend call to ``name`` into the CSI error for it."""
        try:
            yield
        except grpc.RpcError as e:
            raise from_backend(e, name) from None

    def call(
        self,
        name: str,
        fn: Callable[[BackendClient], T],
        secrets: Mapping[str, str] | None = None,
    ) -> T:
        client = self.client(name, secrets)
        with self.calling(name):
            return fn(client)

    def health(self, name: str) -> Health:
        """Ask ``name`` (at most ``PROBE_TIMEOUT``); the answer is kept for :meth:`problem`."""
        result = self._ask_health(name)
        with self._lock:
            self._seen[name] = result
        return result

    def _ask_health(self, name: str) -> Health:
        try:
            h = self.client(name).health(timeout=PROBE_TIMEOUT)
        except grpc.RpcError as e:
            return Health(name, False, from_backend(e, name).message)
        except CsiError as e:
            return Health(name, False, e.message)
        # A node low on space is not ok but still serves: it counts as up
        # (serving is absent, so false, from a node that predates it).
        return Health(name, h.ok or h.serving, f"storage node {name}: {h.message}")

    def problem(self, name: str) -> str | None:
        """Why ``name`` was down at its last Health call; None if up or never asked."""
        with self._lock:
            seen = self._seen.get(name)
        return None if seen is None or seen.ok else seen.message

    def close(self) -> None:
        with self._lock:
            for client in [*self._clients.values(), *self._secret_clients.values()]:
                client.close()
            self._clients.clear()
            self._secret_clients.clear()
