"""``--barrier commit`` with a real Spark query (protocol.md 3.4, issue 28 item 4).

1. The barrier waits of a steady batch (``sos_gateway_barrier_waits_total``, scraped by the
   driver in its foreachBatch sink) are the same at 2 and at 8 shuffle partitions, while the
   state files the batch writes grow with them.
2. The gateway is SIGKILLed after the batch's state files were acknowledged and before its
   commit, its cache deleted, and a new gateway started on an empty cache on the same address
   (restored from the server): the commit of that batch is refused, the query stops; started
   again (in the same driver), it runs the batch again and ends with every input record
   exactly once.

Real processes: sos-server, gateways, a Spark driver (local[2], dropDuplicates, HDFS-backed
state store) through ``gateway_checkpoint``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from spark_plugin.gateway.client import GatewayClient
from spark_plugin.gateway.process import GatewayProcess
from tests.gateway.test_day2_rest import metrics_url
from tools.demo import check_output, gateway_committed_batches, kill_tree, make_input, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(1800)]

NS = "gwbarrier"
CHECKPOINT = "queries/q"

#: A driver that runs the query once per entry of ``cfg["runs"]``, one after the other in the
#: same session (each with its shuffle partitions, checkpoint, input and output; an entry with
#: "wait_for" starts once that flag exists): one JVM where a driver per run cost one each.
DRIVER = textwrap.dedent("""
    import json, os, sys, time, urllib.request
    cfg = json.load(open(sys.argv[1]))
    from pyspark.sql import SparkSession
    from tools.demo import DRIVER_JVM_OPTIONS, write_batch_output
    from spark_plugin.spark import gateway_checkpoint, webhdfs_url

    builder = (SparkSession.builder.master("local[2]").appName("sos-barrier")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               # no state store maintenance (snapshots) inside the measured batches
               .config("spark.sql.streaming.stateStore.maintenanceInterval", "600s")
               .config("spark.driver.extraJavaOptions", DRIVER_JVM_OPTIONS))
    gateway_checkpoint(builder, cfg["url"], cfg["ns"], os.environ["SOS_KEY"], cfg["runs"][0]["checkpoint"])
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")

    def scrape():
        text = urllib.request.urlopen(cfg["metrics"] + "/metrics", timeout=30).read().decode()
        for line in text.splitlines():
            if line.startswith("sos_gateway_barrier_waits_total "):
                return float(line.split()[1])
        return 0.0

    def run(r):
        batches, waits = [], {}

        def sink(df, batch_id):
            write_batch_output(r["out"], df, batch_id)
            batches.append(batch_id)
            if cfg.get("metrics"):
                waits[batch_id] = scrape()
            if batch_id == r.get("hang_at"):  # its state files are acknowledged, its commit is not
                open(os.path.join(cfg["flags"], "hang"), "w").close()
                while not os.path.exists(os.path.join(cfg["flags"], "go")):
                    time.sleep(0.1)

        if r.get("wait_for"):
            while not os.path.exists(os.path.join(cfg["flags"], r["wait_for"])):
                time.sleep(0.1)
        spark.conf.set("spark.sql.shuffle.partitions", str(r["partitions"]))
        os.makedirs(r["out"], exist_ok=True)
        query = (spark.readStream.schema("id LONG, payload STRING")
                 .option("maxFilesPerTrigger", 1).json(r["input"])
                 .dropDuplicates(["id"])
                 .writeStream.foreachBatch(sink)
                 .option("checkpointLocation", webhdfs_url(cfg["url"], r["checkpoint"]))
                 .trigger(availableNow=True).start())
        error = None
        try:
            query.awaitTermination()
        except Exception as exc:
            error = str(exc)
        with open(r["result"] + ".tmp", "w") as f:
            json.dump({"batches": batches, "waits": waits, "error": error}, f)
        os.replace(r["result"] + ".tmp", r["result"])

    for r in cfg["runs"]:
        run(r)
    spark.stop()
""")


def _driver(tmp_path, cfg, key) -> subprocess.Popen:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    (tmp_path / "driver.json").write_text(json.dumps(cfg))
    env = dict(
        os.environ, SOS_KEY=key, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    )
    with open(tmp_path / "driver.log", "wb") as logf:
        return subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "driver.json")],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _result(tmp_path, proc, path: str) -> dict:
    """The result of one run of the driver, once it wrote it."""
    try:
        wait_for(
            lambda: os.path.exists(path),
            900,
            f"the driver's result {os.path.basename(path)}",
            alive=lambda: proc.poll() is None or os.path.exists(path),
        )
    except Exception as exc:
        raise AssertionError(f"{exc}\n" + (tmp_path / "driver.log").read_text(errors="replace")[-6000:]) from exc
    with open(path) as f:
        return json.load(f)


def _state_files(gw_url, key, ns, checkpoint) -> int:
    client = GatewayClient(gw_url, ns, key)
    n = 0
    root = f"/webhdfs/v1/{checkpoint}/state/0"
    for part in client.call("GET", root, op="LISTSTATUS")["FileStatuses"]["FileStatus"]:
        listing = client.call("GET", f"{root}/{part['pathSuffix']}", op="LISTSTATUS")["FileStatuses"]["FileStatus"]
        n += sum(1 for st in listing if st["type"] == "FILE")
    return n


def test_barrier_waits_per_batch_do_not_grow_with_shuffle_partitions(sos_server, tmp_path):
    """The query at 2, then at 8 shuffle partitions (two checkpoints, one after the other in
    one driver, through one gateway: the counter's steps within a run are that run's)."""
    files = 6
    ns = f"{NS}w"
    key = sos_server.keygen(ns, "append")
    runs = []
    for partitions in (2, 8):
        work = tmp_path / f"p{partitions}"
        make_input(str(work / "input"), 300, files)
        runs.append(
            {
                "partitions": partitions,
                "checkpoint": f"queries/p{partitions}",
                "input": str(work / "input"),
                "out": str(work / "out"),
                "result": str(work / "result.json"),
            }
        )
    gw = GatewayProcess(
        ns,
        str(tmp_path / "cache"),
        sos_server.address,
        key,
        extra_args=["--metrics", "127.0.0.1:0"],
        log_path=str(tmp_path / "gateway.log"),
    ).start()
    per_batch, written = {}, {}
    try:
        cfg = {"url": gw.url, "ns": ns, "metrics": metrics_url(gw), "flags": str(tmp_path), "runs": runs}
        proc = _driver(tmp_path, cfg, key)
        try:
            assert proc.wait(900) == 0, (tmp_path / "driver.log").read_text()[-6000:]
        finally:
            kill_tree(proc)
        for run in runs:
            result = _result(tmp_path, proc, run["result"])
            assert result["error"] is None, result
            waits = {int(b): w for b, w in result["waits"].items()}
            assert sorted(waits) == list(range(files))
            # a steady batch: from the sink of batch N-1 to that of batch N (commit of N-1,
            # planning and state of N); the first two carry the query's start
            per_batch[run["partitions"]] = sorted({waits[n] - waits[n - 1] for n in range(3, files)})
            written[run["partitions"]] = _state_files(gw.url, key, ns, run["checkpoint"])
    finally:
        assert gw.stop() == 0, gw.log()[-3000:]
    print(f"barrier waits per steady batch: {per_batch}; state files: {written}")
    assert written[8] >= 8 * files and written[8] >= 3 * written[2]  # the work grows with the partitions ...
    assert per_batch[2] == per_batch[8]  # ... the waits do not
    assert len(per_batch[2]) == 1 and per_batch[2][0] <= 6, per_batch


def test_a_batch_in_flight_when_its_gateway_is_replaced_on_an_empty_cache_runs_again(sos_server, tmp_path):
    """The query stops on the refused commit; started again (a new query on the same
    checkpoint, in the same driver), Spark runs the batch again from its offsets."""
    key = sos_server.keygen(NS, "append")
    records, files, hang_at = 400, 5, 2
    expected = make_input(str(tmp_path / "input"), records, files)
    (tmp_path / "flags").mkdir()
    cache = tmp_path / "cache"

    def gateway(n, listen="127.0.0.1:0"):
        return GatewayProcess(
            NS, str(cache), sos_server.address, key, listen=listen, log_path=str(tmp_path / f"gateway{n}.log")
        ).start()

    gw1 = gateway(1)
    gw2 = None
    run = {"partitions": 2, "checkpoint": CHECKPOINT, "input": str(tmp_path / "input"), "out": str(tmp_path / "out")}
    runs = [
        dict(run, hang_at=hang_at, result=str(tmp_path / "run1.json")),
        dict(run, wait_for="again", result=str(tmp_path / "run2.json")),
    ]
    d = _driver(tmp_path, {"url": gw1.url, "ns": NS, "flags": str(tmp_path / "flags"), "runs": runs}, key)
    try:
        wait_for(
            lambda: (tmp_path / "flags" / "hang").exists(),
            900,
            "the driver in batch 2",
            alive=lambda: d.poll() is None,
        )
        client = GatewayClient(gw1.url, NS, key)
        assert client.exists(f"{CHECKPOINT}/offsets/{hang_at}") and not client.exists(f"{CHECKPOINT}/commits/{hang_at}")
        # the gateway and its disk are lost; a new one on an empty cache, same address
        gw1.kill()
        shutil.rmtree(cache)
        gw2 = gateway(2, listen=gw1.url.removeprefix("http://"))
        assert "batch 2 of checkpoint /queries/q was in flight" in gw2.log()
        (tmp_path / "flags" / "go").touch()
        first = _result(tmp_path, d, runs[0]["result"])
        assert first["error"] is not None, first  # the query stopped
        assert "the commit of batch 2 of checkpoint /queries/q is refused" in first["error"], first["error"]
        assert gateway_committed_batches(client, CHECKPOINT) == set(range(hang_at))
        # started again: Spark runs batch 2 again from offsets/2, then the rest
        (tmp_path / "flags" / "again").touch()
        second = _result(tmp_path, d, runs[1]["result"])
        assert second["error"] is None, second["error"]
        assert d.wait(600) == 0, (tmp_path / "driver.log").read_text()[-6000:]
        assert second["batches"] == list(range(hang_at, files))
        final = gateway_committed_batches(client, CHECKPOINT)
        assert final == set(range(files))
    finally:
        kill_tree(d)
        for g in (gw1, gw2):
            if g is not None:
                g.kill()
    check = check_output(str(tmp_path / "out"), final, expected)
    assert check["records_out"] == records, check
    for k in ("lost", "doubled", "corrupted", "unknown", "committed_without_output"):
        assert check[k] == [], (k, check[k][:10])
