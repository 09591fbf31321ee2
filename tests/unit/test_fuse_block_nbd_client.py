"""The block file's NBD client is a command-line choice (``--nbd-client``), checked
before anything is done: a bad value is a clear error, never a silent default."""

from __future__ import annotations

from pathlib import Path

import pytest

from fuse import blockdev, blockfile, nbdconnections


def test_a_bad_nbd_client_option_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        blockfile.main(["nbd://127.0.0.1:1/disk", str(tmp_path), "--nbd-client", "fast"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--nbd-client" in err and "'fast'" in err and "auto" in err and "libnbd" in err


def test_attach_refuses_a_bad_nbd_client_before_recording_anything(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nbd_client"):
        blockdev.attach_fuse_block("nbd://127.0.0.1:1/disk", tmp_path, nbd_client="fast")
    assert list(tmp_path.iterdir()) == []


def test_connect_refuses_an_unknown_client() -> None:
    with pytest.raises(ValueError, match="'fast'"):
        nbdconnections.connect("nbd://127.0.0.1:1/disk", "fast")
