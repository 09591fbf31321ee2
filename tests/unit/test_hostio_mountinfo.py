"""hostio.mountinfo: the kernel's mount table as it writes it, escapes and all.

The lines are written as the kernel writes them (proc(5)): fields separated
by single spaces, a space, tab, newline or backslash in a field as an octal
escape, every other byte (UTF-8 or not) as it is.
"""

from __future__ import annotations

import logging
import os

import pytest

from hostio.mountinfo import parse_mountinfo, read_mountinfo, topmost, unescape


def test_a_space_tab_newline_and_backslash_in_a_path_are_decoded() -> None:
    data = (
        rb"30 1 7:3 / /mnt/with\040space rw,relatime shared:1 - ext4 /dev/loop3 rw"
        b"\n"
        rb"31 1 0:50 / /mnt/tab\011here rw - nfs4 srv:/export\040dir rw"
        b"\n"
        rb"32 1 0:51 /sub\134dir /mnt/back\134slash\012newline rw - tmpfs tmpfs rw"
        b"\n"
    )
    entries = parse_mountinfo(data)
    assert [e.mount_point for e in entries] == [
        "/mnt/with space",
        "/mnt/tab\there",
        "/mnt/back\\slash\nnewline",
    ]
    assert entries[1].source == "srv:/export dir" and entries[1].fstype == "nfs4"
    assert entries[2].root == "/sub\\dir"
    assert (entries[0].major, entries[0].minor) == (7, 3)


def test_every_octal_escape_is_decoded_not_only_the_space() -> None:
    # the old fuse/loop.py copy undid \040 alone; an escape is \ and three octal digits
    assert unescape(rb"/a\043b\040c\134d") == "/a#b c\\d"
    assert unescape(rb"/no\escape\08") == "/no\\escape\\08"  # not three octal digits: kept


def test_a_utf8_mount_point_is_text_as_os_gives_it() -> None:
    # the old fuse/process.py copy ran "unicode_escape" over the line and got "/mnt/cafÃ©"
    data = "40 1 0:5 / /mnt/café rw - tmpfs tmpfs rw\n".encode()
    (entry,) = parse_mountinfo(data)
    assert entry.mount_point == "/mnt/café"
    assert os.fsencode(entry.mount_point) == "/mnt/café".encode()


def test_a_mount_point_that_is_not_utf8_keeps_its_bytes() -> None:
    (entry,) = parse_mountinfo(b"40 1 0:5 / /mnt/caf\xe9\\040x rw - tmpfs tmpfs rw\n")
    assert os.fsencode(entry.mount_point) == b"/mnt/caf\xe9 x"
    assert entry.mount_point == os.fsdecode(b"/mnt/caf\xe9 x")  # equal to os.listdir's name


def test_a_carriage_return_in_a_path_does_not_end_the_line() -> None:
    # the kernel escapes \n only; bytes.splitlines() would also split at \r
    entries = parse_mountinfo(b"40 1 0:5 / /mnt/a\rb rw - tmpfs tmpfs rw\n")
    assert [e.mount_point for e in entries] == ["/mnt/a\rb"]


def test_malformed_lines_are_skipped_and_logged_and_the_rest_is_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the old backend/mounts.py copy raised on the first of these
    bad = [
        b"garbage",
        b"1 2 3",
        b"41 1 0:5 / /no/separator rw shared:1 tmpfs tmpfs rw",
        b"42 1 0:5 / /nothing/after rw -",
        b"x 1 0:5 / /not/a/number rw - tmpfs tmpfs rw",
        b"43 1 05 / /no/colon rw - tmpfs tmpfs rw",
        b"44 1 +0:5 / /signed rw - tmpfs tmpfs rw",
    ]
    good = b"45 1 0:5 / /kept rw - tmpfs none rw"
    with caplog.at_level(logging.WARNING, logger="moorage.hostio"):
        entries = parse_mountinfo(b"\n".join([*bad[:3], good, *bad[3:]]) + b"\n", "test table")
    assert [e.mount_point for e in entries] == ["/kept"]
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == len(bad)
    assert all(m.startswith("test table line ") and "skipped" in m for m in skipped)


def test_optional_fields_the_separator_and_super_options() -> None:
    data = (
        b"50 1 0:5 / /none rw - tmpfs tmpfs rw,size=10k\n"
        b"51 1 0:5 / /two rw,nosuid shared:3 master:2 - ext4 /dev/sda1 ro,errors=continue\n"
        b"52 1 0:5 / /old rw - ext4 /dev/sda2\n"  # super options missing: old kernels
        b"53 1 0:5 / /empty rw - tmpfs  rw\n"  # an empty source (a mount(2) with "")
    )
    none, two, old, empty = parse_mountinfo(data)
    assert none.optional_fields == () and none.super_options == ("rw", "size=10k")
    assert two.optional_fields == ("shared:3", "master:2")
    assert (two.peer_group, two.master, none.peer_group) == (3, 2, None)
    assert two.mount_options == ("rw", "nosuid") and two.read_only  # the superblock's ro
    assert old.super_options == () and old.source == "/dev/sda2"
    assert (empty.fstype, empty.source, empty.super_options) == ("tmpfs", "", ("rw",))


def test_the_topmost_mount_on_a_point_is_the_last_one() -> None:
    entries = parse_mountinfo(
        b"60 1 7:1 / /m rw - ext4 /dev/loop1 rw\n"
        b"61 1 0:9 / /m/sub rw - tmpfs tmpfs rw\n"
        b"62 60 7:2 / /m rw - xfs /dev/loop2 rw\n"
    )
    found = topmost(entries, "/m")
    assert found is not None and found.source == "/dev/loop2"
    assert topmost(entries, "/m/") is None  # exact mount points only


def test_this_process_and_a_pid_read_the_same_live_table() -> None:
    mine = read_mountinfo()
    assert any(e.mount_point == "/" for e in mine)
    assert [e.mount_id for e in read_mountinfo(os.getpid())] == [e.mount_id for e in mine]
    with pytest.raises(OSError):
        read_mountinfo(2**22 + 1)  # above pid_max: no such process
