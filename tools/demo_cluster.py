"""The cluster demo (README's first command, ``./scripts/demo``): a Spark cluster
checkpoints through ``sos gateway`` and survives the loss of a worker, a gateway restart
and the loss of everything.

1. A real ``sos-server`` (the remote, append-only storage) and ``sos gateway`` for one
   namespace (a child process outside the cluster, OAuth2 as Spark's stock WebHDFS client
   does it). A standalone Spark cluster from the pip package (:mod:`tools.cluster`): a
   Master, two Workers of one core each and the driver, every one a "node" of its own (a
   private mount namespace with its own tmpfs as local disk).
2. The driver runs a stateful query (``dropDuplicates``; every id arrives twice, in two
   micro-batches) for each state store asked (HDFS-backed and RocksDB by default, side by
   side), each with ``checkpointLocation = webhdfs://gateway/queries/<store>`` and a
   foreachBatch sink that writes ``out/<store>/batch-<N>.jsonl`` outside the nodes (the
   external sink), idempotent by batch id.
3. Worker loss: while batch K1's output is written and ``commits/K1`` is not, one Worker
   and its executor are SIGKILLed (its node and local disk vanish). Its tasks move to the
   other Worker, whose executor reads the lost executor's state files through the gateway.
   A new Worker (an empty node) joins later.
4. Gateway restart: in batch K2 (output written, not committed), the gateway is SIGKILLed
   and the queries go on against it; once they have met the dead gateway it is started
   again on the same port and cache. With Hadoop's retry policy
   (``spark_plugin.spark.gateway_conf``) the queries ride through. (A request in flight at
   a kill is not retried: see :func:`gateway_restart`.)
5. Total loss in batch K3 (output written, not committed): every process (driver, Workers,
   Master, gateway, sos-server) SIGKILLed, every local directory deleted, the gateway's
   cache and the server's data directory too. The server ran with ``--tier`` on the demo's
   object store (moto's S3 server, embedded, on 127.0.0.1): once the bucket has caught up
   (the tier's lag 0), the server and its disk go. A replacement ``sos-server`` on an EMPTY
   data directory with the same ``--tier`` (the keys from a backup copy) rebuilds the
   namespace from the bucket; ``sos restore --from`` the bucket alone gives the same tree
   as ``sos restore`` from the replacement. A gateway on an EMPTY cache restores the
   namespace from the replacement server; it must hold batches 0..K3-1 (RPO 0). A new
   cluster and driver resume the query to the end.
6. The check: keep only the output of batches whose ``commits/N`` exists, compare with the
   input: nothing lost, nothing doubled, nothing corrupted, for every state store. The
   verdict is the last line; the exit code is 0 only on success.

Needs root (mount namespaces, tmpfs) and ``unshare``. ``python -m tools.demo --help``
for the options; ``python -m tools.demo --mount`` runs the single-JVM mount demo
(:mod:`tools.demo`). ``_driver CONFIG`` is the internal entry of the driver process.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass

from tools import child_env
from tools.demo_common import (
    DRIVER_JVM_OPTIONS,
    ROCKSDB_PROVIDER,
    DemoFailure,
    EmbeddedStore,
    LocalServer,
    backup_keys,
    check_output,
    check_problems,
    check_summary,
    fmt,
    keygen,
    make_input,
    report,
    restore_keys,
    say,
    tail,
    tree_of,
    use_journal_key,
    wait_tier_drained,
    write_batch_output,
)
from tools.logtext import as_text

NAMESPACE = "sparkcluster"
STORES = ("hdfs", "rocksdb")
PROVIDER = {"hdfs": None, "rocksdb": ROCKSDB_PROVIDER}

#: log4j2 configuration of every JVM of the cluster: warnings (lost executors and tasks),
#: plus what the demo reads back: Hadoop's WebHDFS retries, the state stores' loads and
#: commits
LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss.SSS} %p %c{1}: %m%n%ex
logger.webhdfs.name = org.apache.hadoop.hdfs.web.WebHdfsFileSystem
logger.webhdfs.level = info
logger.retry.name = org.apache.hadoop.io.retry
logger.retry.level = info
logger.state.name = org.apache.spark.sql.execution.streaming.state
logger.state.level = info
"""


def checkpoint_of(store: str) -> str:
    """The query's checkpoint, inside the namespace."""
    return f"queries/{store}"


# --------------------------------------------------------------------------- driver process


def driver_main(cfg_path: str) -> int:
    """The Spark driver (on a node of its own): one stateful query per state store, all
    checkpointing through the gateway, run until the input is used up."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    spark, locations = _driver_session(cfg)
    queries = [(store, loc, _start_query(spark, cfg, store, loc)) for store, loc in locations.items()]
    with open(cfg["runs"], "w") as f:  # which query run is which (executor logs name runs)
        json.dump({store: str(query.runId) for store, _loc, query in queries}, f)
    failed = _await_queries(queries, cfg["flags"])
    markers = {store: _markers_of(loc.listener, query) for store, loc, query in queries}
    with open(cfg["result"], "w") as f:
        json.dump({"failed": failed, "markers": markers}, f)
    spark.stop()
    return 1 if failed else 0


def _driver_session(cfg: dict):
    """The SparkSession on the cluster (``cfg["spark_conf"]``) and, for each state store,
    its query's checkpoint location on the gateway (the key from ``$SOS_KEY``)."""
    from pyspark.sql import SparkSession

    from spark_plugin.spark import gateway_checkpoint

    key = os.environ["SOS_KEY"]
    builder = (
        SparkSession.builder.appName("sos-cluster-demo")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "768m")
        .config("spark.sql.streaming.stateStore.maintenanceInterval", "60s")
        # wait for both executors before the first batch: the state is spread
        .config("spark.scheduler.minRegisteredResourcesRatio", "1.0")
        .config("spark.scheduler.maxRegisteredResourcesWaitingTime", "120s")
    )
    for k, v in cfg["spark_conf"].items():
        builder = builder.config(k, v)
    locations = {s: gateway_checkpoint(builder, cfg["url"], NAMESPACE, key, checkpoint_of(s)) for s in cfg["stores"]}
    return builder.getOrCreate(), locations


def _start_query(spark, cfg: dict, store: str, loc):
    """The stateful query of ``store`` (its state store provider), checkpointing at ``loc``;
    its sink writes ``out/<store>/`` and parks in the batches ``cfg["pause_at"]``."""
    out_dir = os.path.join(cfg["out"], store)
    os.makedirs(out_dir, exist_ok=True)
    loc.attach(spark, query_name=store)
    provider = PROVIDER[store]
    if provider:
        spark.conf.set("spark.sql.streaming.stateStore.providerClass", provider)
    else:
        spark.conf.unset("spark.sql.streaming.stateStore.providerClass")
    pause_at = set(cfg.get("pause_at", []))
    flags = cfg["flags"]

    def sink(df, batch_id):
        write_batch_output(out_dir, df, batch_id)
        if batch_id in pause_at:
            # output written, commits/N not yet: where the demo strikes
            with open(os.path.join(flags, f"paused-{store}-{batch_id}"), "w") as f:
                f.write(str(os.getpid()))
            while not os.path.exists(os.path.join(flags, f"resume-{batch_id}")):
                time.sleep(0.1)

    # the query clones the session's settings when it starts: each keeps its provider
    return (
        spark.readStream.schema("id LONG, payload STRING")
        .option("maxFilesPerTrigger", 1)
        .json(cfg["input"])
        .dropDuplicates(["id"])
        .writeStream.queryName(store)
        .foreachBatch(sink)
        .option("checkpointLocation", str(loc))
        .trigger(availableNow=True)
        .start()
    )


def _await_queries(queries: list, flags: str) -> list[str]:
    """Wait for every query to end; a query that fails is reported at once
    (``flags/failed-<store>``: the demo may be waiting on it). Returns the failures."""
    failed = []
    running = list(queries)
    while running:
        for store, loc, query in list(running):
            if query.isActive:
                continue
            running.remove((store, loc, query))
            exc = query.exception()
            if exc is not None:
                failed.append(f"{store}: {exc}")
                with open(os.path.join(flags, f"failed-{store}"), "w") as f:
                    f.write(str(exc))
        time.sleep(0.2)
    return failed


def _markers_of(listener, query) -> dict:
    """The markers the query's listener wrote, once it has seen the last batch (progress
    events reach the listener asynchronously)."""
    last = query.lastProgress
    last_batch = int(last["batchId"]) if last else -1
    deadline = time.monotonic() + 120
    while (
        last_batch >= 0 and last_batch not in listener.written and not listener.errors and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    return {"written": listener.written, "errors": listener.errors}


# --------------------------------------------------------------------------- what the logs say

#: one request in the gateway's request log (``sos gateway --debug``)
REQUEST_RE = re.compile(
    r" DEBUG (GET|PUT|POST|DELETE) (\S+) /webhdfs/v1(/\S*?)( \[data\])? "
    r"-> (\d+) \([\d.]+ ms\) ?(\S*)$",
    re.MULTILINE,
)


@dataclass(frozen=True)
class Request:
    method: str
    op: str
    path: str  # inside the namespace, with a leading /
    data: bool  # the data step of a two-step OPEN/CREATE/APPEND
    status: int
    query: str = ""

    @property
    def destination(self) -> str:
        """A RENAME's target."""
        return urllib.parse.parse_qs(self.query).get("destination", [""])[0]


def read_from(path: str, start: int = 0, end: int | None = None) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            raw = f.read() if end is None else f.read(max(0, end - start))
    except FileNotFoundError:
        return ""
    return raw.decode("utf-8", "replace")


def gateway_requests(text: str) -> list[Request]:
    return [
        Request(m.group(1), m.group(2), m.group(3), bool(m.group(4)), int(m.group(5)), m.group(6))
        for m in REQUEST_RE.finditer(as_text(text))
    ]


def state_dir(store: str, partition: int) -> str:
    return f"/{checkpoint_of(store)}/state/0/{partition}/"


def _is_state_data(path: str, prefix: str) -> bool:
    # the operator's schema files live under partition 0's _metadata/: not partition data
    return path.startswith(prefix) and not path.startswith(prefix + "_metadata/")


def state_files_written(reqs: list[Request], store: str, partition: int) -> set[str]:
    """Data files of a state-store partition that ``reqs`` wrote: CREATEd with data, or
    the target of a RENAME (Hadoop writes a temp file, then renames it)."""
    prefix = state_dir(store, partition)
    out = set()
    for r in reqs:
        if r.status >= 300:
            continue
        if r.op == "CREATE" and r.data and _is_state_data(r.path, prefix):
            out.add(r.path)
        elif r.op == "RENAME" and _is_state_data(r.destination, prefix):
            out.add(r.destination)
    return out


def state_files_read(reqs: list[Request], store: str, partition: int) -> set[str]:
    """Data files of a state-store partition that ``reqs`` served (OPEN, data step)."""
    prefix = state_dir(store, partition)
    return {r.path for r in reqs if _is_state_data(r.path, prefix) and r.op == "OPEN" and r.data and r.status == 200}


#: an executor's state store names the partition and the query run it serves
PROVIDER_ID_RE = re.compile(r"partitionId=(\d+)[^\]]*\], queryRunId=([0-9a-f-]+)")


def executor_partitions(log_text: str, runs: dict[str, str]) -> set[tuple[str, int]]:
    """(store, partition) pairs an executor's log shows it loaded, for the query runs
    ``runs`` ({store: run id})."""
    store_of = {run: store for store, run in runs.items()}
    return {
        (store_of[m.group(2)], int(m.group(1))) for m in PROVIDER_ID_RE.finditer(log_text) if m.group(2) in store_of
    }


def executor_logs(node) -> dict[str, str]:
    """{executor id: its stderr} of the executors a Worker node launched, read from
    outside through ``/proc/PID/root`` (the work dir is on the node's private tmpfs)."""
    from tools.cluster import NODE_ROOT

    out: dict[str, str] = {}
    if node is None or not node.alive():
        return out
    work = f"/proc/{node.proc.pid}/root{NODE_ROOT}/work"
    for path in sorted(glob.glob(os.path.join(work, "*", "*", "stderr"))):
        exec_id = os.path.basename(os.path.dirname(path))
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                out[exec_id] = out.get(exec_id, "") + f.read()
        except OSError:
            continue
    return out


# --------------------------------------------------------------------------- the demo


class Demo:
    """The scenario's moving parts: server, gateway, cluster, driver, and their logs."""

    def __init__(self, work: str, *, records: int, batches: int, stores: tuple[str, ...]) -> None:
        self.work = work
        self.records = records
        self.batches = batches
        self.stores = stores
        self.paths = {
            k: os.path.join(work, k)
            for k in ("input", "out", "server-data", "flags", "logs", "gateway-cache", "key-backup", "aws")
        }
        for k in ("flags", "logs"):
            os.makedirs(self.paths[k], exist_ok=True)
        # the object store the server copies every acknowledged byte to (--tier)
        self.store = EmbeddedStore(self.paths["aws"])
        self.server = self.new_server(1)
        self.gateway_log = os.path.join(self.paths["logs"], "gateway.log")
        self.log4j = os.path.join(self.paths["logs"], "log4j2.properties")
        with open(self.log4j, "w") as f:
            f.write(LOG4J2)
        self.key = ""
        self.gateway = None
        self.cluster = None
        self.driver = None
        self.drivers = 0
        self.clusters = 0
        self.runs: dict[str, str] = {}

    # -- processes
    def new_server(self, n: int) -> LocalServer:
        """The sos-server on ``server-data`` with ``--tier`` on the demo's bucket (metrics on:
        the demo reads the tier's lag)."""
        return LocalServer(
            self.paths["server-data"],
            os.path.join(self.paths["logs"], f"server{n}.log"),
            args=["--tier", self.store.url],
            metrics=True,
        )

    def replace_server(self) -> dict:
        """After the server and its data directory are gone: the key files back from the
        backup, a new server on the EMPTY data directory with the same ``--tier``, which
        rebuilds the namespace from the bucket before it listens (docs/DEPLOY.md, "Replacing
        a lost server"). Returns what its bootstrap logged."""
        restore_keys(self.paths["key-backup"], self.paths["server-data"], NAMESPACE)
        self.server = self.new_server(2)
        t0 = time.monotonic()
        self.server.start()
        info: dict = {"start_s": round(time.monotonic() - t0, 2)}
        for line in self.server.log_text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if doc.get("msg") == "tier bootstrap":
                info.update({k: doc.get(k) for k in ("namespaces", "objects", "bytes", "cut", "problems", "seconds")})
        if "objects" not in info:
            raise DemoFailure(f"the replacement server logged no tier bootstrap:\n{self.server.log_text()[-3000:]}")
        if info["cut"] or info["problems"]:
            raise DemoFailure(f"the bootstrap from the bucket found problems: {info}")
        return info

    def restore_both_ways(self) -> dict:
        """``sos restore`` of the namespace twice: from the bucket alone (``--from URL``: no
        server, no key) and from the replacement server; the two trees must be equal."""
        from spark_plugin.spark import sos_command

        dirs = {
            "bucket": os.path.join(self.work, "restored-from-bucket"),
            "server": os.path.join(self.work, "restored-from-server"),
        }
        args = {"bucket": ["--from", self.store.url], "server": ["--server", self.server.address]}
        trees = {}
        for how in ("bucket", "server"):
            env = dict(os.environ, SOS_KEY=self.key) if how == "server" else dict(os.environ)
            proc = subprocess.run(
                [*sos_command(), "restore", "-q", *args[how], NAMESPACE, dirs[how]],
                capture_output=True,
                text=True,
                timeout=900,
                env=env,
            )
            if proc.returncode != 0:
                raise DemoFailure(f"sos restore {' '.join(args[how])} failed: {proc.stderr.strip()[-2000:]}")
            trees[how] = tree_of(dirs[how])
        if trees["bucket"] != trees["server"]:
            only = sorted(set(trees["bucket"]) ^ set(trees["server"]))
            differ = sorted(
                p for p in set(trees["bucket"]) & set(trees["server"]) if trees["bucket"][p] != trees["server"][p]
            )
            raise DemoFailure(
                f"the restore from the bucket differs from the replacement "
                f"server's: only one has {only[:5]}, contents differ {differ[:5]}"
            )
        return {
            "files": sum(1 for v in trees["bucket"].values() if v is not None),
            "bytes": sum(len(v) for v in trees["bucket"].values() if v is not None),
            "committed": {s: sorted(int(n) for n in _commit_names(trees["bucket"], s)) for s in self.stores},
        }

    def start_gateway(self, port: int = 0):
        from spark_plugin.gateway.process import GatewayProcess

        self.gateway = GatewayProcess(
            NAMESPACE,
            self.paths["gateway-cache"],
            self.server.address,
            self.key,
            listen=f"127.0.0.1:{port}",
            debug=True,
            log_path=self.gateway_log,
        ).start()
        return self.gateway

    @property
    def gateway_port(self) -> int:
        return int(self.gateway.url.rsplit(":", 1)[1])

    def start_cluster(self):
        from tools.cluster import SparkCluster

        self.clusters += 1  # each cluster keeps its nodes' logs apart
        base = os.path.join(self.work, f"cluster{self.clusters}")
        self.cluster = SparkCluster(base, workers=2, cores=1)
        self.cluster.start(wait=False)  # the Workers register while the driver starts
        return self.cluster

    def start_driver(self, pause_at: list[int]):
        self.drivers += 1
        n = self.drivers
        conf = self.cluster.spark_conf()
        log4j = f"-Dlog4j2.configurationFile=file:{self.log4j}"
        conf["spark.executor.extraJavaOptions"] += f" {log4j}"
        conf["spark.driver.extraJavaOptions"] = f"{DRIVER_JVM_OPTIONS} {log4j}"
        cfg = {
            "url": self.gateway.url,
            "stores": list(self.stores),
            "input": self.paths["input"],
            "out": self.paths["out"],
            "flags": self.paths["flags"],
            "pause_at": pause_at,
            "spark_conf": conf,
            "result": os.path.join(self.paths["flags"], f"driver{n}.json"),
            "runs": os.path.join(self.paths["flags"], f"runs{n}.json"),
        }
        cfg_path = os.path.join(self.work, f"driver{n}.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        env = child_env({"SOS_KEY": self.key})
        self.driver = self.cluster.start_driver(
            [sys.executable, "-m", "tools.demo_cluster", "_driver", cfg_path],
            env={"SOS_KEY": self.key, "PYTHONPATH": env["PYTHONPATH"]},
            name=f"driver{n}",
        )
        self.cluster.wait_workers()  # a new cluster's, spawned side by side with the driver
        self.driver_result = cfg["result"]
        self.runs_file = cfg["runs"]
        return self.driver

    def wait_paused(self, batch: int, timeout: float = 900.0) -> None:
        flags = [os.path.join(self.paths["flags"], f"paused-{s}-{batch}") for s in self.stores]
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(f) for f in flags):
            for store in self.stores:
                failed = os.path.join(self.paths["flags"], f"failed-{store}")
                if os.path.exists(failed):
                    with open(failed, encoding="utf-8", errors="replace") as f:
                        why = f.read()
                    raise DemoFailure(f"query {store} failed before batch {batch}: {why[:2000]}")
            if not self.driver.alive():
                raise DemoFailure(f"the driver died before batch {batch}:\n{tail(self.driver.log_path, 60)}")
            if time.monotonic() > deadline:
                raise DemoFailure(f"batch {batch} not reached after {timeout:.0f}s")
            time.sleep(0.2)

    def query_runs(self) -> dict[str, str]:
        """{store: run id} of the current driver's queries."""
        with open(self.runs_file) as f:
            return json.load(f)

    def save_executor_logs(self, label: str) -> None:
        """Copy the live executors' logs out of their nodes (a log shipper's job)."""
        for i, node in enumerate(self.cluster.workers if self.cluster else []):
            if node is None or not node.alive():
                continue
            for exec_id, text in executor_logs(node).items():
                name = f"{label}-worker{i}-executor{exec_id}.log"
                with open(os.path.join(self.paths["logs"], name), "w") as f:
                    f.write(text)

    def resume(self, batch: int) -> None:
        with open(os.path.join(self.paths["flags"], f"resume-{batch}"), "w"):
            pass

    # -- what the gateway holds
    def committed(self, store: str) -> set[int]:
        from spark_plugin.gateway.client import GatewayClient, GatewayError

        client = GatewayClient(self.gateway.url, NAMESPACE, self.key)
        try:
            doc = client.call("GET", f"/webhdfs/v1/{checkpoint_of(store)}/commits", op="LISTSTATUS")
        except GatewayError as exc:
            if exc.status == 404:
                return set()
            raise
        return {int(s["pathSuffix"]) for s in doc["FileStatuses"]["FileStatus"] if s["pathSuffix"].isdigit()}

    def committed_all(self) -> dict[str, set[int]]:
        return {s: self.committed(s) for s in self.stores}

    def log_size(self, path: str) -> int:
        try:
            return os.path.getsize(path)
        except FileNotFoundError:
            return 0

    # -- teardown
    def kill_everything(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.gateway is not None:
            self.gateway.kill()

    def close(self) -> None:
        try:
            if self.cluster is not None:
                self.cluster.stop()
            if self.gateway is not None:
                self.gateway.stop(timeout=60)  # flushes its journal
        finally:
            try:
                self.server.stop()
            finally:
                self.store.stop()


def _commit_names(tree: dict[str, bytes | None], store: str) -> list[str]:
    """The batch numbers under ``queries/<store>/commits/`` of a restored tree."""
    prefix = f"{checkpoint_of(store)}/commits/"
    return [
        p[len(prefix) :]
        for p, v in tree.items()
        if v is not None and p.startswith(prefix) and p[len(prefix) :].isdigit()
    ]


def _expect_commits(found: dict[str, set[int]], upto: int, when: str) -> None:
    want = set(range(upto))
    bad = {s: sorted(c) for s, c in found.items() if c != want}
    if bad:
        raise DemoFailure(f"{when}: expected batches {fmt(want)} committed, got {bad}")


def run_cluster_demo(
    *,
    records: int = 2000,
    batches: int = 8,
    stores: tuple[str, ...] = STORES,
    worker_loss_at: int = 2,
    gateway_restart_at: int = 4,
    total_loss_at: int = 6,
    workdir: str | None = None,
    keep: bool = False,
) -> dict:
    """Run the whole scenario; returns the result dict (``ok`` True/False)."""
    if not 0 < worker_loss_at < gateway_restart_at < total_loss_at < batches - 1:
        raise ValueError("need 0 < worker loss < gateway restart < total loss < batches - 1")
    from tools.cluster import can_isolate_nodes

    own_dir = workdir is None
    work = workdir or tempfile.mkdtemp(prefix="sos-cluster-demo-")
    os.makedirs(work, exist_ok=True)
    result: dict = {"ok": False, "workdir": work, "stores": list(stores)}
    undo_key = use_journal_key(work)  # every writer and restore of the demo authenticates the journal
    demo = Demo(work, records=records, batches=batches, stores=stores)
    try:
        why = can_isolate_nodes()
        if why:
            raise DemoFailure(
                f"cannot run the cluster demo here: {why} (./scripts/demo --mount runs the single-JVM demo)"
            )
        say(
            f"work dir {work}; state stores {', '.join(stores)}; {records} records in "
            f"{batches} files (each id sent twice: dropDuplicates state must remember them)"
        )
        expected = make_input(demo.paths["input"], records, batches)
        start_everything(demo, [worker_loss_at, gateway_restart_at, total_loss_at])
        # ---- 1. worker loss
        k1, k2, k3 = worker_loss_at, gateway_restart_at, total_loss_at
        demo.wait_paused(k1)
        _expect_commits(demo.committed_all(), k1, f"before the worker loss in batch {k1}")
        result["worker_loss"] = worker_loss(demo, k1)
        # ---- 2. gateway restart
        demo.wait_paused(k2)
        _expect_commits(demo.committed_all(), k2, f"after the worker loss, in batch {k2}")
        survivor_took_over(demo, result["worker_loss"], k1, k2)
        result["gateway_restart"] = gateway_restart(demo, k2)
        # ---- 3. total loss
        demo.wait_paused(k3)
        rode_through(demo, result["gateway_restart"])
        total_loss(demo, k3, result)
        rebuild_from_the_bucket(demo, k3, result["server_loss"])
        restore_the_gateway(demo, k3, result)
        final = resume(demo, result)
        # ---- the check
        result["check"] = {}
        problems = []
        for store in stores:
            check = check_output(os.path.join(demo.paths["out"], store), final[store], expected)
            result["check"][store] = check
            problems += [f"{store}: {p}" for p in check_problems(check, final[store], batches)]
            say(f"check {store}: {check_summary(check)}")
        result["records_in"] = len(expected)
        result["problems"] = problems
        result["ok"] = not problems
        return result
    except Exception as exc:
        result["problems"] = [str(exc) if isinstance(exc, DemoFailure) else f"{type(exc).__name__}: {exc}"]
        return result
    finally:
        demo.close()
        undo_key()
        if own_dir and not keep and result.get("ok"):
            shutil.rmtree(work, ignore_errors=True)
            result["workdir"] = None


def start_everything(demo: Demo, pause_at: list[int]) -> None:
    """The key (backed up), the object store, the server with ``--tier``, the gateway, the
    cluster, and the driver that pauses in the batches ``pause_at``."""
    demo.key = keygen(demo.paths["server-data"], NAMESPACE)
    backup_keys(demo.paths["server-data"], NAMESPACE, demo.paths["key-backup"])
    demo.store.start()
    say(f"object store: moto's S3 server at {demo.store.endpoint} (embedded), bucket {demo.store.url}")
    demo.server.start()
    say(
        f"sos-server listening on {demo.server.address} (the remote storage), copying "
        f"every acknowledged byte to {demo.store.url} (--tier); its keys backed up"
    )
    demo.start_gateway()
    say(
        f"sos gateway serving {NAMESPACE} at {demo.gateway.url} (cache "
        f"{demo.paths['gateway-cache']}, OAuth2 tokens for the namespace key)"
    )
    cluster = demo.start_cluster()
    say(
        f"Spark cluster: Master {cluster.master_url}, 2 Workers of 1 core; every node in a "
        f"mount namespace of its own with a private tmpfs as local disk"
    )
    demo.start_driver(pause_at)
    say(
        f"driver started on its own node: queries {', '.join(demo.stores)} checkpoint to "
        f"webhdfs://127.0.0.1:{demo.gateway_port}/queries/<store>"
    )


def survivor_took_over(demo: Demo, loss: dict, k1: int, k2: int) -> None:
    """After the worker loss in batch ``k1``, parked in ``k2``: the surviving executor must
    have read state files the lost one wrote, for every query; then a new worker joins.
    Adds what the logs show (:func:`state_read_after_loss`) to ``loss``."""
    loss.update(state_read_after_loss(demo, loss))
    say(
        f"worker {loss['survivor']}'s executor took over partitions "
        f"{', '.join(f'{s}/{p}' for s, p in loss['survivor_took_over']) or '(none)'} and ran "
        f"batch{'es' if k2 - k1 > 2 else ''} {fmt(range(k1 + 1, k2))} alone, reading {loss['state_files_read_count']} state "
        f"files the lost executor wrote through the gateway "
        f"({loss['task_failure_count']} task attempts lost with it)"
    )
    missing = sorted({s for s, _ in loss["victim_partitions"]} - {k.split("/")[0] for k in loss["state_files_read"]})
    if missing:
        raise DemoFailure(f"the surviving executor read no state file of the lost one for {', '.join(missing)}")
    demo.cluster.start_worker(loss["victim"])
    say(f"a new worker {loss['victim']} joins (an empty node)")


def rode_through(demo: Demo, restart: dict) -> None:
    """What the query saw of the gateway restart (:func:`what_the_query_saw`): added to
    ``restart`` and said."""
    restart.update(what_the_query_saw(demo, restart))
    say(
        f"the query rode through the gateway restart: {restart['retries']} retried requests "
        f"({restart['driver_retries']} in the driver), {restart['task_failure_count']} failed task "
        f"attempts; batches went on committing"
    )


def total_loss(demo: Demo, k3: int, result: dict) -> None:
    """Parked in batch ``k3`` with ``0..k3-1`` committed: every process SIGKILLed, the
    gateway's cache deleted, and, once the bucket has caught up, the server and its data
    directory. Notes the commits before and ``server_loss`` (the bucket's wait) in
    ``result``."""
    before = demo.committed_all()
    _expect_commits(before, k3, f"after the gateway restart, in batch {k3}")
    result["committed_before_total_loss"] = {s: sorted(c) for s, c in before.items()}
    say(f"batches {fmt(range(k3))} committed; batch {k3}'s output written, commits/{k3} not yet")
    demo.save_executor_logs("before-total-loss")
    demo.kill_everything()
    shutil.rmtree(demo.paths["gateway-cache"])
    # the server dies with its disk too. Without --durability tier, what the bucket
    # lacks when the server dies is lost with it (the upload lag, about --tier-interval):
    # the demo shows the bucket caught up, then the loss
    waited = wait_tier_drained(demo.server, NAMESPACE)
    demo.server.kill()
    shutil.rmtree(demo.paths["server-data"])
    result["server_loss"] = {"tier_drain_wait_s": round(waited, 2)}
    say(
        f"TOTAL LOSS: driver, Workers, Master, gateway and sos-server SIGKILLed; the "
        f"gateway's cache and the server's data directory deleted; every node's local "
        f"disk gone with its namespace (the bucket had caught up {waited:.1f}s before)"
    )


def rebuild_from_the_bucket(demo: Demo, k3: int, server_loss: dict) -> None:
    """A replacement server rebuilds from the bucket; ``sos restore`` from the bucket alone
    and from it give the same tree, with batches ``0..k3-1`` committed. Notes what each
    says in ``server_loss`` ("bootstrap", "restore")."""
    boot = demo.replace_server()
    server_loss["bootstrap"] = boot
    say(
        f"a replacement sos-server on an EMPTY data directory with the same --tier "
        f"rebuilt {NAMESPACE} from the bucket before listening ({boot['objects']} objects, "
        f"{boot['bytes']} bytes in {boot['seconds']}s); keys from the backup; listening on "
        f"{demo.server.address}"
    )
    both = demo.restore_both_ways()
    server_loss["restore"] = both
    say(
        f"sos restore --from {demo.store.url} (the bucket alone, no server, no key) gives "
        f"the same {both['files']} files ({both['bytes']} bytes) as sos restore from the "
        f"replacement server: batches {fmt(both['committed'][demo.stores[0]])} committed"
    )
    _expect_commits({s: set(c) for s, c in both["committed"].items()}, k3, "restored from the bucket")


def restore_the_gateway(demo: Demo, k3: int, result: dict) -> None:
    """A new gateway on an empty cache restores the namespace from the replacement server;
    it must hold batches ``0..k3-1`` (noted in ``result``)."""
    demo.start_gateway()
    restored = demo.committed_all()
    result["restored_committed"] = {s: sorted(c) for s, c in restored.items()}
    say(
        f"a new gateway on an empty cache restored {NAMESPACE} from the replacement "
        f"server ({demo.gateway.url}): batches {fmt(restored[demo.stores[0]])} committed"
    )
    _expect_commits(restored, k3, "restored from the replacement server")


def resume(demo: Demo, result: dict) -> dict[str, set[int]]:
    """A new cluster and driver run the queries to the end from the restored checkpoints;
    returns the batches committed (and notes them and the markers in ``result``)."""
    demo.start_cluster()
    drv = demo.start_driver([])
    say("a new cluster and driver resume the queries from the restored checkpoints")
    while drv.alive():
        time.sleep(0.5)
    demo.save_executor_logs("resumed")
    rc = drv.proc.returncode
    if rc != 0:
        raise DemoFailure(f"the resumed driver failed (exit {rc}):\n{tail(drv.log_path, 60)}")
    final = demo.committed_all()
    result["committed_final"] = {s: sorted(c) for s, c in final.items()}
    with open(demo.driver_result) as f:
        result["markers"] = json.load(f)["markers"]
    say(f"queries finished: batches {fmt(final[demo.stores[0]])} committed")
    return final


def worker_loss(demo: Demo, batch: int) -> dict:
    """Pick the Worker whose executor holds the most state, release ``batch``, and SIGKILL
    that Worker and its executor as soon as one of its state partitions is touched in the
    next batch (its task is running)."""
    cluster = demo.cluster
    runs = demo.query_runs()
    held = {}
    for i, node in enumerate(cluster.workers):
        for exec_id, text in executor_logs(node).items():
            held[i] = (exec_id, text, executor_partitions(text, runs))
    if len(held) != 2:
        raise DemoFailure(f"expected an executor on each worker, found {sorted(held)}")
    # the victim: the executor holding state of the most queries, then the most partitions
    victim = max(held, key=lambda i: (len({s for s, _ in held[i][2]}), len(held[i][2]), -i))
    survivor = 1 - victim
    exec_id, _text, parts = held[victim]
    if not parts:
        raise DemoFailure(f"no executor holds state after {batch} batches")
    info = {
        "victim": victim,
        "survivor": survivor,
        "victim_executor": exec_id,
        "survivor_executor": held[survivor][0],
        "victim_partitions": sorted([s, p] for s, p in parts),
        "gateway_offset": demo.log_size(demo.gateway_log),
        "driver_offset": demo.log_size(demo.driver.log_path),
    }
    demo.resume(batch)
    prefixes = tuple(state_dir(s, p) for s, p in parts)
    deadline = time.monotonic() + 120
    touched: list[Request] = []
    while not touched and time.monotonic() < deadline:
        touched = [
            r
            for r in gateway_requests(read_from(demo.gateway_log, info["gateway_offset"]))
            if any(_is_state_data(r.path, prefix) for prefix in prefixes)
        ]
        if not demo.driver.alive():
            raise DemoFailure(f"the driver died:\n{tail(demo.driver.log_path, 60)}")
        time.sleep(0.05)
    demo.save_executor_logs("before-worker-loss")  # its node's disk is about to vanish
    info["kill_offset"] = demo.log_size(demo.gateway_log)
    cluster.kill_worker(victim)
    info["killed_after"] = f"{touched[0].op} {touched[0].path}" if touched else ""
    say(
        f"WORKER LOSS in batch {batch + 1}: worker {victim} and its executor {exec_id} "
        f"SIGKILLed while at work ({info['killed_after'] or 'no request seen'}); it held state "
        f"partitions {', '.join(f'{s}/{p}' for s, p in sorted(parts))}; its node's disk is gone"
    )
    return info


def state_read_after_loss(demo: Demo, info: dict) -> dict:
    """What the survivor read: data files of the lost executor's partitions, written
    before its loss (by it: it ran those partitions), read after it (by the survivor:
    the only executor left until the new worker joins; the driver reads no partition
    data files)."""
    offset = info["kill_offset"]
    end = demo.log_size(demo.gateway_log)
    before = gateway_requests(read_from(demo.gateway_log, 0, offset))
    after = gateway_requests(read_from(demo.gateway_log, offset, end))
    read: dict[str, list[str]] = {}
    for store, p in info["victim_partitions"]:
        both = state_files_written(before, store, p) & state_files_read(after, store, p)
        if both:
            read[f"{store}/{p}"] = sorted(both)
    survivor_parts = set()
    for text in executor_logs(demo.cluster.workers[info["survivor"]]).values():
        survivor_parts |= executor_partitions(text, demo.query_runs())
    drv = read_from(demo.driver.log_path, info["driver_offset"])
    victim_parts = {tuple(x) for x in info["victim_partitions"]}
    return {
        "state_files_read": read,
        "evidence_end_offset": end,
        "state_files_read_count": sum(len(v) for v in read.values()),
        "survivor_took_over": sorted([s, p] for s, p in survivor_parts & victim_parts),
        "task_failures": sorted(set(LOST_TASK_RE.findall(drv))),
        "task_failure_count": len(LOST_TASK_RE.findall(drv)),
        "driver_saw": sorted(set(re.findall(r"Lost executor \S+", drv))),
    }


RETRY_RE = re.compile(r"Retrying connect to namenode")
LOST_TASK_RE = re.compile(r"Lost task \S+ in stage \S+ \(TID \d+\) \([^)]*\): (\w[\w.$]*)")


def _retries(demo: Demo) -> tuple[int, list[str]]:
    """Hadoop's "Retrying connect" lines in the driver's and the live executors' logs."""
    texts = [read_from(demo.driver.log_path)]
    texts += [t for node in demo.cluster.workers for t in executor_logs(node).values()]
    lines = [line for t in texts for line in t.splitlines() if RETRY_RE.search(line)]
    return len(lines), lines


def gateway_restart(demo: Demo, batch: int) -> dict:
    """SIGKILL the gateway while the queries are parked in ``batch`` (output written,
    ``commits/<batch>`` not yet: no request of theirs in flight), release them: they meet
    the dead gateway (connection refused) and Hadoop's retry policy retries; as soon as a
    retry shows in a log, start the gateway again on the same port and cache.

    (A request in flight at the kill is not retried by Hadoop once its body is sent: in
    an executor its task fails and Spark runs it again; in the driver the query stops with
    ``java.net.SocketException: Unexpected end of file from server``. docs/SPARK.md.)"""
    port = demo.gateway_port
    drv_offset = demo.log_size(demo.driver.log_path)
    retries_before, _ = _retries(demo)
    t0 = time.monotonic()
    demo.gateway.kill()
    say(
        f"GATEWAY KILLED (SIGKILL) in batch {batch} (output written, commits/{batch} not yet); "
        f"the queries go on against the dead gateway"
    )
    demo.resume(batch)
    # the retry policy allows about 22 s from the first refusal: restart as soon as the
    # query has met the dead gateway
    hit: list[str] = []
    while not hit and time.monotonic() - t0 < 60:
        n, lines = _retries(demo)
        hit = lines[retries_before:] if n > retries_before else []
        if not demo.driver.alive():
            raise DemoFailure(f"the driver died:\n{tail(demo.driver.log_path, 60)}")
        time.sleep(0.05)
    demo.start_gateway(port)
    downtime = time.monotonic() - t0
    say(
        f"gateway restarted on the same port and cache after {downtime:.1f}s"
        + (f"; the query was retrying: {hit[0].split(': ', 1)[-1][:90]}..." if hit else "; no retry seen")
    )
    return {"downtime_s": round(downtime, 2), "driver_offset": drv_offset, "retries_before": retries_before}


def what_the_query_saw(demo: Demo, info: dict) -> dict:
    """Retries and task failures in the driver's and live executors' logs since the kill."""
    drv = read_from(demo.driver.log_path, info["driver_offset"])
    n, lines = _retries(demo)
    return {
        "retries": n - info["retries_before"],
        "retry_lines": lines[info["retries_before"] :][:5],
        "driver_retries": len(RETRY_RE.findall(drv)),
        "task_failures": sorted(set(LOST_TASK_RE.findall(drv))),
        "task_failure_count": len(LOST_TASK_RE.findall(drv)),
        "driver_alive": demo.driver.alive(),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_driver":
        return driver_main(argv[1])
    p = argparse.ArgumentParser(
        prog="scripts/demo",
        description="A Spark cluster checkpoints through sos gateway: a worker loss, a gateway "
        "restart and a total loss, then the committed output is checked exactly "
        "once. --mount runs the single-JVM FUSE mount demo instead (see "
        "scripts/demo --mount --help).",
    )
    p.add_argument("--records", type=int, default=2000, help="unique record ids (default 2000)")
    p.add_argument("--batches", type=int, default=8, help="input files = micro-batches (default 8)")
    p.add_argument(
        "--state-store",
        choices=("hdfs", "rocksdb", "both"),
        default="both",
        help="the queries' state stores (default both: one query each)",
    )
    p.add_argument("--workdir", help="work directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", action="store_true", help="print the result as JSON before the verdict")
    p.add_argument(
        "--mount", action="store_true", help="run the single-JVM FUSE mount demo instead (its options: --mount --help)"
    )
    args = p.parse_args(argv)
    if args.mount:  # listed for --help; tools.demo.main (the entry) dispatches it before this
        p.error("--mount: run python -m tools.demo --mount (./scripts/demo --mount)")
    stores = STORES if args.state_store == "both" else (args.state_store,)
    b = args.batches
    try:
        result = run_cluster_demo(
            records=args.records,
            batches=b,
            stores=stores,
            worker_loss_at=max(1, b // 4),
            gateway_restart_at=b // 2,
            total_loss_at=3 * b // 4,
            workdir=args.workdir,
            keep=args.keep,
        )
    except ValueError as exc:
        p.error(f"{exc} (--batches 5 or more)")
    return report(
        result,
        as_json=args.json,
        passed=lambda: (
            f"exactly once through a worker loss, a gateway restart and a total "
            f"loss with the server's data directory (restored from the bucket): "
            f"{result['records_in']} records in, 0 lost, 0 doubled, 0 corrupted "
            f"({' and '.join(stores)} state store{'s' if len(stores) > 1 else ''})"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
