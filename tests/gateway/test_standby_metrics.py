"""Issue 31 item 1: a standby gateway serves `--metrics` (its role, its tail, its view of the
active's lease) and keeps serving them once promoted, with the writer's series then: after a
failover the surviving gateway is not without a metrics endpoint. Real parts: a sos-server
process, two `sos gateway` processes, a SIGKILL of the active, HTTP as Spark's commit log."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request

from spark_plugin.spark import sos_command
from tests.gateway.support import pair_gateway
from tests.support import metrics_url, scrape, token_for, wait_for, webhdfs_create

LEASE = 3

NS = "ha"


def commit(url: str, tok: str, batch: int) -> None:
    """Spark's commit of batch N: a temp file renamed onto checkpoint/commits/N."""
    tmp = f"/checkpoint/commits/.{batch}.tmp"
    assert webhdfs_create(url, tok, tmp, b"v1\n{}").status_code == 201
    r = urllib.request.Request(
        f"{url}/webhdfs/v1{tmp}?op=RENAME&destination=/checkpoint/commits/{batch}",
        method="PUT",
        headers={"Authorization": f"Bearer {tok}"},
    )
    with urllib.request.urlopen(r, timeout=60) as reply:
        assert reply.status == 200


def test_standby_serves_metrics_before_and_after_its_promotion(sos_server, tmp_path):
    key = sos_server.keygen(NS)
    active = pair_gateway(sos_server, key, tmp_path, "active", "--metrics", ":0", lease=LEASE, namespace=NS)
    standby = pair_gateway(
        sos_server, key, tmp_path, "standby", "--standby", "--metrics", ":0", lease=LEASE, namespace=NS
    )
    try:
        a_url, s_url = metrics_url(active.log()), metrics_url(standby.log())
        tok = token_for(active.url, key, NS)
        commit(active.url, tok, 0)
        a = scrape(a_url)
        assert a['sos_gateway_role{role="active"}'] == 1 and a['sos_gateway_role{role="standby"}'] == 0
        assert a['sos_gateway_last_commit_batch{checkpoint="/checkpoint"}'] == 0
        # the standby: its role, its tail (it catches up with the active's records), its lease view
        wait_for(lambda: scrape(s_url).get("sos_gateway_standby_tail_record", 0) >= 3, 20, "the tail in the metrics")
        s = scrape(s_url)
        assert s['sos_gateway_role{role="standby"}'] == 1 and s['sos_gateway_role{role="active"}'] == 0
        assert s["sos_gateway_standby_lease_seconds"] == LEASE
        assert 0 <= s["sos_gateway_standby_lease_silent_seconds"] < LEASE
        assert time.time() - s["sos_gateway_standby_last_tail_timestamp_seconds"] < 10
        assert s["sos_gateway_standby_tail_rebuilds_total"] >= 1
        assert s["sos_gateway_standby_promotions_total"] == 0
        assert s["sos_gateway_up"] == 1 and s["sos_gateway_fenced"] == 0
        assert "sos_gateway_writer_epoch" not in s  # no writer until promoted
        assert "once promoted, the writer runs with sync, durability server" in standby.log()

        os.kill(active.proc.pid, signal.SIGKILL)  # the active is lost
        active.proc.wait(timeout=30)
        wait_for(lambda: scrape(s_url)['sos_gateway_role{role="active"}'] == 1, 60, "the promotion, in the metrics")
        assert re.search(r"the namespace's writer opens with sync, durability server, .*lease 3 s", standby.log())
        # the same endpoint, now the active's: the writer's series and its commits
        p = scrape(s_url)
        assert p['sos_gateway_role{role="active"}'] == 1 and p['sos_gateway_role{role="standby"}'] == 0
        assert p["sos_gateway_standby_promotions_total"] == 1
        assert "sos_gateway_standby_lease_silent_seconds" not in p
        assert p["sos_gateway_writer_epoch"] >= 2 and p['sos_gateway_writer_state{state="ok"}'] == 1
        commit(standby.url, tok, 1)  # the token of the lost active still holds
        p = scrape(s_url)
        assert p['sos_gateway_last_commit_batch{checkpoint="/checkpoint"}'] == 1
        assert p["sos_gateway_spool_lag_records"] == 0
    finally:
        for g in (active, standby):
            g.kill()


def test_a_standby_still_refuses_restore_batch(sos_server, tmp_path):
    key = sos_server.keygen(NS)
    done = subprocess.run(
        [*sos_command(), "gateway", NS, "--listen", "127.0.0.1:0", "--standby", "--restore-batch", "c:1", "--yes"],
        env=dict(os.environ, SOS_KEY=key, SOS_SERVER=sos_server.address),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--restore-batch is not served by a --standby gateway" in done.stderr, done


def test_a_standby_warns_when_its_durability_is_not_the_actives(sos_server, tmp_path):
    """Issue 31 item 3: a promoted standby writes with its own options; the active names its
    --durability in its lease, and a standby started with another one says so at once."""
    key = sos_server.keygen(NS)
    active = pair_gateway(sos_server, key, tmp_path, "active", lease=LEASE, namespace=NS)
    standby = pair_gateway(
        sos_server, key, tmp_path, "standby", "--standby", "--durability", "tier", lease=LEASE, namespace=NS
    )
    same = pair_gateway(sos_server, key, tmp_path, "same", "--standby", lease=LEASE, namespace=NS)
    try:
        wait_for(
            lambda: "runs with --durability server, this standby with --durability tier" in standby.log(),
            20,
            "the warning",
        )
        time.sleep(1)  # several polls of the other standby
        assert "this standby with --durability" not in same.log()
        assert standby.log().count("runs with --durability server") == 1  # once per lease
    finally:
        for g in (active, standby, same):
            g.kill()
