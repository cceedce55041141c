"""What the kernel says is mounted where, through psutil (the mount table, no stat of the
mount point: a dead FUSE mount hangs or fails one). Shared by the mount and the Spark
helpers; needs no pyfuse3 (the Spark image has none)."""

from __future__ import annotations

import os

import psutil

__all__ = ["is_mounted", "mount_fstype"]


def mount_fstype(mountpoint: str) -> str | None:
    """The file system type of the mount at ``mountpoint`` (``fuse.sos`` for an SOS mount),
    None if nothing is mounted there. Of mounts stacked on one point the top one counts."""
    target = os.path.abspath(mountpoint)
    found = None
    for part in psutil.disk_partitions(all=True):
        if part.mountpoint == target:
            found = part.fstype
    return found


def is_mounted(mountpoint: str) -> bool:
    """True if the kernel lists ``mountpoint`` as a mount, live or dead."""
    return mount_fstype(mountpoint) is not None
