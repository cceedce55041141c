"""A real Spark standalone cluster checkpoints through `sos gateway`: the cluster demo
(README's first command) run once as CI runs it, then its claims checked from the raw
logs it leaves.

Real parts: a `sos-server` process, `sos gateway` as a child process outside the cluster
(OAuth2 through Hadoop's stock WebHDFS client, Hadoop's retry policy from `gateway_conf`),
a Master, two Workers of one core and the driver from the pip package, each a node in a
mount namespace of its own with a private tmpfs as local disk (tools/cluster.py). Two
stateful queries (dropDuplicates, HDFS-backed and RocksDB state stores) run side by side.

- worker loss: one Worker and its executor SIGKILLed while the next batch runs; the other
  executor takes over its state partitions and reads the files the lost one wrote, through
  the gateway; the batches go on committing;
- gateway restart: SIGKILL mid-batch (the queries parked, no request in flight), then the
  queries go on against it: they retry (Hadoop's "Retrying connect" lines) until it is
  back on the same port and cache; no query fails, the batches go on committing;
- total loss: every process and local directory, the gateway's cache and the server's data
  directory included (the server ran with `--tier` on moto's S3 server, embedded in the
  demo, on 127.0.0.1); a replacement server on an empty data directory with the same
  `--tier` rebuilds the namespace from the bucket (keys from a backup copy), `sos restore
  --from` the bucket alone gives the same tree as `sos restore` from it; a gateway on an
  empty cache restores the namespace from the replacement with every committed batch
  (RPO 0); a new cluster resumes; committed output exactly once, for both state stores.
  (issue 19 item 8's last case: this one run covers both state stores.)
- the namespace key: the executors get it with their tasks, never on a command line nor in
  their environment (the processes are read from /proc while the demo runs);
- the class-data archive (tools/jvm.py): the drivers and executors map Spark's classes from
  it (their class-loading logs: ``$SOS_SPARK_JVM_EXTRA`` adds ``-Xlog:class+load``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import urllib.parse

import psutil
import pytest

from sos_wire.logs import JsonFormatter
from tests.support import tree_snapshot
from tools import child_env
from tools.demo_cluster import (
    PROVIDER_ID_RE,
    Request,
    executor_partitions,
    gateway_requests,
    state_files_read,
    state_files_written,
)
from tools.jvm import archive_path

RECORDS = 1200
#: the fewest batches that keep each event apart (tools.demo_cluster: --batches 5 or more): the
#: worker loss in batch K1 = 6 // 4, the survivor alone in batch 2, the gateway restart in K2 =
#: 6 // 2, the total loss in K3 = 3 * 6 // 4, and batch 5 after the resume
BATCHES = 6
K1, K2, K3 = 1, 3, 4  # worker loss after batch K1, gateway restart after K2, total loss in K3
STORES = ("hdfs", "rocksdb")


class ProcessWatch(threading.Thread):
    """Reads /proc every second while the demo runs: every command line of the machine, and
    the command line and environment of each process of the demo's tree that is an
    executor or a driver (what ``ps`` and ``/proc/PID/environ`` show a local user)."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.cmdlines: set[str] = set()
        self.executors: dict[int, tuple[list[str], str]] = {}  # pid: (argv, environment)
        self.drivers: dict[int, tuple[list[str], dict[str, str]]] = {}
        self.classes = None  # the directory of the JVMs' class-loading logs (PID.log)
        #: pid: the scans that found it alive (a JVM killed within its first second, the
        #: worker loss or the total loss, may be seen before it opened its class log)
        self.scans: dict[int, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.scan()

    def scan(self) -> None:
        procs = list(psutil.process_iter(["pid", "ppid", "cmdline"]))
        children: dict[int, list[int]] = {}
        for p in procs:
            children.setdefault(p.info["ppid"], []).append(p.info["pid"])
        tree, todo = set(), [self.root]
        while todo:
            pid = todo.pop()
            tree.add(pid)
            todo.extend(children.get(pid, []))
        for p in procs:
            argv = p.info["cmdline"] or []
            line = "\0".join(argv)
            self.cmdlines.add(line)
            if p.info["pid"] not in tree:
                continue
            self.scans[p.info["pid"]] = self.scans.get(p.info["pid"], 0) + 1
            try:
                if "CoarseGrainedExecutorBackend" in line and p.pid not in self.executors:
                    env = "\0".join(f"{k}={v}" for k, v in p.environ().items())
                    self.executors[p.pid] = (argv, env)
                elif "org.apache.spark.deploy.SparkSubmit" in argv or "tools.demo_cluster" in argv:
                    self.drivers[p.pid] = (argv, p.environ())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass


def _driver_jvm(argv: list[str]) -> bool:
    """A driver's JVM (PySpark's spark-submit execs it; not the launcher JVM that builds its
    command line first)."""
    return (
        bool(argv)
        and os.path.basename(argv[0]) == "java"
        and "org.apache.spark.deploy.SparkSubmit" in argv
        and "org.apache.spark.launcher.Main" not in argv
    )


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One run of ``python -m tools.demo`` (the cluster demo): its exit code, stdout lines,
    JSON result and work directory, and what /proc showed while it ran."""
    base = tmp_path_factory.mktemp("cluster-demo")
    work, classes = base / "work", base / "classes"
    classes.mkdir()
    # every Spark JVM of the run logs the classes it loads, and where from, to classes/PID.log
    env = child_env(dict(os.environ, SOS_SPARK_JVM_EXTRA=f"-Xlog:class+load=info:file={classes}/%p.log"))
    cmd = [
        sys.executable,
        "-m",
        "tools.demo",
        "--records",
        str(RECORDS),
        "--batches",
        str(BATCHES),
        "--workdir",
        str(work),
        "--json",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    watch = ProcessWatch(proc.pid)
    watch.start()
    try:
        out, err = proc.communicate(timeout=1400)
    finally:
        watch.stop.set()
        watch.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    lines = out.strip().splitlines()
    result = next((json.loads(line) for line in lines if line.startswith("{")), None)
    assert result is not None, out[-3000:] + err[-3000:]
    watch.classes = classes
    return run, lines, result, work, watch


@pytest.fixture(scope="module")
def demo(demo_run):
    """The cluster demo's run: exit code, stdout lines, JSON result, work directory."""
    return demo_run[:4]


@pytest.fixture(scope="module")
def watch(demo_run) -> ProcessWatch:
    """What /proc showed while the cluster demo ran."""
    return demo_run[4]


def _log(work, name, start=0, end=None):
    """A log of the run (bytes ``start``..``end``), as text."""
    with open(os.path.join(work, "logs", name), "rb") as f:
        raw = f.read()
    return raw[start:end].decode("utf-8", "replace")


# ---- the run: verdict and exactly once --------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cluster_demo_passes_exactly_once_for_both_state_stores(demo):
    proc, lines, result, _work = demo
    assert proc.returncode == 0, "\n".join(lines[-30:]) + proc.stderr[-3000:]
    assert lines[-1].startswith("VERDICT: PASS"), lines[-1]  # the verdict comes last
    assert all(re.match(r"\[ *\d+\.\ds\] ", line) for line in lines[:-1] if not line.startswith("{")), (
        lines
    )  # progress lines carry their time
    assert result["ok"] is True and result["problems"] == []
    assert result["stores"] == list(STORES)
    for store in STORES:
        assert result["committed_final"][store] == list(range(BATCHES))
        check = result["check"][store]
        assert check["records_in"] == check["records_out"] == RECORDS
        for k in ("lost", "doubled", "corrupted", "unknown", "committed_without_output", "uncommitted_output_ignored"):
            assert check[k] == [], (store, k)
        # the resumed driver's GatewayMarkerListener marked the batches it committed
        assert result["markers"][store]["errors"] == []
        assert sorted(set(result["markers"][store]["written"])) == list(range(K3, BATCHES))


# ---- worker loss ------------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_worker_loss_the_survivor_reads_the_lost_executors_state(demo):
    _proc, _lines, result, work = demo
    loss = result["worker_loss"]
    victim, survivor = loss["victim"], loss["survivor"]
    assert {victim, survivor} == {0, 1}
    victim_parts = {tuple(p) for p in loss["victim_partitions"]}
    # both executors were registered before batch 0 (minRegisteredResourcesRatio=1), so
    # each query's two partitions were spread over both: the lost one held state of both
    assert {s for s, _ in victim_parts} == set(STORES), loss
    # the driver learned of the loss; the survivor's executor took over every partition
    assert f"Lost executor {loss['victim_executor']}" in loss["driver_saw"]
    assert {tuple(p) for p in loss["survivor_took_over"]} == victim_parts

    # from the raw logs: the lost executor's own log names the state files it wrote ...
    with open(os.path.join(work, "flags", "runs1.json")) as f:
        runs = json.load(f)
    victim_log = _log(work, f"before-worker-loss-worker{victim}-executor{loss['victim_executor']}.log")
    assert victim_parts <= executor_partitions(victim_log, runs)
    # each query runs the state store it was started with (one session, two providers)
    for store, provider in (("hdfs", "HDFSBackedStateStoreProvider"), ("rocksdb", "RocksDB")):
        for line in victim_log.splitlines():
            if f"queryRunId={runs[store]} ]:" in line:
                assert provider in line.split(" StateStoreProviderId[")[0], line
    # the gateway's requests before the kill, and from then until the survivor had run
    # the next batches alone (before the new worker joined)
    assert loss["gateway_offset"] <= loss["kill_offset"] < loss["evidence_end_offset"]
    before = gateway_requests(_log(work, "gateway.log", 0, loss["kill_offset"]))
    after = gateway_requests(_log(work, "gateway.log", loss["kill_offset"], loss["evidence_end_offset"]))
    read_by_survivor = set()
    for store, p in victim_parts:
        written = state_files_written(before, store, p)
        read = state_files_read(after, store, p)
        # ... the gateway had them written before the kill, and served them after it:
        # only the survivor was left to read them
        assert written & read, (store, p, sorted(written), sorted(read))
        assert sorted(written & read) == loss["state_files_read"][f"{store}/{p}"]
        # files the lost executor's own log names as written by it: HDFS deltas by their
        # URL, RocksDB SSTs by their unique DFS name
        named = {
            f for f in written & read if f in victim_log or (f.endswith(".sst") and os.path.basename(f) in victim_log)
        }
        read_by_survivor |= {(store, f) for f in named}
    # for every query it held state of, the survivor read files the lost executor wrote
    assert {s for s, _ in read_by_survivor} == {s for s, _ in victim_parts}, read_by_survivor
    # and the survivor's log shows it loaded those partitions of the same query runs
    survivor_log = _log(work, f"before-total-loss-worker{survivor}-executor{loss['survivor_executor']}.log")
    assert victim_parts <= executor_partitions(survivor_log, runs)


# ---- gateway restart --------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_gateway_restart_mid_batch_the_query_rides_through(demo):
    _proc, lines, result, work = demo
    gw = result["gateway_restart"]
    # the gateway was SIGKILLed while both queries were parked in batch K2 (no request in
    # flight), then they were released against it. What the query saw: connections
    # refused, retried by Hadoop's retry policy (spark_plugin.spark.GATEWAY_RETRY_SPEC)
    # until the gateway was back on the same port and cache
    assert gw["retries"] >= 1, gw
    assert all(
        "Retrying connect to namenode" in line and "MultipleLinearRandomRetry" in line for line in gw["retry_lines"]
    ), gw["retry_lines"]
    # no query failed: the same driver went on to commit every batch up to the total loss
    assert gw["driver_alive"] is True
    for store in STORES:
        assert result["committed_before_total_loss"][store] == list(range(K3))
    assert any("the query rode through the gateway restart" in line for line in lines)
    # the same port twice (restart), then a new gateway after the total loss
    ready = re.findall(r"sos gateway: ready on (\S+)", _log(work, "gateway.log"))
    assert len(ready) == 3 and ready[0] == ready[1] != ready[2], ready


# ---- total loss -------------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_total_loss_a_gateway_on_an_empty_cache_restores_every_committed_batch(demo):
    _proc, _lines, result, work = demo
    for store in STORES:
        # RPO 0: batches 0..K3-1 were committed when everything was lost; all came back
        assert result["committed_before_total_loss"][store] == list(range(K3))
        assert result["restored_committed"][store] == list(range(K3))
    gateway_log = _log(work, "gateway.log")
    last_start = gateway_log.rindex("sos gateway: ready on")
    assert (
        "was rebuilt from the server"
        in gateway_log[gateway_log.rindex("sos gateway: ready on", 0, last_start) : last_start]
    )
    # the restarted queries ran on new nodes: a second cluster, whose driver resumed
    assert os.path.isdir(os.path.join(work, "cluster2", "logs"))
    for store in STORES:
        names = sorted(os.listdir(os.path.join(work, "out", store)))
        assert names == [f"batch-{b:06d}.jsonl" for b in range(BATCHES)], names
    # nothing a node wrote reached the host's own /tmp/sos-node (private tmpfs per node)
    assert not os.path.exists("/tmp/sos-node/work")


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_total_loss_with_the_servers_disk_the_bucket_brings_it_back(demo):
    """Issue 19, item 8's last case: the server's data directory is lost with everything
    else; the bucket alone brings the checkpoints back, and the queries resume exactly once
    (the first test checks the output for both state stores)."""
    _proc, lines, result, work = demo
    loss = result["server_loss"]
    # the replacement server rebuilt the namespace from the bucket before it listened
    boot = loss["bootstrap"]
    assert boot["namespaces"] == 1 and boot["objects"] >= 1 and boot["bytes"] > 0, boot
    assert boot["cut"] == 0 and boot["problems"] == 0, boot

    def bootstraps(name):
        docs = [json.loads(ln) for ln in _log(work, name).splitlines() if ln.startswith("{")]
        return [d for d in docs if d.get("msg") == "tier bootstrap"]

    # the first server started on a data directory with keys only, before the bucket held
    # anything: it rebuilt nothing; the replacement rebuilt the namespace before listening
    assert [(b["namespaces"], b["objects"]) for b in bootstraps("server1.log")] == [(0, 0)]
    (second,) = bootstraps("server2.log")
    assert (second["namespaces"], second["objects"], second["bytes"]) == (1, boot["objects"], boot["bytes"])
    text2 = _log(work, "server2.log")
    assert text2.index('"tier bootstrap"') < text2.index("sos-server listening on ")
    assert os.path.isdir(os.path.join(work, "server-data", "ns", "sparkcluster", "objects"))
    # `sos restore --from` the bucket alone == `sos restore` from the replacement server,
    # and both hold every batch committed before the loss (RPO 0)
    from_bucket = tree_snapshot(os.path.join(work, "restored-from-bucket"))
    from_server = tree_snapshot(os.path.join(work, "restored-from-server"))
    assert from_bucket == from_server
    for store in STORES:
        commits = sorted(
            int(p.rsplit("/", 1)[1])
            for p in from_bucket
            if p.startswith(f"queries/{store}/commits/") and p.rsplit("/", 1)[1].isdigit()
        )
        assert commits == list(range(K3)), (store, commits)
        assert loss["restore"]["committed"][store] == list(range(K3))
        # and the new gateway, on the replacement server, served the same
        assert result["restored_committed"][store] == list(range(K3))
    # the progress lines say it, in order, and the verdict does
    text = "\n".join(lines)
    order = [
        text.index(s)
        for s in (
            "TOTAL LOSS",
            "server's data directory deleted",
            "a replacement sos-server on an EMPTY data directory",
            "sos restore --from s3://",
            "a new gateway on an empty cache",
        )
    ]
    assert order == sorted(order), order
    assert "restored from the bucket" in lines[-1]


# ---- the namespace key ------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_executors_get_the_key_with_their_tasks_not_on_a_command_line(demo, watch):
    """The credential is no Builder config (``gateway_checkpoint`` sets it on the session's
    Hadoop configuration once getOrCreate returns), so no SparkConf carries it to the
    executors: they can only have it from the Hadoop configuration the driver ships with
    each task. They wrote state through the gateway, so they had it; no process of the
    machine had it on its command line (executors, the drivers' PySpark parents and JVMs,
    Master, Workers, gateway, server) and the executors' environments did not hold it; an
    executor's command line is what a Worker gives (the JVM options and the ``spark.*``
    startup confs, ``SparkConf.isExecutorStartupConf``), no ``spark.hadoop.*``."""
    _proc, _lines, result, work = demo
    # the key, as the demo gave it to its drivers (their environment, SOS_KEY)
    keys = {env["SOS_KEY"] for argv, env in watch.drivers.values() if "tools.demo_cluster" in argv and "SOS_KEY" in env}
    assert len(keys) == 1, keys
    secret = keys.pop().rpartition(".")[2]
    assert len(secret) >= 16
    # both state stores' executors wrote state files through the gateway: they had the key
    written = gateway_requests(_log(work, "gateway.log"))
    for store in STORES:
        assert state_files_written(written, store, 0) and state_files_written(written, store, 1), store
    assert result["committed_final"] == {store: list(range(BATCHES)) for store in STORES}
    # the executors of both clusters (before and after the total loss), as /proc showed them
    assert len(watch.executors) >= 4, sorted(watch.executors)
    for argv, env in watch.executors.values():
        line = "\0".join(argv)
        assert secret not in line and "oauth2.credential" not in line
        assert not [a for a in argv if "spark.hadoop." in a], line
        assert secret not in env
    jvms = [argv for argv, _env in watch.drivers.values() if _driver_jvm(argv)]
    assert jvms and all("spark.hadoop.dfs.webhdfs.oauth2.client.id=" in "\0".join(a) for a in jvms)
    leaks = [line[:200] for line in watch.cmdlines if secret in line]
    assert not leaks, leaks


# ---- the class-data archive -------------------------------------------------------------


def _from_archive(log: str, prefix: str = "") -> tuple[int, int]:
    """(classes mapped from the archive, classes read from jars or directories), of those
    whose name starts with ``prefix``."""
    with open(log) as f:
        lines = [ln for ln in f.read().splitlines() if ln.partition("] ")[2].startswith(prefix)]
    shared = sum(1 for ln in lines if "source: shared objects file (top)" in ln)
    read = sum(1 for ln in lines if "source: jar:" in ln or "source: file:" in ln)
    return shared, read


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_driver_and_an_executor_map_sparks_classes_from_the_archive(demo, watch):
    """The drivers and executors of the run, started with the options of tools/jvm.py, map
    Spark's classes from the archive scripts/setup made instead of reading them from the
    jars (a JVM that could not use it reads every class from the jars: thousands)."""
    assert os.path.isfile(archive_path()), f"scripts/setup makes {archive_path()}"
    drivers = [pid for pid, (argv, _env) in watch.drivers.items() if _driver_jvm(argv)]
    assert drivers and watch.executors
    counts = {}
    unlogged = []
    for pid in [*drivers, *watch.executors]:
        log = watch.classes / f"{pid}.log"
        if not log.is_file() and watch.scans.get(pid, 0) <= 1:
            unlogged.append(pid)  # seen once, then killed before its JVM opened the log
            continue
        assert log.is_file(), (pid, watch.scans.get(pid), sorted(os.listdir(watch.classes)))
        counts[pid] = (*_from_archive(str(log)), *_from_archive(str(log), "org.apache.spark."))
    # every JVM that lived past one scan has its log; the few that did not are no majority
    assert len(unlogged) <= 2 and set(drivers) - set(unlogged), (unlogged, counts)
    assert len([pid for pid in counts if pid in watch.executors]) >= 2, counts
    print("classes (shared, read; Spark's shared, read) by pid:", counts)
    # thousands of classes mapped; Spark's own almost all from the archive (what the query
    # loads beyond the archive's driver: the webhdfs client, the ride-through jar)
    for pid, (shared, _read, spark_shared, spark_read) in counts.items():
        assert shared > 3000 and spark_read < spark_shared / 5, (pid, counts[pid])
    for pid in drivers:
        with open(watch.classes / f"{pid}.log") as f:
            assert any("org.apache.spark.SparkContext source: shared objects file (top)" in ln for ln in f)


# ---- the log readers (no Spark) ---------------------------------------------------------


def test_request_log_parser_reads_creates_renames_and_opens():
    dest = urllib.parse.quote("/queries/hdfs/state/0/1/3.delta", safe="")
    text = "\n".join(
        [
            "2026-01-01 00:00:00,000 sos.gateway DEBUG PUT CREATE /webhdfs/v1/queries/hdfs/state/0/1/"
            ".3.delta.x.tmp [data] -> 201 (3.1 ms) op=CREATE&data=true",
            "2026-01-01 00:00:00,001 sos.gateway DEBUG PUT RENAME /webhdfs/v1/queries/hdfs/state/0/1/"
            f".3.delta.x.tmp -> 200 (1.0 ms) op=RENAME&destination={dest}&renameoptions=NONE",
            "2026-01-01 00:00:00,002 sos.gateway DEBUG PUT CREATE /webhdfs/v1/queries/rocksdb/state/0/"
            "0/SSTs/000008-u.sst [data] -> 201 (2.0 ms) op=CREATE&data=true",
            "2026-01-01 00:00:00,003 sos.gateway DEBUG GET OPEN /webhdfs/v1/queries/hdfs/state/0/1/"
            "3.delta -> 307 (0.5 ms) op=OPEN",
            "2026-01-01 00:00:00,004 sos.gateway DEBUG GET OPEN /webhdfs/v1/queries/hdfs/state/0/1/"
            "3.delta [data] -> 200 (0.5 ms) op=OPEN&data=true",
            "2026-01-01 00:00:00,005 sos.gateway DEBUG GET OPEN /webhdfs/v1/queries/hdfs/state/0/1/"
            "4.delta [data] -> 404 (0.5 ms) op=OPEN&data=true",
            "2026-01-01 00:00:00,006 sos.gateway INFO issued a append token for key k (3600 s)",
        ]
    )
    reqs = gateway_requests(text)
    assert len(reqs) == 6
    # the same log as the gateway writes it now: JSON lines (sos_wire.logs)
    fmt = JsonFormatter()
    as_json = [
        fmt.format(logging.LogRecord("spark_plugin.gateway.http.server", getattr(logging, lv), "", 0, msg, (), None))
        for _day, _time, _logger, lv, msg in (line.split(" ", 4) for line in text.splitlines())
    ]
    assert gateway_requests("\n".join(as_json)) == reqs
    assert reqs[1] == Request(
        "PUT",
        "RENAME",
        "/queries/hdfs/state/0/1/.3.delta.x.tmp",
        False,
        200,
        f"op=RENAME&destination={dest}&renameoptions=NONE",
    )
    assert reqs[1].destination == "/queries/hdfs/state/0/1/3.delta"
    assert state_files_written(reqs, "hdfs", 1) == {
        "/queries/hdfs/state/0/1/.3.delta.x.tmp",
        "/queries/hdfs/state/0/1/3.delta",
    }
    assert state_files_written(reqs, "rocksdb", 0) == {"/queries/rocksdb/state/0/0/SSTs/000008-u.sst"}
    assert state_files_written(reqs, "hdfs", 0) == set()
    # only a served data step is a read (not the redirect, not a 404)
    assert state_files_read(reqs, "hdfs", 1) == {"/queries/hdfs/state/0/1/3.delta"}


def test_executor_partitions_maps_query_runs_to_stores():
    line = (
        "INFO StateStore: Reported that the loaded instance StateStoreProviderId[ storeId="
        "StateStoreId[ operatorId=0, partitionId={p}, storeName=default ], queryRunId={r} ] "
        "is active"
    )
    text = "\n".join([line.format(p=1, r="aaaa-1"), line.format(p=0, r="bbbb-2"), line.format(p=1, r="cccc-3")])
    assert PROVIDER_ID_RE.search(text)
    runs = {"hdfs": "aaaa-1", "rocksdb": "bbbb-2"}
    assert executor_partitions(text, runs) == {("hdfs", 1), ("rocksdb", 0)}  # cccc: another run
    assert executor_partitions("", runs) == set()
