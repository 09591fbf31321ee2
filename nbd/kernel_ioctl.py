"""The kernel nbd driver's ioctl interface (``linux/nbd.h``): request numbers and setup plan.

Pure values: ``ioctl_setup_plan`` says which ioctls configure a device and in
what order; ``nbd.kernel`` issues them when the host has no netlink interface.
``linux/nbd.h`` also defines the client flags (``NBD_CFLAG_*``) that netlink's
NBD_ATTR_CLIENT_FLAGS carries; they are kept here with the rest of the header.
"""

from __future__ import annotations

import struct

# ----------------------------------------------- uapi values (kernel headers)
# Hard-coded so nothing needs the headers at run time; tests/unit/test_nbd_kernel_ioctl.py
# checks each against /usr/include/linux/nbd.h.

# linux/nbd.h
NBD_CFLAG_DESTROY_ON_DISCONNECT = 1 << 0
NBD_CFLAG_DISCONNECT_ON_CLOSE = 1 << 1


def _IO(type_: int, nr: int) -> int:
    """``_IO`` from asm-generic/ioctl.h: direction none, size 0."""
    return (0 << 30) | (0 << 16) | (type_ << 8) | nr


NBD_SET_SOCK = _IO(0xAB, 0)
NBD_SET_BLKSIZE = _IO(0xAB, 1)
NBD_SET_SIZE = _IO(0xAB, 2)
NBD_DO_IT = _IO(0xAB, 3)
NBD_CLEAR_SOCK = _IO(0xAB, 4)
NBD_CLEAR_QUE = _IO(0xAB, 5)
NBD_PRINT_DEBUG = _IO(0xAB, 6)
NBD_SET_SIZE_BLOCKS = _IO(0xAB, 7)
NBD_DISCONNECT = _IO(0xAB, 8)
NBD_SET_TIMEOUT = _IO(0xAB, 9)
NBD_SET_FLAGS = _IO(0xAB, 10)


def ioctl_setup_plan(
    *,
    size: int,
    block_size: int,
    server_flags: int,
    sock_fd: int,
    io_timeout: int | None = None,
    ulong_bytes: int = struct.calcsize("L"),
) -> list[tuple[str, int, int]]:
    """The (name, request, argument) ioctls that configure a device before NBD_DO_IT.

    The socket goes last: until then, closing the device undoes everything.
    """
    plan = [("NBD_SET_BLKSIZE", NBD_SET_BLKSIZE, block_size)]
    if size < 1 << (8 * ulong_bytes):
        plan.append(("NBD_SET_SIZE", NBD_SET_SIZE, size))
    else:  # a 32-bit unsigned long cannot carry the size in bytes
        plan.append(("NBD_SET_SIZE_BLOCKS", NBD_SET_SIZE_BLOCKS, size // block_size))
    plan.append(("NBD_SET_FLAGS", NBD_SET_FLAGS, server_flags))
    if io_timeout is not None:
        plan.append(("NBD_SET_TIMEOUT", NBD_SET_TIMEOUT, io_timeout))
    plan.append(("NBD_SET_SOCK", NBD_SET_SOCK, sock_fd))
    return plan
