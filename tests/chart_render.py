"""The Helm chart rendered for tests: helm (built by ``make tools``, at MOORAGE_HELM),
``helm template`` with given values, and the objects of what it printed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO

CHART = REPO / "deploy" / "helm" / "moorage"
KUBE_VERSION = "1.34.0"


def helm() -> str:
    path = os.environ.get("MOORAGE_HELM")
    assert path, "MOORAGE_HELM is not set: run the tests through make (make test)"
    assert os.access(path, os.X_OK), f"{path} is missing: make tools builds it"
    return path


def run_helm(*args: str) -> str:
    result = subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(values: dict[str, Any] | None, tmp_path: Path) -> str:
    extra: list[str] = []
    if values is not None:
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        extra = ["--values", str(path)]
    return run_helm(
        "template", "moorage", str(CHART), "--namespace", "moorage-system",
        "--kube-version", KUBE_VERSION, *extra,
    )  # fmt: skip


def render_error(values: dict[str, Any], tmp_path: Path) -> str:
    """The error helm gives for ``values`` (it must refuse them)."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = subprocess.run(
        [helm(), "template", "moorage", str(CHART), "--kube-version", KUBE_VERSION,
         "--values", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0, f"helm rendered {values}"
    return result.stderr


def objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]
