"""A home for the FUSE processes outside the cgroups of whoever started them.

In Kubernetes the node plugin runs in a container, and restarting the
container kills every process in its cgroups.  A FUSE block file or FUSE
NFS mount that dies breaks every pod using it, so with
``MOORAGE_FUSE_CGROUP=NAME`` in its environment the starter moves each FUSE
process, right after starting it, into the cgroup ``NAME`` at the top of
every cgroup hierarchy it can see (``/sys/fs/cgroup/<controller>/NAME`` on
cgroup v1, ``/sys/fs/cgroup/NAME`` on v2): out of the container's cgroups,
where a container restart does not reach.  The node DaemonSet runs the
plugin privileged with the host's PID namespace, so nothing else ties the
processes to the container.  Unset, the processes stay where they started
(their own session, which is enough outside containers).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Final

log = logging.getLogger("moorage.fuse")

ENV: Final = "MOORAGE_FUSE_CGROUP"
CGROUP_ROOT = Path("/sys/fs/cgroup")  # module level so tests can point elsewhere
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class CgroupError(ValueError):
    """The configured cgroup name is not one."""


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise CgroupError(f"{ENV}={name[:80]!r} is not a cgroup name ([A-Za-z0-9_.-], 64 at most)")
    return name


def hierarchies(root: Path | None = None) -> list[Path]:
    """The root of every cgroup hierarchy mounted under ``root``."""
    root = root or CGROUP_ROOT
    if (root / "cgroup.procs").exists():  # cgroup v2 alone
        return [root]
    try:
        return sorted(p for p in root.iterdir() if (p / "cgroup.procs").exists())
    except OSError:
        return []


def _prepare(directory: Path) -> None:
    directory.mkdir(exist_ok=True)
    # cgroup v1 cpuset takes no task until it has CPUs and memory nodes
    for knob in ("cpuset.cpus", "cpuset.mems"):
        mine = directory / knob
        if mine.exists() and not mine.read_text().strip():
            mine.write_text((directory.parent / knob).read_text())


def adopt(pid: int, name: str | None = None) -> list[Path]:
    """Move ``pid`` into the cgroup ``name`` (default: ``$MOORAGE_FUSE_CGROUP``) of
    every hierarchy; the cgroups it joined.  Unset: nothing is done."""
    name = name if name is not None else os.environ.get(ENV, "")
    if not name:
        return []
    try:
        check_name(name)
    except CgroupError as e:  # checked at the plugin's start; never leave a process half-made
        log.error("FUSE process %d stays where it is: %s", pid, e)
        return []
    joined = []
    for hierarchy in hierarchies():
        directory = hierarchy / name
        try:
            _prepare(directory)
            (directory / "cgroup.procs").write_text(f"{pid}\n")
        except OSError as e:
            log.warning("could not move FUSE process %d into %s: %s", pid, directory, e)
            continue
        joined.append(directory)
    if joined:
        log.info("FUSE process %d moved into cgroup %s (%d hierarchies)", pid, name, len(joined))
    return joined
