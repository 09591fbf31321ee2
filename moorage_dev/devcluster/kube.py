"""kubectl and helm against the cluster, run inside the control plane's namespace."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from moorage_dev.devcluster.layout import API_PORT, CONTROL_NS, Layout
from moorage_dev.devcluster.tools import Tools


class KubectlError(RuntimeError):
    pass


class Kube:
    """The cluster as its administrator sees it."""

    def __init__(self, layout: Layout, tools: Tools) -> None:
        self.layout = layout
        self.tools = tools
        self.server = f"https://127.0.0.1:{API_PORT}"

    def _in_control_ns(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{CONTROL_NS}", "--", *argv]

    def run(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        argv = self._in_control_ns(
            [self.tools.kube("kubectl"), f"--kubeconfig={self.layout.admin_kubeconfig}", *args]
        )
        result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result

    def __call__(self, *args: str, input: str | None = None) -> str:
        return self.run(*args, input=input).stdout

    def get(self, kind: str, name: str | None = None, namespace: str | None = None) -> Any:
        """The object (or list) as JSON; None when a named object does not exist."""
        args = ["get", kind, *([name] if name else []), "-o", "json"]
        if namespace:
            args += ["-n", namespace]
        result = self.run(*args, check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise KubectlError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return json.loads(result.stdout)

    def apply(self, manifest: str | dict[str, Any], *extra: str) -> str:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        return self("apply", "-f", "-", *extra, input=text)

    def ready(self) -> bool:
        return self.run("get", "--raw", "/readyz", check=False, timeout=10).stdout == "ok"

    def helm(self, *args: str, timeout: float = 600) -> str:
        argv = self._in_control_ns(
            [str(self.tools.helm), f"--kubeconfig={self.layout.admin_kubeconfig}", *args]
        )
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise KubectlError(f"helm {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def wait_until(
        self, what: str, check: Callable[[], bool], timeout: float = 180, interval: float = 1
    ) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if check():
                    return
                last = None
            except (KubectlError, KeyError, TypeError, IndexError) as e:
                last = e
            time.sleep(interval)
        raise TimeoutError(f"{what}: not after {timeout:.0f} s" + (f" ({last})" if last else ""))
