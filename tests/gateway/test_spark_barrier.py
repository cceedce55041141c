"""``--barrier commit`` with a real Spark query (protocol.md 3.4, issue 28 item 4).

1. The barrier waits of a steady batch (``sos_gateway_barrier_waits_total``, scraped by the
   driver in its foreachBatch sink) are the same at 2 and at 8 shuffle partitions, while the
   state files the batch writes grow with them.
2. The gateway is SIGKILLed after the batch's state files were acknowledged and before its
   commit, its cache deleted, and a new gateway started on an empty cache on the same address
   (restored from the server): the commit of that batch is refused, the query stops; started
   again, it runs the batch again and ends with every input record exactly once.

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
from tools.demo import check_output, gateway_committed_batches, make_input, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(1800)]

NS = "gwbarrier"
CHECKPOINT = "queries/q"

DRIVER = textwrap.dedent("""
    import json, os, sys, time, urllib.request
    cfg = json.load(open(sys.argv[1]))
    from pyspark.sql import SparkSession
    from tools.demo import DRIVER_JVM_OPTIONS, write_batch_output
    from spark_plugin.spark import gateway_checkpoint

    builder = (SparkSession.builder.master("local[2]").appName("sos-barrier")
               .config("spark.sql.shuffle.partitions", str(cfg["partitions"]))
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.extraJavaOptions", DRIVER_JVM_OPTIONS))
    loc = gateway_checkpoint(builder, cfg["url"], cfg["ns"], os.environ["SOS_KEY"], cfg["checkpoint"])
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    batches, waits = [], {}

    def scrape():
        text = urllib.request.urlopen(cfg["metrics"] + "/metrics", timeout=30).read().decode()
        for line in text.splitlines():
            if line.startswith("sos_gateway_barrier_waits_total "):
                return float(line.split()[1])
        return 0.0

    def sink(df, batch_id):
        write_batch_output(cfg["out"], df, batch_id)
        batches.append(batch_id)
        if cfg.get("metrics"):
            waits[batch_id] = scrape()
        if batch_id == cfg.get("hang_at"):  # its state files are acknowledged, its commit is not
            open(os.path.join(cfg["flags"], "hang"), "w").close()
            while not os.path.exists(os.path.join(cfg["flags"], "go")):
                time.sleep(0.1)

    os.makedirs(cfg["out"], exist_ok=True)
    query = (spark.readStream.schema("id LONG, payload STRING")
             .option("maxFilesPerTrigger", 1).json(cfg["input"])
             .dropDuplicates(["id"])
             .writeStream.foreachBatch(sink).option("checkpointLocation", str(loc))
             .trigger(availableNow=True).start())
    error = None
    try:
        query.awaitTermination()
    except Exception as exc:
        error = str(exc)
    with open(cfg["result"], "w") as f:
        json.dump({"batches": batches, "waits": waits, "error": error}, f)
    spark.stop()
    sys.exit(3 if error else 0)
""")


def _driver(tmp_path, name, cfg, key) -> tuple[int, dict]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    cfg = dict(cfg, result=str(tmp_path / f"{name}-result.json"))
    (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
    env = dict(
        os.environ, SOS_KEY=key, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    )
    with open(tmp_path / f"{name}.log", "wb") as logf:
        return subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"{name}.json")],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
        ), cfg


def _result(tmp_path, name, proc, cfg) -> tuple[int, dict]:
    rc = proc.wait(900)
    assert os.path.exists(cfg["result"]), (tmp_path / f"{name}.log").read_text()[-6000:]
    with open(cfg["result"]) as f:
        return rc, json.load(f)


def _state_files(gw_url, key, ns) -> int:
    client = GatewayClient(gw_url, ns, key)
    n = 0
    root = f"/webhdfs/v1/{CHECKPOINT}/state/0"
    for part in client.call("GET", root, op="LISTSTATUS")["FileStatuses"]["FileStatus"]:
        listing = client.call("GET", f"{root}/{part['pathSuffix']}", op="LISTSTATUS")["FileStatuses"]["FileStatus"]
        n += sum(1 for st in listing if st["type"] == "FILE")
    return n


def test_barrier_waits_per_batch_do_not_grow_with_shuffle_partitions(sos_server, tmp_path):
    files = 6
    per_batch = {}
    written = {}
    for partitions in (2, 8):
        key = sos_server.keygen(f"{NS}{partitions}", "append")
        work = tmp_path / f"p{partitions}"
        make_input(str(work / "input"), 300, files)
        gw = GatewayProcess(
            f"{NS}{partitions}",
            str(work / "cache"),
            sos_server.address,
            key,
            extra_args=["--metrics", "127.0.0.1:0"],
            log_path=str(work / "gateway.log"),
        ).start()
        try:
            cfg = {
                "url": gw.url,
                "ns": f"{NS}{partitions}",
                "checkpoint": CHECKPOINT,
                "partitions": partitions,
                "input": str(work / "input"),
                "out": str(work / "out"),
                "metrics": metrics_url(gw),
            }
            proc, cfg = _driver(work, "driver", cfg, key)
            rc, result = _result(work, "driver", proc, cfg)
            assert rc == 0, result
            waits = {int(b): w for b, w in result["waits"].items()}
            assert sorted(waits) == list(range(files))
            # a steady batch: from the sink of batch N-1 to that of batch N (commit of N-1,
            # planning and state of N); the first two carry the query's start
            per_batch[partitions] = sorted({waits[n] - waits[n - 1] for n in range(3, files)})
            written[partitions] = _state_files(gw.url, key, f"{NS}{partitions}")
        finally:
            assert gw.stop() == 0, gw.log()[-3000:]
    print(f"barrier waits per steady batch: {per_batch}; state files: {written}")
    assert written[8] >= 8 * files and written[8] >= 3 * written[2]  # the work grows with the partitions ...
    assert per_batch[2] == per_batch[8]  # ... the waits do not
    assert len(per_batch[2]) == 1 and per_batch[2][0] <= 6, per_batch


def test_a_batch_in_flight_when_its_gateway_is_replaced_on_an_empty_cache_runs_again(sos_server, tmp_path):
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
    try:
        cfg = {
            "url": gw1.url,
            "ns": NS,
            "checkpoint": CHECKPOINT,
            "partitions": 2,
            "input": str(tmp_path / "input"),
            "out": str(tmp_path / "out"),
            "flags": str(tmp_path / "flags"),
            "hang_at": hang_at,
        }
        d1, cfg1 = _driver(tmp_path, "driver1", cfg, key)
        wait_for(
            lambda: (tmp_path / "flags" / "hang").exists(),
            900,
            "the driver in batch 2",
            alive=lambda: d1.poll() is None,
        )
        client = GatewayClient(gw1.url, NS, key)
        assert client.exists(f"{CHECKPOINT}/offsets/{hang_at}") and not client.exists(f"{CHECKPOINT}/commits/{hang_at}")
        # the gateway and its disk are lost; a new one on an empty cache, same address
        gw1.kill()
        shutil.rmtree(cache)
        gw2 = gateway(2, listen=gw1.url.removeprefix("http://"))
        assert "batch 2 of checkpoint /queries/q was in flight" in gw2.log()
        (tmp_path / "flags" / "go").touch()
        rc, first = _result(tmp_path, "driver1", d1, cfg1)
        assert rc == 3, first
        assert "the commit of batch 2 of checkpoint /queries/q is refused" in first["error"], first["error"]
        assert gateway_committed_batches(client, CHECKPOINT) == set(range(hang_at))
        # started again: Spark runs batch 2 again from offsets/2, then the rest
        d2, cfg2 = _driver(tmp_path, "driver2", dict(cfg, hang_at=None), key)
        rc, second = _result(tmp_path, "driver2", d2, cfg2)
        assert rc == 0, (tmp_path / "driver2.log").read_text()[-6000:]
        assert second["batches"] == list(range(hang_at, files))
        final = gateway_committed_batches(client, CHECKPOINT)
        assert final == set(range(files))
    finally:
        for g in (gw1, gw2):
            if g is not None:
                g.kill()
    check = check_output(str(tmp_path / "out"), final, expected)
    assert check["records_out"] == records, check
    for k in ("lost", "doubled", "corrupted", "unknown", "committed_without_output"):
        assert check[k] == [], (k, check[k][:10])
