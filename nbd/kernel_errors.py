"""The errors of the kernel nbd interface, raised by the attach and the netlink layer below it.

They live apart from ``nbd.kernel`` so that ``nbd.netlink`` can raise them
without importing the attach; ``nbd.kernel`` exports them with its API.
"""

from __future__ import annotations


class KernelNBDError(Exception):
    """The kernel refused or failed an nbd operation."""


class KernelNBDUnavailable(KernelNBDError):
    """This host's kernel has no usable nbd driver."""
