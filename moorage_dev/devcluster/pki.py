"""The cluster's certificates and kubeconfigs, made with the openssl command.

One CA signs every certificate (P-256 keys); the service-account tokens are
signed with a key of their own.  Files are made once and reused by a later
``up`` of the same cluster directory.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hostio import tools
from hostio.atomicfile import write_atomically

DAYS = "3650"


@dataclass(frozen=True)
class Identity:
    """A key and certificate: ``name.key`` / ``name.crt`` in the pki directory."""

    name: str
    common_name: str
    organization: str | None = None
    ips: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()


def _openssl(*args: str) -> None:
    try:
        tools.run(["openssl", *args], timeout=60)
    except tools.ToolError as e:
        raise RuntimeError(f"openssl {args[0]}: {e.stderr}") from e


def _key(path: Path) -> None:
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)
    )
    path.chmod(0o600)


def ca(pki: Path) -> None:
    """The CA and the service-account key pair, once."""
    pki.mkdir(parents=True, exist_ok=True)
    if not (pki / "ca.crt").exists():
        _key(pki / "ca.key")
        _openssl(
            "req", "-x509", "-new", "-key", str(pki / "ca.key"), "-subj", "/CN=moorage-e2e-ca",
            "-days", DAYS, "-out", str(pki / "ca.crt"),
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        )  # fmt: skip
    if not (pki / "sa.pub").exists():
        _key(pki / "sa.key")
        _openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def issue(pki: Path, who: Identity) -> None:
    """``who``'s key and certificate, signed by the CA, once."""
    crt = pki / f"{who.name}.crt"
    if crt.exists():
        return
    key = pki / f"{who.name}.key"
    _key(key)
    subject = (f"/O={who.organization}" if who.organization else "") + f"/CN={who.common_name}"
    names = [f"IP:{ip}" for ip in who.ips] + [f"DNS:{d}" for d in who.dns]
    extensions = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        "extendedKeyUsage=serverAuth,clientAuth",
    ]
    if names:
        extensions.append("subjectAltName=" + ",".join(names))
    with tempfile.TemporaryDirectory() as tmp:
        csr = Path(tmp) / "req.csr"
        ext = Path(tmp) / "ext.cnf"
        ext.write_text("\n".join(extensions) + "\n")
        _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"),
            "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", DAYS,
            "-extfile", str(ext), "-out", str(crt),
        )  # fmt: skip


def kubeconfig(path: Path, pki: Path, who: str, server: str) -> None:
    """A kubeconfig for ``who``'s certificate against ``server``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "moorage-e2e",
                "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": who,
                "user": {
                    "client-certificate": str(pki / f"{who}.crt"),
                    "client-key": str(pki / f"{who}.key"),
                },
            }
        ],
        "contexts": [{"name": "moorage-e2e", "context": {"cluster": "moorage-e2e", "user": who}}],
        "current-context": "moorage-e2e",
    }
    # JSON is YAML: every Kubernetes client reads it
    write_atomically(path, json.dumps(config, indent=2), mode=0o600)
