"""Debian's Prometheus for tests: its binaries, a server on loopback with file_sd
targets and a data directory of its own, and the monitoring files the chart ships.

``promtool`` and ``prometheus`` are found on PATH (deploy/host/install-deps.sh
installs Debian's ``prometheus`` package without starting its service), or at
``MOORAGE_PROMTOOL`` / ``MOORAGE_PROMETHEUS``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO, free_port, stop_process

FILES = REPO / "deploy" / "helm" / "moorage" / "files"
RULES = FILES / "prometheus-rules.yaml"
DASHBOARD = FILES / "grafana-dashboard.json"
ALERT_TESTS = REPO / "tests" / "monitoring" / "alerts-test.yaml"
# Grafana's variables, as a Prometheus of its own reads them: every instance,
# and a rate window long enough to hold a test's few scrapes
GRAFANA_VARIABLES = {"$instance": ".*", "$__rate_interval": "5m"}


def tool(name: str) -> str:
    path = os.environ.get(f"MOORAGE_{name.upper()}") or shutil.which(name)
    assert path and os.access(path, os.X_OK), (
        f"{name} is missing: deploy/host/install-deps.sh installs Debian's prometheus package"
    )
    return path


def run_promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of the rules file."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def as_prometheus_reads_it(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced."""
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable the tests do not know in {expr}"
    return expr


def fast_rules(path: Path) -> Path:
    """The chart's rules with each ``for`` in seconds rather than minutes, at ``path``
    (for the integration test's Prometheus, so that an alert fires in seconds)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = f"{max(1, seconds(rule['for']) // 60)}s"
    path.write_text(yaml.safe_dump(doc))
    return path


@dataclass
class PrometheusServer:
    """``prometheus`` on 127.0.0.1, scraping file_sd targets by job, with rules."""

    root: Path
    jobs: Mapping[str, Sequence[str]]  # job -> HOST:PORT targets
    rule_files: Sequence[Path] = ()
    interval: str = "1s"  # scrape and evaluation
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.root / "prometheus.log"

    def write_config(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        scrape_configs = []
        for job, targets in self.jobs.items():
            sd = self.root / f"targets-{job}.json"
            sd.write_text(json.dumps([{"targets": list(targets)}]))
            scrape_configs.append(
                {
                    "job_name": job,
                    "file_sd_configs": [{"files": [str(sd)], "refresh_interval": "1s"}],
                }
            )
        config = {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": scrape_configs,
        }
        path = self.root / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self, timeout: float = 60) -> PrometheusServer:
        config = self.write_config()
        argv = [
            tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={self.root / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=info",
        ]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=self.root)
        try:
            self._wait_ready(timeout)
        except BaseException:
            # the caller never gets the server to stop: it is stopped here
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url("/-/ready"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:  # not listening yet, an error status, a read timed out
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        stop_process(self.proc, 20)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(self.url(f"/api/v1/{path}{query}"), timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` gives now (a 400 for bad PromQL fails the test)."""
        try:
            data = self.api("query", query=expr)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{expr}: {e.read().decode(errors='replace')}") from None
        result: list[dict[str, Any]] = data["result"] if data["resultType"] == "vector" else []
        return result

    def alerts(self, name: str) -> list[dict[str, Any]]:
        """The alerts named ``name``, pending or firing."""
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]

    def wait(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not after {timeout}s\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


_DURATION = re.compile(r"^(\d+)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(duration: str) -> int:
    """A Prometheus duration of one unit (2m, 30s, 1h) in seconds."""
    m = _DURATION.match(duration)
    assert m, f"not a one-unit duration: {duration}"
    return int(m[1]) * _SECONDS[m[2]]
