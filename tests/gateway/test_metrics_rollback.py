"""Day two, the rest of issue 23: the gateway's metrics endpoint and the example alert rules
(item 5), rolling a gateway's namespace back to a batch (item 8), a fenced mount stops on its
own (item 4), the documented certificate names localhost (item 10). Real parts: real
sos-server processes (one with --tier against moto), real `sos gateway` child processes,
plain HTTP CREATE + RENAME as Spark's commit log does them, `sos restore`."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import time

import pytest
import yaml

from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.mount.process import MountProcess, is_mounted
from spark_plugin.spark import sos_command
from tests.deploy.support import documented_line
from tests.gateway.support import NS, Gw, restore
from tests.support import gateway_refused, metrics_url, scrape

pytestmark = [pytest.mark.day2, pytest.mark.slow]
pytest_plugins = ["tests.tier.support"]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def commit_batch(gw: Gw, chk: str, batch: int) -> None:
    """What Spark's commit log does for batch N: the body to a temp file, renamed onto
    CHK/commits/N (offsets first, as a micro-batch does)."""
    assert gw.put_file(f"/{chk}/offsets/{batch}", f"v1\noffsets {batch}".encode()).status_code == 201
    tmp = f"/{chk}/commits/.{batch}.tmp"
    assert gw.put_file(tmp, f'v1\n{{"nextBatchWatermarkMs":{batch}}}'.encode()).status_code == 201
    r = gw.session.put(gw.u(tmp, op="RENAME", destination=f"/{chk}/commits/{batch}"))
    assert r.status_code == 200 and r.json() == {"boolean": True}, r.text


# ---------------------------------------------------------------------------- item 5: metrics


def test_gateway_metrics_answer_is_my_checkpoint_protected(sos_server, tmp_path):
    gw = Gw(sos_server, tmp_path, args=["--metrics", ":0"])
    try:
        url = metrics_url(gw.proc.log())
        assert url.startswith("http://127.0.0.1:")  # :PORT is loopback, as sos-server's
        for batch in range(3):
            commit_batch(gw, "jobs/a", batch)
        commit_batch(gw, "jobs/b", 7)
        m = scrape(url)
        assert m['sos_gateway_last_commit_batch{checkpoint="/jobs/a"}'] == 2
        assert m['sos_gateway_last_commit_batch{checkpoint="/jobs/b"}'] == 7
        assert abs(m['sos_gateway_last_commit_timestamp_seconds{checkpoint="/jobs/a"}'] - time.time()) < 600
        # sync mode: every commit waited for the server: nothing behind
        assert m["sos_gateway_spool_lag_records"] == 0
        assert m["sos_gateway_spool_lag_bytes"] == 0
        assert m["sos_gateway_spool_lag_seconds"] == 0
        assert m['sos_gateway_writer_state{state="ok"}'] == 1
        assert m['sos_gateway_writer_state{state="failed"}'] == 0
        assert m["sos_gateway_fenced"] == 0
        assert m["sos_gateway_replicator_errors_total"] == 0
        assert m["sos_gateway_barrier_seconds_count"] >= 4  # a barrier per RENAME at least
        assert m['sos_gateway_requests_total{op="RENAME"}'] == 4
        assert m['sos_gateway_requests_total{op="CREATE data"}'] == 8
    finally:
        gw.stop()


def test_gateway_metrics_show_the_lag_while_the_server_is_down(sos_server, tmp_path):
    """Async mode, the server stopped: the records wait in the spool and the lag in records,
    bytes and seconds grows; the writer says it is retrying and counts its errors."""
    gw = Gw(sos_server, tmp_path, sync=False, args=["--metrics", "127.0.0.1:0"])
    try:
        url = metrics_url(gw.proc.log())
        sos_server.stop()
        commit_batch(gw, "chk", 0)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = scrape(url)
            if m['sos_gateway_writer_state{state="retrying"}'] and m["sos_gateway_spool_lag_seconds"] >= 1:
                break
            time.sleep(0.5)
        assert m["sos_gateway_spool_lag_records"] >= 3
        assert m["sos_gateway_spool_lag_bytes"] > 0
        assert m["sos_gateway_spool_lag_seconds"] >= 1
        states = {k: v for k, v in m.items() if "writer_state" in k}
        assert m['sos_gateway_writer_state{state="retrying"}'] == 1, states
        assert sum(states.values()) == 1
        assert m["sos_gateway_replicator_errors_total"] >= 1, m
        sos_server.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and scrape(url)["sos_gateway_spool_lag_records"]:
            time.sleep(0.5)
        m = scrape(url)
        assert m["sos_gateway_spool_lag_records"] == 0 and m["sos_gateway_spool_lag_seconds"] == 0
        assert m['sos_gateway_writer_state{state="ok"}'] == 1
    finally:
        gw.stop()


def test_gateway_metrics_address_is_checked_before_anything_runs(sos_server, tmp_path):
    r = gateway_refused(sos_server, sos_server.keygen(NS, "append"), NS, tmp_path / "c", "--metrics", "nonsense")
    assert r.returncode == 2 and "--metrics 'nonsense'" in r.stderr, r.stderr


def _rule_metric_names() -> set[str]:
    doc = yaml.safe_load((ROOT / "deploy" / "prometheus" / "sos-alerts.yaml").read_text())
    names = set()
    for group in doc["groups"]:
        for rule in group["rules"]:
            assert {"alert", "expr", "labels", "annotations"} <= set(rule), rule
            names |= set(re.findall(r"\bsos_[a-z0-9_]+", rule["expr"]))
    return names


def _exposed(name: str, scraped: dict[str, float]) -> bool:
    return any(key == name or key.startswith(name + "{") for key in scraped)


def test_every_metric_in_the_alert_rules_exists(sos_server_factory, new_bucket, tmp_path):
    """The example rules (deploy/prometheus/sos-alerts.yaml) name only series a real gateway
    and a real server (with --tier, against moto) expose; promtool is not installed here
    (apt's prometheus package is large), so the YAML's shape is checked by this parse."""
    if shutil.which("promtool"):
        subprocess.run(
            ["promtool", "check", "rules", str(ROOT / "deploy/prometheus/sos-alerts.yaml")], check=True, timeout=60
        )
    srv = sos_server_factory(args=["--tier", new_bucket(), "--tier-interval", "1s", "--namespace-quota", "64MiB"])
    gw = Gw(srv, tmp_path, args=["--metrics", ":0"])
    names = _rule_metric_names()
    try:
        commit_batch(gw, "chk", 0)
        deadline = time.monotonic() + 60  # the tier's series come with its first round
        while True:
            scraped = scrape(metrics_url(gw.proc.log())) | scrape("http://" + srv.metrics_address)
            if all(_exposed(n, scraped) for n in names) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        gw.stop()
    assert {
        "sos_gateway_spool_lag_seconds",
        "sos_gateway_fenced",
        "sos_namespace_quota_bytes",
        "sos_gateway_last_commit_timestamp_seconds",
        "sos_tier_lag_seconds",
    } <= names
    missing = sorted(n for n in names if not _exposed(n, scraped))
    assert not missing, f"alert rules name series nobody exposes: {missing}"


# ---------------------------------------------------------------------------- item 8: rollback


def _tree(root: pathlib.Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.endswith(".tmp")}


def test_restore_batch_rolls_the_namespace_back_and_the_journal_goes_on(sos_server, tmp_path):
    gw = Gw(sos_server, tmp_path, cache=tmp_path / "cache")
    key = gw.key
    for batch in range(5):
        commit_batch(gw, "chk", batch)
    assert gw.put_file("/other/late", b"written after batch 2").status_code == 201
    assert gw.stop() == 0

    # without --yes: refused, nothing changed on the server
    refused = GatewayProcess(
        NS,
        str(tmp_path / "cache"),
        sos_server.address,
        key,
        extra_args=["--restore-batch", "chk:2"],
        log_path=str(tmp_path / "refused.log"),
    )
    with pytest.raises(Exception):  # noqa: B017 - it exits before its ready line
        refused.start()
    refused.stop()
    assert "pass --yes" in refused.log() and "EVERY other checkpoint" in refused.log(), refused.log()
    assert "chk/commits/4" in _tree(restore(sos_server, key, tmp_path / "still-latest"))

    gw = Gw(
        sos_server,
        tmp_path,
        key=key,
        cache=tmp_path / "cache",
        name="rolled",
        args=["--restore-batch", "chk:2", "--yes"],
    )
    try:
        st = gw.session.get(gw.u("/chk/commits", op="LISTSTATUS")).json()
        names = sorted(e["pathSuffix"] for e in st["FileStatuses"]["FileStatus"])
        assert names == ["0", "1", "2"], names
        # the other checkpoint went back to the same journal position: its later file is gone
        assert gw.session.get(gw.u("/other/late", op="GETFILESTATUS")).status_code == 404
        assert "rolled back to batch 2" in gw.proc.log()
        commit_batch(gw, "chk", 3)  # the query goes on from batch 3
    finally:
        assert gw.stop() == 0
    tree = _tree(restore(sos_server, key, tmp_path / "restored"))
    assert {"chk/commits/0", "chk/commits/1", "chk/commits/2", "chk/commits/3"} <= tree
    assert "chk/commits/4" not in tree and "other/late" not in tree and "chk/offsets/4" not in tree
    assert (tmp_path / "restored" / "chk" / "offsets" / "3").read_bytes() == b"v1\noffsets 3"


def test_restore_batch_of_an_unknown_batch_is_refused_and_changes_nothing(sos_server, tmp_path):
    gw = Gw(sos_server, tmp_path, cache=tmp_path / "cache")
    key = gw.key
    commit_batch(gw, "chk", 0)
    assert gw.stop() == 0
    r = gateway_refused(sos_server, key, NS, tmp_path / "cache", "--restore-batch", "chk:9", "--yes")
    assert r.returncode == 1 and "no chk/commits/9" in r.stderr, r.stderr
    # the emptied cache is rebuilt at the journal's end by the next plain start
    gw = Gw(sos_server, tmp_path, key=key, cache=tmp_path / "cache", name="after")
    try:
        assert gw.session.get(gw.u("/chk/commits/0", op="GETFILESTATUS")).status_code == 200
    finally:
        gw.stop()


def test_a_rollback_cut_short_is_not_taken_for_the_namespace(sos_server, tmp_path):
    """A --restore-batch killed between emptying the cache and starting its new generation
    leaves a half-restored tree the journal does not hold, and its marker: the next plain start
    rebuilds the tree from the journal's end instead of journaling on top of it."""
    cache = tmp_path / "cache"
    gw = Gw(sos_server, tmp_path, cache=cache)
    key = gw.key
    for batch in range(3):
        commit_batch(gw, "chk", batch)
    assert gw.stop() == 0
    # the state such a crash leaves: the marker, a partly restored tree
    (cache / "rollback-pending").write_text("--restore-batch chk:0 in progress\n")
    shutil.rmtree(cache / "tree" / "chk" / "commits")
    gw = Gw(sos_server, tmp_path, key=key, cache=cache, name="after-crash")
    try:
        st = gw.session.get(gw.u("/chk/commits", op="LISTSTATUS")).json()
        assert sorted(e["pathSuffix"] for e in st["FileStatuses"]["FileStatus"]) == ["0", "1", "2"]
        assert "did not finish" in gw.proc.log()
    finally:
        assert gw.stop() == 0
    assert not (cache / "rollback-pending").exists()


# ---------------------------------------------------------------------------- item 4: the mount


@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing: no FUSE")
def test_a_fenced_idle_mount_unmounts_itself_and_exits_3(sos_server, tmp_path):
    """An idle mount whose namespace a gateway takes over learns it from its fence check (the
    gateway's FenceWatch, shared), says who fenced it, unmounts and exits 3."""
    key = sos_server.keygen(NS, "append")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mp = MountProcess(
        NS,
        str(mnt),
        str(tmp_path / "mcache"),
        sos_server.address,
        key,
        log_path=str(tmp_path / "mount.log"),
        extra_args=["--fence-check", "1"],
    ).start()
    try:
        (mnt / "before").write_bytes(b"x")
        gw = Gw(sos_server, tmp_path, key=key, name="newcomer")  # fences the mount
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and mp.returncode is None:
                time.sleep(0.2)
            assert mp.returncode == 3, mp.log()
            assert "FENCED" in mp.log() and "by a newer writer" in mp.log(), mp.log()
            assert not is_mounted(str(mnt))
            assert "FENCED A LIVE WRITER?" in gw.proc.log()
        finally:
            gw.stop()
    finally:
        mp.stop()


# ---------------------------------------------------------------------------- item 10


def test_the_documented_gateway_certificate_names_localhost(tmp_path):
    """Hadoop names the gateway `localhost:PORT` in its errors when the user gave 127.0.0.1
    (NetUtils.getHostPortString -> InetSocketAddress.getHostName, a reverse lookup), and may
    connect by that name: the documented certificate carries DNS:localhost as well."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed")
    subprocess.run(
        ["bash", "-c", documented_line("openssl req", "/CN=sos-gateway")],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=120,
    )
    text = subprocess.run(
        [
            "openssl",
            "x509",
            "-noout",
            "-ext",
            "subjectAltName",
            "-in",
            str(tmp_path / "deploy" / "tls" / "gateway.crt"),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "DNS:localhost" in text and "IP Address:127.0.0.1" in text, text
    spark = (ROOT / "docs" / "SPARK.md").read_text()
    assert "getHostName" in spark and "DNS:localhost" in spark


# ---------------------------------------------------------------------------- newcomer: is my batch committed?


def committed_lines() -> list[str]:
    """The command lines of docs/SPARK.md's "Is my batch committed?" block."""
    doc = (ROOT / "docs" / "SPARK.md").read_text()
    section = doc.split("### Is my batch committed?", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block, "no sh block under 'Is my batch committed?'"
    lines = [line for line in block.group(1).splitlines() if line and not line.startswith("#")]
    assert len(lines) == 4, lines  # curl; the environment; the newest batch; batch 41
    return [lines[0], lines[3].replace("checkpoint:41", "checkpoint:0").replace("/tmp/peek41", "/tmp/peek")]


def test_is_my_batch_committed_as_documented(sos_server, tmp_path):
    """docs/SPARK.md's two commands, run as written (the documented port and scratch
    directory swapped for this test's): the metric names the batch only once it is
    committed, and the read-key restore exits 1 before the commit, 0 after it with
    commits/0 listed."""
    curl_line, restore_line = committed_lines()
    assert "--role read --out myjob-read.key" in (ROOT / "docs" / "SPARK.md").read_text()
    gw = Gw(sos_server, tmp_path, args=["--metrics", ":0"])
    try:
        port = metrics_url(gw.proc.log()).rpartition(":")[2]
        curl = ["bash", "-c", curl_line.replace("127.0.0.1:9102", f"127.0.0.1:{port}")]
        (tmp_path / "myjob-read.key").write_text(sos_server.keygen(NS, "read") + "\n")
        peek = tmp_path / "peek"
        restore = ["bash", "-c", restore_line.replace(" myjob ", f" {NS} ").replace("/tmp/peek", str(peek))]
        env = os.environ | {
            "SOS_SERVER": sos_server.address,
            "SOS_KEY_FILE": "myjob-read.key",  # the block's export line (tests/project/test_ops_docs.py runs it whole)
            "PATH": f"{pathlib.Path(sos_command()[0]).parent}:{os.environ['PATH']}",
        }
        before = subprocess.run(curl, capture_output=True, text=True, timeout=60)
        assert before.returncode == 1 and before.stdout == "", before  # grep: no commit yet
        assert gw.put_file("/checkpoint/metadata", b'{"id":"q"}').status_code == 201  # no commit yet
        early = subprocess.run(restore, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert early.returncode == 1 and "no checkpoint/commits/0" in early.stderr, early
        shutil.rmtree(peek, ignore_errors=True)
        commit_batch(gw, "checkpoint", 0)
        after = subprocess.run(curl, capture_output=True, text=True, timeout=60)
        assert after.stdout.strip() == 'sos_gateway_last_commit_batch{checkpoint="/checkpoint"} 0.0', after
        done = subprocess.run(restore, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done
        assert done.stdout.split() == ["0"], done.stdout
    finally:
        gw.stop()
