"""deploy/image/oci.py: the OCI image archives of ``make image`` and ``make e2e-tools``.

The moorage image's configuration is what the archive gets without options,
and its digest for a given root filesystem is pinned here: the options the
e2e images need (entrypoint, command, environment, user) must not change it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO

OCI_PY = REPO / "deploy" / "image" / "oci.py"
# build(ROOTFS, OUT, "moorage:0.1.0") of the root filesystem below, as the
# archive was first written (commit 22f618a)
MOORAGE_DIGEST = "sha256:11d63d083018486b93182742ddc4cb16acc82b2d863b68628c4270d826077e66"


@pytest.fixture(scope="module")
def oci() -> ModuleType:
    spec = importlib.util.spec_from_file_location("oci", OCI_PY)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    """A small root filesystem tar, byte for byte the same on every run."""
    path = tmp_path / "rootfs.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in [("bin", None), ("bin/hello", b"#!/bin/sh\necho hello\n")]:
            info = tarfile.TarInfo(name)
            info.mtime, info.mode = 0, 0o755
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def blobs(archive: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The archive's index.json and its blobs by digest, each checked against its name."""
    files = {}
    with tarfile.open(archive) as tar:
        for member in tar:
            f = tar.extractfile(member)
            assert f is not None, member.name
            files[member.name] = f.read()
    assert json.loads(files.pop("oci-layout")) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files.pop("index.json"))
    by_digest = {}
    for name, data in files.items():
        assert name.startswith("blobs/sha256/"), name
        digest = name.removeprefix("blobs/sha256/")
        assert hashlib.sha256(data).hexdigest() == digest, name
        by_digest[f"sha256:{digest}"] = data
    return index, by_digest


def image_config(archive: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The index entry of the archive's one image and that image's configuration."""
    index, by_digest = blobs(archive)
    [entry] = index["manifests"]
    manifest = json.loads(by_digest[entry["digest"]])
    config = json.loads(by_digest[manifest["config"]["digest"]])
    assert [layer["digest"] for layer in manifest["layers"]] == config["rootfs"]["diff_ids"]
    return entry, config


def test_the_moorage_image_keeps_its_digest(oci: ModuleType, rootfs: Path, tmp_path: Path) -> None:
    out = tmp_path / "moorage.tar"
    assert oci.build(rootfs, out, "moorage:0.1.0") == MOORAGE_DIGEST
    entry, config = image_config(out)
    assert entry["annotations"]["io.containerd.image.name"] == "docker.io/library/moorage:0.1.0"
    assert config["config"]["Entrypoint"] == ["/usr/local/bin/moorage"]


def test_the_command_line_without_options_builds_the_moorage_image(
    rootfs: Path, tmp_path: Path
) -> None:
    """What deploy/image/build.sh runs."""
    out = tmp_path / "moorage.tar"
    result = subprocess.run(
        [sys.executable, str(OCI_PY), str(rootfs), str(out), "moorage:0.1.0"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert result.stdout.strip() == MOORAGE_DIGEST


def test_another_programs_image(rootfs: Path, tmp_path: Path) -> None:
    """An e2e image: its own entrypoint, environment and user, its registry kept."""
    out = tmp_path / "pause.tar"
    subprocess.run(
        [sys.executable, str(OCI_PY), str(rootfs), str(out), "registry.k8s.io/pause:3.10.1",
         "--entrypoint", '["/pause"]', "--env", "PATH=/bin", "--user", "65535:65535",
         "--created-by", "a test"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    entry, config = image_config(out)
    assert entry["annotations"] == {
        "org.opencontainers.image.ref.name": "3.10.1",
        "io.containerd.image.name": "registry.k8s.io/pause:3.10.1",
    }
    assert config["config"] == {
        "Entrypoint": ["/pause"],
        "Env": ["PATH=/bin"],
        "User": "65535:65535",
    }
    assert config["history"] == [{"created": "2026-01-01T00:00:00Z", "created_by": "a test"}]


def test_a_command_without_an_entrypoint(oci: ModuleType, rootfs: Path, tmp_path: Path) -> None:
    out = tmp_path / "busybox.tar"
    oci.build(rootfs, out, "busybox:1.35", entrypoint=[], cmd=["sh"], env=["PATH=/bin"])
    entry, config = image_config(out)
    assert entry["annotations"]["io.containerd.image.name"] == "docker.io/library/busybox:1.35"
    assert config["config"] == {"Cmd": ["sh"], "Env": ["PATH=/bin"]}


@pytest.mark.parametrize("bad", ["moorage", "localhost:5000/moorage", ":0.1.0"])
def test_a_reference_without_a_tag_is_refused(
    oci: ModuleType, bad: str, rootfs: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="not NAME:TAG"):
        oci.build(rootfs, tmp_path / "x.tar", bad)
    assert not list(tmp_path.glob("x.*"))


def test_a_malformed_entrypoint_is_refused(rootfs: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(OCI_PY), str(rootfs), str(tmp_path / "x.tar"), "x:1",
         "--entrypoint", "/pause"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 2 and "--entrypoint" in result.stderr
