"""Ganesha's files on disk: one file per export, atomic writes, sync from the catalog."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from backend.api.errors import FailedPrecondition, InvalidArgument
from backend.ganesha.config import CoreConfig, ExportConfig, render_export, render_main
from backend.ganesha.files import GaneshaFiles


def export(export_id: int, *clients: str, access: str = "RW") -> ExportConfig:
    return ExportConfig(
        export_id=export_id,
        path=Path(f"/srv/pool/mnt/v{export_id}/export"),
        pseudo=f"/volumes/v{export_id}",
        clients=clients,
        access=access,  # type: ignore[arg-type]
    )


@pytest.fixture
def files(tmp_path: Path) -> GaneshaFiles:
    f = GaneshaFiles(tmp_path / "ganesha")
    f.write_main(CoreConfig(nfs_port=2049, recovery_root=tmp_path / "state" / "recovery"))
    return f


def test_main_file_points_its_dir_include_at_the_export_directory(tmp_path: Path) -> None:
    core = CoreConfig(nfs_port=2049, recovery_root=tmp_path / "state" / "recovery")
    files = GaneshaFiles(tmp_path / "ganesha")
    assert files.write_main(core) is True
    assert files.main_file.read_text() == render_main(core, tmp_path / "ganesha" / "exports.d")
    assert files.export_dir.is_dir()
    # ganesha creates only the last level of RecoveryRoot itself
    assert (tmp_path / "state" / "recovery").is_dir()
    assert files.write_main(core) is False


def test_configuration_directory_must_be_renderable() -> None:
    with pytest.raises(InvalidArgument):
        GaneshaFiles(Path("/tmp/with space/ganesha"))
    with pytest.raises(InvalidArgument):
        GaneshaFiles(Path("relative"))


def test_export_is_written_to_its_own_file_and_nothing_else_is_left(files: GaneshaFiles) -> None:
    assert files.write_export(export(3, "10.0.0.1")) is True
    assert sorted(os.listdir(files.export_dir)) == ["export-3.conf"]
    assert (files.export_dir / "export-3.conf").read_text() == render_export(export(3, "10.0.0.1"))
    assert files.write_export(export(3, "10.0.0.1")) is False
    assert files.write_export(export(3, "10.0.0.2")) is True
    assert "10.0.0.2" in (files.export_dir / "export-3.conf").read_text()
    assert files.read_export_ids() == [3]


def test_export_file_is_replaced_by_rename_of_a_temp_name_ganesha_does_not_read(
    files: GaneshaFiles,
) -> None:
    files.write_export(export(4, "10.0.0.1"))
    seen: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        seen.append((Path(src).name, Path(dst).name))
        # the old file is still whole while the new one is being prepared
        assert "10.0.0.1" in Path(dst).read_text()
        real_replace(src, dst)

    with mock.patch("backend.ganesha.files.os.replace", spy):
        files.write_export(export(4, "10.0.0.9"))
    [(temp, final)] = seen
    assert final == "export-4.conf"
    assert temp.startswith(".export-4.conf.") and temp.endswith(".tmp"), temp
    assert not temp.endswith(".conf")  # %dir reads only *.conf


def test_failed_write_leaves_the_old_file_and_no_temp(files: GaneshaFiles) -> None:
    files.write_export(export(5, "10.0.0.1"))
    with (
        mock.patch("backend.ganesha.files.os.fsync", side_effect=OSError(5, "EIO")),
        pytest.raises(OSError),
    ):
        files.write_export(export(5, "10.0.0.2"))
    assert sorted(os.listdir(files.export_dir)) == ["export-5.conf"]
    assert "10.0.0.1" in (files.export_dir / "export-5.conf").read_text()


def test_remove_export_reports_whether_it_existed(files: GaneshaFiles) -> None:
    files.write_export(export(6))
    assert files.remove_export(6) is True
    assert files.remove_export(6) is False
    assert files.read_export_ids() == []


@pytest.mark.parametrize("bad", [0, 65535, -1])
def test_export_file_ids_are_range_checked(files: GaneshaFiles, bad: int) -> None:
    with pytest.raises(InvalidArgument):
        files.remove_export(bad)


def test_write_export_before_main_is_a_failed_precondition(tmp_path: Path) -> None:
    with pytest.raises(FailedPrecondition):
        GaneshaFiles(tmp_path / "nothing").write_export(export(1))


def test_sync_repairs_the_directory_to_exactly_the_catalog(files: GaneshaFiles) -> None:
    d = files.export_dir
    files.write_export(export(1, "10.0.0.1"))  # stays as is
    files.write_export(export(2, "10.0.0.1"))  # differs from the catalog
    files.write_export(export(9, "10.0.0.1"))  # not in the catalog any more
    (d / "export-0.conf").write_text("EXPORT { Export_Id = 0; }\n")
    (d / "operator.conf").write_text("EXPORT {\n")
    (d / ".export-7.conf.tmp").write_text("EXPORT { half written")
    (d / "README").write_text("not ganesha's business\n")
    (d / "subdir.conf").mkdir()

    repairs = files.sync([export(1, "10.0.0.1"), export(2, "10.0.0.2"), export(3)])

    assert repairs == [
        "removed stale ganesha export file for export 9",
        "rewrote differing ganesha export file for export 2",
        "wrote missing ganesha export file for export 3",
        f"removed unexpected file {d / '.export-7.conf.tmp'}",
        f"removed unexpected file {d / 'export-0.conf'}",
        f"removed unexpected file {d / 'operator.conf'}",
    ]
    assert files.read_export_ids() == [1, 2, 3]
    assert sorted(os.listdir(d)) == [
        "README",
        "export-1.conf",
        "export-2.conf",
        "export-3.conf",
        "subdir.conf",
    ]
    assert (d / "export-2.conf").read_text() == render_export(export(2, "10.0.0.2"))
    assert files.sync([export(1, "10.0.0.1"), export(2, "10.0.0.2"), export(3)]) == []


def test_sync_to_nothing_empties_the_directory(files: GaneshaFiles) -> None:
    files.write_export(export(1))
    assert files.sync([]) == ["removed stale ganesha export file for export 1"]
    assert files.read_export_ids() == []


def test_sync_refuses_duplicate_ids_and_pseudo_paths(files: GaneshaFiles) -> None:
    with pytest.raises(InvalidArgument):
        files.sync([export(1), export(1)])
    twin = ExportConfig(export_id=2, path=Path("/srv/other"), pseudo="/volumes/v1")
    with pytest.raises(InvalidArgument):
        files.sync([export(1), twin])
    assert files.read_export_ids() == []
