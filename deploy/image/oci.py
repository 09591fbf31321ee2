"""Wrap a root filesystem tar as a one-layer OCI image archive (no Docker daemon).

    python deploy/image/oci.py ROOTFS.tar IMAGE.tar NAME:TAG
        [--entrypoint JSON] [--cmd JSON] [--env NAME=VALUE]... [--user UID:GID]
        [--created-by TEXT]

Without options the image is moorage's (entrypoint /usr/local/bin/moorage,
PATH with its virtualenv first); the options describe another program's
image, e.g. ``--entrypoint '["/csi-provisioner"]' --env PATH=/bin`` (JSON
lists, as a Dockerfile's exec form; ``[]`` for none).  ``--env`` replaces the
default environment.

The archive holds an OCI image layout (``oci-layout``, ``index.json``,
``blobs/sha256/...``): ``ctr images import`` takes it, and so does any tool
that pushes OCI layouts to a registry.  The layer is the tar as it is
(uncompressed, media type ``application/vnd.oci.image.layer.v1.tar``), so its
digest is also its diff id.  Timestamps are fixed, so the same root
filesystem gives the same image digest.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"
CREATED = "2026-01-01T00:00:00Z"
PATH = "/opt/moorage/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MOORAGE_ENTRYPOINT = ("/usr/local/bin/moorage",)
MOORAGE_ENV = (f"PATH={PATH}",)
MOORAGE_HISTORY = "mmdebstrap (deploy/image/build.sh)"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def build(
    rootfs: Path,
    out: Path,
    reference: str,
    *,
    entrypoint: Sequence[str] = MOORAGE_ENTRYPOINT,
    cmd: Sequence[str] = (),
    env: Sequence[str] = MOORAGE_ENV,
    user: str = "",
    created_by: str = MOORAGE_HISTORY,
) -> str:
    """Write the archive; returns the manifest's digest.

    An empty entrypoint, command, environment or user is left out of the
    image's configuration (the runtime's defaults apply).
    """
    name, _, tag = reference.rpartition(":")
    if not name or not tag or "/" in tag:
        raise ValueError(f"image reference {reference!r} is not NAME:TAG")
    runtime: dict[str, object] = {}
    if entrypoint:
        runtime["Entrypoint"] = list(entrypoint)
    if cmd:
        runtime["Cmd"] = list(cmd)
    if env:
        runtime["Env"] = list(env)
    if user:
        runtime["User"] = user
    layer_digest = _sha256(rootfs)
    config = _json(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": CREATED,
            "config": runtime,
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
            "history": [{"created": CREATED, "created_by": created_by}],
        }
    )
    config_digest = hashlib.sha256(config).hexdigest()
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": {
                "mediaType": CONFIG,
                "digest": f"sha256:{config_digest}",
                "size": len(config),
            },
            "layers": [
                {
                    "mediaType": LAYER,
                    "digest": f"sha256:{layer_digest}",
                    "size": rootfs.stat().st_size,
                }
            ],
        }
    )
    manifest_digest = hashlib.sha256(manifest).hexdigest()
    full = name if "/" in name else f"docker.io/library/{name}"
    index = _json(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": MANIFEST,
                    "digest": f"sha256:{manifest_digest}",
                    "size": len(manifest),
                    "annotations": {
                        "org.opencontainers.image.ref.name": tag,
                        "io.containerd.image.name": f"{full}:{tag}",
                    },
                }
            ],
        }
    )
    tmp = out.with_suffix(".partial")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        _add_bytes(tar, "oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
        _add_bytes(tar, "index.json", index)
        _add_bytes(tar, f"blobs/sha256/{manifest_digest}", manifest)
        _add_bytes(tar, f"blobs/sha256/{config_digest}", config)
        info = tar.gettarinfo(str(rootfs), arcname=f"blobs/sha256/{layer_digest}")
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        with rootfs.open("rb") as f:
            tar.addfile(info, f)
    tmp.replace(out)
    return f"sha256:{manifest_digest}"


def _json_list(text: str) -> list[str]:
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rootfs", type=Path, help="the root filesystem, a tar")
    parser.add_argument("out", type=Path, help="the OCI image archive to write")
    parser.add_argument("reference", help="NAME:TAG")
    parser.add_argument("--entrypoint", type=_json_list, default=list(MOORAGE_ENTRYPOINT))
    parser.add_argument("--cmd", type=_json_list, default=[])
    parser.add_argument("--env", action="append", metavar="NAME=VALUE")
    parser.add_argument("--user", default="")
    parser.add_argument("--created-by", default=MOORAGE_HISTORY)
    args = parser.parse_args(argv)
    digest = build(
        args.rootfs,
        args.out,
        args.reference,
        entrypoint=args.entrypoint,
        cmd=args.cmd,
        env=MOORAGE_ENV if args.env is None else args.env,
        user=args.user,
        created_by=args.created_by,
    )
    print(digest)


if __name__ == "__main__":
    main(sys.argv[1:])
