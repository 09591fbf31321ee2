"""deploy/host/install-deps.sh's policy-rc.d while it installs a package whose
service must not run (Debian's prometheus): the host's own policy-rc.d comes
back as it was, a symlink included, after a run that succeeds, fails or is
killed (the next run puts it right); a failure to keep the service from
starting at boot is reported.

The script runs as it is, as root, in a private mount namespace whose
/usr/sbin and /run are empty tmpfs, with apt-get, dpkg-query and systemctl
stubbed on PATH: nothing is installed, and the host's own /usr/sbin is never
seen or touched.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "deploy" / "host" / "install-deps.sh"
POLICY = "policy-rc.d"
HOST_POLICY = "#!/bin/sh\n# the host's own\nexit 0\n"

STUBS = {
    # the packages in $MISSING are not installed, every other one is
    "dpkg-query": """#!/bin/sh
for p; do :; done
case " $MISSING " in *" $p "*) exit 1 ;; esac
printf 'install ok installed'
""",
    # what policy-rc.d answers while the package installs; then as $APT_DOES says
    "apt-get": """#!/bin/sh
[ "$1" = update ] && exit 0
/usr/sbin/policy-rc.d prometheus start
echo "policy-rc.d answered $?" >> "$OUT/apt.log"
case "$APT_DOES" in
    kill) kill -9 "$PPID" ;;
    fail) exit 100 ;;
esac
""",
    "systemctl": """#!/bin/sh
[ -z "$DISABLE_FAILS" ] && exit 0
echo "Failed to disable unit: Access denied" >&2
exit 1
""",
}

# In the namespace: empty /usr/sbin and /run (systemd's directory in it, so
# the script disables the service with systemctl), the host's policy-rc.d as
# $HOST says (none, a file, a symlink to $OUT/target), then each run in turn
# with its environment; /usr/sbin copied out at the end.
DRIVER = """
set -u
mount -t tmpfs tmpfs /usr/sbin
mount -t tmpfs tmpfs /run
mkdir -p /run/systemd/system
case "$HOST" in
    file) printf '%s' "$HOST_POLICY" > /usr/sbin/policy-rc.d; chmod 0755 /usr/sbin/policy-rc.d ;;
    symlink) printf '%s' "$HOST_POLICY" > "$OUT/target"; chmod 0755 "$OUT/target"
             ln -s "$OUT/target" /usr/sbin/policy-rc.d ;;
esac
i=0
for run in $RUNS; do
    i=$((i + 1))
    env $(echo "$run" | tr ',' ' ') PATH="$OUT/bin:$PATH" timeout 60 bash "$SCRIPT" \
        > "$OUT/run$i.out" 2>&1
    echo $? > "$OUT/run$i.rc"
    mkdir "$OUT/sbin$i" && cp -a /usr/sbin/. "$OUT/sbin$i/"
done
"""


@dataclass
class Run:
    rc: int
    output: str
    sbin: Path  # /usr/sbin as this run left it


def install_deps(tmp_path: Path, host: str, *runs: str) -> list[Run]:
    """Run the script once per item of ``runs`` (VAR=value,VAR=value), the host's
    policy-rc.d being ``host`` (none, file, symlink)."""
    assert os.geteuid() == 0, "the script runs as root (in a namespace of its own)"
    out = tmp_path / "out"
    (out / "bin").mkdir(parents=True)
    for name, text in STUBS.items():
        (out / "bin" / name).write_text(text)
        (out / "bin" / name).chmod(0o755)
    env = {
        **os.environ,
        "OUT": str(out),
        "HOST": host,
        "HOST_POLICY": HOST_POLICY,
        "SCRIPT": str(SCRIPT),
        "RUNS": " ".join(runs),
    }
    subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", DRIVER],
        env=env,
        check=True,
        timeout=300,
    )
    return [
        Run(
            int((out / f"run{i}.rc").read_text()),
            (out / f"run{i}.out").read_text(),
            out / f"sbin{i}",
        )
        for i in range(1, len(runs) + 1)
    ]


def answers(tmp_path: Path) -> list[str]:
    return (tmp_path / "out" / "apt.log").read_text().splitlines()


def assert_host_policy_back(run: Run, host: str, tmp_path: Path) -> None:
    policy = run.sbin / POLICY
    assert sorted(p.name for p in run.sbin.iterdir()) == ([] if host == "none" else [POLICY])
    if host == "symlink":
        target = tmp_path / "out" / "target"
        assert policy.is_symlink() and os.readlink(policy) == str(target)
        assert target.read_text() == HOST_POLICY, "the policy-rc.d the link points to was written"
    elif host == "file":
        assert not policy.is_symlink() and policy.read_text() == HOST_POLICY


@pytest.mark.parametrize("host", ["none", "file", "symlink"])
def test_the_hosts_policy_is_back_after_an_install(tmp_path: Path, host: str) -> None:
    [run] = install_deps(tmp_path, host, "MISSING=prometheus")
    assert run.rc == 0, run.output
    assert answers(tmp_path) == ["policy-rc.d answered 101"]
    assert_host_policy_back(run, host, tmp_path)


@pytest.mark.parametrize("host", ["none", "symlink"])
def test_the_hosts_policy_is_back_after_a_failed_install(tmp_path: Path, host: str) -> None:
    [run] = install_deps(tmp_path, host, "MISSING=prometheus,APT_DOES=fail")
    assert run.rc != 0
    assert_host_policy_back(run, host, tmp_path)


@pytest.mark.parametrize("host", ["none", "file", "symlink"])
@pytest.mark.parametrize("then", ["still-missing", "installed"])
def test_the_next_run_puts_right_what_a_killed_run_left(
    tmp_path: Path, host: str, then: str
) -> None:
    missing = "prometheus" if then == "still-missing" else ""
    killed, next_run = install_deps(
        tmp_path, host, "MISSING=prometheus,APT_DOES=kill", f"MISSING={missing}"
    )
    assert killed.rc != 0
    # what a kill leaves: ours, which forbids every service start, and the host's aside
    left = killed.sbin / POLICY
    assert not left.is_symlink() and "exit 101" in left.read_text()
    assert os.path.lexists(killed.sbin / f"{POLICY}.install-deps-orig") == (host != "none")
    assert next_run.rc == 0, next_run.output
    assert_host_policy_back(next_run, host, tmp_path)
    if then == "still-missing":
        assert answers(tmp_path) == ["policy-rc.d answered 101"] * 2


def test_a_failure_to_disable_the_service_at_boot_is_reported(tmp_path: Path) -> None:
    [run] = install_deps(tmp_path, "none", "MISSING=prometheus,DISABLE_FAILS=1")
    assert run.rc == 0, run.output
    assert "warning: systemctl disable prometheus.service failed" in run.output
    assert "Access denied" in run.output
