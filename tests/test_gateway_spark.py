"""A real Spark query (local[2], stateful: dropDuplicates) checkpoints on webhdfs:// through
`sos gateway` with the OAuth2 and retry settings of `gateway_checkpoint`, runs 3 batches,
restarts for 2 more; every id comes out exactly once, the batch markers are written, and
`sos restore` (also `--batch`) gives back a checkpoint with the committed batches."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import restore_to_batch, sos_command
from tools.demo import committed_batches, make_input

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(1500)]

NS = "gwspark"
RECORDS = 500
FILES = 5
FIRST_RUN_FILES = 3

DRIVER = textwrap.dedent('''
    import json, os, sys, time
    cfg = json.load(open(sys.argv[1]))
    from pyspark.sql import SparkSession
    from tools.demo import DRIVER_JVM_OPTIONS, write_batch_output
    from spark_plugin.spark import gateway_checkpoint

    builder = (SparkSession.builder.master("local[2]").appName("sos-gateway-smoke")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.extraJavaOptions", DRIVER_JVM_OPTIONS))
    loc = gateway_checkpoint(builder, cfg["url"], cfg["ns"], os.environ["SOS_KEY"], cfg["checkpoint"])
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    loc.attach(spark)
    batches = []

    def sink(df, batch_id):
        write_batch_output(cfg["out"], df, batch_id)
        batches.append(batch_id)

    os.makedirs(cfg["out"], exist_ok=True)
    query = (spark.readStream.schema("id LONG, payload STRING")
             .option("maxFilesPerTrigger", 1).json(cfg["input"])
             .dropDuplicates(["id"])
             .writeStream.foreachBatch(sink).option("checkpointLocation", str(loc))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    deadline = time.monotonic() + 120  # the listener runs asynchronously
    while set(loc.listener.written) < set(batches) and time.monotonic() < deadline:
        time.sleep(0.2)
    with open(cfg["result"], "w") as f:
        json.dump({"location": str(loc), "batches": batches, "markers": loc.listener.written,
                   "errors": loc.listener.errors}, f)
    spark.stop()
''')


def _run_driver(tmp_path, name, cfg, key):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    cfg_path = tmp_path / f"{name}.json"
    cfg = dict(cfg, result=str(tmp_path / f"{name}-result.json"))
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ, SOS_KEY=key,
               PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH"))
                                          if p))
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.run([sys.executable, str(script), str(cfg_path)], stdout=logf,
                              stderr=subprocess.STDOUT, env=env, timeout=900, check=False)
    assert proc.returncode == 0, log_path.read_text()[-6000:]
    return json.loads((tmp_path / f"{name}-result.json").read_text())


def _ids(out_dir):
    ids = Counter()
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as f:
            ids.update(json.loads(line)["id"] for line in f)
    return ids


def _requests_by_op(gateway_log: str) -> Counter:
    ops = Counter()
    for m in re.finditer(r"DEBUG (GET|PUT|POST|DELETE) (\S+) \S+( \[data\])? -> (\d+)",
                         gateway_log):
        ops[f"{m.group(1)} {m.group(2)}{' data' if m.group(3) else ''} {m.group(4)}"] += 1
    return ops


def test_spark_query_checkpoints_through_the_gateway_and_resumes(sos_server, tmp_path):
    key = sos_server.keygen(NS, "append")
    staging = tmp_path / "staging"
    make_input(str(staging), RECORDS, FILES)
    (tmp_path / "input").mkdir()
    names = sorted(os.listdir(staging))
    for name in names[:FIRST_RUN_FILES]:
        shutil.copy2(staging / name, tmp_path / "input" / name)

    gw = GatewayProcess(NS, str(tmp_path / "cache"), sos_server.address, key, debug=True,
                        log_path=str(tmp_path / "gateway.log")).start()
    try:
        cfg = {"url": gw.url, "ns": NS, "checkpoint": "queries/q1", "input": str(tmp_path / "input"),
               "out": str(tmp_path / "out")}
        first = _run_driver(tmp_path, "run1", cfg, key)
        assert first["batches"] == list(range(FIRST_RUN_FILES))
        assert first["location"].startswith("webhdfs://")
        for name in names[FIRST_RUN_FILES:]:
            shutil.copy2(staging / name, tmp_path / "input" / name)
        second = _run_driver(tmp_path, "run2", cfg, key)
        assert second["batches"] == list(range(FIRST_RUN_FILES, FILES))
    finally:
        assert gw.stop() == 0, gw.log()[-4000:]
    for run in (first, second):
        assert run["errors"] == []
        assert sorted(run["markers"]) == run["batches"]

    ids = _ids(tmp_path / "out")
    assert sorted(ids) == list(range(RECORDS)) and set(ids.values()) == {1}, "exactly once"

    # what Hadoop asked of the gateway (the lead's per-batch request count)
    ops = _requests_by_op(gw.log())
    print("gateway requests for", FILES, "batches:", sum(ops.values()))
    for op, n in sorted(ops.items()):
        print(f"  {op}: {n}")
    assert not [op for op in ops if op.endswith((" 400", " 401", " 500"))], ops

    # the journal holds the checkpoint: a restore has every committed batch, and a restore
    # to batch 2 stops at its commit
    env = dict(os.environ, SOS_KEY=key)
    subprocess.run([*sos_command(), "restore", "-q", "--server", sos_server.address, NS,
                    str(tmp_path / "restored")], env=env, check=True, timeout=300)
    assert committed_batches(str(tmp_path / "restored" / "queries" / "q1")) == set(range(FILES))
    at2 = restore_to_batch(NS, str(tmp_path / "at2"), "queries/q1", 2,
                           server=sos_server.address, key=key)
    assert committed_batches(at2) == {0, 1, 2}
