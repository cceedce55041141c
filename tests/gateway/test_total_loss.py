"""Total loss through the gateway (issue 10, deliverable 6), with a real Spark query.

A stateful query (local mode, dropDuplicates, foreachBatch sink idempotent by batch id)
checkpoints to ``webhdfs://`` through ``sos gateway`` (a child process) of a real
``sos-server``, with the OAuth2 settings of ``gateway_conf``. Its driver, a separate
process (``tools.demo``'s ``_driver``), is SIGKILLed in the middle of batch K: the batch's
output is written, its ``commits/K`` is not. Then the gateway is SIGKILLed and its cache
directory deleted. A new gateway on an empty cache, on the same address, restores the
namespace from the server; the query restarts on the same webhdfs checkpoint and runs to
the end. The committed output (filtered by the committed batches, as the demo checks it)
holds every input record exactly once. For the HDFS-backed state store and for RocksDB
with changelog checkpointing.

Afterwards ``sos restore`` of the namespace gives the tree the gateway serves (LISTSTATUS
and OPEN, name by name and byte by byte), and ``sos restore --batch CHECKPOINT:N`` stops
at commit N.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request

import pytest

from spark_plugin.gateway.client import GatewayClient
from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import restore_to_batch, sos_command
from tests.support import tree_snapshot as local_tree
from tools.demo import (
    check_output,
    committed_batches,
    gateway_committed_batches,
    kill_tree,
    make_input,
    start_driver,
    tail,
    wait_for,
)

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(2400)]

NS = "gwloss"
CHECKPOINT = "queries/dedup"
RECORDS = 600
BATCHES = 4
CRASH_AFTER = 2
STATE_STORES = {
    "hdfs": {},
    "rocksdb": {"spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true"},
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


@pytest.mark.parametrize("state_store", sorted(STATE_STORES))
def test_driver_gateway_and_cache_lost_mid_batch_then_exactly_once(sos_server, tmp_path, state_store):
    key = sos_server.keygen(NS, "append")
    paths = {k: str(tmp_path / k) for k in ("input", "out", "flags", "cache", "logs")}
    for k in ("flags", "logs"):
        os.makedirs(paths[k])
    expected = make_input(paths["input"], RECORDS, BATCHES)
    logs = paths["logs"]

    gateways: list[GatewayProcess] = []
    drivers: list[subprocess.Popen] = []

    def gateway(n: int, listen: str = "127.0.0.1:0") -> GatewayProcess:
        gw = GatewayProcess(
            NS, paths["cache"], sos_server.address, key, listen=listen, log_path=os.path.join(logs, f"gateway{n}.log")
        )
        gateways.append(gw)
        return gw.start()

    try:
        # ---- the first life: gateway 1, driver 1 stopped in the middle of batch CRASH_AFTER
        gw1 = gateway(1)
        client = GatewayClient(gw1.url, NS, key)
        cfg = {
            "input": paths["input"],
            "out": paths["out"],
            "flags": paths["flags"],
            "gateway": {"url": gw1.url, "namespace": NS, "checkpoint": CHECKPOINT},
            "markers": True,
            "state_store": state_store,
            "spark_conf": STATE_STORES[state_store],
            "hang_at_batch": CRASH_AFTER,
        }
        d1 = start_driver(cfg, os.path.join(logs, "driver1.log"), str(tmp_path / "driver1.json"), key=key)
        drivers.append(d1)
        wait_for(
            lambda: os.path.exists(os.path.join(paths["flags"], f"hang-{CRASH_AFTER}")),
            1200,
            f"driver 1 reaching batch {CRASH_AFTER}",
            alive=lambda: d1.poll() is None,
        )
        before = gateway_committed_batches(client, CHECKPOINT)
        assert before == set(range(CRASH_AFTER)), tail(os.path.join(logs, "driver1.log"))
        # mid-batch: its output is written and its offsets are logged, its commit is not
        assert os.path.exists(os.path.join(paths["out"], f"batch-{CRASH_AFTER:06d}.jsonl"))
        assert client.exists(f"{CHECKPOINT}/offsets/{CRASH_AFTER}")
        assert not client.exists(f"{CHECKPOINT}/commits/{CRASH_AFTER}")

        # ---- total loss: the driver, then the gateway, then the gateway's disk
        kill_tree(d1)
        gw1.kill()
        assert gw1.proc.returncode == -9
        shutil.rmtree(paths["cache"])

        # ---- a new gateway on an empty cache, same address: restores from the server
        gw2 = gateway(2, listen=gw1.url.removeprefix("http://"))
        assert gw2.url == gw1.url
        assert gateway_committed_batches(client, CHECKPOINT) == before  # RPO 0
        assert not client.exists(f"{CHECKPOINT}/commits/{CRASH_AFTER}")

        # ---- the query restarts on the same webhdfs checkpoint and runs to the end
        d2 = start_driver(
            dict(cfg, hang_at_batch=None), os.path.join(logs, "driver2.log"), str(tmp_path / "driver2.json"), key=key
        )
        drivers.append(d2)
        assert d2.wait(1200) == 0, tail(os.path.join(logs, "driver2.log"), 80)
        final = gateway_committed_batches(client, CHECKPOINT)
        assert final == set(range(BATCHES))
        with open(os.path.join(paths["flags"], "markers.json")) as f:
            markers = json.load(f)
        assert markers["errors"] == []
        assert sorted(set(markers["written"])) == list(range(CRASH_AFTER, BATCHES))

        # ---- exactly once: the output of committed batches against the input
        check = check_output(paths["out"], final, expected)
        assert check["records_in"] == RECORDS
        assert check["records_out"] == RECORDS, check
        for k in ("lost", "doubled", "corrupted", "unknown", "committed_without_output", "uncommitted_output_ignored"):
            assert check[k] == [], (k, check[k][:10])

        # ---- `sos restore` gives what the gateway serves. A marker is a barrier in sync
        # mode: once it is answered, everything the gateway did before it is on the server.
        client.marker("test.barrier", b"{}")
        served = served_tree(client)
        assert f"{CHECKPOINT}/commits/{BATCHES - 1}" in served
        # the state store asked for is the one that wrote the state: deltas or changelogs
        state_files = {os.path.splitext(p)[1] for p in served if p.startswith(f"{CHECKPOINT}/state/")}
        assert {"hdfs": ".delta", "rocksdb": ".changelog"}[state_store] in state_files, state_files
        restored_dir = str(tmp_path / "restored")
        subprocess.run(
            [*sos_command(), "restore", "-q", "--server", sos_server.address, NS, restored_dir],
            env=dict(os.environ, SOS_KEY=key),
            check=True,
            timeout=600,
        )
        restored = local_tree(restored_dir)
        assert sorted(restored) == sorted(served)
        assert [p for p in served if served[p] != restored[p]] == []

        # ---- and `sos restore --batch CHECKPOINT:N` stops at commit N: before the loss
        # (first journal generation) and after it (the new gateway's generation)
        for n in (CRASH_AFTER - 1, BATCHES - 2):
            at = restore_to_batch(NS, str(tmp_path / f"at-{n}"), CHECKPOINT, n, server=sos_server.address, key=key)
            assert committed_batches(at) == set(range(n + 1)), n
    finally:
        for d in drivers:
            kill_tree(d)
        for gw in gateways:
            gw.stop()
    assert gateways[-1].proc.returncode == 0, gateways[-1].log()[-4000:]
