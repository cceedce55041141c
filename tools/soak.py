"""Crash-loop harness (``scripts/soak``): the main job's Spark query under random SIGKILLs.

A stream of unique records (the demo's input: :func:`tools.demo.make_input`, each id
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
  ``--no-spare`` to start every replacement cold);
- ``all``: server, mount and driver at once, then the worker is lost: mount point, cache
  and spool are deleted; recovery is either ``sos restore`` into a fresh directory (checked)
  followed by a mount on an empty cache, or directly a mount on an empty cache. The spare
  driver (if any) survives: it is a process that has only started a SparkSession, touched
  neither mount nor checkpoint nor output, like a freshly provisioned worker.

After every restart the checkpoint (through the new mount, or the restored directory) is
checked against the output, with the demo's checker (:func:`tools.demo.check_output`):
the committed batches 0..K (``commits/`` is contiguous; K never below a batch the driver
saw committed: RPO 0) must have produced exactly the records of input files 0..K: nothing
doubled, nothing corrupted, nothing unknown, nothing lost. At the end the kills stop, the
query drains every fed file and the final check demands the whole fed input.

``--cluster`` runs the same query, input, sink and check on a Spark standalone cluster
(:mod:`tools.cluster`: a Master, two Workers of one core and the driver, each a node with a
private local disk) whose checkpoint goes through ``sos gateway`` (``webhdfs://``, Hadoop's
retry policy) to the sos-server, and kills the gateway (restarted on the same port, on the
same cache or on an empty one), the server, one executor JVM, a Worker with its executors
(replaced by a new node), the driver (the query restarts in a new one), or everything at
once (every process and local directory including the gateway's cache; a new cluster, a
gateway on an empty cache, before it sometimes ``sos restore``). See :class:`ClusterSoak`.

Exit 0: no violation; 1: a violation (the work directory with every log is kept and its
path printed); 2: the harness could not do its job (a process would not start, a stall).
The last line is ``SOAK-RESULT {json}``.

``python -m tools.soak --help``; ``_driver CONFIG`` is the driver process's entry.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from tools.server import ServerProcess
from tools import child_env
from tools.demo import (
    CHECKPOINT,
    ROCKSDB_PROVIDER,
    check_output,
    committed_batches,
    fmt,
    keygen,
    kill_tree,
    make_input,
    write_batch_output,
)

NAMESPACE = "soak"
KINDS = ("server", "mount", "driver", "all")
#: server kills are cheap (clients reconnect), driver kills cost a JVM start
DEFAULT_WEIGHTS = {"server": 0.72, "mount": 0.20, "driver": 0.04, "all": 0.04}
#: the driver JVM restarts often: C1 only and a serial GC start it with less CPU
DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
TRIGGER = "200 milliseconds"
#: spark.sql.shuffle.partitions of the query: one state store directory each
SHUFFLE_PARTITIONS = 2


class Violation(Exception):
    """The exactly-once / RPO-0 contract was broken: the run stops, logs are kept."""


class HarnessError(Exception):
    """The harness could not do its job (not a verdict on SOS's correctness)."""


def _write_json_atomic(path: str, doc) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


# =========================================================================== driver process

def driver_main(cfg_path: str) -> int:
    """A long-lived Spark driver: runs the demo's query on whatever mount the harness names.

    Commands come from ``control/cmd.json`` ({"seq", "action": run|stop|exit, "checkpoint",
    "mountpoint"}); the state goes to ``control/status.json`` ({"seq", "state", "error",
    "pid"}). A query that fails (its mount died) is reported and left stopped until the next
    command, so one JVM survives any number of mount and server crashes. Batches seen
    committed (progress events with data, ``commits/N`` present) are appended to the
    ``acked`` file: the harness's RPO-0 baseline.
    """
    t_start = time.monotonic()
    with open(cfg_path) as f:
        cfg = json.load(f)
    from pyspark.sql import SparkSession

    from spark_plugin.spark import MarkerListener

    def note(msg):
        print(f"soak driver [{time.monotonic() - t_start:6.1f}s]: {msg}", file=sys.stderr,
              flush=True)

    gw = cfg.get("gateway")  # cluster mode: {"url", "namespace"}; the key in $SOS_KEY
    builder = SparkSession.builder.appName("sos-soak-cluster" if gw else "sos-soak")
    if cfg.get("spark_conf"):  # the cluster's master, executors, local dirs
        for k, v in cfg["spark_conf"].items():
            builder = builder.config(k, v)
    else:
        builder = builder.master("local[2]")
    builder = (builder.config("spark.sql.shuffle.partitions", "2")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.extraJavaOptions", DRIVER_JAVA_OPTIONS)
               .config("spark.sql.streaming.stateStore.maintenanceInterval",
                       cfg.get("maintenance_interval", "10s")))
    if cfg.get("state_store") == "rocksdb":
        builder = builder.config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
    location = None
    if gw:
        from spark_plugin.spark import gateway_checkpoint

        location = gateway_checkpoint(builder, gw["url"], gw["namespace"], os.environ["SOS_KEY"],
                                      CHECKPOINT)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    note("Spark session up")

    control = cfg["control"]
    cmd_path = os.path.join(control, "cmd.json")
    status_path = os.path.join(control, "status.json")
    out_dir = cfg["out"]
    acked_path = cfg["acked"]
    os.makedirs(out_dir, exist_ok=True)
    pid = os.getpid()

    def status(seq, state, error=None, unreadable=False):
        _write_json_atomic(status_path, {"seq": seq, "state": state, "error": error, "pid": pid,
                                         "checkpoint_unreadable": unreadable})

    class AckListener(MarkerListener):
        """Records committed batches for the harness, then writes the batch marker."""

        def onQueryProgress(self, event):  # noqa: N802 - Spark's name
            try:
                p = event.progress
                if int(p.numInputRows) > 0 and os.path.exists(
                        os.path.join(self.checkpoint, "commits", str(int(p.batchId)))):
                    try:
                        log_offset = int(json.loads(p.sources[0].endOffset)["logOffset"])
                    except Exception:  # noqa: BLE001
                        log_offset = -1
                    with open(acked_path, "a") as f:
                        f.write(f"{int(p.batchId)} {log_offset}\n")
            except Exception as exc:  # noqa: BLE001 - a listener must never kill the query
                self.errors.append(repr(exc))
            super().onQueryProgress(event)

    if gw:
        from spark_plugin.spark import GatewayMarkerListener

        class GatewayAckListener(GatewayMarkerListener):
            """AckListener through the gateway: ``commits/N`` checked with a GETFILESTATUS."""

            def committed(self, batch: int) -> bool:
                """Does ``commits/<batch>`` exist? Asked again while the gateway is down
                (a restart takes a second or two) so an acknowledgement is not lost."""
                from spark_plugin.gateway_client import GatewayError

                deadline = time.monotonic() + 60
                while True:
                    try:
                        return self._client.exists(f"{self.relpath}/commits/{batch}")
                    except GatewayError:
                        raise
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)

            def onQueryProgress(self, event):  # noqa: N802 - Spark's name
                try:
                    p = event.progress
                    if int(p.numInputRows) > 0 and self.committed(int(p.batchId)):
                        try:
                            log_offset = int(json.loads(p.sources[0].endOffset)["logOffset"])
                        except Exception:  # noqa: BLE001
                            log_offset = -1
                        with open(acked_path, "a") as f:
                            f.write(f"{int(p.batchId)} {log_offset}\n")
                except Exception as exc:  # noqa: BLE001 - a listener must never kill the query
                    self.errors.append(repr(exc))
                super().onQueryProgress(event)

    def sink(df, batch_id):  # the demo's sink, without its hang hook
        write_batch_output(out_dir, df, batch_id)

    # the demo's query (same source, dedup and sink); a processing-time trigger instead of
    # availableNow because the input keeps coming
    stream = (spark.readStream.schema("id LONG, payload STRING")
              .option("maxFilesPerTrigger", 1).json(cfg["input"])
              .dropDuplicates(["id"]))

    handled = -1
    query = None
    listener = None
    while True:
        cmd = _read_json(cmd_path)
        if cmd is not None and cmd["seq"] > handled:
            handled = cmd["seq"]
            if query is not None:
                try:
                    query.stop()
                except Exception:  # noqa: BLE001 - it failed already; we only want it gone
                    pass
                query = None
            if listener is not None:
                try:
                    spark.streams.removeListener(listener)
                except Exception:  # noqa: BLE001
                    pass
                listener = None
            action = cmd["action"]
            if action == "exit":
                status(handled, "exited")
                break
            if action == "stop":
                status(handled, "stopped")
                continue
            mnt, chk = cmd["mountpoint"], cmd["checkpoint"]
            if location is None and not os.path.ismount(mnt):
                status(handled, "failed", f"{mnt} is not a mount point")
                continue
            try:
                listener = (GatewayAckListener(location) if location is not None
                            else AckListener(chk, mountpoint=mnt))
                spark.streams.addListener(listener)
                query = (stream.writeStream.foreachBatch(sink)
                         .option("checkpointLocation", chk)
                         .trigger(processingTime=TRIGGER).start())
            except Exception as exc:  # noqa: BLE001 - reported to the harness
                status(handled, "failed", f"start: {type(exc).__name__}: {str(exc)[:400]}")
                query = None
                continue
            status(handled, "running")
            note(f"query started on {chk}")
        if query is not None and not query.isActive:
            unreadable = False
            try:
                exc = query.exception()
                full = str(exc) if exc is not None else "terminated"
                err = full[:600]
                # the committed checkpoint's state cannot be loaded (a delta or snapshot
                # file of a committed version is missing, empty or truncated)
                unreadable = "CANNOT_LOAD_STATE_STORE" in full
                if unreadable:
                    i = full.index("CANNOT_LOAD_STATE_STORE")
                    err = full[max(0, i - 40):i + 500]
            except Exception as e:  # noqa: BLE001
                err = repr(e)[:600]
            status(handled, "failed", err, unreadable)
            note(f"query failed: {err[:200]}")
            query = None
        time.sleep(0.1)
    spark.stop()
    return 0


# =========================================================================== the parts

def ServerProc(data_dir: str, log_path: str) -> ServerProcess:
    """``sos-server serve`` on a FIXED port (the mount and the gateway must find it again
    after a restart): the one launcher, tools.server."""
    return ServerProcess(data_dir, log_path=log_path, fixed_port=True, metrics=False)


def source_offset(checkpoint_dir, batch: int) -> int:
    """The file source's log offset recorded in ``offsets/<batch>`` (line 3: {"logOffset": L}).

    ``checkpoint_dir``: a local directory, or a :class:`GatewayView`."""
    if isinstance(checkpoint_dir, GatewayView):
        text = checkpoint_dir.read(f"offsets/{batch}")
    else:
        with open(os.path.join(checkpoint_dir, "offsets", str(batch)), encoding="utf-8") as f:
            text = f.read()
    lines = text.splitlines()
    try:
        return int(json.loads(lines[2])["logOffset"])
    except (IndexError, ValueError, KeyError, TypeError) as exc:
        raise Violation(f"offsets/{batch} of {checkpoint_dir} is unreadable: {lines!r:.300}") from exc


def state_files(checkpoint_dir, rel: str) -> dict[str, int]:
    """{name: size} of the files in ``rel`` of a local checkpoint or a :class:`GatewayView`."""
    if isinstance(checkpoint_dir, GatewayView):
        return checkpoint_dir.sizes(rel)
    d = os.path.join(checkpoint_dir, rel)
    if not os.path.isdir(d):
        return {}
    return {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)
            if os.path.isfile(os.path.join(d, n))}


def checkpoint_commits(checkpoint_dir) -> set[int]:
    """The batch ids in ``commits/`` of a local checkpoint or a :class:`GatewayView`."""
    if isinstance(checkpoint_dir, GatewayView):
        return checkpoint_dir.commits()
    return committed_batches(checkpoint_dir)


class GatewayView:
    """A checkpoint as ``sos gateway`` serves it (what Spark sees): the harness's check reads
    ``commits/`` and ``offsets/N`` over WebHDFS (LISTSTATUS, OPEN) with a bearer token."""

    def __init__(self, url: str, namespace: str, key: str, relpath: str) -> None:
        from spark_plugin.gateway_client import GatewayClient

        self.client = GatewayClient(url, namespace, key, timeout=120)
        self.relpath = relpath.strip("/")

    def __str__(self) -> str:
        return f"{self.client.url}/webhdfs/v1/{self.relpath}"

    def commits(self) -> set[int]:
        from spark_plugin.gateway_client import GatewayError

        try:
            doc = self.client.call("GET", f"/webhdfs/v1/{self.relpath}/commits", op="LISTSTATUS")
        except GatewayError as exc:
            if exc.status == 404:
                return set()
            raise
        return {int(st["pathSuffix"]) for st in doc["FileStatuses"]["FileStatus"]
                if st["pathSuffix"].isdigit()}

    def sizes(self, rel: str) -> dict[str, int]:
        """{name: length} of the files in ``rel`` ({} if it does not exist)."""
        from spark_plugin.gateway_client import GatewayError

        try:
            doc = self.client.call("GET", f"/webhdfs/v1/{self.relpath}/{rel}", op="LISTSTATUS")
        except GatewayError as exc:
            if exc.status == 404:
                return {}
            raise
        return {st["pathSuffix"]: int(st["length"]) for st in doc["FileStatuses"]["FileStatus"]
                if st["type"] == "FILE"}

    def read(self, rel: str) -> str:
        import urllib.request

        url = f"{self.client.url}/webhdfs/v1/{self.relpath}/{rel}?op=OPEN&data=true"
        req = urllib.request.Request(url, headers={"Authorization":
                                                   f"Bearer {self.client.token()}"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.read().decode("utf-8")


def _pick_port() -> int:
    """A free port below the usual ephemeral range (so no outgoing connection takes it
    while the server is down)."""
    rnd = random.SystemRandom()
    for _ in range(200):
        port = rnd.randrange(20000, 32000)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise HarnessError("no free port")


# =========================================================================== the harness

class Soak:
    """The crash loop on one machine: the query in a local[2] driver on an ``sos mount``."""

    #: the kinds of kill event, and those that may strike again before the next batch
    KINDS = KINDS
    CHEAP = ("server",)
    MODE = "mount"

    def __init__(self, *, duration: float, seed: int, workdir: str, rows: int,
                 max_kills: int | None, weights: dict, state_store: str, ahead: int,
                 stall_timeout: float, delay: tuple[float, float], quiet: bool = False,
                 standby: bool = True):
        self.duration = duration
        self.seed = seed
        self.rng = random.Random(seed)
        self.work = workdir
        self.rows = rows
        self.max_kills = max_kills
        self.weights = weights
        self.state_store = state_store
        self.ahead = ahead
        self.stall_timeout = stall_timeout
        self.delay = delay
        self.quiet = quiet
        p = {k: os.path.join(workdir, k) for k in
             ("staging", "input", "out", "server-data", "control", "logs", "restore")}
        self.paths = p
        for k in ("staging", "input", "out", "control", "logs"):
            os.makedirs(p[k], exist_ok=True)
        self.acked_path = os.path.join(workdir, "acked.log")
        open(self.acked_path, "a").close()
        self.events_log = open(os.path.join(p["logs"], "events.log"), "a")
        self.t0 = time.monotonic()
        self.server = ServerProc(p["server-data"], os.path.join(p["logs"], "server.log"))
        self.key = ""
        self.mount = None
        self.mount_n = 0
        self.worker_n = 0
        self.worker_dir = ""
        self.mountpoint = ""
        self.driver: subprocess.Popen | None = None
        self.driver_ctl = ""
        self.driver_n = 0
        # a warm spare driver process (SparkSession up, nothing else: it has not touched the
        # mount, the checkpoint or the output) that replaces a killed driver at once
        self.use_standby = standby
        self.standby: subprocess.Popen | None = None
        self.standby_ctl = ""
        self._standby_after = 0  # spawn the spare once the active driver committed past this
        self.promoted = 0
        self.cmd_seq = 0
        self.want_running = False  # the harness asked the driver to run the query
        # input
        self.total_files = 0
        self.fed = 0
        self.file_ids: list[list[int]] = []
        self.expected_prefix: dict[int, str] = {}
        self.expected_all: dict[int, str] = {}
        # progress
        self._acked_off = 0
        self.acked_max = -1
        self.acked_files = 0  # input files consumed by acknowledged batches
        self.seen_files = 0  # input files consumed by batches a look at the checkpoint saw
        self.last_progress_t = time.monotonic()
        # figures
        self.kills = {k: 0 for k in self.KINDS}
        self.restores = {"sos-restore": 0, "empty-cache": 0}
        self.processes_killed = {"server": 0, "mount": 0, "driver": 0}
        self.query_restarts = 0          # same JVM, after a mount kill
        self.query_failures: list[str] = []  # failures the harness did not cause directly
        self.unexpected: list[str] = []  # processes that died without being killed
        self.checks = 0
        self.records_checked = 0         # records of committed output compared, all checks
        self.last_check_records = 0
        self.violations: list[str] = []
        self.restart_times = {k: [] for k in self.KINDS}
        # event -> first batch committed after it (beyond what the check saw): the real
        # cost of each kind of crash for the query
        self.recovery = {k: [] for k in self.KINDS}
        # (kind, t_event, last batch seen by the check) of every event not yet followed by a
        # committed batch (a later event does not cancel an earlier one's measure)
        self._pending_recovery: list[tuple[str, float, int]] = []
        self.last_check_hi = -1

    # ------------------------------------------------------------------ output
    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        self.events_log.write(line + "\n")
        self.events_log.flush()
        if not self.quiet:
            print(line, flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ input
    def prepare_input(self) -> None:
        # batches are at most a few per second here; generous, the rest stays unused
        self.total_files = int(self.duration * 2) + 400
        records = self.total_files * self.rows
        self.expected_all = make_input(self.paths["staging"], records, self.total_files)
        bounds = [records * i // self.total_files for i in range(self.total_files + 1)]
        # the ids new in file i (make_input: file i = chunk i + half of chunk i-1 again)
        self.file_ids = [list(range(bounds[i], bounds[i + 1])) for i in range(self.total_files)]
        self.say(f"input: {self.total_files} files of {self.rows} new ids (+ duplicates of the "
                 f"previous file) staged; fed {self.ahead} batches ahead of the query")

    def consumed_files(self) -> int:
        """Input files the committed batches consumed: the driver's acknowledgements, or
        (cluster mode) a look at the checkpoint when an acknowledgement went missing."""
        return max(self.acked_files, self.seen_files)

    def feed(self) -> None:
        target = min(self.total_files, self.consumed_files() + self.ahead)
        while self.fed < target:
            name = f"part-{self.fed:05d}.json"
            os.rename(os.path.join(self.paths["staging"], name),
                      os.path.join(self.paths["input"], name))  # keeps make_input's mtime
            for rid in self.file_ids[self.fed]:
                self.expected_prefix[rid] = self.expected_all[rid]
            self.fed += 1

    def read_acked(self) -> int:
        with open(self.acked_path) as f:
            f.seek(self._acked_off)
            data = f.read()
        end = data.rfind("\n")
        if end >= 0:
            self._acked_off += end + 1
            for line in data[:end].splitlines():
                try:
                    b, log_offset = (int(x) for x in line.split())
                except ValueError:  # a driver killed mid-line: that batch is re-acked later
                    continue
                self.acked_files = max(self.acked_files, log_offset + 1)
                if b > self.acked_max:
                    self.acked_max = b
                    self.last_progress_t = time.monotonic()
                for pending in [p for p in self._pending_recovery if b > p[2]]:
                    self.recovery[pending[0]].append(time.monotonic() - pending[1])
                    self._pending_recovery.remove(pending)
        return self.acked_max

    # ------------------------------------------------------------------ processes
    def start_server(self) -> None:
        self.server.start()

    def new_worker(self) -> None:
        """A fresh worker: new cache directory (empty: the mount restores it)."""
        self.worker_n += 1
        self.worker_dir = os.path.join(self.work, f"worker{self.worker_n}")
        os.makedirs(os.path.join(self.worker_dir, "cache"), exist_ok=True)

    def start_mount(self) -> None:
        from spark_plugin.spark import start_mount

        self.mount_n += 1
        # a new mount point per mount: a dying query can never write into the directory
        # under a later mount
        self.mountpoint = os.path.join(self.worker_dir, f"mnt{self.mount_n}")
        t = time.monotonic()
        try:
            self.mount = start_mount(NAMESPACE, self.mountpoint, server=self.server.address,
                                     key=self.key, cache_dir=os.path.join(self.worker_dir, "cache"),
                                     timeout=300,
                                     log_path=os.path.join(self.paths["logs"],
                                                           f"mount{self.mount_n}.log"))
        except Exception as exc:  # noqa: BLE001
            raise HarnessError(f"sos mount #{self.mount_n} did not start: {exc}") from exc
        os.makedirs(self.checkpoint(), exist_ok=True)
        return time.monotonic() - t

    def checkpoint(self) -> str:
        return os.path.join(self.mountpoint, CHECKPOINT)

    def view(self):
        """The checkpoint as the harness's check reads it (here: through the mount)."""
        return self.checkpoint()

    def kill_mount_only(self) -> None:
        """SIGKILL the mount process but leave the dead mount in place (ENOTCONN)."""
        if self.mount is not None and self.mount.proc.poll() is None:
            os.kill(self.mount.pid, signal.SIGKILL)
            self.mount.proc.wait()
            self.processes_killed["mount"] += 1

    def drop_mount(self) -> None:
        """Lazily unmount the (dead) mount and remove its mount point."""
        if self.mount is not None:
            self.mount.kill()
            try:
                os.rmdir(self.mount.mountpoint)
            except OSError:
                pass
            self.mount = None

    def command(self, action: str) -> int:
        self.cmd_seq += 1
        doc = {"seq": self.cmd_seq, "action": action}
        if action == "run":
            doc.update(mountpoint=self.mountpoint, checkpoint=self.checkpoint())
        _write_json_atomic(os.path.join(self.driver_ctl, "cmd.json"), doc)
        self.want_running = action == "run"
        return self.cmd_seq

    def status(self):
        if self.driver is None:
            return None
        st = _read_json(os.path.join(self.driver_ctl, "status.json"))
        if st is None or self.driver is None or st.get("pid") != self.driver.pid:
            return None
        return st

    def wait_status(self, seq: int, states, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st is not None and st["seq"] >= seq and st["state"] in states:
                return st
            if self.driver is None or self.driver.poll() is not None:
                return None
            time.sleep(0.05)
        return None

    def _spawn_driver(self) -> tuple[subprocess.Popen, str]:
        """A new driver process with its own control directory; it idles until told."""
        self.driver_n += 1
        ctl = os.path.join(self.paths["control"], f"d{self.driver_n}")
        os.makedirs(ctl, exist_ok=True)
        cfg = {"input": self.paths["input"], "out": self.paths["out"], "control": ctl,
               "acked": self.acked_path, "state_store": self.state_store}
        cfg_path = os.path.join(ctl, "driver.json")
        _write_json_atomic(cfg_path, cfg)
        log_path = os.path.join(self.paths["logs"], f"driver{self.driver_n}.log")
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tools.soak", "_driver", cfg_path],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True, env=child_env())
        return proc, ctl

    def start_driver(self) -> str:
        """Run the query in a new driver: the warm spare if there is one, else a cold start."""
        how = "a cold-started driver"
        if self.standby is not None and self.standby.poll() is None:
            self.driver, self.driver_ctl = self.standby, self.standby_ctl
            self.standby = None
            self.promoted += 1
            how = "the warm spare driver"
        else:
            if self.standby is not None:
                self._standby_died()
            self.driver, self.driver_ctl = self._spawn_driver()
        self.command("run")
        self._standby_after = max(self.acked_max, self.last_check_hi)
        return how

    def _standby_died(self) -> None:
        rc = self.standby.poll()
        self.unexpected.append(f"t={self.elapsed():.0f}s: the spare driver exited by itself ({rc})")
        self.say(f"UNEXPECTED: the spare driver exited ({rc})")
        self.standby = None

    def tend_standby(self) -> None:
        if not self.use_standby:
            return
        if self.standby is not None:
            if self.standby.poll() is not None:
                self._standby_died()
            return
        # start the spare only once the active driver commits: its JVM start would
        # otherwise slow the query's own start
        if self.driver is not None and self.acked_max > self._standby_after:
            self.standby, self.standby_ctl = self._spawn_driver()

    def kill_driver(self) -> None:
        if self.driver is not None:
            if self.driver.poll() is None:
                self.processes_killed["driver"] += 1
            kill_tree(self.driver)

    # ------------------------------------------------------------------ the check
    def check(self, chk_dir: str, label: str) -> str:
        """Committed output == the input prefix of the committed batches; RPO 0."""
        acked = self.read_acked()  # BEFORE listing commits: a later commit only adds
        commits = checkpoint_commits(chk_dir)
        self.checks += 1
        self.last_check_hi = max(commits, default=-1)
        if not commits:
            if acked >= 0:
                raise Violation(f"{label}: no commits in {chk_dir}, but batch {acked} was "
                                "acknowledged committed (RPO 0 broken)")
            return "no batch committed yet"
        hi, lo = max(commits), min(commits)
        if commits != set(range(lo, hi + 1)):
            raise Violation(f"{label}: commits/ has gaps: {fmt(commits)}")
        if hi < acked:
            raise Violation(f"{label}: last commit is batch {hi} but batch {acked} was "
                            "acknowledged committed before (RPO 0 broken: a committed batch "
                            "was lost)")
        # the file source's log offset L of batch hi: batches 0..hi read files 0..L (one file
        # per source offset, maxFilesPerTrigger=1; a batch re-planned after a crash can span
        # several offsets)
        last_file = source_offset(chk_dir, hi)
        if last_file < hi or last_file >= self.fed:
            raise Violation(f"{label}: batch {hi} ends at input file {last_file}, but "
                            f"{self.fed} files were fed")
        # older commit files are purged by Spark (minBatchesToRetain): every batch up to hi
        # has committed
        committed = set(range(hi + 1))
        prefix = {rid: self.expected_all[rid] for i in range(last_file + 1)
                  for rid in self.file_ids[i]}
        res = check_output(self.paths["out"], committed, prefix)
        problems = [f"{len(res[k])} {k.replace('_', ' ')} (e.g. {res[k][:5]})"
                    for k in ("lost", "doubled", "corrupted", "unknown", "committed_without_output")
                    if res[k]]
        if problems or res["records_out"] != len(prefix):
            raise Violation(f"{label}: committed batches 0..{hi}: " + "; ".join(problems or [
                f"{res['records_out']} records out, {len(prefix)} expected"]))
        if self.state_store == "hdfs":
            self.check_state(chk_dir, hi, label)
        self.records_checked += res["records_out"]
        self.last_check_records = res["records_out"]
        return (f"batches 0..{hi} committed (input files 0..{last_file}), "
                f"{res['records_out']} records exactly once")

    def check_state(self, chk_dir, hi: int, label: str) -> None:
        """The dedup state of committed batch ``hi`` (state version hi+1) is there: in each
        shuffle partition ``state/0/P/`` the delta file of version hi+1 exists, and no delta
        or snapshot file of a committed version is empty (Spark makes each one visible by a
        rename of a complete file; an empty one cannot be loaded)."""
        for part in range(SHUFFLE_PARTITIONS):
            files = state_files(chk_dir, f"state/0/{part}")
            if f"{hi + 1}.delta" not in files:
                raise Violation(f"{label}: batch {hi} committed, but state/0/{part}/"
                                f"{hi + 1}.delta is missing")
            empty = sorted((n for n, size in files.items() if size == 0
                            and re.fullmatch(r"\d+\.(delta|snapshot)", n)
                            and int(n.split(".")[0]) <= hi + 1),
                           key=lambda n: int(n.split(".")[0]))
            if empty:
                raise Violation(f"{label}: batch {hi} committed, but the state files "
                                f"state/0/{part}/{', '.join(empty)} are empty")

    # ------------------------------------------------------------------ events
    def kill_server(self) -> str:
        pid = self.server.proc.pid
        self.server.kill()
        self.processes_killed["server"] += 1
        outage = self.rng.uniform(0.0, 1.5)
        time.sleep(outage)
        t = time.monotonic()
        self.server.start()
        verdict = self.check(self.view(), "after a server kill")
        return (f"server pid {pid} SIGKILLed, down {outage:.1f}s, restarted in "
                f"{time.monotonic() - t:.1f}s; check: {verdict}")

    def kill_mount(self) -> str:
        pid = self.mount.pid
        self.kill_mount_only()
        # the query dies on the dead mount (ENOTCONN); stop it before the mount point moves
        seq = self.command("stop")
        st = self.wait_status(seq, ("stopped",), 120)
        note = ""
        if st is None:
            note = "; driver did not stop its query within 120s: driver killed"
            self.unexpected.append(f"t={self.elapsed():.0f}s: driver did not stop its query "
                                   "after a mount kill")
            self.kill_driver()
            self.driver = None
        self.drop_mount()
        took = self.start_mount()
        verdict = self.check(self.checkpoint(), "after a mount kill")
        if self.driver is not None:
            self.command("run")
            self.query_restarts += 1
        else:
            self.start_driver()
        return (f"mount pid {pid} SIGKILLed, query stopped, new mount on the same cache in "
                f"{took:.1f}s; check: {verdict}; query restarted in the same driver{note}")

    def kill_driver_event(self) -> str:
        pid = self.driver.pid if self.driver else None
        self.kill_driver()
        verdict = self.check(self.view(), "after a driver kill")
        how = self.start_driver()
        return f"driver pid {pid} (and its JVM) SIGKILLed; check: {verdict}; query on {how}"

    def kill_all(self) -> str:
        order = ["server", "mount", "driver"]
        self.rng.shuffle(order)
        mode = self.rng.choice(("sos-restore", "empty-cache"))
        for what in order:
            if what == "server":
                self.server.kill()
                self.processes_killed["server"] += 1
            elif what == "mount":
                self.kill_mount_only()
            else:
                self.kill_driver()
        self.driver = None
        self.drop_mount()
        shutil.rmtree(self.worker_dir)  # the worker is gone: mount point, cache, spool
        self.server.start()
        self.new_worker()
        detail = ""
        if mode == "sos-restore":
            target = os.path.join(self.paths["restore"], f"r{self.restores['sos-restore'] + 1}")
            t = time.monotonic()
            self.sos_restore(target)
            detail = f"sos restore into a fresh directory in {time.monotonic() - t:.1f}s"
            verdict = self.check(os.path.join(target, CHECKPOINT), "after sos restore")
            detail += f" ({verdict}); "
            shutil.rmtree(target)
        self.restores[mode] += 1
        took = self.start_mount()
        verdict = self.check(self.checkpoint(), "after a total loss, on the rebuilt mount")
        detail += f"mount on an EMPTY cache rebuilt it in {took:.1f}s; check: {verdict}"
        how = self.start_driver()
        return f"SIGKILL {'+'.join(order)}, worker deleted; {detail}; query on {how}"

    def sos_restore(self, target: str) -> None:
        from spark_plugin.spark import sos_command

        proc = subprocess.run(sos_command() + ["restore", "-q", "--server", self.server.address,
                                               NAMESPACE, target],
                              capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, SOS_KEY=self.key))
        with open(os.path.join(self.paths["logs"], "restore.log"), "a") as f:
            f.write(f"--- {target}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
        if proc.returncode != 0:
            raise Violation(f"sos restore failed after a total loss (exit {proc.returncode}): "
                            f"{proc.stderr.strip()[-500:]}")

    # ------------------------------------------------------------------ supervision
    def pump(self) -> None:
        """Feed input, notice failures nobody caused on purpose, keep the query running."""
        self.read_acked()
        self.feed()
        self.tend_standby()
        if not self.server.alive():
            self.unexpected.append(f"t={self.elapsed():.0f}s: sos-server exited by itself "
                                   f"({self.server.proc.returncode})")
            self.say(f"UNEXPECTED: sos-server exited ({self.server.proc.returncode}); restarting")
            self.server.start()
        if self.supervise():
            return
        if self.mount is not None and self.mount.proc.poll() is not None:
            rc = self.mount.proc.returncode
            self.unexpected.append(f"t={self.elapsed():.0f}s: sos mount #{self.mount_n} exited "
                                   f"by itself ({rc})")
            self.say(f"UNEXPECTED: sos mount #{self.mount_n} exited ({rc}); see "
                     f"{self.mount.log_path}; remounting")
            self.kill_mount()
            return
        if self.driver is not None and self.driver.poll() is not None:
            rc = self.driver.returncode
            self.unexpected.append(f"t={self.elapsed():.0f}s: driver #{self.driver_n} exited "
                                   f"by itself ({rc})")
            self.say(f"UNEXPECTED: the driver exited ({rc}); starting a new one")
            self.start_driver()
            return
        st = self.status()
        if st is not None and st["seq"] == self.cmd_seq and st["state"] == "failed" \
                and self.want_running:
            if st.get("checkpoint_unreadable"):
                raise Violation(f"the query cannot load the state of its committed checkpoint "
                                f"(a state file of a committed batch is lost, empty or "
                                f"truncated): {(st.get('error') or '')[:500]}")
            err = (st.get("error") or "").splitlines()[0][:300] if st.get("error") else ""
            self.query_failures.append(f"t={self.elapsed():.0f}s: {err}")
            self.say(f"query failed{' without a mount kill' if self.MODE == 'mount' else ''}: "
                     f"{err}; restarting it in the same driver")
            self.command("run")
            self.query_restarts += 1
        if time.monotonic() - self.last_progress_t > self.stall_timeout:
            raise HarnessError(f"no batch committed for {self.stall_timeout:.0f}s (stall); "
                               f"last committed batch {self.acked_max}")

    def supervise(self) -> bool:
        """Notice and repair the mode's own parts dying by themselves; True if it did."""
        return False

    def wait_progress(self, since: int, until: float) -> bool:
        while self.acked_max <= since:
            if time.monotonic() > until:
                return False
            self.pump()
            time.sleep(0.1)
        return True

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        self.say(f"soak: seed {self.seed}, duration {self.duration:.0f}s"
                 + (f", at most {self.max_kills} kill events" if self.max_kills else "")
                 + f", work dir {self.work}")
        self.prepare_input()
        self.key = keygen(self.paths["server-data"], NAMESPACE)
        self.start_server()
        self.say(f"sos-server on {self.server.address}")
        self.setup()
        self.feed()
        self.start_driver()
        self.last_progress_t = time.monotonic()
        if not self.wait_progress(-1, time.monotonic() + self.stall_timeout):
            raise HarnessError("the query committed no batch after start")
        self.say("first batch committed; the crash loop starts")
        end = self.t0 + self.duration
        n = 0
        streak = 0  # server kills since the last committed batch
        while time.monotonic() < end and (self.max_kills is None or n < self.max_kills):
            # every draw happens for every event, so a seed gives the same sequence of events
            kind = self.rng.choices(self.KINDS, weights=[self.weights[k] for k in self.KINDS])[0]
            delay = self.rng.uniform(*self.delay)
            jitter = self.rng.uniform(0.0, 1.0)
            before = self.acked_max
            at = time.monotonic() + delay
            while time.monotonic() < at:
                self.pump()
                time.sleep(0.05)
            # before a mount, driver or total kill, at least one batch committed since the
            # previous event (the crash loop must not starve the query); then strike at a
            # random point of a later batch. Two server kills may come back to back.
            if self.acked_max > before:
                streak = 0
            if (kind not in self.CHEAP or streak >= 2) and self.acked_max <= before:
                self.wait_progress(before, time.monotonic() + self.stall_timeout)
                streak = 0
                self.pump()
                t = time.monotonic() + jitter
                while time.monotonic() < t:
                    self.pump()
                    time.sleep(0.05)
            if time.monotonic() >= end:
                break
            streak += 1
            n += 1
            t = time.monotonic()
            self.kills[kind] += 1
            self.say(f"#{n} kill {kind} (batch {self.acked_max} committed last)")
            what = self.handlers()[kind]()
            self.restart_times[kind].append(time.monotonic() - t)
            self._pending_recovery.append((kind, t, max(self.last_check_hi, self.acked_max)))
            self.say(f"#{n} {kind}: {what} ({time.monotonic() - t:.1f}s)")
        self.say(f"{n} kill events; no more kills: draining the {self.fed} fed input files")
        self.drain()
        return self.summary()

    def setup(self) -> None:
        """Start what runs beside the server and the driver (here: the worker's mount)."""
        self.new_worker()
        self.start_mount()
        self.say(f"mounted {NAMESPACE} at {self.mountpoint}")

    def handlers(self) -> dict:
        return {"server": self.kill_server, "mount": self.kill_mount,
                "driver": self.kill_driver_event, "all": self.kill_all}

    def drain(self) -> None:
        final_fed = self.fed
        deadline = time.monotonic() + max(self.stall_timeout, 120)
        while self.consumed_files() < final_fed:
            if time.monotonic() > deadline:
                raise HarnessError(f"drain: batch {self.acked_max} is the last committed, it "
                                   f"read {self.consumed_files()} of the {final_fed} files fed")
            self.read_acked()
            self.pump_no_feed()
            time.sleep(0.1)
        verdict = self.check(self.view(), "final")
        hi = max(checkpoint_commits(self.view()))
        if source_offset(self.view(), hi) != final_fed - 1:
            raise Violation(f"final: last committed batch {hi} does not end at the last fed "
                            f"file {final_fed - 1}")
        res = check_output(self.paths["out"], set(range(hi + 1)), self.expected_prefix)
        if res["lost"] or res["records_out"] != len(self.expected_prefix):
            raise Violation(f"final: {len(res['lost'])} records lost of "
                            f"{len(self.expected_prefix)} fed (e.g. {res['lost'][:5]})")
        self.final_records = res["records_out"]
        self.say(f"final check: every fed record came out exactly once: {verdict}")
        if self.standby is not None:
            kill_tree(self.standby)
            self.standby = None
        seq = self.command("exit")
        self.wait_status(seq, ("exited",), 120)
        if self.driver is not None:
            try:
                self.driver.wait(60)
            except subprocess.TimeoutExpired:
                pass
            kill_tree(self.driver)
        self.driver = None
        self.finish()

    def finish(self) -> None:
        """After the final check and the driver's exit: stop the rest cleanly."""
        rc = self.mount.stop()
        if rc not in (0, None):
            self.unexpected.append(f"final clean unmount exited {rc}")
        self.mount = None

    def pump_no_feed(self) -> None:
        saved, self.ahead = self.ahead, -10**9
        try:
            self.pump()
        finally:
            self.ahead = saved

    def summary(self) -> dict:
        def med(xs):
            xs = sorted(xs)
            return round(xs[len(xs) // 2], 1) if xs else None

        return {
            "ok": not self.violations, "seed": self.seed, "duration_s": round(self.elapsed(), 1),
            "kill_events": sum(self.kills.values()), "kills": dict(self.kills),
            "processes_killed": dict(self.processes_killed),
            "restores": dict(self.restores), "query_restarts_same_jvm": self.query_restarts,
            "driver_starts": self.driver_n, "spare_driver_promotions": self.promoted,
            "mount_starts": self.mount_n,
            "server_starts": self.server.starts,
            "batches_committed": self.acked_max + 1, "input_files_fed": self.fed,
            "records_final": getattr(self, "final_records", 0),
            "checks": self.checks, "records_checked": self.records_checked,
            "violations": list(self.violations), "query_failures": list(self.query_failures),
            "unexpected": list(self.unexpected),
            "median_event_s": {k: med(v) for k, v in self.restart_times.items()},
            "median_recovery_s": {k: med(v) for k, v in self.recovery.items()},
            "kills_per_hour": round(sum(self.kills.values()) * 3600 / max(self.elapsed(), 1), 0),
        }

    def cleanup(self) -> None:
        """Kill what is left, unmount. Safe to call twice."""
        if self.driver is not None:
            kill_tree(self.driver)
            self.driver = None
        if self.standby is not None:
            kill_tree(self.standby)
            self.standby = None
        if self.mount is not None:
            self.mount.kill()
            self.mount = None
        self.server.kill()
        # mounts of earlier workers are already gone; be thorough anyway
        for root, dirs, _files in os.walk(self.work):
            for d in list(dirs):
                if d.startswith("mnt"):
                    from spark_plugin.mount import is_mounted, lazy_unmount

                    p = os.path.join(root, d)
                    if is_mounted(p):
                        lazy_unmount(p)
                    dirs.remove(d)
        self.events_log.close()


# =========================================================================== cluster mode

CLUSTER_KINDS = ("gateway", "server", "executor", "worker", "driver", "all")
#: gateway and server kills are cheap (Hadoop's retry policy and the journal writer ride
#: through them); an executor or worker kill costs a JVM start, a driver kill the whole
#: application (driver and both executors), a total loss the cluster as well
CLUSTER_WEIGHTS = {"gateway": 0.32, "server": 0.12, "executor": 0.2, "worker": 0.14,
                   "driver": 0.12, "all": 0.10}
#: share of gateway kills whose replacement starts on an EMPTY cache (restored from the server)
GATEWAY_EMPTY_CACHE = 0.3


class ClusterSoak(Soak):
    """The crash loop on a Spark standalone cluster (``tools.cluster``: a Master, two Workers
    of one core, the driver, each on a node of its own) that checkpoints through
    ``sos gateway`` (a child process outside the nodes) to the real ``sos-server``.

    Kill events:

    - ``gateway``: SIGKILL the gateway, restart it on the same port, on the same cache or
      (sometimes) on an EMPTY one that it restores from the server; the query rides through
      on Hadoop's retry policy (``gateway_conf``);
    - ``server``: SIGKILL the sos-server (restarted on the same port and data);
    - ``executor``: SIGKILL one executor JVM only; its Worker launches a new one;
    - ``worker``: SIGKILL a Worker and its executors and unmount its node's local disk; a
      replacement node registers with the Master;
    - ``driver``: SIGKILL the driver node (Spark's application ends, its executors with it);
      a new driver restarts the query from the checkpoint;
    - ``all``: every process (driver, Workers, executors, Master, gateway, server) and every
      local directory including the gateway's cache; a new cluster, then either
      ``sos restore`` into a fresh directory (checked) and a gateway on an empty cache, or
      directly a gateway on an empty cache; a new driver resumes the query.

    The check after every restart reads the checkpoint through the gateway (what Spark
    sees); after an ``sos restore``, the restored directory too.
    """

    KINDS = CLUSTER_KINDS
    CHEAP = ("gateway", "server")
    MODE = "cluster"

    def __init__(self, **kw) -> None:
        kw["standby"] = False  # a spare application would queue for the cluster's cores
        super().__init__(**kw)
        self.cluster = None
        self.cluster_n = 0
        self.gateway = None
        self.gateway_n = 0
        self.gateway_port = 0
        self.gateway_cache = ""
        self.gateway_url = ""
        self.processes_killed.update(gateway=0, worker=0, executor=0, master=0)
        self.gateway_restarts = {"same-cache": 0, "empty-cache": 0}
        self._last_peek = 0.0
        self.worker_starts = 0
        #: log every gateway request (--gateway-debug; big logs, for a diagnosis)
        self.gateway_debug = bool(os.environ.get("SOS_SOAK_GATEWAY_DEBUG"))
        del self.processes_killed["mount"]

    # ------------------------------------------------------------------ parts
    def setup(self) -> None:
        self.start_gateway(empty=True)
        self.say(f"sos gateway on {self.gateway_url} (cache {self.gateway_cache})")
        self.start_cluster()
        self.say(f"Spark cluster: Master {self.cluster.master_url}, 2 Workers of 1 core")

    def checkpoint(self) -> str:
        from spark_plugin.spark import webhdfs_url

        return webhdfs_url(self.gateway_url, CHECKPOINT)

    def view(self):
        return GatewayView(self.gateway_url, NAMESPACE, self.key, CHECKPOINT)

    def start_gateway(self, *, empty: bool) -> float:
        """``sos gateway`` on its fixed port; ``empty``: on a new, empty cache directory."""
        from spark_plugin.gateway import GatewayProcess

        if empty:
            if self.gateway_cache:
                shutil.rmtree(self.gateway_cache, ignore_errors=True)
            self.gateway_cache = os.path.join(self.work, f"gw-cache{self.gateway_n + 1}")
        if not self.gateway_port:
            self.gateway_port = _pick_port()
        deadline = time.monotonic() + 300
        t = time.monotonic()
        while True:
            self.gateway_n += 1
            gw = GatewayProcess(NAMESPACE, self.gateway_cache, self.server.address, self.key,
                                listen=f"127.0.0.1:{self.gateway_port}", start_timeout=300,
                                debug=self.gateway_debug,
                                log_path=os.path.join(self.paths["logs"],
                                                      f"gateway{self.gateway_n}.log"))
            try:
                gw.start()
                break
            except RuntimeError as exc:  # e.g. the port still taken for a moment
                if time.monotonic() > deadline:
                    raise HarnessError(f"sos gateway #{self.gateway_n} did not start: "
                                       f"{str(exc)[-1500:]}") from exc
                time.sleep(0.5)
        self.gateway = gw
        self.gateway_url = gw.url
        return time.monotonic() - t

    def kill_gateway_only(self) -> None:
        if self.gateway is not None and self.gateway.proc.poll() is None:
            self.gateway.kill()
            self.processes_killed["gateway"] += 1

    def start_cluster(self) -> None:
        from tools.cluster import SparkCluster

        self.cluster_n += 1
        self.cluster = SparkCluster(os.path.join(self.work, f"cluster{self.cluster_n}"),
                                    workers=2, cores=1, env=child_env())
        try:
            self.cluster.start(timeout=300)
        except Exception as exc:  # noqa: BLE001
            raise HarnessError(f"the Spark cluster did not start: {exc}") from exc
        self.worker_starts += 2

    def _spawn_driver(self) -> tuple[subprocess.Popen, str]:
        """A driver on a node of its own of the current cluster."""
        self.driver_n += 1
        ctl = os.path.join(self.paths["control"], f"d{self.driver_n}")
        os.makedirs(ctl, exist_ok=True)
        cfg = {"input": self.paths["input"], "out": self.paths["out"], "control": ctl,
               "acked": self.acked_path, "state_store": self.state_store,
               "spark_conf": self.cluster.spark_conf(),
               "gateway": {"url": self.gateway_url, "namespace": NAMESPACE}}
        cfg_path = os.path.join(ctl, "driver.json")
        _write_json_atomic(cfg_path, cfg)
        node = self.cluster.start_driver([sys.executable, "-m", "tools.soak", "_driver", cfg_path],
                                         env=child_env(dict(os.environ, SOS_KEY=self.key)),
                                         name=f"driver{self.driver_n}")
        return node.proc, ctl

    def executors(self) -> list:
        out = []
        for w in self.cluster.workers:
            if w is not None and w.alive():
                out.extend(w.executors())
        return out

    # ------------------------------------------------------------------ events
    def handlers(self) -> dict:
        return {"gateway": self.kill_gateway, "server": self.kill_server,
                "executor": self.kill_executor, "worker": self.kill_worker,
                "driver": self.kill_driver_event, "all": self.kill_all}

    def kill_gateway(self) -> str:
        pid = self.gateway.pid
        empty = self.rng.random() < GATEWAY_EMPTY_CACHE
        outage = self.rng.uniform(0.0, 1.5)
        self.kill_gateway_only()
        time.sleep(outage)
        took = self.start_gateway(empty=empty)
        self.gateway_restarts["empty-cache" if empty else "same-cache"] += 1
        verdict = self.check(self.view(), "after a gateway kill")
        return (f"gateway pid {pid} SIGKILLed, down {outage:.1f}s, restarted on the same port "
                f"on {'an EMPTY' if empty else 'the same'} cache in {took:.1f}s; "
                f"check: {verdict}")

    def kill_executor(self) -> str:
        # an executor exists unless one is being relaunched: wait for one (pumping)
        i = self.rng.randrange(self.cluster.n_workers)
        deadline = time.monotonic() + self.stall_timeout
        while True:
            w = self.cluster.workers[i]
            execs = w.executors() if w is not None and w.alive() else []
            if not execs:
                execs = self.executors()
            if execs:
                break
            if time.monotonic() > deadline:
                raise HarnessError(f"no executor running for {self.stall_timeout:.0f}s")
            self.pump()
            time.sleep(0.2)
        victim = execs[0]
        pid = victim.pid
        try:
            victim.send_signal(signal.SIGKILL)
            self.processes_killed["executor"] += 1
        except Exception:  # noqa: BLE001 - psutil.NoSuchProcess: it died meanwhile
            pass
        verdict = self.check(self.view(), "after an executor kill")
        return f"executor JVM pid {pid} SIGKILLed (its Worker relaunches one); check: {verdict}"

    def kill_worker(self) -> str:
        i = self.rng.randrange(self.cluster.n_workers)
        node = self.cluster.workers[i]
        n_exec = len(node.executors()) if node is not None else 0
        self.cluster.kill_worker(i)
        self.processes_killed["worker"] += 1
        self.processes_killed["executor"] += n_exec
        verdict = self.check(self.view(), "after a worker kill")
        t = time.monotonic()
        try:
            self.cluster.start_worker(i, timeout=300)
        except Exception as exc:  # noqa: BLE001
            raise HarnessError(f"replacement worker {i} did not start: {exc}") from exc
        self.worker_starts += 1
        return (f"worker {i} (pid {node.proc.pid}, {n_exec} executor) SIGKILLed with its node's "
                f"disk; check: {verdict}; a new worker node registered in "
                f"{time.monotonic() - t:.1f}s")

    def kill_all(self) -> str:
        mode = self.rng.choice(("sos-restore", "empty-cache"))
        order = ["server", "gateway", "cluster"]
        self.rng.shuffle(order)
        for what in order:
            if what == "server":
                self.server.kill()
                self.processes_killed["server"] += 1
            elif what == "gateway":
                self.kill_gateway_only()
            else:
                self.kill_cluster()
        self.driver = None
        # every local directory: each node's disk (a tmpfs in its mount namespace) went with
        # its last process (the cluster's base directory holds only the harness's logs); the
        # gateway's cache and spool go here
        shutil.rmtree(self.gateway_cache, ignore_errors=True)
        self.server.start()
        detail = ""
        if mode == "sos-restore":
            target = os.path.join(self.paths["restore"], f"r{self.restores['sos-restore'] + 1}")
            t = time.monotonic()
            self.sos_restore(target)
            detail = f"sos restore into a fresh directory in {time.monotonic() - t:.1f}s"
            verdict = self.check(os.path.join(target, CHECKPOINT), "after sos restore")
            detail += f" ({verdict}); "
            shutil.rmtree(target)
        self.restores[mode] += 1
        took = self.start_gateway(empty=True)
        verdict = self.check(self.view(), "after a total loss, through the rebuilt gateway")
        detail += f"gateway on an EMPTY cache rebuilt it in {took:.1f}s; check: {verdict}"
        t = time.monotonic()
        self.start_cluster()
        detail += f"; a new cluster in {time.monotonic() - t:.1f}s"
        how = self.start_driver()
        return f"SIGKILL {'+'.join(order)}, every local directory deleted; {detail}; query on {how}"

    def kill_cluster(self) -> None:
        """SIGKILL every node: the driver, the Workers with their executors, the Master."""
        c = self.cluster
        if self.driver is not None and self.driver.poll() is None:
            self.processes_killed["driver"] += 1
        for w in c.workers:
            if w is not None and w.alive():
                self.processes_killed["worker"] += 1
                self.processes_killed["executor"] += len(w.executors())
        if c.master is not None and c.master.alive():
            self.processes_killed["master"] += 1
        c.stop()

    # ------------------------------------------------------------------ supervision
    def peek(self) -> None:
        """No acknowledged batch for a while: look at the checkpoint through the gateway. A
        batch whose acknowledgement the driver could not make (the gateway was down when
        its listener asked for ``commits/N``) still consumed its input; the harness feeds
        on from there (the RPO-0 baseline stays the acknowledged batches)."""
        now = time.monotonic()
        if now - self.last_progress_t < 15 or now - self._last_peek < 15:
            return
        self._last_peek = now
        try:
            view = self.view()
            commits = view.commits()
            if commits:
                self.seen_files = max(self.seen_files, source_offset(view, max(commits)) + 1)
        except Exception as exc:  # noqa: BLE001 - a look only; the stall timeout decides
            self.say(f"peek at the checkpoint failed: {exc!r:.200}")

    def supervise(self) -> bool:
        self.peek()
        if self.gateway is not None and self.gateway.proc.poll() is not None:
            rc = self.gateway.proc.returncode
            self.unexpected.append(f"t={self.elapsed():.0f}s: sos gateway #{self.gateway_n} "
                                   f"exited by itself ({rc})")
            self.say(f"UNEXPECTED: sos gateway #{self.gateway_n} exited ({rc}); see "
                     f"{self.gateway.log_path}; restarting it on the same cache")
            self.start_gateway(empty=False)
            return True
        c = self.cluster
        if c is not None and c.master is not None and not c.master.alive():
            raise HarnessError(f"the Spark Master exited by itself; see {c.master.log_path}")
        if c is not None:
            for i, w in enumerate(c.workers):
                if w is not None and not w.alive():
                    self.unexpected.append(f"t={self.elapsed():.0f}s: worker {i} exited by "
                                           f"itself ({w.proc.returncode})")
                    self.say(f"UNEXPECTED: worker {i} exited; see {w.log_path}; replacing it")
                    c.start_worker(i, timeout=300)
                    self.worker_starts += 1
                    return True
        return False

    def finish(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.gateway is not None:
            rc = self.gateway.stop()
            if rc not in (0, None):
                self.unexpected.append(f"final clean gateway stop exited {rc}")
            self.gateway = None

    def summary(self) -> dict:
        out = super().summary()
        out.update(mode="cluster", gateway_starts=self.gateway_n,
                   gateway_restarts=dict(self.gateway_restarts),
                   worker_starts=self.worker_starts, clusters=self.cluster_n)
        return out

    def cleanup(self) -> None:
        try:
            if self.cluster is not None:
                self.cluster.stop()
        finally:
            if self.gateway is not None:
                self.gateway.kill()
                self.gateway = None
            super().cleanup()


# =========================================================================== main

def _weights(text: str, defaults: dict | None = None) -> dict:
    """``kind=w,...`` over ``defaults`` (the mode's weights; a kind of neither mode is an
    error; the mode checks its own kinds)."""
    w = dict(defaults or {})
    for part in text.split(","):
        if not part.strip():
            continue
        k, _, v = part.partition("=")
        if k.strip() not in KINDS + CLUSTER_KINDS:
            raise argparse.ArgumentTypeError(
                f"unknown kind {k!r}: one of {', '.join(KINDS)} (mount mode) or "
                f"{', '.join(CLUSTER_KINDS)} (--cluster)")
        w[k.strip()] = float(v)
    return w


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_driver":
        return driver_main(argv[1])
    p = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=300, help="seconds of crash loop (default 300)")
    p.add_argument("--seed", type=int, default=1, help="RNG seed of the kill schedule (default 1)")
    p.add_argument("--max-kills", type=int, default=None,
                   help="stop after this many kill events even if time is left")
    p.add_argument("--cluster", action="store_true",
                   help="cluster mode: a Spark standalone cluster (Master, two 1-core Workers, "
                        "driver, each a node with its own local disk) checkpointing through "
                        "`sos gateway`; kills of gateway, server, executor, worker, driver, all")
    p.add_argument("--weights", type=_weights, default={},
                   help="relative frequency of each kind, e.g. server=5,mount=2,driver=1,all=1 "
                        "(--cluster: gateway=4,server=1,executor=2,worker=2,driver=1,all=1)")
    p.add_argument("--delay", type=float, nargs=2, default=(0.3, 3.0), metavar=("MIN", "MAX"),
                   help="seconds between a restart and the next kill (uniform, default 0.3 3)")
    p.add_argument("--rows", type=int, default=20, help="new record ids per input file/batch")
    p.add_argument("--ahead", type=int, default=2, help="input files fed ahead of the query")
    p.add_argument("--state-store", choices=("hdfs", "rocksdb"), default="hdfs")
    p.add_argument("--stall-timeout", type=float, default=240,
                   help="seconds without a committed batch before the run gives up (exit 2)")
    p.add_argument("--no-spare", dest="standby", action="store_false",
                   help="start every replacement driver cold (default: keep one warm spare "
                        "driver process with its SparkSession up to replace a killed driver)")
    p.add_argument("--workdir", help="work directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory on success")
    args = p.parse_args(argv)

    cls = ClusterSoak if args.cluster else Soak
    weights = dict(CLUSTER_WEIGHTS if args.cluster else DEFAULT_WEIGHTS, **args.weights)
    wrong = sorted(set(weights) - set(cls.KINDS))
    if wrong:
        p.error(f"--weights: {', '.join(wrong)} is no kind of the {cls.MODE} mode "
                f"({', '.join(cls.KINDS)})")
    work = args.workdir or tempfile.mkdtemp(prefix="sos-soak-")
    os.makedirs(work, exist_ok=True)
    soak = cls(duration=args.duration, seed=args.seed, workdir=work, rows=args.rows,
               max_kills=args.max_kills, weights=weights, state_store=args.state_store,
               ahead=args.ahead, stall_timeout=args.stall_timeout, delay=tuple(args.delay),
               standby=args.standby)

    def on_term(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_term)
    code = 0
    result = None
    try:
        result = soak.run()
    except Violation as exc:
        soak.violations.append(str(exc))
        soak.say(f"VIOLATION: {exc}")
        code = 1
    except HarnessError as exc:
        soak.say(f"HARNESS ERROR: {exc}")
        code = 2
    except KeyboardInterrupt as exc:
        soak.say(f"interrupted ({exc or 'SIGINT'})")
        code = 2
    except Exception as exc:  # noqa: BLE001 - any surprise keeps the logs
        import traceback

        soak.say(f"HARNESS ERROR: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        code = 2
    finally:
        try:
            soak.cleanup()
        except Exception as exc:  # noqa: BLE001
            print(f"cleanup: {exc!r}", file=sys.stderr)
    if result is None:
        result = soak.summary()
        result["ok"] = False
    k = result["kills"]
    print(f"kill events: {result['kill_events']} ("
          + ", ".join(f"{kind} {k[kind]}" for kind in cls.KINDS)
          + f") in {result['duration_s']:.0f}s = {result['kills_per_hour']:.0f}/h", flush=True)
    if args.cluster:
        g = result["gateway_restarts"]
        print(f"gateway restarts after a gateway kill: {g['same-cache']} on the same cache, "
              f"{g['empty-cache']} on an empty cache; processes SIGKILLed: "
              + ", ".join(f"{n} {w}" for w, n in result["processes_killed"].items()), flush=True)
    print(f"restores after total loss: {result['restores']['sos-restore']} via sos restore, "
          f"{result['restores']['empty-cache']} via a "
          f"{'gateway' if args.cluster else 'mount'} on an empty cache; "
          f"query restarted in the same JVM {result['query_restarts_same_jvm']} times; "
          f"driver processes started {result['driver_starts']} "
          f"({result['spare_driver_promotions']} took over as warm spares)", flush=True)
    print(f"checks: {result['checks']}, records checked {result['records_checked']} "
          f"(final {result['records_final']} of {result['batches_committed']} batches); "
          f"violations {len(result['violations'])}", flush=True)
    rec = result["median_recovery_s"]
    print("median time from a kill to the next committed batch: "
          + ", ".join(f"{k} {rec[k]}s" for k in cls.KINDS if rec[k] is not None), flush=True)
    if result["unexpected"] or result["query_failures"]:
        print(f"unexpected exits: {len(result['unexpected'])}; query failures not caused by a "
              + ("mount kill" if not args.cluster else "driver kill (restarted in the same driver)")
              + f": {len(result['query_failures'])} (see SOAK-RESULT)", flush=True)
    if code != 0 or args.keep:
        print(f"logs kept in {work} (logs/events.log, server.log, "
              + ("gatewayN.log, clusterN/logs/" if args.cluster else "mountN.log, driverN.log")
              + ")", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    result["exit"] = code
    result["workdir"] = work if (code != 0 or args.keep) else None
    print("SOAK-RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
