"""TLS contexts for the NBD server (X.509, as NBD_OPT_STARTTLS uses)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


def server_context(cert: Path, key: Path, client_ca: Path | None = None) -> ssl.SSLContext:
    """A server context; with ``client_ca`` clients must present a certificate it signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
    if client_ca is not None:
        ctx.load_verify_locations(cafile=str(client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


@dataclass(frozen=True)
class TLSFiles:
    """Where a server context comes from: what a worker process needs to make
    its own (an ``SSLContext`` cannot cross a process boundary)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def context(self) -> ssl.SSLContext:
        return server_context(self.cert, self.key, self.client_ca)
