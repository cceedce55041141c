"""The mount table: the one reader of the project (the Spark helpers and the mount use it).

Standard library only: this module runs in the Spark image next to ``spark_plugin/spark/`` (the
standard library and pyspark, no psutil, no pyfuse3, no sos packages), below both the
helpers and the mount (neither imports the other for it).
"""

from __future__ import annotations

import os

__all__ = ["mount_fstype"]


def mount_fstype(mountpoint: str) -> str | None:
    """The file system type of the mount at ``mountpoint`` (None if it is no mount point).

    Reads /proc/self/mountinfo (no stat of the mount point: a dead FUSE mount hangs or
    fails it).
    """
    target = os.path.abspath(mountpoint)
    found = None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 7 or "-" not in fields:
                    continue
                where = (
                    fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
                )
                if where == target:
                    found = fields[fields.index("-", 6) + 1]  # the last mount on top wins
    except FileNotFoundError:  # pragma: no cover - not Linux
        return "unknown" if os.path.ismount(target) else None
    return found
