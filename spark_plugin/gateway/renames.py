"""The gateway's memory of its recent RENAMEs, which answers a client's resend after a crash.

Hadoop's client resends a request whose reply it did not get (a gateway killed after
applying a RENAME, before answering it), and a checkpoint's rename of its temporary file
must not fail for it. HDFS's NameNode answers such a retry from its RetryCache, rebuilt from
its edit log after a restart; :class:`RenameMemory` is the gateway's: the last RENAMEs, kept
in ``gateway-renames.json`` of the cache directory (beside ``tree/``) for the next gateway on
the same cache. No cache walking, no journal: the namespace
(:mod:`spark_plugin.gateway.webhdfs_changes`) stats the entries and asks.
"""

from __future__ import annotations

import json
import os
import stat as stat_mod
import time
from typing import Any

__all__ = ["RENAME_MEMORY", "RENAME_MEMORY_FILE", "RENAME_RETRY_WINDOW", "RenameMemory", "identity"]

#: RENAMEs remembered for a client's retry, at most this many, for this long (seconds), in
#: this file of the cache directory (beside tree/)
RENAME_MEMORY = 256
RENAME_RETRY_WINDOW = 600.0
RENAME_MEMORY_FILE = "gateway-renames.json"


def identity(st: os.stat_result) -> int:
    """What a rebuilt cache keeps of an entry (a gateway restarted after a crash may
    rebuild its tree from the server: new inodes, new times): -1 for a directory, else
    the file's size."""
    return -1 if stat_mod.S_ISDIR(st.st_mode) else st.st_size


class RenameMemory:
    """(source, destination asked) -> [destination, its :func:`identity`, wall time] of the
    last RENAMEs (:attr:`recent`), loaded from and saved to ``path``. Not locked: the
    namespace calls it under its lock."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.recent: dict[tuple[str, str], list[Any]] = self._load()

    def _load(self) -> dict[tuple[str, str], list[Any]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                rows = json.load(f)
            return {(str(r[0]), str(r[1])): [str(r[2]), int(r[3]), float(r[4])] for r in rows}
        except (OSError, ValueError, TypeError, IndexError):
            return {}  # none yet, or unreadable: no retry is recognised, nothing else changes

    def remember(self, rel: str, asked: str, dst: str, ident: int) -> None:
        """Note a RENAME of ``rel`` to ``asked`` that was applied (``dst``: where the entry
        went, ``ident`` its identity), before its reply. The file is written whole (a few KiB)
        and replaced: a SIGKILLed gateway leaves it whole for the next one on the same cache."""
        now = time.time()
        renames = {k: v for k, v in self.recent.items() if now - v[2] < RENAME_RETRY_WINDOW}
        renames.pop((rel, asked), None)
        renames[(rel, asked)] = [dst, ident, now]
        while len(renames) > RENAME_MEMORY:
            del renames[next(iter(renames))]
        self.recent = renames
        tmp = self.path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump([[k[0], k[1], *v] for k, v in renames.items()], f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a retry after a crash is then not recognised: the client sees HDFS's answer

    def applied(self, rel: str, asked: str) -> tuple[str, int] | None:
        """(destination, identity) of a RENAME of ``rel`` to ``asked`` applied in the last
        RENAME_RETRY_WINDOW seconds, else None."""
        seen = self.recent.get((rel, asked))
        if seen is None or time.time() - seen[2] >= RENAME_RETRY_WINDOW:
            return None
        return str(seen[0]), int(seen[1])
