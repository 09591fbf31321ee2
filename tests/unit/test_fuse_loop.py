"""``fuse.loop``'s ioctl numbers, flags and struct layouts against ``linux/loop.h``.

A small C program, compiled against the installed kernel headers
(linux-libc-dev), prints what the compiler makes of them; the ctypes
definitions must agree field by field.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from fuse import loop
from tests.kernel_headers import compiled_values

CONSTANTS = [
    "LO_NAME_SIZE",
    "LO_KEY_SIZE",
    "LO_FLAGS_READ_ONLY",
    "LO_FLAGS_AUTOCLEAR",
    "LO_FLAGS_PARTSCAN",
    "LO_FLAGS_DIRECT_IO",
    "LOOP_SET_FD",
    "LOOP_CLR_FD",
    "LOOP_SET_STATUS",
    "LOOP_GET_STATUS",
    "LOOP_SET_STATUS64",
    "LOOP_GET_STATUS64",
    "LOOP_CHANGE_FD",
    "LOOP_SET_CAPACITY",
    "LOOP_SET_DIRECT_IO",
    "LOOP_SET_BLOCK_SIZE",
    "LOOP_CONFIGURE",
    "LOOP_CTL_ADD",
    "LOOP_CTL_REMOVE",
    "LOOP_CTL_GET_FREE",
]
INFO_FIELDS = [f[0] for f in loop.LoopInfo64._fields_]
CONFIG_FIELDS = {"fd": "fd", "block_size": "block_size", "info": "info", "reserved": "__reserved"}


@pytest.fixture(scope="module")
def header_values(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """Every constant, size and offset, as the C compiler sees linux/loop.h."""
    lines = [f'printf("{name} %lu\\n", (unsigned long)({name}));' for name in CONSTANTS]
    lines += [
        'printf("sizeof_info %zu\\n", sizeof(struct loop_info64));',
        'printf("sizeof_config %zu\\n", sizeof(struct loop_config));',
    ]
    lines += [f'printf("info.{f} %zu\\n", offsetof(struct loop_info64, {f}));' for f in INFO_FIELDS]
    lines += [
        f'printf("config.{ours} %zu\\n", offsetof(struct loop_config, {theirs}));'
        for ours, theirs in CONFIG_FIELDS.items()
    ]
    return compiled_values(["linux/loop.h"], lines, tmp_path_factory.mktemp("loop_h"))


def test_header_is_installed() -> None:
    assert Path("/usr/include/linux/loop.h").is_file()


@pytest.mark.parametrize("name", CONSTANTS)
def test_constants_match_the_header(name: str, header_values: dict[str, int]) -> None:
    assert getattr(loop, name) == header_values[name]


def test_struct_sizes_match_the_header(header_values: dict[str, int]) -> None:
    assert ctypes.sizeof(loop.LoopInfo64) == header_values["sizeof_info"] == 232
    assert ctypes.sizeof(loop.LoopConfig) == header_values["sizeof_config"] == 304


def test_field_offsets_match_the_header(header_values: dict[str, int]) -> None:
    for name in INFO_FIELDS:
        assert getattr(loop.LoopInfo64, name).offset == header_values[f"info.{name}"], name
    for name in CONFIG_FIELDS:
        assert getattr(loop.LoopConfig, name).offset == header_values[f"config.{name}"], name


def test_loop_device_names_are_checked() -> None:
    assert loop.loop_backing_file("/dev/loop999999") is None  # no such device: not bound
    with pytest.raises(ValueError):
        loop.loop_backing_file("/dev/sda")
    with pytest.raises(ValueError):
        loop.detach_loop("/dev/loop../../etc")
