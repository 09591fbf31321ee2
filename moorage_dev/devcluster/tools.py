"""Where the cluster's binaries and images are (built by ``make e2e-tools``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Tools:
    kube_bin: Path
    etcd: Path
    helm: Path
    images: Path
    moorage_image: Path

    @classmethod
    def from_env(cls) -> Tools:
        """From the variables the Makefile exports; a missing one is a clear error."""
        names = {
            "kube_bin": "MOORAGE_KUBE_BIN",
            "etcd": "MOORAGE_ETCD",
            "helm": "MOORAGE_HELM",
            "images": "MOORAGE_E2E_IMAGES",
            "moorage_image": "MOORAGE_IMAGE",
        }
        missing = [v for v in names.values() if not os.environ.get(v)]
        if missing:
            raise LookupError(
                "not set: " + ", ".join(missing) + " (run through make: `make cluster-up`, "
                "or export what `make e2e-tools` built)"
            )
        tools = cls(**{k: Path(os.environ[v]) for k, v in names.items()})
        absent = [str(p) for p in tools.__dict__.values() if not Path(p).exists()]
        if absent:
            raise LookupError("not built: " + ", ".join(absent) + " (make e2e-tools)")
        return tools

    def kube(self, name: str) -> str:
        return str(self.kube_bin / name)
