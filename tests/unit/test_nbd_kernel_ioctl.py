"""The ioctl interface (``nbd.kernel_ioctl``): request numbers and the setup plan.

Every value of ``linux/nbd.h`` the module hard-codes is checked against the
installed kernel header (``linux-libc-dev``, installed by deploy/host/install-deps.sh).
"""

from __future__ import annotations

from nbd import constants

# Bound as ``kernel``: these tests were written when the ioctl values were part
# of nbd.kernel, and their assertions are kept exactly as they were written.
from nbd import kernel_ioctl as kernel
from nbd.constants import TransmissionFlag
from tests.kernel_headers import IOCTL_H, NBD_H, _require, header_constants

# ------------------------------------------------------------------ ioctls


def test_ioctl_numbers_are_io_0xab_n() -> None:
    numbers = {
        "NBD_SET_SOCK": 0,
        "NBD_SET_BLKSIZE": 1,
        "NBD_SET_SIZE": 2,
        "NBD_DO_IT": 3,
        "NBD_CLEAR_SOCK": 4,
        "NBD_CLEAR_QUE": 5,
        "NBD_PRINT_DEBUG": 6,
        "NBD_SET_SIZE_BLOCKS": 7,
        "NBD_DISCONNECT": 8,
        "NBD_SET_TIMEOUT": 9,
        "NBD_SET_FLAGS": 10,
    }
    for name, nr in numbers.items():
        # _IO: no direction (0 << 30), no size (0 << 16), type 0xab << 8, number.
        assert getattr(kernel, name) == 0xAB00 | nr, name
    assert kernel.NBD_DO_IT == 0xAB03


def test_ioctl_setup_plan() -> None:
    plan = kernel.ioctl_setup_plan(
        size=10 << 30, block_size=512, server_flags=0x12D, sock_fd=7, io_timeout=30
    )
    assert plan == [
        ("NBD_SET_BLKSIZE", 0xAB01, 512),
        ("NBD_SET_SIZE", 0xAB02, 10 << 30),
        ("NBD_SET_FLAGS", 0xAB0A, 0x12D),
        ("NBD_SET_TIMEOUT", 0xAB09, 30),
        ("NBD_SET_SOCK", 0xAB00, 7),
    ]
    # Where unsigned long is 32 bits, sizes from 4 GiB go in blocks.
    narrow = kernel.ioctl_setup_plan(
        size=10 << 30, block_size=4096, server_flags=1, sock_fd=7, ulong_bytes=4
    )
    assert narrow[1] == ("NBD_SET_SIZE_BLOCKS", 0xAB07, (10 << 30) // 4096)
    assert [name for name, _, _ in narrow] == [
        "NBD_SET_BLKSIZE",
        "NBD_SET_SIZE_BLOCKS",
        "NBD_SET_FLAGS",
        "NBD_SET_SOCK",
    ]


def test_nbd_header_matches_every_constant() -> None:
    parsed = header_constants(_require(NBD_H), header_constants(_require(IOCTL_H)))
    wire = {
        # The transmission values the wire codec (nbd.constants) already owns.
        "NBD_CMD_READ": constants.Command.READ,
        "NBD_CMD_WRITE": constants.Command.WRITE,
        "NBD_CMD_DISC": constants.Command.DISC,
        "NBD_CMD_FLUSH": constants.Command.FLUSH,
        "NBD_CMD_TRIM": constants.Command.TRIM,
        "NBD_FLAG_HAS_FLAGS": TransmissionFlag.HAS_FLAGS,
        "NBD_FLAG_READ_ONLY": TransmissionFlag.READ_ONLY,
        "NBD_FLAG_SEND_FLUSH": TransmissionFlag.SEND_FLUSH,
        "NBD_FLAG_SEND_FUA": TransmissionFlag.SEND_FUA,
        "NBD_FLAG_SEND_TRIM": TransmissionFlag.SEND_TRIM,
        "NBD_FLAG_CAN_MULTI_CONN": TransmissionFlag.CAN_MULTI_CONN,
        "NBD_REQUEST_MAGIC": constants.REQUEST_MAGIC,
        "NBD_REPLY_MAGIC": constants.SIMPLE_REPLY_MAGIC,
        # The kernel's 32-bit request type is the codec's 16-bit flags then 16-bit type.
        "NBD_CMD_FLAG_FUA": constants.CommandFlag.FUA << 16,
    }
    assert len(parsed) == 11 + 5 + 6 + 1 + 2 + 2  # ioctls, cmds, flags, cmd flag, cflags, magics
    for name, value in parsed.items():
        mine = wire[name] if name in wire else getattr(kernel, name)
        assert mine == value, name
