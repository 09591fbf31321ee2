"""The errors of attaching and mounting volumes on this node."""

from __future__ import annotations


class AttachError(Exception):
    """An attach, detach, mount or unmount that did not happen, with the reason."""


class PathUnavailable(AttachError):
    """The chosen (or forced) path cannot work on this host."""
