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
from tests.support import metrics_url
from tools.demo import check_output, gateway_committed_batches, kill_tree, make_input, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(1800)]

NS = "gwbarrier"
CHECKPOINT = "queries/q"

#: A driver that runs the query once per entry of ``cfg["runs"]``, one after the other in the
#: same session (each with its shuffle partitions, checkpoint, input and output; an entry with
#: "metrics" scrapes the gateway's barrier counter in each batch, one with "wait_for" starts
#: once that flag exists): one JVM for both tests' four runs.
DRIVER = textwrap.dedent("""
    import json, os, sys, time, urllib.request
    cfg = json.load(open(sys.argv[1]))
    from tools.demo import write_batch_output
    from spark_plugin.spark import gateway_checkpoint, webhdfs_url
    from tests.support import dedup_query, spark_builder

    # each run sets its own shuffle partitions; no state store maintenance (snapshots)
    # inside the measured batches
    builder = spark_builder("sos-barrier", shuffle_partitions=None,
                            conf={"spark.sql.streaming.stateStore.maintenanceInterval": "600s"})
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
            if r.get("metrics"):
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
        query = dedup_query(spark, r["input"], sink, webhdfs_url(cfg["url"], r["checkpoint"]))
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


FILES = 6  # per partitions run
RECORDS, Q_FILES, HANG_AT = 400, 5, 2  # the run whose gateway is replaced


@pytest.fixture(scope="module")
def barrier(server, tmp_path_factory):
    """One driver, one namespace: the query at 2 then at 8 shuffle partitions through gateway
    1 (its barrier counter scraped per batch), then the query on queries/q parked in batch 2
    while gateway 1 is SIGKILLed, its cache deleted and gateway 2 started on an empty cache on
    the same address; released, its commit is refused and it stops; started again (in the
    same driver) it runs to the end. What each step showed, for the two tests."""
    tmp_path = tmp_path_factory.mktemp("barrier")
    key = server.keygen(NS, "append")
    (tmp_path / "flags").mkdir()
    cache = tmp_path / "cache"
    runs = []
    for partitions in (2, 8):
        work = tmp_path / f"p{partitions}"
        make_input(str(work / "input"), 300, FILES)
        runs.append(
            {
                "partitions": partitions,
                "metrics": True,
                "checkpoint": f"queries/p{partitions}",
                "input": str(work / "input"),
                "out": str(work / "out"),
                "result": str(work / "result.json"),
            }
        )
    expected = make_input(str(tmp_path / "input"), RECORDS, Q_FILES)
    q = {"partitions": 2, "checkpoint": CHECKPOINT, "input": str(tmp_path / "input"), "out": str(tmp_path / "out")}
    runs += [
        dict(q, hang_at=HANG_AT, result=str(tmp_path / "run1.json")),
        dict(q, wait_for="again", result=str(tmp_path / "run2.json")),
    ]

    def gateway(n, listen="127.0.0.1:0"):
        return GatewayProcess(
            NS,
            str(cache),
            server.address,
            key,
            listen=listen,
            extra_args=["--metrics", "127.0.0.1:0"],
            log_path=str(tmp_path / f"gateway{n}.log"),
        ).start()

    gw1 = gateway(1)
    gw2 = None
    out: dict = {"expected": expected}
    cfg = {"url": gw1.url, "ns": NS, "metrics": metrics_url(gw1.log()), "flags": str(tmp_path / "flags"), "runs": runs}
    d = _driver(tmp_path, cfg, key)
    try:
        for run in runs[:2]:
            out[run["partitions"]] = _result(tmp_path, d, run["result"])
            out[run["partitions"]]["state_files"] = _state_files(gw1.url, key, NS, run["checkpoint"])
        wait_for(
            lambda: (tmp_path / "flags" / "hang").exists(),
            900,
            "the driver in batch 2",
            alive=lambda: d.poll() is None,
        )
        client = GatewayClient(gw1.url, NS, key)
        out["parked"] = (
            client.exists(f"{CHECKPOINT}/offsets/{HANG_AT}"),
            client.exists(f"{CHECKPOINT}/commits/{HANG_AT}"),
        )
        # the gateway and its disk are lost; a new one on an empty cache, same address
        gw1.kill()
        shutil.rmtree(cache)
        gw2 = gateway(2, listen=gw1.url.removeprefix("http://"))
        out["gateway2_log"] = gw2.log()
        (tmp_path / "flags" / "go").touch()
        out["first"] = _result(tmp_path, d, runs[2]["result"])
        out["committed_after_refusal"] = gateway_committed_batches(client, CHECKPOINT)
        # started again: Spark runs batch 2 again from offsets/2, then the rest
        (tmp_path / "flags" / "again").touch()
        out["second"] = _result(tmp_path, d, runs[3]["result"])
        assert d.wait(600) == 0, (tmp_path / "driver.log").read_text()[-6000:]
        out["final"] = gateway_committed_batches(client, CHECKPOINT)
        out["check"] = check_output(str(tmp_path / "out"), out["final"], expected)
    finally:
        kill_tree(d)
        gw1.kill()
        if gw2 is not None:
            assert gw2.stop() == 0, gw2.log()[-3000:]
    return out


def test_barrier_waits_per_batch_do_not_grow_with_shuffle_partitions(barrier):
    """The query at 2, then at 8 shuffle partitions (two checkpoints, one after the other in
    one driver, through one gateway: the counter's steps within a run are that run's)."""
    per_batch, written = {}, {}
    for partitions in (2, 8):
        result = barrier[partitions]
        assert result["error"] is None, result
        waits = {int(b): w for b, w in result["waits"].items()}
        assert sorted(waits) == list(range(FILES))
        # a steady batch: from the sink of batch N-1 to that of batch N (commit of N-1,
        # planning and state of N); the first two carry the query's start
        per_batch[partitions] = sorted({waits[n] - waits[n - 1] for n in range(3, FILES)})
        written[partitions] = result["state_files"]
    print(f"barrier waits per steady batch: {per_batch}; state files: {written}")
    assert written[8] >= 8 * FILES and written[8] >= 3 * written[2]  # the work grows with the partitions ...
    assert per_batch[2] == per_batch[8]  # ... the waits do not
    assert len(per_batch[2]) == 1 and per_batch[2][0] <= 6, per_batch


def test_a_batch_in_flight_when_its_gateway_is_replaced_on_an_empty_cache_runs_again(barrier):
    """The query stops on the refused commit; started again (a new query on the same
    checkpoint, in the same driver), Spark runs the batch again from its offsets."""
    assert barrier["parked"] == (True, False)  # batch 2: offsets logged, not committed
    assert "batch 2 of checkpoint /queries/q was in flight" in barrier["gateway2_log"]
    first = barrier["first"]
    assert first["error"] is not None, first  # the query stopped
    assert "the commit of batch 2 of checkpoint /queries/q is refused" in first["error"], first["error"]
    assert barrier["committed_after_refusal"] == set(range(HANG_AT))
    second = barrier["second"]
    assert second["error"] is None, second["error"]
    assert second["batches"] == list(range(HANG_AT, Q_FILES))
    assert barrier["final"] == set(range(Q_FILES))
    check = barrier["check"]
    assert check["records_out"] == RECORDS, check
    for k in ("lost", "doubled", "corrupted", "unknown", "committed_without_output"):
        assert check[k] == [], (k, check[k][:10])
