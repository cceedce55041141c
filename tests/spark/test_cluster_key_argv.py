"""On a real standalone cluster the executors get the namespace key with their tasks, never
on a command line nor in their environment.

The cluster demo's own driver (``python -m tools.demo_cluster _driver``: ``gateway_checkpoint``
with a SparkSession.Builder, then ``attach``) runs a stateful query (dropDuplicates, the
HDFS-backed state store, which runs on the executors) on a Master and one Worker
(tools/cluster.py: each a node of its own), checkpointing through a real ``sos gateway``.
The credential is no Builder config any more, so no SparkConf carries it to the executors:
they can only have it from the Hadoop configuration the driver ships with each task
(``sessionState.newHadoopConf()``, which holds the driver's ``hadoopConfiguration()``). In
the middle of batch 1 (the query parked in its sink, the executors alive):

- the state store files of batch 0 are on the gateway: the executors wrote them there,
  so they had the key;
- no process of the machine has the key on its command line (the Worker's executor JVMs,
  the driver's PySpark parent and JVM, the Master and Worker daemons), and the executors'
  environments do not hold it either; the executors' command lines are what a Worker gives:
  the JVM options and the ``spark.*`` startup confs (``SparkConf.isExecutorStartupConf``),
  no ``spark.hadoop.*``;
- the query then finishes with every batch committed and its batch markers written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

from spark_plugin.gateway.client import GatewayClient
from spark_plugin.gateway.process import GatewayProcess
from tools import child_env
from tools.cluster import SparkCluster, can_isolate_nodes
from tools.demo import DRIVER_JVM_OPTIONS, make_input
from tools.demo_cluster import NAMESPACE, checkpoint_of
from tools.demo_common import wait_for

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(1200)]

FILES = 3
RECORDS = 300
STORE = "hdfs"


def _cmdline(p: psutil.Process) -> str:
    try:
        return "\0".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def test_executors_get_the_key_with_their_tasks_not_on_a_command_line(sos_server, tmp_path):
    why = can_isolate_nodes()
    if why:
        pytest.skip(why)
    key = str(sos_server.keygen(NAMESPACE, "append"))
    secret = key.rpartition(".")[2]
    paths = {name: tmp_path / name for name in ("input", "out", "flags")}
    make_input(str(paths["input"]), RECORDS, FILES)
    paths["flags"].mkdir()
    gw = GatewayProcess(
        NAMESPACE, str(tmp_path / "cache"), sos_server.address, key, log_path=str(tmp_path / "gw.log")
    ).start()
    cluster = SparkCluster(str(tmp_path / "cluster"), workers=1, cores=1)
    try:
        cluster.start()
        conf = cluster.spark_conf()
        conf["spark.driver.extraJavaOptions"] = DRIVER_JVM_OPTIONS
        cfg = {
            "url": gw.url,
            "stores": [STORE],
            "input": str(paths["input"]),
            "out": str(paths["out"]),
            "flags": str(paths["flags"]),
            "pause_at": [1],
            "spark_conf": conf,
            "result": str(paths["flags"] / "result.json"),
            "runs": str(paths["flags"] / "runs.json"),
        }
        cfg_path = tmp_path / "driver.json"
        cfg_path.write_text(json.dumps(cfg))
        driver = cluster.start_driver(
            [sys.executable, "-m", "tools.demo_cluster", "_driver", str(cfg_path)],
            env={"SOS_KEY": key, "PYTHONPATH": child_env()["PYTHONPATH"]},
        )
        paused = paths["flags"] / f"paused-{STORE}-1"
        wait_for(paused.exists, 900, "the query in batch 1", alive=driver.alive)

        # the executors wrote batch 0's state through the gateway: they had the key
        client = GatewayClient(gw.url, NAMESPACE, key)
        ckpt = checkpoint_of(STORE)
        assert client.exists(f"{ckpt}/commits/0")
        assert client.exists(f"{ckpt}/state/0/0/1.delta") and client.exists(f"{ckpt}/state/0/1/1.delta")

        worker = cluster.workers[0]
        assert worker is not None
        executors = worker.executors()
        assert executors, "no executor JVM under the Worker"
        for ex in executors:
            line = _cmdline(ex)
            print("an executor's command line:", line.replace("\0", " "))
            assert "CoarseGrainedExecutorBackend" in line  # what was read is the executor's
            assert secret not in line and "oauth2.credential" not in line
            assert not [a for a in ex.cmdline() if "spark.hadoop." in a], line
            assert secret not in "\0".join(f"{k}={v}" for k, v in ex.environ().items())
        procs = [psutil.Process(driver.proc.pid), *psutil.Process(driver.proc.pid).children(recursive=True)]
        jvm = [p for p in procs if "org.apache.spark.deploy.SparkSubmit" in _cmdline(p)]
        assert jvm and "spark.hadoop.dfs.webhdfs.oauth2.client.id=" in _cmdline(jvm[0])
        leaks = {p.pid: _cmdline(p)[:200] for p in psutil.process_iter() if secret in _cmdline(p)}
        assert not leaks, leaks

        (paths["flags"] / "resume-1").write_text("")
        wait_for(lambda: not driver.alive(), 600, "the driver's end")
        assert driver.proc.returncode == 0, Path(driver.log_path).read_text(errors="replace")[-6000:]
        assert client.exists(f"{ckpt}/commits/{FILES - 1}")
    finally:
        cluster.stop()
        assert gw.stop() == 0, gw.log()[-4000:]
    result = json.loads((paths["flags"] / "result.json").read_text())
    assert result["failed"] == []
    assert result["markers"][STORE]["errors"] == []
    assert set(range(FILES)) <= set(result["markers"][STORE]["written"])
