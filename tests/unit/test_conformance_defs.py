"""The External Storage suite's inputs (tests/conformance) and how its report is read."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from moorage_dev.devcluster import conformance

REPO = Path(__file__).resolve().parents[2]
VALUES = yaml.safe_load((REPO / "deploy/helm/moorage/values.yaml").read_text())
# every capability the suite knows (test/e2e/storage/framework/testdriver.go, v1.34)
SUITE_CAPABILITIES = {
    "persistence", "block", "fsGroup", "volumeMountGroup", "exec", "snapshotDataSource",
    "groupSnapshot", "pvcDataSource", "multipods", "RWX", "controllerExpansion",
    "nodeExpansion", "offlineExpansion", "onlineExpansion", "volumeLimits",
    "singleNodeVolume", "topology", "capacity", "FSResizeFromSourceNotSupported",
    "readWriteOncePod", "multiplePVsSameID", "capReadOnlyMany",
}  # fmt: skip


@pytest.mark.parametrize("which", sorted(conformance.CLASSES))
def test_each_definition_tests_a_class_the_chart_installs(which: str) -> None:
    text = conformance.driver_definition(which).read_text()
    definition = yaml.safe_load(text)
    chart_classes = {c["name"] for c in VALUES["storageClasses"].values() if isinstance(c, dict)}
    assert definition["StorageClass"]["FromExistingClassName"] in chart_classes
    assert definition["StorageClass"]["FromExistingClassName"] == conformance.CLASSES[which]
    assert (
        definition["SnapshotClass"]["FromExistingClassName"]
        == VALUES["volumeSnapshotClass"]["name"]
    )
    assert definition["DriverInfo"]["Name"] == "csi.moorage.dev"
    vac = yaml.safe_load((REPO / definition["VolumeAttributesClass"]["FromFile"]).read_text())
    assert vac["driverName"] == "csi.moorage.dev"
    capabilities = definition["DriverInfo"]["Capabilities"]
    assert set(capabilities) <= SUITE_CAPABILITIES, set(capabilities) - SUITE_CAPABILITIES
    # a capability left out or false says why, on the line before it
    lines = text.splitlines()
    for name, claimed in capabilities.items():
        if claimed:
            continue
        (at,) = [i for i, line in enumerate(lines) if line.strip().startswith(f"{name}:")]
        assert lines[at - 1].strip().startswith("#"), f"{which}: {name} false without a reason"


def test_the_report_counts_specs_not_suite_nodes(tmp_path: Path) -> None:
    report = tmp_path / "junit_01.xml"
    report.write_text(
        """<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="5"><testsuite name="Kubernetes e2e suite" tests="5">
  <testcase name="[ReportBeforeSuite]" status="passed"></testcase>
  <testcase name="[SynchronizedBeforeSuite]" status="passed"></testcase>
  <testcase name="[It] External Storage a" status="passed"></testcase>
  <testcase name="[It] External Storage b" status="failed"><failure>x</failure></testcase>
  <testcase name="[It] External Storage c" status="skipped"><skipped/></testcase>
  <testcase name="[SynchronizedAfterSuite]" status="failed"><failure>y</failure></testcase>
  <testcase name="[ReportAfterSuite] Kubernetes e2e suite report" status="passed"></testcase>
</testsuite></testsuites>
"""
    )
    counts = conformance.read_junit(report)
    assert (counts.passed, counts.failed, counts.skipped) == (1, 2, 1)
    assert counts.failures == ["[It] External Storage b", "[SynchronizedAfterSuite]"]


def test_a_hung_suite_is_killed_with_its_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ginkgo's parallel processes included: nothing of a run past GINKGO_WAIT survives it."""
    monkeypatch.setattr(conformance, "GINKGO_WAIT", 1.0)
    pidfile = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {pidfile}; wait"
    with (tmp_path / "log").open("wb") as log, pytest.raises(RuntimeError, match="still running"):
        conformance._run_ginkgo(["sh", "-c", script], log)
    child = int(pidfile.read_text())
    # the killed child is reaped by init; until then it may linger as a zombie
    for _ in range(100):
        try:
            state = Path(f"/proc/{child}/stat").read_text().split()[2]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"pid {child} still running after the bound")


def test_a_finished_suite_gives_its_exit_status(tmp_path: Path) -> None:
    with (tmp_path / "log").open("wb") as log:
        assert conformance._run_ginkgo(["sh", "-c", "echo out; exit 3"], log) == 3
    assert (tmp_path / "log").read_text() == "out\n"
