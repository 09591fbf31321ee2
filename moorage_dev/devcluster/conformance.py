"""Kubernetes' External Storage suite against the chart's classes (``make conformance``).

``e2e.test`` (built from the cluster's Kubernetes release) runs the storage
test suites Kubernetes judges a CSI driver by, once per driver definition in
``tests/conformance/`` (one per chart class), under ginkgo with parallel
processes, from the control plane's network namespace with the admin
kubeconfig.  The suite's pods run images built on this machine
(deploy/e2e/build-suite-images.sh), imported into every node first.  The
second node takes the suite's pods too: its taint is lifted for the run and
put back after it.  Each run leaves its JUnit report and ginkgo's output under
the cluster's directory; the counts per class are printed and returned.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from moorage_dev.devcluster import node as nodes
from moorage_dev.devcluster.cluster import SECOND_NODE_TAINT
from moorage_dev.devcluster.kube import Kube
from moorage_dev.devcluster.layout import CONTROL_NS, Layout

REPO = Path(__file__).resolve().parents[2]
DRIVERS = REPO / "tests" / "conformance"
# the classes the chart installs, by the driver definition that tests each
CLASSES = {"block": "moorage-block-xfs", "nfs": "moorage-nfs"}
FOCUS = r"External.Storage"
# the suite's own marks for what a shared cluster should not run, and what is
# known to be unreliable upstream
SKIP = r"\[Disruptive\]|\[Serial\]|\[Slow\]|\[Flaky\]"
# ginkgo's bound for one class's whole run
SUITE_TIMEOUT = "90m"
# ginkgo stops its suite at SUITE_TIMEOUT; should it not, the whole process group goes here
GINKGO_WAIT = 95 * 60.0


@dataclass(frozen=True)
class Suite:
    """Where ``make conformance-tools`` put e2e.test, ginkgo and the suite's images."""

    bin: Path
    images: Path

    @classmethod
    def from_env(cls) -> Suite:
        names = {"bin": "MOORAGE_CONFORMANCE_BIN", "images": "MOORAGE_SUITE_IMAGES"}
        missing = [v for v in names.values() if not os.environ.get(v)]
        if missing:
            raise LookupError(
                "not set: " + ", ".join(missing) + " (run through make: `make conformance`)"
            )
        suite = cls(**{k: Path(os.environ[v]) for k, v in names.items()})
        absent = [
            str(p)
            for p in (suite.bin / "e2e.test", suite.bin / "ginkgo", suite.images / "images.txt")
            if not p.exists()
        ]
        if absent:
            raise LookupError("not built: " + ", ".join(absent) + " (make conformance-tools)")
        return suite

    def archives(self) -> list[Path]:
        """The image archives images.txt lists (ROLE REFERENCE ARCHIVE a line)."""
        lines = (self.images / "images.txt").read_text().splitlines()
        return [self.images / line.split()[2] for line in lines if line.strip()]


@dataclass
class Counts:
    """One class's result, from its JUnit report."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)


def read_junit(path: Path) -> Counts:
    """Pass, fail and skip counts of the specs (``[It] ...``) in a ginkgo JUnit
    report; a suite node (``[SynchronizedBeforeSuite]`` and the like) counts
    only when it failed, as a failure."""
    counts = Counts()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        failed = case.find("failure") is not None or case.find("error") is not None
        if failed:
            counts.failed += 1
            counts.failures.append(name)
        elif not name.startswith("[It]"):
            continue
        elif case.find("skipped") is not None:
            counts.skipped += 1
        else:
            counts.passed += 1
    return counts


def driver_definition(which: str) -> Path:
    if which not in CLASSES:
        raise ValueError(f"no class {which!r}; the chart's: {', '.join(CLASSES)}")
    return DRIVERS / f"{CLASSES[which]}.yaml"


def ginkgo_argv(
    layout: Layout, suite: Suite, which: str, report_dir: Path, procs: int, focus: str, skip: str
) -> list[str]:
    """ginkgo running e2e.test for one class, in the control plane's network namespace."""
    return [
        "nsenter", f"--net=/run/netns/{CONTROL_NS}", "--",
        str(suite.bin / "ginkgo"), f"--procs={procs}", "--no-color", "--timeout", SUITE_TIMEOUT,
        f"--focus={focus}", f"--skip={skip}",
        str(suite.bin / "e2e.test"), "--",
        f"--kubeconfig={layout.admin_kubeconfig}",
        "--provider=skeleton",
        f"--repo-root={REPO}",
        f"--storage.testdriver={driver_definition(which)}",
        f"--report-dir={report_dir}",
        # the suite's pods come from images imported into the nodes beforehand
        "--prepull-images=false",
    ]  # fmt: skip


def _run_ginkgo(argv: list[str], log: BinaryIO) -> int:
    """Run ginkgo (and its parallel processes) to its end; its exit status.

    Bounded by GINKGO_WAIT: past it the whole process group is killed and
    the run is reported as failed (a hung suite must not hang the make target).
    """
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=GINKGO_WAIT)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        limit = f"{GINKGO_WAIT / 60:g} minutes"
        raise RuntimeError(f"ginkgo still running after {limit}: killed") from None
    except BaseException:
        _kill_group(proc)
        raise


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _taint(kube: Kube, node: str, on: bool) -> None:
    if on:
        kube("taint", "node", node, f"{SECOND_NODE_TAINT}:NoSchedule", "--overwrite")
    else:
        key = SECOND_NODE_TAINT.split("=", 1)[0]
        kube("taint", "node", node, f"{key}:NoSchedule-")


def run(
    layout: Layout,
    kube: Kube,
    suite: Suite,
    classes: Sequence[str],
    procs: int,
    focus: str = FOCUS,
    skip: str = SKIP,
    report: Callable[[str], None] = print,
) -> dict[str, Counts]:
    """The suite once per class; its counts by class."""
    archives = suite.archives()
    for node in layout.nodes:
        nodes.import_images(node, archives)
    report(f"suite images imported on {', '.join(n.name for n in layout.nodes)}")
    later = [n.name for n in layout.nodes[1:]]
    results: dict[str, Counts] = {}
    for name in later:
        _taint(kube, name, on=False)
    try:
        for which in classes:
            report_dir = layout.root / "conformance" / which
            shutil.rmtree(report_dir, ignore_errors=True)
            report_dir.mkdir(parents=True)
            argv = ginkgo_argv(layout, suite, which, report_dir, procs, focus, skip)
            started = time.monotonic()
            report(
                f"{which} ({CLASSES[which]}): ginkgo --procs={procs}, log {report_dir}/ginkgo.log"
            )
            with (report_dir / "ginkgo.log").open("wb") as log:
                returncode = _run_ginkgo(argv, log)
            minutes = (time.monotonic() - started) / 60
            junit = sorted(report_dir.glob("junit*.xml"))
            if not junit:
                raise RuntimeError(
                    f"{which}: ginkgo exited {returncode} without a JUnit report "
                    f"(see {report_dir}/ginkgo.log)"
                )
            counts = read_junit(junit[0])
            results[which] = counts
            report(
                f"{which} ({CLASSES[which]}): {counts.passed} passed, {counts.failed} failed, "
                f"{counts.skipped} skipped, in {minutes:.1f} min"
            )
            for name in counts.failures:
                report(f"  FAILED {name}")
    finally:
        for name in later:
            _taint(kube, name, on=True)
    return results
