"""Ganesha's configuration on disk: the main file and one file per export.

Layout under ``conf_dir``::

    ganesha.conf                 core parameters, then %dir "<conf_dir>/exports.d/*.conf"
    exports.d/export-<id>.conf   one EXPORT block each

ganesha 4.3's ``%dir`` includes every regular file whose name matches the
pattern, so a file is written to ``.export-<id>.conf.<random>.tmp`` (which
does not match ``*.conf``) in the same directory, fsynced, then renamed over
its final name (``hostio.atomicfile``): a SIGHUP at any moment sees either the
old file or the new one, whole.
The catalog is the source of truth; :meth:`GaneshaFiles.sync` rebuilds the
directory from it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from backend.api.errors import FailedPrecondition, InvalidArgument
from backend.ganesha.config import (
    MAX_EXPORT_ID,
    CoreConfig,
    ExportConfig,
    render_export,
    render_main,
    safe_path,
)
from hostio.atomicfile import fsync_directory, unlink_durably, write_atomically

MAIN_FILE: Final = "ganesha.conf"
EXPORT_DIR: Final = "exports.d"
_EXPORT_FILE = re.compile(r"export-([1-9][0-9]{0,4})\.conf")
_TEMP_SUFFIX: Final = ".tmp"


def _export_id(name: str) -> int | None:
    """The id in an ``export-<id>.conf`` file name, or None for any other name."""
    match = _EXPORT_FILE.fullmatch(name)
    if match is None or int(match.group(1)) > MAX_EXPORT_ID:
        return None
    return int(match.group(1))


def _write_atomically(path: Path, text: str) -> None:
    """A dot-named temp file beside ``path`` (``.NAME.*.tmp``), fsync, rename, fsync the dir."""
    write_atomically(path, text.encode("ascii"), mode=0o644)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        return None


class GaneshaFiles:
    """The main file and the per-export files under one configuration directory."""

    def __init__(self, conf_dir: Path) -> None:
        # conf_dir ends up in the %dir line of the main file: same allowlist.
        self.conf_dir = safe_path(conf_dir, "ganesha configuration directory")

    @property
    def main_file(self) -> Path:
        return self.conf_dir / MAIN_FILE

    @property
    def export_dir(self) -> Path:
        return self.conf_dir / EXPORT_DIR

    def export_file(self, export_id: int) -> Path:
        if type(export_id) is not int or not 1 <= export_id <= MAX_EXPORT_ID:
            raise InvalidArgument(f"export_id must be between 1 and {MAX_EXPORT_ID}")
        return self.export_dir / f"export-{export_id}.conf"

    def write_main(self, core: CoreConfig) -> bool:
        """Write ``ganesha.conf`` and create ``exports.d/`` and the recovery root.

        Returns whether the main file changed (a change to the core
        parameters needs a restart of ganesha; SIGHUP reloads exports only).
        """
        self.export_dir.mkdir(parents=True, exist_ok=True)
        # ganesha creates only the last level of RecoveryRoot itself.
        core.recovery_root.mkdir(parents=True, exist_ok=True)
        text = render_main(core, self.export_dir)
        if _read_text(self.main_file) == text:
            return False
        _write_atomically(self.main_file, text)
        return True

    def write_export(self, export: ExportConfig) -> bool:
        """Write ``exports.d/export-<id>.conf``; returns whether it changed."""
        path = self.export_file(export.export_id)
        text = render_export(export)
        if _read_text(path) == text:
            return False
        try:
            _write_atomically(path, text)
        except FileNotFoundError as e:
            raise FailedPrecondition(
                f"{self.export_dir} does not exist; write the main file first"
            ) from e
        return True

    def remove_export(self, export_id: int) -> bool:
        """Remove ``exports.d/export-<id>.conf``; returns whether it existed."""
        return unlink_durably(self.export_file(export_id), missing_ok=True)

    def read_export_ids(self) -> list[int]:
        """The ids of the export files present, sorted."""
        return sorted(i for i in map(_export_id, self._names()) if i is not None)

    def sync(self, exports: Iterable[ExportConfig]) -> list[str]:
        """Make ``exports.d/`` hold exactly ``exports``; return what was repaired.

        Writes missing or different files, removes stale ones, and removes any
        other ``*.conf`` (ganesha would include it) and leftover temp files.
        """
        wanted: dict[int, ExportConfig] = {}
        pseudos: dict[str, int] = {}
        for export in exports:
            if export.export_id in wanted:
                raise InvalidArgument(f"export id {export.export_id} listed twice")
            if export.pseudo in pseudos:
                raise InvalidArgument(
                    f"exports {pseudos[export.pseudo]} and {export.export_id} "
                    f"share the pseudo path {export.pseudo}"
                )
            wanted[export.export_id] = export
            pseudos[export.pseudo] = export.export_id

        self.export_dir.mkdir(parents=True, exist_ok=True)
        repairs: list[str] = []
        present = set(self.read_export_ids())
        for export_id in sorted(present - wanted.keys()):
            self.remove_export(export_id)
            repairs.append(f"removed stale ganesha export file for export {export_id}")
        for export_id in sorted(wanted):
            if self.write_export(wanted[export_id]):
                verb = "rewrote differing" if export_id in present else "wrote missing"
                repairs.append(f"{verb} ganesha export file for export {export_id}")
        for name in self._names():
            path = self.export_dir / name
            if not name.endswith((".conf", _TEMP_SUFFIX)) or _export_id(name) is not None:
                continue
            # ganesha reads regular files only, so only those can break it
            if path.is_file() and not path.is_symlink():
                path.unlink()
                repairs.append(f"removed unexpected file {path}")
        if repairs:
            fsync_directory(self.export_dir)
        return repairs

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.export_dir))
        except FileNotFoundError:
            return []
        except NotADirectoryError as e:
            raise FailedPrecondition(f"{self.export_dir} is not a directory") from e
