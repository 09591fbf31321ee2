"""The CSI plugin on the kernel paths: pytest run inside the guest.

The guest runs the plugin (``--mode all``: controller and node) against the
host's storage node, whose API it reaches over the lane's network with a
token (tests/kernel/conftest.py), and its node steps take the kernel paths
the probe picks there (kernel nbd through netlink, the kernel NFS client):

- the kubelet sequence of tests/integration/test_csi_node.py, every test of
  it but the one about the FUSE NFS mount (this guest mounts NFS with the
  kernel): global mount, two binds, write in one pod and read in the other,
  stats, read-only publish, expansion, ephemeral volumes, kill -9 of the
  plugin with volumes published, a simulated reboot and restage;
- csi-sanity's Node specs (the binary ``make tools`` builds, carried into the
  guest) for nbd+ext4, nbd+xfs, raw block and nfs;
- tests/kernel/inguest: what only a kernel allows (online ext4 growth on
  /dev/nbdN, the seed's ``mountOptions: [nfsvers=4.1]`` and NFSv3).

Each in-guest run's JUnit report comes back to the host: every test selected
there must have passed, none skipped.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from tests.conftest import REPO
from tests.csi_plugin import sanity_binary
from tests.kernel.conftest import GUEST_TOKEN, Store
from tests.kernel.guest import API_PORT, GUEST_IP, HOST_IP, Lane

PYTEST_TIMEOUT = 1500  # the whole in-guest run; each test has its own timeout below


def run_in_guest(guest: Lane, store: Store, name: str, *args: str) -> list[tuple[str, str]]:
    """pytest in the guest on ``args``; each test's (name, outcome)."""
    report = f"/tmp/{name}.xml"
    result = guest.run(
        str(REPO / ".venv/bin/python"), "-m", "pytest", "-o", "addopts=", "-p", "no:randomly",
        "-p", "no:cacheprovider", "-rA", "--timeout=600", f"--junitxml={report}", *args,
        timeout=PYTEST_TIMEOUT, check=False,
        env={
            "MOORAGE_IN_GUEST": "1",
            "MOORAGE_TEST_STORAGE_NODE": f"{HOST_IP}:{API_PORT}",
            "MOORAGE_TEST_STORAGE_TOKEN": GUEST_TOKEN,
            "MOORAGE_TEST_NODE_ADDRESS": GUEST_IP,
            "MOORAGE_CSI_SANITY": str(sanity_binary()),
        },
    )  # fmt: skip
    assert result.rc == 0, f"{result}\n--- storage node\n{store.node.log_tail()}"
    cases: list[tuple[str, str]] = []
    for case in ET.fromstring(guest.run("cat", report).stdout).iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        cases.append((case.get("name", ""), outcome))
    return cases


def _all_passed(cases: list[tuple[str, str]], least: int) -> None:
    assert len(cases) >= least, cases
    assert [c for c in cases if c[1] != "passed"] == [], cases


def test_the_kubelet_sequence_on_the_kernel_paths(guest: Lane, store: Store) -> None:
    cases = run_in_guest(
        guest, store, "csi-node",
        "tests/integration/test_csi_node.py",
        "--deselect",
        "tests/integration/test_csi_node.py::test_fuse_nfs_mount_refuses_flags_it_cannot_honour",
    )  # fmt: skip
    _all_passed(cases, 13)
    names = {name for name, _ in cases}
    assert "test_a_killed_plugin_leaves_pods_working_and_cleans_up_after_restart" in names
    assert "test_after_a_reboot_staging_again_brings_the_data_back" in names


def test_what_only_a_kernel_allows(guest: Lane, store: Store) -> None:
    cases = run_in_guest(guest, store, "kernel-paths", "tests/kernel/inguest")
    _all_passed(cases, 4)


def test_csi_sanity_node_specs_on_the_kernel_paths(guest: Lane, store: Store) -> None:
    # nbd-ext4, nbd-xfs, nbd-block and nfs: test_csi_sanity's own runs, each of which
    # checks that every Node spec passed
    cases = run_in_guest(
        guest, store, "sanity", "tests/integration/test_csi_sanity.py::test_csi_sanity_node_specs"
    )
    _all_passed(cases, 4)
