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

An explicit ``fsync`` always waits (POSIX's promise), whatever the path. The WebHDFS
gateway does not use this policy (protocol.md 3.4): its clients are on several nodes, and
a gateway that loses its disk could lose an acknowledged state file that the driver's
commit, reaching a replacement gateway, would then not carry.
"""

from __future__ import annotations

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
