"""Which changes of a sync-mode tree wait for the server: the barrier policy, in one place.

A barrier (:meth:`JournalWriter.barrier`) returns once every record up to a point is
durable on the server. The journal is ONE ordered stream of records, so a barrier carries
everything journaled before it: a change needs a round trip of its own only when something
outside SOS can act on it before the next barrier. For a Spark checkpoint on the mount
those are the files a batch is planned and committed by:

* ``offsets/N``: the write-ahead log of batch N. The sink writes batch N's output after it;
  lost, a restore could re-plan batch N differently from what the sink already wrote.
* ``commits/N``: the commit point of batch N (RPO 0 for committed batches: once its rename
  returns, batch N and every file written before it survive the loss of the machine).
* ``_spark_metadata/N`` (and ``N.compact``): a file sink's commit log, which downstream
  readers of the sink's output act on.

State files, ``.crc`` sidecars, temp files and their renames are not: nothing outside the
query reads them before the next ``offsets``/``commits`` rename, whose barrier carries
them; a crash before that leaves the batch uncommitted and Spark runs it again.

An explicit ``fsync`` always waits (POSIX's promise), whatever the path.

The WebHDFS gateway (protocol.md 3.4) has clients on several nodes: a gateway that loses its
disk could lose a state file it acknowledged to an executor, and the driver's commit,
reaching a replacement gateway, would not carry it. Its rule (``--barrier commit``, the
default of a lone gateway) is :func:`acknowledged_early`: only the files of a checkpoint that
a re-run of the batch writes again (its ``state/`` directory, the temp files of its
``offsets/`` and ``commits/`` logs) are acknowledged from the gateway's spool; everything else
waits as before; and a gateway whose cache was rebuilt from the server (it does not hold its
predecessor's spool) refuses the commit of each batch that was in flight (:func:`in_flight`)
until Spark runs it again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

#: Directories whose batch-numbered files are barriers (see the module docstring).
BARRIER_LOGS = frozenset({"offsets", "commits", "_spark_metadata"})


def _batch_file(name: str) -> bool:
    """``N`` or ``N.compact`` with N a decimal batch number."""
    if name.endswith(".compact"):
        name = name[: -len(".compact")]
    return name.isascii() and name.isdigit()


def needs_barrier(path: str) -> bool:
    """True when a rename onto ``path``, or the close of a file written at ``path``, must
    wait until the journal is durable on the server (sync mode). ``path`` is relative to
    the namespace's root, ``/``-separated (e.g. ``"chk/commits/7"``)."""
    parent, _, name = path.rpartition("/")
    return _batch_file(name) and parent.rpartition("/")[2] in BARRIER_LOGS


#: the directory, in a checkpoint, of its state stores (what executors write, one file or
#: more per partition per batch)
STATE_DIR = "state"
#: the checkpoint logs whose temp files (``.N.<uuid>.tmp``) a RENAME onto ``N`` follows
TEMP_LOGS = frozenset({"offsets", "commits"})


def acknowledged_early(path: str, is_checkpoint: Callable[[str], bool]) -> bool:
    """True when a gateway running ``--barrier commit`` may acknowledge a change of ``path``
    (its CREATE or APPEND body, a RENAME from or onto it, its DELETE, TRUNCATE or MKDIRS) once
    its records are in the local spool. ``path`` is namespace-relative (``"q/state/0/3/7.delta"``);
    ``is_checkpoint(dir)`` tells whether ``dir`` (``""``: the root) is a Spark checkpoint (the
    gateway: it holds an ``offsets`` directory).

    Such paths are those a re-run of the batch in flight writes again: anything under
    ``CHECKPOINT/state`` (state stores: deltas, snapshots, changelogs, RocksDB zips and SSTs,
    their schema and metadata files), and a file of ``CHECKPOINT/offsets`` or
    ``CHECKPOINT/commits`` that is not a batch file (Spark's temp file, which the RENAME onto
    the batch file that waits carries). Everything else waits: batch files, ``metadata``,
    ``sources/``, the logs' directories, the checkpoint itself, and every path outside a
    checkpoint (a file sink's output and its ``_spark_metadata``, a user's files)."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if part == STATE_DIR and is_checkpoint("/".join(parts[:i])):
            return True
    if len(parts) >= 2 and parts[-2] in TEMP_LOGS and not _batch_file(parts[-1]):
        return is_checkpoint("/".join(parts[:-2]))
    return False


def commit_of(path: str) -> tuple[str, int] | None:
    """(checkpoint, N) when ``path`` is ``CHECKPOINT/commits/N`` (the commit of batch N), else None."""
    parent, _, name = path.rpartition("/")
    head, _, log = parent.rpartition("/")
    if log != "commits" or not (name.isascii() and name.isdigit()):
        return None
    return head, int(name)


def offsets_of(path: str) -> tuple[str, int] | None:
    """(checkpoint, N) when ``path`` is ``CHECKPOINT/offsets/N`` (batch N's write-ahead log)."""
    parent, _, name = path.rpartition("/")
    head, _, log = parent.rpartition("/")
    if log != "offsets" or not (name.isascii() and name.isdigit()):
        return None
    return head, int(name)


def in_flight(offsets: Iterable[str], commits: Iterable[str]) -> int | None:
    """The batch of one checkpoint that is in flight, from the names in its ``offsets`` and
    ``commits`` directories: the latest batch of ``offsets`` when ``commits`` lacks it (Spark
    plans batch N in ``offsets/N`` and commits it in ``commits/N``), else None."""
    planned = [int(n) for n in offsets if n.isascii() and n.isdigit()]
    if not planned:
        return None
    latest = max(planned)
    return None if str(latest) in set(commits) else latest
