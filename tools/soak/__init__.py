"""Crash-loop harness (``scripts/soak``): the main job's Spark query under random SIGKILLs.

A stream of unique records (the demo's input: :func:`tools.demo_common.make_input`, each id
sent twice so the ``dropDuplicates`` state must survive every crash) flows through the
demo's query (file source, ``maxFilesPerTrigger=1``, ``dropDuplicates(["id"])``, a
foreachBatch sink writing ``out/batch-<N>.jsonl`` atomically) whose checkpointLocation is
on a ``sos mount``. The harness feeds input files a few batches ahead of the query and,
at random moments drawn from a seeded RNG, SIGKILLs:

- ``server``: the sos-server (restarted on the same port and data directory; the mount's
  writer reconnects, Spark only sees a slow rename);
- ``mount``: the ``sos mount`` process (the query fails on the dead mount; the driver
  stops it, a new mount starts on the same cache, the SAME driver JVM restarts the query);
- ``driver``: the Spark driver (the query moves to a new driver process: the expensive
  case; a warm spare process with its SparkSession already up takes over if there is one,
  kept while an event still to come needs a new driver, ``--no-spare`` to start every
  replacement cold);
- ``disk``: the server's disk is lost: the server is SIGKILLed and its data directory
  deleted; a replacement on the empty directory with the same ``--tier`` (moto's S3 server,
  embedded in the harness; the keys from a backup copy) rebuilds the namespace from the
  bucket before it listens, and the mount's writer reconnects to it. The writer is frozen
  (SIGSTOP) until the bucket holds everything the server acknowledged: without
  ``--durability tier`` the upload lag would go with the disk. With ``--durability tier``
  (the mount's, or the gateways' in ``--cluster``; the server always runs with ``--tier``
  then) nothing is frozen or waited for: the disk goes at a random moment, mid-flush or
  mid-barrier, and every barrier the writer saw return must be in the bucket (RPO 0);
- ``all``: server, mount and driver at once, then the worker is lost: mount point, cache
  and spool are deleted; recovery is either ``sos restore`` into a fresh directory (checked)
  followed by a mount on an empty cache, or directly a mount on an empty cache. The spare
  driver (if any) survives: it is a process that has only started a SparkSession, touched
  neither mount nor checkpoint nor output, like a freshly provisioned worker.

After every restart the checkpoint (through the new mount, or the restored directory) is
checked against the output, with the demo's checker (:func:`tools.demo_common.check_output`):
the committed batches 0..K (``commits/`` is contiguous; K never below a batch the driver
saw committed: RPO 0) must have produced exactly the records of input files 0..K: nothing
doubled, nothing corrupted, nothing unknown, nothing lost. At the end the kills stop, the
query drains every fed file and the final check demands the whole fed input.

``--cluster`` runs the same query, input, sink and check on a Spark standalone cluster
(:mod:`tools.cluster`: a Master, two Workers of one core and the driver, each a node with a
private local disk) whose checkpoint goes through ``sos gateway`` (``webhdfs://``, Hadoop's
retry policy) to the sos-server, and kills the gateway (restarted on the same port, on the
same cache or on an empty one), the server, the server's disk, one executor JVM, a Worker with its executors
(replaced by a new node), the driver (the query restarts in a new one), or everything at
once (every process and local directory including the gateway's cache; a new cluster, a
gateway on an empty cache, before it sometimes ``sos restore``). See :class:`ClusterSoak`.

Exit 0: no violation; 1: a violation (the work directory with every log is kept and its
path printed); 2: the harness could not do its job (a process would not start, a stall).
The last line is ``SOAK-RESULT {json}``.

``python -m tools.soak --help``; ``_driver CONFIG`` is the driver process's entry.

The package, by role: :mod:`.common` (names, the two error kinds), :mod:`.driver` (the
Spark job side: the driver process), :mod:`.checks` (the exactly-once / RPO-0 verdict on a
checkpoint and the output), :mod:`.harness` (the crash loop: processes, kill events,
supervision, the run), :mod:`.cluster_mode` (the same on a standalone cluster through
``sos gateway``), :mod:`.report` (what is printed at the end) and :mod:`.cli`.
"""

from tools.soak.checks import GatewayView, checkpoint_commits, source_offset, state_files
from tools.soak.cli import main
from tools.soak.cluster_mode import ClusterSoak
from tools.soak.common import (
    CLUSTER_KINDS,
    KINDS,
    NAMESPACE,
    HarnessError,
    Violation,
    read_json,
    write_json_atomic,
)
from tools.soak.driver import driver_main
from tools.soak.harness import Soak

__all__ = [
    "CLUSTER_KINDS",
    "KINDS",
    "NAMESPACE",
    "ClusterSoak",
    "GatewayView",
    "HarnessError",
    "Soak",
    "Violation",
    "checkpoint_commits",
    "driver_main",
    "main",
    "read_json",
    "source_offset",
    "state_files",
    "write_json_atomic",
]
