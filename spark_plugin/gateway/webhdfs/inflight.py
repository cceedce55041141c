"""The batches in flight across a gateway replacement, whose commit the gateway refuses until Spark runs them again.

With ``--barrier commit`` (protocol.md 3.4) a gateway acknowledges a checkpoint's state files
from its local spool: a gateway that restarts on its own cache ships that spool, so nothing
is lost, but one whose cache was rebuilt from the SOS server (started on an empty cache, a
``--restore-batch``) holds only what the server held: the files of the batch in flight that
its predecessor acknowledged and never shipped may be missing. So, when it opens on a rebuilt
cache, it notes each checkpoint's batch in flight (``offsets/N`` present, ``commits/N``
absent: :func:`sos_journal.tree.barrier_rule.in_flight`) in ``gateway-inflight.json`` of its
cache directory, and refuses a RENAME onto, or CREATE of, ``CHECKPOINT/commits/N`` of such a
batch (403 IOException naming the batch). The query stops; started again, its driver reads
``offsets/N`` to run batch N again, and that read (an OPEN of ``CHECKPOINT/offsets/N``) ends
the refusal: the state files of the re-run all come through this gateway, and the commit's
barrier carries them. The note survives a restart on the same cache (the file is rewritten,
fsynced, before the change is answered); a new rebuild notes again from what the server holds.

A gateway that stops cleanly (SIGTERM: drained, its journal flushed to the server) leaves
``stopped/<epoch>`` on the server (:func:`record_clean_stop`: the sequence number of its last
record): a gateway whose writer fences it next (epoch + 1) and finds the journal ending at that
record lost nothing, and notes nothing (:func:`predecessor_stopped_cleanly`), so a rolling
update of a gateway on an empty cache (a Kubernetes Deployment's emptyDir) stops no query.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from sos_client.errors import SOSError
from sos_journal.format import layout
from sos_journal.tree.barrier_rule import STATE_DIR, commit_of, in_flight, offsets_of
from sos_journal.writer.writer import server_last_record
from spark_plugin.gateway.webhdfs.hdfs import WebHdfsError, hdfs_path

if TYPE_CHECKING:
    from sos_journal.tree.open import OpenNamespace, RoleClient

__all__ = [
    "INFLIGHT_FILE",
    "InFlightBatches",
    "predecessor_stopped_cleanly",
    "previous_writer_segment",
    "record_clean_stop",
    "scan_in_flight",
    "stopped_name",
]

log = logging.getLogger(__name__)

#: in the cache directory, next to ``tree/`` and ``spool/``
INFLIGHT_FILE = "gateway-inflight.json"
#: on the server, outside ``gen/`` (readers of the journal ignore it, as the lease objects)
STOPPED_PREFIX = "stopped/"


def stopped_name(epoch: int) -> str:
    return f"{STOPPED_PREFIX}{epoch:010d}"


def record_clean_stop(opened: OpenNamespace) -> None:
    """After a final flush that reached the server: ``stopped/<epoch>`` holds the sequence
    number of this writer's last record (nothing it acknowledged is only in its spool).
    Best effort: without it the next gateway on an empty cache refuses a commit in flight."""
    writer, factory = opened.writer, opened.client_factory
    if writer is None or factory is None:
        return
    doc = {"seq": int(writer.last_seq), "t": int(time.time() * 1000)}
    try:
        client = factory()
        try:
            client.append(stopped_name(writer.epoch), 0, json.dumps(doc).encode() + b"\n", epoch=writer.epoch)
        finally:
            client.close()
    except (SOSError, OSError) as exc:
        log.warning("could not record the clean stop of this gateway on the server: %r", exc)


def previous_writer_segment(client: RoleClient, epoch: int) -> layout.SegmentInfo | None:
    """The newest journal segment holding records of a writer older than ``epoch`` (the
    writer a writer of ``epoch`` fenced), or None."""
    segs = [
        seg
        for g in layout.scan_listing(client.list(layout.GEN_PREFIX)).values()
        for seg in g.segments
        if seg.epoch < epoch and seg.length > 0
    ]
    return max(segs, key=lambda seg: (seg.generation, seg.first_seq)) if segs else None


def predecessor_stopped_cleanly(opened: OpenNamespace) -> bool:
    """Whether the writer this one fenced (the epoch just below its own, the newest segment's)
    stopped cleanly at the last record the server holds of it (:func:`record_clean_stop`)."""
    writer, factory = opened.writer, opened.client_factory
    if writer is None or factory is None:
        return False
    try:
        client = factory()
        try:
            last = previous_writer_segment(client, writer.epoch)
            if last is None or last.epoch != writer.epoch - 1:  # a writer between (fenced, nothing shipped)
                return False
            found = server_last_record(client, last.name)
            name = stopped_name(last.epoch)
            length = int(client.stat(name)[0])
            doc = json.loads(b"".join(bytes(c) for c in client.read_iter(name, 0, 0))[: min(length, 4096)])
        finally:
            client.close()
    except (SOSError, OSError, ValueError) as exc:
        log.info("the previous writer left no clean stop that can be read: %r", exc)
        return False
    return found is not None and isinstance(doc, dict) and doc.get("seq") == found[0]


def _names(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def scan_in_flight(tree_dir: str) -> dict[str, int]:
    """{checkpoint: N} of every checkpoint in ``tree_dir`` (a directory holding ``offsets/``)
    whose latest batch has no commit. State directories are not walked (they are never a
    checkpoint's parent); links are never followed."""
    found: dict[str, int] = {}
    for dirpath, dirnames, _files in os.walk(tree_dir, followlinks=False):
        rel = os.path.relpath(dirpath, tree_dir)
        rel = "" if rel == "." else rel
        if "offsets" in dirnames and os.path.isdir(os.path.join(dirpath, "offsets")):
            batch = in_flight(_names(os.path.join(dirpath, "offsets")), _names(os.path.join(dirpath, "commits")))
            if batch is not None:
                found[rel] = batch
            dirnames[:] = [d for d in dirnames if d not in (STATE_DIR, "offsets", "commits")]
    return found


class InFlightBatches:
    """The batches whose commit is refused (module docstring), kept in ``path``."""

    def __init__(self, path: str, batches: dict[str, int] | None = None) -> None:
        self.path = path
        self._batches: dict[str, int] = dict(batches or {})
        self._lock = threading.Lock()

    @classmethod
    def open(cls, cache_dir: str, tree_dir: str, *, rebuilt: bool, enabled: bool) -> InFlightBatches:
        """A rebuilt cache (``rebuilt``) of a gateway that acknowledges early (``enabled``):
        the batches in flight in what the server held, noted durably before anything is
        served. A cache this gateway (or the one before it on this cache) left: the note it
        left, if any. ``enabled`` false: none (the old note is removed)."""
        path = os.path.join(cache_dir, INFLIGHT_FILE)
        if not enabled:
            if rebuilt:
                _remove(path)
            return cls(path)
        if rebuilt:
            found = cls(path, scan_in_flight(tree_dir))
            found._save()
            for checkpoint, n in sorted(found._batches.items()):
                log.warning(
                    "the cache was rebuilt from the server: batch %d of checkpoint %s was in flight; "
                    "its commit is refused until the query runs it again",
                    n,
                    hdfs_path(checkpoint),
                )
            return found
        return cls(path, _load(path))

    @property
    def batches(self) -> dict[str, int]:
        with self._lock:
            return dict(self._batches)

    def refusal(self, rel: str) -> WebHdfsError | None:
        """The refusal of a RENAME onto, or CREATE of, ``rel`` when it commits a batch in
        flight (None otherwise, and always when nothing is noted)."""
        if not self._batches:
            return None
        at = commit_of(rel)
        if at is None or self._batches.get(at[0]) != at[1]:
            return None
        checkpoint, n = at
        return WebHdfsError(
            "IOException",
            f"the commit of batch {n} of checkpoint {hdfs_path(checkpoint)} is refused: this gateway's "
            f"cache was rebuilt from the SOS server after the gateway that served the batch was lost, "
            f"so files of batch {n} it acknowledged may be missing. Start the query again: Spark runs "
            f"batch {n} again from {hdfs_path(checkpoint)}/offsets/{n} and its commit is then accepted "
            f"(exactly once)",
        )

    def read(self, rel: str) -> None:
        """An OPEN of ``rel``: the read of ``CHECKPOINT/offsets/N`` of a batch in flight, as a
        driver that starts the query again does, ends that batch's refusal."""
        if not self._batches:
            return
        at = offsets_of(rel)
        if at is None:
            return
        with self._lock:
            if self._batches.get(at[0]) != at[1]:
                return
            del self._batches[at[0]]
            self._save()
        log.info("batch %d of checkpoint %s is run again: its commit is accepted", at[1], hdfs_path(at[0]))

    def _save(self) -> None:
        """Rewrite the note durably (temp file, fsync, rename, fsync of the directory)."""
        tmp = self.path + ".tmp"
        data = json.dumps({"version": 1, "in_flight": self._batches}, sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _load(path: str) -> dict[str, int]:
    """The note in ``path``; a missing one is none. A damaged one refuses to start: serving
    without it could accept the commit of a batch whose files are missing."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise RuntimeError(
            f"{path} (the batches in flight whose commit this gateway refuses) cannot be read: {exc}; "
            f"start the gateway on an empty cache to note them again from the server"
        ) from exc
    batches = doc.get("in_flight") if isinstance(doc, dict) else None
    if not isinstance(batches, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in batches.items()
    ):
        raise RuntimeError(
            f"{path} (the batches in flight whose commit this gateway refuses) is not what the gateway "
            f"writes; start the gateway on an empty cache to note them again from the server"
        )
    return dict(batches)
