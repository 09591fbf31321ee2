"""NodeGetInfo's ``max_volumes_per_node`` follows what the node holds and can
still attach (``csi.attach.limits``), over the plugin's socket.

A real storage node, the plugin in ``--mode all`` on the FUSE block path (a
FUSE block file behind a loop device per volume), and volumes staged and
unstaged through it: the count kubelet would publish in CSINode
(MutableCSINodeAllocatableCount) is read after each step.  The memory term is
the host's real /proc/meminfo, so a count that depends on it is checked
between two reads taken around the call.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from csi.attach import limits
from csi.proto import csi_pb2 as pb
from tests.csi_site import MIB, Mode, Mounted, Site, block_cap, made, open_site

# MiB budgeted per attachment: 1 TiB, more than this host has, so memory allows
# no further volume and the count is what the node holds (never below 1)
NO_ROOM = 1 << 20
ROOMY = 256  # MiB
CALL = 30  # seconds


def count(site: Site) -> int:
    info = site.nodes.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=CALL)
    return int(info.max_volumes_per_node)


def node_table(mib: int) -> str:
    return f"[node]\nfuse_attachment_mib = {mib}\n"


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    # the FUSE path's rule is the one under test, whatever this host's kernel has
    monkeypatch.setenv("MOORAGE_BLOCK_PATH", "fuse-loop")
    with open_site(tmp_path, node_table(NO_ROOM)) as opened:
        yield opened


@pytest.fixture
def volumes(site: Site) -> Iterator[list[Mounted]]:
    made_here: list[Mounted] = []
    yield made_here
    for m in made_here:  # whatever failed: nothing left staged or on the storage node
        m.teardown(site)


def new_volume(site: Site, volumes: list[Mounted]) -> Mounted:
    m = made(site, "nbd", block_cap(Mode.SINGLE_NODE_WRITER), 16 * MIB)
    volumes.append(m)
    return m


def unstage(site: Site, m: Mounted) -> None:
    site.nodes.NodeUnstageVolume(
        pb.NodeUnstageVolumeRequest(volume_id=m.vol.volume_id, staging_target_path=str(m.staging)),
        timeout=CALL,
    )


def test_the_count_follows_the_volumes_the_node_holds(site: Site, volumes: list[Mounted]) -> None:
    """With no memory to spare the count is what the node holds: each stage of a
    real FUSE-attached volume raises it, each unstage lowers it (1 at least)."""
    a, b = new_volume(site, volumes), new_volume(site, volumes)
    seen = [count(site)]
    a.stage(site)
    seen.append(count(site))
    b.stage(site)
    seen.append(count(site))
    unstage(site, a)
    seen.append(count(site))
    unstage(site, b)
    seen.append(count(site))
    assert seen == [1, 1, 2, 1, 1]


def available_mib() -> int:
    memory = limits.available_memory()
    assert memory is not None
    return memory >> 20


def test_the_count_follows_the_memory_budget(site: Site, volumes: list[Mounted]) -> None:
    """The same node held volume, and the plugin restarted with a budget that
    leaves room: the count is what it holds plus MemAvailable over the budget."""
    held = new_volume(site, volumes)
    held.stage(site)
    tight = count(site)
    config = site.plugin.config
    assert config is not None
    config.write_text(config.read_text().replace(node_table(NO_ROOM), node_table(ROOMY)))
    site.restart()
    before = available_mib()
    roomy = count(site)
    after = available_mib()
    low, high = sorted((before, after))
    assert tight == 1
    assert 1 + low // ROOMY <= roomy <= 1 + high // ROOMY, (before, roomy, after)
    assert roomy > 1, "this host has less than 256 MiB available"
    # the held volume counted once, from the record the restarted plugin found:
    # unstaged, the count is memory's alone
    unstage(site, held)
    before = available_mib()
    freed = count(site)
    after = available_mib()
    low, high = sorted((before, after))
    assert max(1, low // ROOMY) <= freed <= max(1, high // ROOMY), (before, freed, after)


def test_a_bad_budget_stops_the_plugin_before_it_serves(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="fuse_attachment_mib"),
        open_site(tmp_path, node_table(0)),
    ):
        pass
