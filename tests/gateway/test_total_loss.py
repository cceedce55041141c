"""Total loss through the gateway (issue 10, deliverable 6), with a real Spark query.

Two stateful queries side by side in one driver (local mode, dropDuplicates, foreachBatch
sink idempotent by batch id), one on the HDFS-backed state store and one on RocksDB with
changelog checkpointing, checkpoint to ``webhdfs://`` through ``sos gateway`` (a child
process) of a real ``sos-server``, with the OAuth2 settings of ``gateway_conf``. Their
driver, a separate process (the cluster demo's ``tools.demo_cluster _driver``, here in local
mode), is SIGKILLed in the middle of batch K of both: each batch's output is written, its
``commits/K`` is not. Then the gateway is SIGKILLed and its cache directory deleted. A new
gateway on an empty cache, on the same address, restores the namespace from the server; the
queries restart on the same webhdfs checkpoints and run to the end. The committed output
(filtered by the committed batches, as the demo checks it) holds every input record exactly
once, for each state store. (One run serves both state stores' tests: one driver per life
instead of one per life and store.)

Afterwards ``sos restore`` of the namespace gives the tree the gateway serves (LISTSTATUS
and OPEN, name by name and byte by byte), and ``sos restore --batch CHECKPOINT:N`` stops
at commit N.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request

import psutil
import pytest

from spark_plugin.gateway.client import GatewayClient
from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import restore_to_batch, sos_command
from tests.gateway.support import cmdline
from tests.support import tree_snapshot as local_tree
from tools import child_env
from tools.demo import (
    DRIVER_JVM_OPTIONS,
    check_output,
    committed_batches,
    gateway_committed_batches,
    kill_tree,
    make_input,
    tail,
    wait_for,
)
from tools.demo_cluster import NAMESPACE, checkpoint_of

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(2400)]

NS = NAMESPACE  # the cluster demo's driver checkpoints to queries/<store> there
RECORDS = 600
BATCHES = 4
CRASH_AFTER = 2
STATE_STORES = ("hdfs", "rocksdb")
SPARK_CONF = {
    "spark.master": "local[2]",
    "spark.sql.shuffle.partitions": "2",
    "spark.ui.enabled": "false",
    "spark.driver.extraJavaOptions": DRIVER_JVM_OPTIONS,
    # the RocksDB store with changelog checkpointing (the HDFS-backed store ignores it)
    "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
}


def served_tree(client: GatewayClient, rel: str = "") -> dict[str, bytes | None]:
    """What the gateway serves under ``rel``: {path: None for a directory, bytes for a
    file}, by LISTSTATUS and OPEN (the two-step read, as Hadoop does it)."""
    tree: dict[str, bytes | None] = {}
    path = "/webhdfs/v1/" + rel
    for st in client.call("GET", path, op="LISTSTATUS")["FileStatuses"]["FileStatus"]:
        child = f"{rel}/{st['pathSuffix']}" if rel else st["pathSuffix"]
        if st["type"] == "DIRECTORY":
            tree[child] = None
            tree.update(served_tree(client, child))
        else:
            assert st["type"] == "FILE", st
            location = client.call("GET", "/webhdfs/v1/" + child, op="OPEN", noredirect="true")["Location"]
            req = urllib.request.Request(location, headers={"Authorization": f"Bearer {client.token()}"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                data = resp.read()
            assert len(data) == st["length"], child
            tree[child] = data
    return tree


def start_driver(cfg: dict, work, n: int, key: str) -> subprocess.Popen:
    """The cluster demo's driver (both queries) in its own process and session, the key in
    ``$SOS_KEY``."""
    cfg = dict(cfg, result=str(work / "flags" / f"driver{n}.json"), runs=str(work / "flags" / f"runs{n}.json"))
    (work / f"driver{n}.json").write_text(json.dumps(cfg))
    with open(work / "logs" / f"driver{n}.log", "ab") as logf:
        return subprocess.Popen(
            [sys.executable, "-m", "tools.demo_cluster", "_driver", str(work / f"driver{n}.json")],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            start_new_session=True,
            env=child_env(dict(os.environ, SOS_KEY=key)),
        )


def _command_lines(driver: subprocess.Popen, key: str) -> dict:
    """What ``ps`` shows while the driver is parked mid-batch (after checkpointing through
    the gateway): its processes' command lines (the PySpark parent, its driver JVM, the
    JVM's as /proc has it) and those of every process of the machine holding the key."""
    secret = key.rpartition(".")[2] or key
    ours = [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(recursive=True)]
    jvms = [p for p in ours if "org.apache.spark.deploy.SparkSubmit" in cmdline(p)]
    proc_cmdline = ""
    if jvms:
        with open(f"/proc/{jvms[0].pid}/cmdline", "rb") as f:
            proc_cmdline = f.read().decode(errors="replace").rstrip("\0")
    return {
        "secret_len": len(secret),
        "jvm": cmdline(jvms[0]) if jvms else None,
        "jvm_proc": proc_cmdline,
        "ours_with_key": [p.pid for p in ours if secret in cmdline(p)],
        "leaks": {p.pid: cmdline(p)[:200] for p in psutil.process_iter() if secret in cmdline(p)},
    }


@pytest.fixture(scope="module")
def total_loss(server, tmp_path_factory):
    """One run of the scenario for both state stores: {store: what was seen}, plus "restored"
    (the tree ``sos restore`` gives) and "served" (the tree the last gateway serves)."""
    tmp_path = tmp_path_factory.mktemp("total-loss")
    key = server.keygen(NS, "append")
    paths = {k: tmp_path / k for k in ("input", "out", "flags", "cache", "logs")}
    for k in ("flags", "logs"):
        paths[k].mkdir()
    expected = make_input(str(paths["input"]), RECORDS, BATCHES)
    seen: dict = {store: {} for store in STATE_STORES}
    gateways: list[GatewayProcess] = []
    drivers: list[subprocess.Popen] = []

    def gateway(n: int, listen: str = "127.0.0.1:0") -> GatewayProcess:
        gw = GatewayProcess(
            NS, str(paths["cache"]), server.address, key, listen=listen, log_path=str(paths["logs"] / f"gateway{n}.log")
        )
        gateways.append(gw)
        return gw.start()

    try:
        # ---- the first life: gateway 1, driver 1 stopped in the middle of batch CRASH_AFTER
        gw1 = gateway(1)
        client = GatewayClient(gw1.url, NS, key)
        cfg = {
            "url": gw1.url,
            "stores": list(STATE_STORES),
            "input": str(paths["input"]),
            "out": str(paths["out"]),
            "flags": str(paths["flags"]),
            "pause_at": [CRASH_AFTER],
            "spark_conf": SPARK_CONF,
        }
        d1 = start_driver(cfg, tmp_path, 1, key)
        drivers.append(d1)
        wait_for(
            lambda: all((paths["flags"] / f"paused-{s}-{CRASH_AFTER}").exists() for s in STATE_STORES),
            1200,
            f"driver 1 reaching batch {CRASH_AFTER} in both queries",
            alive=lambda: d1.poll() is None,
        )
        key_seen = _command_lines(d1, str(key))
        for store in STATE_STORES:
            ckpt = checkpoint_of(store)
            seen[store]["before"] = gateway_committed_batches(client, ckpt)
            # mid-batch: its output is written and its offsets are logged, its commit is not
            seen[store]["mid_batch"] = (
                (paths["out"] / store / f"batch-{CRASH_AFTER:06d}.jsonl").exists(),
                client.exists(f"{ckpt}/offsets/{CRASH_AFTER}"),
                client.exists(f"{ckpt}/commits/{CRASH_AFTER}"),
            )

        # ---- total loss: the driver, then the gateway, then the gateway's disk
        kill_tree(d1)
        gw1.kill()
        assert gw1.proc.returncode == -9
        shutil.rmtree(paths["cache"])

        # ---- a new gateway on an empty cache, same address: restores from the server
        gw2 = gateway(2, listen=gw1.url.removeprefix("http://"))
        assert gw2.url == gw1.url
        for store in STATE_STORES:
            ckpt = checkpoint_of(store)
            seen[store]["restored_by_gateway"] = gateway_committed_batches(client, ckpt)
            seen[store]["commit_after_loss"] = client.exists(f"{ckpt}/commits/{CRASH_AFTER}")

        # ---- the queries restart on the same webhdfs checkpoints and run to the end
        d2 = start_driver(dict(cfg, pause_at=[]), tmp_path, 2, key)
        drivers.append(d2)
        assert d2.wait(1200) == 0, tail(str(paths["logs"] / "driver2.log"), 80)
        result = json.loads((paths["flags"] / "driver2.json").read_text())
        assert result["failed"] == [], result
        for store in STATE_STORES:
            ckpt = checkpoint_of(store)
            final = gateway_committed_batches(client, ckpt)
            seen[store]["final"] = final
            seen[store]["markers"] = result["markers"][store]
            # ---- exactly once: the output of committed batches against the input
            seen[store]["check"] = check_output(str(paths["out"] / store), final, expected)

        # ---- `sos restore` gives what the gateway serves. A marker is a barrier in sync
        # mode: once it is answered, everything the gateway did before it is on the server.
        client.marker("test.barrier", b"{}")
        served = served_tree(client)
        restored_dir = str(tmp_path / "restored")
        subprocess.run(
            [*sos_command(), "restore", "-q", "--server", server.address, NS, restored_dir],
            env=dict(os.environ, SOS_KEY=key),
            check=True,
            timeout=600,
        )
        out: dict = {"served": served, "restored": local_tree(restored_dir), "seen": seen, "key": key_seen}
        # ---- and `sos restore --batch CHECKPOINT:N` stops at commit N: before the loss
        # (first journal generation) and after it (the new gateway's generation)
        for store in STATE_STORES:
            seen[store]["at"] = {}
            for n in (CRASH_AFTER - 1, BATCHES - 2):
                at = restore_to_batch(
                    NS, str(tmp_path / f"at-{store}-{n}"), checkpoint_of(store), n, server=server.address, key=key
                )
                seen[store]["at"][n] = committed_batches(at)
    finally:
        for d in drivers:
            kill_tree(d)
        for gw in gateways:
            gw.stop()
    assert gateways[-1].proc.returncode == 0, gateways[-1].log()[-4000:]
    return out


@pytest.mark.parametrize("state_store", STATE_STORES)
def test_driver_gateway_and_cache_lost_mid_batch_then_exactly_once(total_loss, state_store):
    seen = total_loss["seen"][state_store]
    ckpt = checkpoint_of(state_store)
    # the first life stopped in the middle of batch CRASH_AFTER: output written, offsets
    # logged, not committed
    assert seen["before"] == set(range(CRASH_AFTER))
    assert seen["mid_batch"] == (True, True, False)
    # the new gateway on an empty cache restored every committed batch (RPO 0), and not the
    # commit that was never made
    assert seen["restored_by_gateway"] == seen["before"]
    assert seen["commit_after_loss"] is False
    # the restarted query ran to the end, marking the batches it committed
    assert seen["final"] == set(range(BATCHES))
    assert seen["markers"]["errors"] == []
    assert sorted(set(seen["markers"]["written"])) == list(range(CRASH_AFTER, BATCHES))
    check = seen["check"]
    assert check["records_in"] == RECORDS
    assert check["records_out"] == RECORDS, check
    for k in ("lost", "doubled", "corrupted", "unknown", "committed_without_output", "uncommitted_output_ignored"):
        assert check[k] == [], (k, check[k][:10])
    # `sos restore` gives what the gateway serves, name by name and byte by byte
    served, restored = total_loss["served"], total_loss["restored"]
    assert f"{ckpt}/commits/{BATCHES - 1}" in served
    mine = sorted(p for p in served if p.startswith(f"{ckpt}/"))
    assert mine and sorted(p for p in restored if p.startswith(f"{ckpt}/")) == mine
    assert [p for p in mine if served[p] != restored[p]] == []
    # the state store asked for is the one that wrote the state: deltas or changelogs
    state_files = {os.path.splitext(p)[1] for p in served if p.startswith(f"{ckpt}/state/")}
    assert {"hdfs": ".delta", "rocksdb": ".changelog"}[state_store] in state_files, state_files
    # `sos restore --batch CHECKPOINT:N` stops at commit N, before the loss and after it
    for n, batches in seen["at"].items():
        assert batches == set(range(n + 1)), n


def test_no_key_on_any_command_line_while_the_driver_checkpoints_through_the_gateway(total_loss):
    """The namespace key never reaches a Spark JVM's command line (least privilege: every
    local user reads any process's ``/proc/<pid>/cmdline``): while the first driver is parked
    in batch 2, having committed batches 0 and 1 through the gateway (the key worked in its
    JVM), no process of the machine (the PySpark parent, its driver JVM, any other) has the
    key on its command line; the JVM's command line does hold the other settings (what was
    read is the right thing). Its successor, with the same settings, finishes exactly once
    with its batch markers (the test above). (tests/gateway/test_key_off_spark_argv.py: the
    Builder side; tests/spark/test_cluster.py: the executors of a standalone cluster.)"""
    seen = total_loss["key"]
    assert seen["secret_len"] >= 16
    for store in STATE_STORES:
        assert total_loss["seen"][store]["before"] == set(range(CRASH_AFTER))
    jvm = seen["jvm"]
    assert jvm, "no driver JVM among the driver's processes"
    assert seen["jvm_proc"] == jvm  # what psutil read is /proc's
    assert f"spark.hadoop.dfs.webhdfs.oauth2.client.id={NS}" in jvm
    assert "dfs.webhdfs.oauth2.credential" not in jvm
    assert seen["ours_with_key"] == [], "the key is on a command line of the driver's"
    assert not seen["leaks"], seen["leaks"]
