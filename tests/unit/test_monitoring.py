"""The chart's alerts and dashboard: the rules file checked and unit-tested by
Debian's promtool, every dashboard query valid PromQL, and both rendered by the
chart (off by default) from the files as they are.

tests/integration/test_monitoring.py runs them in a real Prometheus scraping
a real storage node and plugins.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart_render import CHART, KUBE_VERSION, objects, render, run_helm
from tests.prometheus_server import (
    ALERT_TESTS,
    DASHBOARD,
    RULES,
    PrometheusServer,
    alert_rules,
    as_prometheus_reads_it,
    dashboard_queries,
    fast_rules,
    run_promtool,
    seconds,
)

ALL_ON: dict[str, Any] = {
    "metrics": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "grafanaDashboard": {"enabled": True, "namespace": "grafana"},
    }
}
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
# Grafana's own variables a dashboard may use without defining them
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}


# ------------------------------------------------------------------ the rules


def test_promtool_checks_the_rules_file() -> None:
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    rules = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in result.stdout


def test_every_alert_fires_and_resolves_in_the_promtool_tests() -> None:
    result = run_promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_the_promtool_tests_read_the_rules_the_chart_ships() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    assert [(ALERT_TESTS.parent / f).resolve() for f in tests["rule_files"]] == [RULES.resolve()]


def test_the_integration_tests_rules_differ_from_the_charts_only_in_their_for(
    tmp_path: Path,
) -> None:
    fast = yaml.safe_load(fast_rules(tmp_path / "rules.yaml").read_text())
    source = yaml.safe_load(RULES.read_text())
    fors = []
    for doc in (fast, source):
        fors.append([r.pop("for", None) for g in doc["groups"] for r in g["rules"]])
    assert fast == source  # every group, every rule, with its for taken out
    assert [f and f"{max(1, seconds(f) // 60)}s" for f in fors[1]] == fors[0]


def _cases() -> dict[str, list[tuple[int, int, bool]]]:
    """By alert: (test group, evaluation time in seconds, fires) of every case."""
    cases: dict[str, list[tuple[int, int, bool]]] = {}
    for group, test in enumerate(yaml.safe_load(ALERT_TESTS.read_text())["tests"]):
        for case in test.get("alert_rule_test", []):
            fires = bool(case["exp_alerts"])
            cases.setdefault(case["alertname"], []).append(
                (group, seconds(case["eval_time"]), fires)
            )
    return cases


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_each_alert_has_a_case_where_it_fires_is_quiet_before_its_for_and_resolves(
    rule: dict[str, Any],
) -> None:
    cases = _cases().get(rule["alert"], [])
    firing = [(g, t) for g, t, fires in cases if fires]
    assert firing, f"{rule['alert']}: no promtool case where it fires"
    for group, at in firing:
        quiet_after = [t for g, t, fires in cases if g == group and not fires and t > at]
        assert quiet_after, f"{rule['alert']}: fires at {at}s and never resolves"
        if "for" in rule:
            # the quiet case before is inside the for: the condition already held
            quiet_before = [t for g, t, fires in cases if g == group and not fires and t < at]
            assert quiet_before, f"{rule['alert']}: no case before its for ({rule['for']}) ran out"
            assert at - max(quiet_before) <= seconds(rule["for"]), rule["alert"]


def test_every_alert_says_how_bad_and_what_it_means() -> None:
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        assert rule["alert"].startswith("Moorage"), rule["alert"]


# -------------------------------------------------------------- the dashboard


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    # promtool has no PromQL check of its own: each query as a recording rule
    queries = dashboard_queries()
    rules = [
        {"record": f"moorage:dashboard_query_{i}", "expr": as_prometheus_reads_it(expr)}
        for i, (_, expr) in enumerate(queries)
    ]
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    text = " ".join(expr for _, expr in dashboard_queries())
    for metric in (
        "moorage_capacity_bytes",  # pool
        "moorage_volumes",  # volumes
        "moorage_csi_volumes_abnormal",
        "moorage_nbd_read_bytes_total",  # NBD throughput
        "moorage_nbd_written_bytes_total",
        "moorage_nbd_requests_total",  # NBD IOPS
        "moorage_nbd_request_seconds_total",  # NBD latency
        "csi_plugin_operations_seconds_bucket",  # CSI operation latency
    ):
        assert metric in text, metric
    # per storage node: every storage-node query keeps (or selects by) its instance
    for title, expr in dashboard_queries():
        if "moorage_nbd_" in expr:
            assert "by (instance)" in expr or "sum" not in expr, title


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$\{?(\w+)", target["expr"]))
            assert used <= defined | GRAFANA_BUILTINS, f"{panel['title']}: {used - defined}"
    assert {"datasource", "instance"} <= defined


# ------------------------------------------------------------------ the chart


@pytest.fixture(scope="module")
def default(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return objects(render(None, tmp_path_factory.mktemp("default")))


@pytest.fixture(scope="module")
def all_on(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return objects(render(ALL_ON, tmp_path_factory.mktemp("monitoring")))


def test_the_chart_ships_no_monitoring_objects_by_default(default: list[dict[str, Any]]) -> None:
    assert not [o for o in default if o["kind"] in MONITORING_KINDS]
    assert not [
        o for o in default if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]
    ]


def test_the_prometheus_rule_is_the_rules_file(all_on: list[dict[str, Any]]) -> None:
    [rule] = [o for o in all_on if o["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["namespace"] == "moorage-system"


def test_the_dashboard_config_map_is_the_dashboard_file(all_on: list[dict[str, Any]]) -> None:
    [cm] = [o for o in all_on if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]]
    assert json.loads(cm["data"]["moorage.json"]) == json.loads(DASHBOARD.read_text())
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "grafana"


def _jobs_in_rules() -> set[str]:
    jobs: set[str] = set()
    for rule in alert_rules():
        for op, value in re.findall(r'\bjob(=~?)"([^"]*)"', rule["expr"]):
            jobs |= set(value.split("|")) if op == "=~" else {value}
    return jobs


def test_every_job_the_rules_select_is_one_a_monitor_sets(all_on: list[dict[str, Any]]) -> None:
    monitors = [o for o in all_on if o["kind"] in ("ServiceMonitor", "PodMonitor")]
    set_jobs = {}
    for m in monitors:
        for endpoint in m["spec"].get("endpoints", []) + m["spec"].get("podMetricsEndpoints", []):
            [job] = [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
            set_jobs[job] = (m, endpoint["port"])
    assert (
        _jobs_in_rules()
        == set(set_jobs)
        == {
            "moorage-storage-node",
            "moorage-csi-controller",
            "moorage-csi-node",
        }
    )
    # each monitor's port is a named port of the pods it selects, serving metrics
    for job, (monitor, port) in set_jobs.items():
        component = monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        if monitor["kind"] == "ServiceMonitor":
            [service] = [
                o
                for o in all_on
                if o["kind"] == "Service" and "storage-node" in o["metadata"]["name"]
            ]
            assert port in {p["name"] for p in service["spec"]["ports"]}, job
            continue
        [owner] = [
            o
            for o in all_on
            if o["kind"] in ("Deployment", "DaemonSet")
            and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
            == component
        ]
        [plugin] = [
            c for c in owner["spec"]["template"]["spec"]["containers"] if c["name"] == "moorage"
        ]
        [number] = [p["containerPort"] for p in plugin["ports"] if p["name"] == port]
        assert f"--metrics-address=0.0.0.0:{number}" in plugin["args"], job


def test_helm_lint_passes_with_monitoring_on(tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(ALL_ON))
    out = run_helm(
        "lint", str(CHART), "--kube-version", KUBE_VERSION, "--values", str(tmp_path / "v.yaml")
    )
    assert "0 chart(s) failed" in out, out


# ------------------------------------------ the integration test's Prometheus

# A stand-in for ``prometheus`` that never becomes ready: it does not listen
# (refused), or it listens and never answers (each poll's read times out).
_NEVER_READY = """
import socket, sys, time
if sys.argv[1] == "silent":
    addr = next(a for a in sys.argv if a.startswith("--web.listen-address="))
    host, port = addr.split("=", 1)[1].rsplit(":", 1)
    s = socket.socket()
    s.bind((host, int(port)))
    s.listen()
time.sleep(300)
"""


@pytest.mark.parametrize("mode", ["refused", "silent"])
def test_a_prometheus_that_never_gets_ready_is_stopped_by_start(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = tmp_path / "prometheus"
    stub.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "stub.py"} {mode} "$@"\n')
    stub.chmod(0o755)
    (tmp_path / "stub.py").write_text(_NEVER_READY)
    monkeypatch.setenv("MOORAGE_PROMETHEUS", str(stub))
    server = PrometheusServer(tmp_path / "p", jobs={})
    try:
        with pytest.raises(TimeoutError, match="not ready"):
            server.start(timeout=3)  # a silent one's poll times out after 2 s
        assert server.proc is not None
        assert server.proc.poll() is not None, "start() raised and left prometheus running"
    finally:
        server.stop()
