"""The gateway's memory of its recent RENAMEs, which answers a client's resend after a crash.

Hadoop's client resends a request whose reply it did not get (a gateway killed after
applying a RENAME, before answering it), and a checkpoint's rename of its temporary file
must not fail for it. HDFS's NameNode answers such a retry from its RetryCache, rebuilt from
its edit log after a restart; :class:`RenameMemory` is the gateway's: the last RENAMEs, each
with the identity of the entry it left at its destination (:func:`identity`: a directory, or
a file's size and a digest of its contents, which a cache rebuilt from the server after a
crash keeps), forgotten as soon as anything changes that destination.

It lives in ``gateway-renames.log`` of the cache directory (beside ``tree/``) for the next
gateway on the same cache: an append-only log of JSON lines, one ``write`` each (a RENAME
costs one line, not a rewrite of the whole memory), rewritten with only its live entries at
start and once it holds :data:`RENAME_LOG_LINES` lines. A torn last line (a crash in the
middle of a write) is ignored; a damaged line before the last makes the whole log
distrusted (nothing is answered from it). No cache walking: the namespace
(:mod:`spark_plugin.gateway.webhdfs.changes`) tells it what it renamed and what it changes.

A gateway whose cache is rebuilt from the server (a replacement on an empty cache: a pod
rescheduled with an ``emptyDir``, a lost disk) has no log; it rebuilds the memory from the
journal instead, as the NameNode rebuilds its RetryCache from its edit log:
:class:`JournalRenames` watches the records the rebuild applies and keeps the RENAMEs of the
last RENAME_RETRY_WINDOW whose destination no later record changed, each with the identity
of what the rebuilt tree holds there. The journal records where an entry went, not what
the client asked: a RENAME into an existing directory (HDFS's boolean rename) is not
remembered this way, and a resend of one gets HDFS's plain answer, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat as stat_mod
import time
from collections import Counter
from typing import NamedTuple

from sos_journal.beneath import Beneath
from sos_journal.format.records import Create, Delete, Mkdir, Record, Rename, Rmdir, Truncate, Write

__all__ = [
    "RENAME_LOG_LINES",
    "RENAME_MEMORY",
    "RENAME_MEMORY_FILE",
    "RENAME_RETRY_WINDOW",
    "JournalRenames",
    "RenameIndex",
    "RenameMemory",
    "Renamed",
    "identity",
]

log = logging.getLogger(__name__)

#: RENAMEs remembered for a client's retry, at most this many, for this long (seconds), in
#: this file of the cache directory (beside tree/)
RENAME_MEMORY = 256
RENAME_RETRY_WINDOW = 600.0
RENAME_MEMORY_FILE = "gateway-renames.log"
#: the memory of older gateways (whole-file JSON keyed on paths and size): removed, not read
_OLD_MEMORY_FILE = "gateway-renames.json"
#: the log is rewritten with its live entries (at most RENAME_MEMORY) past this many lines
RENAME_LOG_LINES = 4 * RENAME_MEMORY
#: bytes of a file's head and of its tail that its identity digests (all of a smaller file)
IDENTITY_SAMPLE = 64 << 10
_O_LOG = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def identity(at: Beneath, rel: str, st: os.stat_result) -> str:
    """What identifies the entry at ``rel`` (``st``: its lstat) for a resend, also in a cache
    rebuilt from the server after a crash (new inodes, new times, the same bytes): ``"d"``
    for a directory; for a file its size and a BLAKE2b digest of its contents (its first
    and last IDENTITY_SAMPLE bytes when it is larger than both). Opened through ``at``:
    never through a link."""
    if stat_mod.S_ISDIR(st.st_mode):
        return "d"
    digest = hashlib.blake2b(digest_size=16)
    fd = at.open_file(rel, os.O_RDONLY, single_link=True)
    try:
        size = os.fstat(fd).st_size
        if size <= 2 * IDENTITY_SAMPLE:
            digest.update(os.pread(fd, size, 0))
        else:
            digest.update(os.pread(fd, IDENTITY_SAMPLE, 0))
            digest.update(os.pread(fd, IDENTITY_SAMPLE, size - IDENTITY_SAMPLE))
    finally:
        os.close(fd)
    return f"f{size}:{digest.hexdigest()}"


def _and_above(path: str) -> list[str]:
    """``path`` and every directory above it, up to the root ``""``."""
    out = [path]
    while path:
        path = path.rpartition("/")[0]
        out.append(path)
    return out


class Renamed(NamedTuple):
    """A RENAME applied: where the entry went, its :func:`identity` there, wall time."""

    dst: str
    ident: str
    when: float


class RenameIndex:
    """(source, destination asked) -> :class:`Renamed` of the last RENAME_MEMORY RENAMEs
    (:attr:`recent`, oldest first), each forgotten when its destination changes
    (:meth:`_drop`): what :class:`RenameMemory` keeps and :class:`JournalRenames` rebuilds."""

    def __init__(self) -> None:
        self.recent: dict[tuple[str, str], Renamed] = {}
        #: every destination of :attr:`recent` and each directory above it, counted (none at
        #: 0): a change of a path none of them is (the usual case) is told apart without a scan
        self._paths: Counter[str] = Counter()

    def _add(self, key: tuple[str, str], renamed: Renamed) -> None:
        self._remove(key)
        self.recent[key] = renamed
        self._paths.update(_and_above(renamed.dst))
        if len(self.recent) > RENAME_MEMORY:
            self._remove(next(iter(self.recent)))

    def _remove(self, key: tuple[str, str]) -> None:
        renamed = self.recent.pop(key, None)
        if renamed is None:
            return
        for path in _and_above(renamed.dst):
            left = self._paths[path] - 1
            if left > 0:
                self._paths[path] = left
            else:
                del self._paths[path]

    def _drop(self, path: str, *, under: bool) -> bool:
        """Forget every RENAME whose destination is ``path`` (``under``: or below it)."""
        if self._paths[path] <= 0:
            return False  # no destination is this path or below it
        prefix = path + "/" if path else ""
        doomed = [k for k, r in self.recent.items() if r.dst == path or (under and r.dst.startswith(prefix))]
        for k in doomed:
            self._remove(k)
        return bool(doomed)


class RenameMemory(RenameIndex):
    """:class:`RenameIndex` loaded from and logged to ``path``. Not locked: the namespace
    calls it under its lock."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._lines = 0
        self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(os.path.dirname(path), _OLD_MEMORY_FILE))
        self._load()
        self._compact()

    # ------------------------------------------------------------------ the log
    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                lines = f.read().split(b"\n")
        except OSError:
            return  # none yet, or unreadable: no retry is recognised, nothing else changes
        # the text after the last newline is a torn line (or nothing): ignored
        for number, line in enumerate(lines[:-1], 1):
            try:
                self._apply(json.loads(line))
            except (ValueError, TypeError, IndexError, KeyError):
                log.warning(
                    "%s: line %d of %d is damaged: no RENAME is answered as a resend from it",
                    self.path,
                    number,
                    len(lines),
                )
                self.recent, self._paths = {}, Counter()
                return

    def _apply(self, row: list) -> None:
        """One line of the log: ``["rename", src, asked, dst, identity, time]`` or
        ``["forget", dst, under]``."""
        if row[0] == "rename":
            self._add((str(row[1]), str(row[2])), Renamed(str(row[3]), str(row[4]), float(row[5])))
        elif row[0] == "forget":
            self._drop(str(row[1]), under=bool(row[2]))
        else:
            raise ValueError(f"unknown line {row[0]!r}")

    def _write(self, row: list, *, sync: bool = False) -> None:
        """Append one line (one write on an O_APPEND descriptor); ``sync``: fdatasync it."""
        if self._fd < 0:
            return
        try:
            os.write(self._fd, json.dumps(row, separators=(",", ":")).encode() + b"\n")
            if sync:
                os.fdatasync(self._fd)
        except OSError as exc:  # a retry after a crash is then not recognised: HDFS's answer
            log.warning("%s: cannot log a RENAME (%s): a resend after a crash gets HDFS's plain answer", self.path, exc)
            self._close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # never half a memory: a forgotten change must not be read back
            return
        self._lines += 1
        if self._lines > RENAME_LOG_LINES:
            self._compact()

    def _compact(self) -> None:
        """Rewrite the log with the live entries only (written aside, then renamed over it:
        a crash leaves the old log or the new one, whole), and append from then on."""
        self._close()
        now = time.time()
        for key in [k for k, v in self.recent.items() if now - v.when >= RENAME_RETRY_WINDOW]:
            self._remove(key)
        tmp = self.path + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                for (src, asked), r in self.recent.items():
                    f.write(json.dumps(["rename", src, asked, r.dst, r.ident, r.when]).encode() + b"\n")
                f.flush()
                os.fdatasync(f.fileno())
            os.replace(tmp, self.path)
            self._fd = os.open(self.path, _O_LOG, 0o600)
        except OSError as exc:
            log.warning("%s: cannot write the RENAME memory (%s): resends get HDFS's plain answer", self.path, exc)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            return
        self._lines = len(self.recent)

    def _close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        self._close()

    # ------------------------------------------------------------------ what the namespace says
    def remember(self, rel: str, asked: str, dst: str, ident: str) -> None:
        """Note a RENAME of ``rel`` to ``asked`` that was applied (``dst``: where the entry
        went, ``ident`` its :func:`identity`), before its reply: one line appended."""
        now = time.time()
        self._apply(["rename", rel, asked, dst, ident, now])
        self._write(["rename", rel, asked, dst, ident, now])

    def adopt(self, renames: list[tuple[str, str, str, float]]) -> None:
        """Remember RENAMEs a rebuild found in the journal (:class:`JournalRenames`): each
        ``(source, destination, identity, wall time)``, oldest first, logged and synced."""
        for src, dst, ident, when in renames:
            self._apply(["rename", src, dst, dst, ident, when])
        if renames:
            self._compact()

    def forget(self, path: str, *, under: bool = False) -> None:
        """``path`` is about to change (replaced, written, truncated, removed or renamed away;
        ``under``: and everything below it): no RENAME that left an entry there is
        answered as a resend any more. Logged (and synced) before the change is made, so
        that no crash leaves the change without its forgetting."""
        if self._drop(path, under=under):
            self._write(["forget", path, under], sync=True)

    def applied(self, rel: str, asked: str) -> Renamed | None:
        """The RENAME of ``rel`` to ``asked`` applied in the last RENAME_RETRY_WINDOW seconds
        whose destination nothing changed since, else None."""
        seen = self.recent.get((rel, asked))
        if seen is None or time.time() - seen.when >= RENAME_RETRY_WINDOW:
            return None
        return seen


class JournalRenames(RenameIndex):
    """The RENAMEs a rebuild of the cache replays (``observe`` of
    :func:`~sos_journal.rebuild.finish.rebuild_journal_end`, called in journal order with
    each record after the snapshot), for :meth:`RenameMemory.adopt`: the live memory's
    index, each RENAME keyed on the destination the record names, forgotten as the live
    memory forgets (no identity yet: :meth:`found` reads it from the rebuilt tree)."""

    def __init__(self) -> None:
        super().__init__()
        self._last_seq = -1

    def __call__(self, rec: Record) -> None:
        if rec.seq <= self._last_seq:  # another replay (an older generation): start over
            super().__init__()
        self._last_seq = rec.seq
        op = rec.op
        if isinstance(op, Rename):
            self._drop(op.src, under=True)
            self._drop(op.dst, under=True)
            self._add((op.src, op.dst), Renamed(op.dst, "", rec.time_ns / 1e9))
        elif isinstance(op, (Delete, Rmdir)):
            self._drop(op.path, under=True)
        elif isinstance(op, (Create, Write, Truncate, Mkdir)):
            self._drop(op.path, under=False)

    def found(self, tree_dir: str) -> list[tuple[str, str, str, float]]:
        """``(source, destination, identity, time)`` of each RENAME seen within the last
        RENAME_RETRY_WINDOW whose destination the rebuilt tree at ``tree_dir`` holds, oldest
        first (for :meth:`RenameMemory.adopt`)."""
        now = time.time()
        out: list[tuple[str, str, str, float]] = []
        with Beneath(tree_dir) as at:
            for (src, dst), r in self.recent.items():
                if now - r.when >= RENAME_RETRY_WINDOW:
                    continue
                try:
                    out.append((src, dst, identity(at, dst, at.lstat(dst)), r.when))
                except OSError:  # gone, or not a plain entry: a resend gets HDFS's answer
                    continue
        return out

    def save(self, cache_dir: str, tree_dir: str) -> None:
        """:meth:`found` adopted by the memory in ``cache_dir`` (its log written and synced),
        before a rebuilt or promoted gateway serves."""
        memory = RenameMemory(os.path.join(cache_dir, RENAME_MEMORY_FILE))
        try:
            memory.adopt(self.found(tree_dir))
        finally:
            memory.close()
