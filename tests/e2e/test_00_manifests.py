"""Every Kubernetes manifest in deploy/ passes the real API server's dry run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, Cluster, Namespace

EXAMPLES = sorted((REPO / "deploy" / "examples").glob("*.yaml"))
MANIFESTS = [REPO / "deploy" / "kubernetes" / "moorage.yaml", *EXAMPLES]


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_passes_server_dry_run(cluster: Cluster, ns: Namespace, manifest: Path) -> None:
    text = manifest.read_text()
    namespace = ns.name
    if manifest.name == "moorage.yaml":
        # the plain manifests (the chart rendered) name their namespace
        namespace = "moorage-system"
        if cluster.kube.get("namespace", namespace) is None:
            cluster.kube("create", "namespace", namespace)
    result = cluster.kube.run(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=text, check=False
    )
    if namespace != ns.name:
        cluster.kube.run("delete", "namespace", namespace, "--wait=false", check=False)
    assert result.returncode == 0, result.stderr
    assert "(server dry run)" in result.stdout
