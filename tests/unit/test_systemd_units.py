"""deploy/systemd: the storage node's units pass ``systemd-analyze verify``.

They are verified under a root of their own (the units in etc/systemd/system,
a copy of this host's unit directory for the targets they name, and the
``moorage`` entry point at /usr/local/bin where the install steps put it), so
nothing of the host's systemd configuration is read or touched.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

UNITS = sorted((REPO / "deploy" / "systemd").glob("*.service"))
HOST_UNITS = Path("/lib/systemd/system")


def verify_root(tmp_path: Path, units: list[Path]) -> Path:
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "usr/local/bin").mkdir(parents=True)
    (root / "lib/systemd").mkdir(parents=True)
    shutil.copytree(HOST_UNITS, root / "lib/systemd/system", symlinks=True)
    for unit in units:
        shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    entry = shutil.which("moorage") or str(REPO / ".venv/bin/moorage")
    shutil.copy(entry, root / "usr/local/bin/moorage")
    return root


def verify(root: Path, names: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", *names],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_units_verify_clean(tmp_path: Path) -> None:
    assert [u.name for u in UNITS] == ["moorage-backend.service", "moorage-pool.service"]
    result = verify(verify_root(tmp_path, UNITS), [u.name for u in UNITS])
    complaints = [line for line in result.stderr.splitlines() if "moorage" in line]
    assert result.returncode == 0 and not complaints, result.stderr


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (("ProtectClock=yes", "ProtectClok=yes"), "Unknown key"),
        (("/usr/local/bin/moorage backend serve", "/usr/local/bin/nowhere serve"), "nowhere"),
    ],
)
def test_verify_catches_a_broken_unit(
    tmp_path: Path, change: tuple[str, str], complaint: str
) -> None:
    broken = tmp_path / "moorage-backend.service"
    text = (REPO / "deploy/systemd/moorage-backend.service").read_text()
    assert change[0] in text
    broken.write_text(text.replace(change[0], change[1]))
    result = verify(verify_root(tmp_path, [broken]), [broken.name])
    assert complaint in result.stderr, result.stderr
