"""A gateway pair (issue 22, protocol.md 3.6): `sos gateway --standby` tails the journal and
answers StandbyException; Hadoop's own HA client (a webhdfs://<nameservice> URI over both
addresses) writes through the pair and keeps going when the active gateway is SIGKILLed or
paused past its lease (SIGSTOP), which never makes two writers: the resumed one is fenced,
refused, and the journal on the server is one unbroken history equal to what the client was
told. All real processes: sos-server, two gateways, a JVM with pyspark's Hadoop jars."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse

import pytest
import requests

from tests.gateway.support import pair_gateway, restored
from tests.support import hadoop_jars, run_sos_as, token_for, tree_snapshot, wait_for, webhdfs_create
from tools.jvm import LIGHT_JVM_OPTIONS

NS = "ha"
LEASE = 3
DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


def standby_refusal(r):
    assert r.status_code == 403, (r.status_code, r.text)
    assert "content-type" not in r.headers
    doc = r.json()["RemoteException"]
    assert doc["exception"] == "StandbyException"
    assert doc["javaClassName"] == "org.apache.hadoop.ipc.StandbyException"
    # Hadoop's validateResponse fails over (after its sleep) on a message ending so
    assert doc["message"].endswith("StandbyException")
    return doc


def refused_or_gone(url, tok, path):
    """A fenced gateway of a pair refuses as a standby until it has stopped (exit 3)."""
    try:
        r = webhdfs_create(url, tok, path, b"z")
    except requests.ConnectionError:
        return "gone"
    standby_refusal(r)
    return "refused"


def generations(server, key):
    out = run_sos_as(server, key, "ls", f"{NS}/gen/", ok=True).stdout
    return sorted({line.split("gen/")[1].split("/")[0] for line in out.splitlines() if "gen/" in line})


# ------------------------------------------------------------------ the standby itself


def test_standby_tails_the_journal_answers_standby_exception_and_takes_over(sos_server, tmp_path):
    key = sos_server.keygen(NS)
    active = pair_gateway(sos_server, key, tmp_path, "active", "--generation-bytes", "64K", namespace=NS)
    standby = pair_gateway(sos_server, key, tmp_path, "standby", "--standby", namespace=NS)
    try:
        tok = token_for(active.url, key, NS)
        # tokens: the standby issues them too, and each gateway accepts the other's
        tok2 = token_for(standby.url, key, NS)
        for i in range(40):  # several generations (64 KiB each): their snapshots are skipped
            assert webhdfs_create(active.url, tok2, f"/d/f{i % 7}", os.urandom(5000) + b"%d" % i).status_code == 201
        r = requests.put(
            f"{active.url}/webhdfs/v1/d/f1?op=RENAME&destination=/d/moved", headers={"Authorization": f"Bearer {tok}"}
        )
        assert r.json() == {"boolean": True}
        h = {"Authorization": f"Bearer {tok}"}
        # every WebHDFS request and a marker: StandbyException, as a standby NameNode
        standby_refusal(requests.get(f"{standby.url}/webhdfs/v1/d?op=LISTSTATUS", headers=h))
        standby_refusal(requests.put(f"{standby.url}/webhdfs/v1/x?op=MKDIRS", headers=h))
        standby_refusal(requests.put(f"{standby.url}/webhdfs/v1/x?op=CREATE", headers=h, allow_redirects=False))
        standby_refusal(requests.post(f"{standby.url}/sos/v1/marker?label=x", headers=h, data=b"p"))
        assert requests.get(f"{standby.url}/webhdfs/v1/d?op=LISTSTATUS").status_code == 401
        assert len(generations(sos_server, key)) > 2
        expected = tree_snapshot(os.path.join(active.cache_dir, "tree"))
        wait_for(
            lambda: tree_snapshot(os.path.join(standby.cache_dir, "tree")) == expected,
            20,
            "the standby's cache equals the active's",
        )
        before = generations(sos_server, key)
        active.kill()
        # the standby takes over within its lease (plus a poll): then it serves, and writes
        wait_for(
            lambda: requests.get(f"{standby.url}/webhdfs/v1/d?op=LISTSTATUS", headers=h, timeout=60).status_code == 200,
            LEASE + 15,
            "the standby promoted itself",
        )
        assert webhdfs_create(standby.url, tok, "/d/after", b"after").status_code == 201
        # it continued the journal's generation (no snapshot of the whole tree)
        assert generations(sos_server, key) == before
        assert "continues the journal after record" in standby.log()
        expected["d/after"] = b"after"
        assert restored(sos_server, key, tmp_path / "r", NS) == expected
        assert run_sos_as(sos_server, key, "verify", "-q", NS, ok=True).returncode == 0
    finally:
        for g in (active, standby):
            g.kill()


def test_promote_by_hand_fences_the_active(sos_server, tmp_path):
    key = sos_server.keygen(NS)
    active = pair_gateway(sos_server, key, tmp_path, "active", namespace=NS)
    standby = pair_gateway(sos_server, key, tmp_path, "standby", "--standby", lease=60, namespace=NS)
    try:
        tok = token_for(active.url, key, NS)
        assert webhdfs_create(active.url, tok, "/a", b"before").status_code == 201
        wrong = run_sos_as(sos_server, key, "gateway", "promote", NS, active.url)
        assert wrong.returncode == 1 and "FileNotFoundException" in wrong.stderr  # not a standby
        done = run_sos_as(sos_server, key, "gateway", "promote", NS, standby.url, ok=True)
        assert "promoted: writer epoch" in done.stdout, done.stdout
        again = run_sos_as(sos_server, key, "gateway", "promote", NS, standby.url, ok=True)
        assert "already active" in again.stdout
        # the old active is fenced: its lease renewal (or its fence check) says so: it refuses
        # as a standby, and stops with exit status 3
        refused_or_gone(active.url, tok, "/zombie")
        assert active.proc.wait(timeout=30) == 3
        assert "FENCED" in active.log()
        assert webhdfs_create(standby.url, tok, "/b", b"after").status_code == 201
        assert restored(sos_server, key, tmp_path / "r", NS) == {"a": b"before", "b": b"after"}
    finally:
        for g in (active, standby):
            g.kill()


# ------------------------------------------------------------------ Hadoop's own HA client


#: javac with the short-lived JVM options of tools/jvm.py (C1 only, serial GC): half the CPU
JAVAC_LIGHT = [f"-J{o}" for o in LIGHT_JVM_OPTIONS.split()]


@pytest.fixture(scope="module")
def ha_writer(tmp_path_factory):
    jars = hadoop_jars()
    if shutil.which("javac") is None:
        pytest.skip("needs pyspark's Hadoop jars and javac")
    out = tmp_path_factory.mktemp("hawriter")
    subprocess.run(
        ["javac", *JAVAC_LIGHT, "-cp", os.path.join(jars, "*"), "-d", str(out), os.path.join(DATA, "HaWriter.java")],
        check=True,
        timeout=300,
    )
    return f"{jars}/*:{out}"


class JavaWriter:
    """HaWriter in a JVM; ``commits`` maps batch -> the local time its COMMITTED line came."""

    def __init__(self, classpath, key, addresses, token_url, tmp_path, *, batches=100000, props=()):
        self.stop_file = tmp_path / "STOP"
        self.lines: list[str] = []
        self.commits: dict[int, float] = {}
        cmd = [
            "java",
            *LIGHT_JVM_OPTIONS.split(),
            *props,
            "-cp",
            classpath,
            "HaWriter",
            "sosha",
            ",".join(addresses),
            token_url,
            NS,
            str(batches),
            str(self.stop_file),
        ]
        with open(tmp_path / "java.log", "w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=dict(os.environ, SOS_KEY=key)
            )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.startswith("COMMITTED "):
                self.commits[int(line.split()[1])] = time.monotonic()

    def wait(self, n, timeout):
        wait_for(lambda: len(self.commits) >= n or self.proc.poll() is not None, timeout, f"{n} batches committed")
        assert len(self.commits) >= n, self.lines[-20:]

    def finish(self):
        self.stop_file.write_text("")
        assert self.proc.wait(timeout=120) == 0, self.lines[-20:]
        self.thread.join(timeout=10)
        self.proc.stdout.close()
        assert self.lines[-1] == "DONE"

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.thread.join(timeout=10)
        self.proc.stdout.close()

    def gap_after(self, t):
        """Seconds from ``t`` to the first commit after it."""
        return min(c for c in self.commits.values() if c > t) - t


def check_history(server, key, writer, tmp_path):
    """One unbroken journal (sos verify), and restore equals what the client was told."""
    assert run_sos_as(server, key, "verify", "-q", NS, ok=True).returncode == 0
    tree = restored(server, key, tmp_path / "restored", NS)
    commits = {p: v for p, v in tree.items() if p.startswith("ha/commits/")}
    assert commits == {f"ha/commits/{i}": f"batch {i}\n".encode() for i in writer.commits}


def addr(url):
    return urllib.parse.urlsplit(url).netloc


def test_hadoop_client_fails_over_when_the_active_is_killed(sos_server, tmp_path, ha_writer):
    key = sos_server.keygen(NS)
    active = pair_gateway(sos_server, key, tmp_path, "active", namespace=NS)
    standby = pair_gateway(sos_server, key, tmp_path, "standby", "--standby", namespace=NS)
    writer = None
    try:
        # the standby first: the client is sent on by its StandbyException
        writer = JavaWriter(
            ha_writer, key, [addr(standby.url), addr(active.url)], standby.url + "/oauth2/token", tmp_path
        )
        writer.wait(20, 120)
        killed = time.monotonic()
        active.kill()
        n = len(writer.commits)
        writer.wait(n + 20, 120)
        gap = writer.gap_after(killed)
        print(f"first commit {gap:.2f} s after SIGKILL of the active (lease {LEASE} s)")
        assert gap < LEASE + 30  # generous: the lease, a poll, the client's sleep
        writer.finish()
        check_history(sos_server, key, writer, tmp_path)
    finally:
        if writer is not None:
            writer.kill()
        for g in (active, standby):
            g.kill()


def test_sigstop_past_the_lease_never_makes_two_writers(sos_server, tmp_path, ha_writer):
    key = sos_server.keygen(NS)
    active = pair_gateway(sos_server, key, tmp_path, "active", namespace=NS)
    standby = pair_gateway(sos_server, key, tmp_path, "standby", "--standby", namespace=NS)
    writer = None
    try:
        tok = token_for(active.url, key, NS)
        # a request held by the paused gateway times out after 8 s and goes to the other
        writer = JavaWriter(
            ha_writer,
            key,
            [addr(active.url), addr(standby.url)],
            standby.url + "/oauth2/token",
            tmp_path,
            props=["-Dhadoop.dfs.webhdfs.socket.read-timeout=8s"],
        )
        writer.wait(20, 120)
        os.kill(active.pid, signal.SIGSTOP)
        paused = time.monotonic()
        n = len(writer.commits)
        writer.wait(n + 10, 120)  # the standby took over while the active is paused
        print(f"first commit {writer.gap_after(paused):.2f} s after SIGSTOP of the active")
        os.kill(active.pid, signal.SIGCONT)
        # the resumed zombie: its lease lapsed (StandbyException at once), then its renewal or
        # its fence check finds it fenced: it stops with exit status 3. Its overdue renewal runs
        # the moment it resumes, so it may be gone before this request: either way it writes
        # nothing (the restored tree below has no zombie-write)
        assert refused_or_gone(active.url, tok, "/zombie-write") in ("refused", "gone")
        assert active.proc.wait(timeout=30) == 3, active.log()[-3000:]
        n = len(writer.commits)
        writer.wait(n + 10, 120)
        writer.finish()
        check_history(sos_server, key, writer, tmp_path)
        assert "zombie-write" not in tree_snapshot(tmp_path / "restored")
    finally:
        if writer is not None:
            writer.kill()
        with __import__("contextlib").suppress(ProcessLookupError):
            os.kill(active.pid, signal.SIGCONT)
        for g in (active, standby):
            g.kill()


# ------------------------------------------------------------------ Spark through the helper

SPARK_DRIVER = """
import json, os, signal, sys, time
cfg = json.load(open(sys.argv[1]))
from tools.demo import write_batch_output
from spark_plugin.spark import gateway_checkpoint
from tests.support import dedup_query, spark_builder

builder = spark_builder("sos-gateway-pair")
loc = gateway_checkpoint(builder, cfg["urls"], cfg["ns"], os.environ["SOS_KEY"], "queries/q1",
                         token_url=cfg["token_url"])
spark = builder.getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
loc.attach(spark)
batches = []

def sink(df, batch_id):
    write_batch_output(cfg["out"], df, batch_id)
    batches.append(batch_id)
    if batch_id == cfg["kill_at"]:  # mid-batch: before Spark renames onto commits/N
        os.kill(cfg["kill_pid"], signal.SIGKILL)
        with open(cfg["killed"], "w") as f:
            f.write(str(time.monotonic()))

os.makedirs(cfg["out"], exist_ok=True)
query = dedup_query(spark, cfg["input"], sink, str(loc))
query.awaitTermination()
deadline = time.monotonic() + 120  # the listener runs asynchronously
while set(loc.listener.written) < set(batches) and time.monotonic() < deadline:
    time.sleep(0.2)
with open(cfg["result"], "w") as f:
    json.dump({"location": str(loc), "batches": batches, "markers": loc.listener.written,
               "errors": loc.listener.errors, "conf": loc.conf}, f)
spark.stop()
"""


@pytest.mark.spark
@pytest.mark.timeout(900)
def test_spark_query_through_the_helper_rides_through_the_loss_of_the_active(sos_server, tmp_path):
    import json
    import sys
    from collections import Counter

    from tools.demo import committed_batches, make_input

    pytest.importorskip("pyspark")
    key = sos_server.keygen(NS)
    files, records = 8, 400
    make_input(str(tmp_path / "input"), records, files)
    active = pair_gateway(sos_server, key, tmp_path, "active", namespace=NS)
    standby = pair_gateway(sos_server, key, tmp_path, "standby", "--standby", namespace=NS)
    try:
        cfg = {
            "urls": [active.url, standby.url],
            "ns": NS,
            "input": str(tmp_path / "input"),
            "out": str(tmp_path / "out"),
            "kill_at": 3,
            "kill_pid": active.pid,
            "killed": str(tmp_path / "killed"),
            "result": str(tmp_path / "result.json"),
            "token_url": standby.url,
        }
        (tmp_path / "cfg.json").write_text(json.dumps(cfg))
        (tmp_path / "driver.py").write_text(SPARK_DRIVER)
        env = dict(
            os.environ,
            SOS_KEY=key,
            PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p),
        )
        with open(tmp_path / "driver.log", "wb") as logf:
            proc = subprocess.run(
                [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "cfg.json")],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=800,
            )
        assert proc.returncode == 0, (tmp_path / "driver.log").read_text()[-6000:]
        result = json.loads((tmp_path / "result.json").read_text())
    finally:
        for g in (active, standby):
            g.kill()
    assert result["location"] == f"webhdfs://sos-{NS}/queries/q1"
    conf = result["conf"]
    assert conf[f"spark.hadoop.dfs.ha.namenodes.sos-{NS}"] == "gw1,gw2"
    assert conf[f"spark.hadoop.dfs.namenode.http-address.sos-{NS}.gw2"] == addr(standby.url)
    assert result["batches"][-1] == files - 1
    assert sorted(set(result["batches"])) == list(range(files))
    assert result["errors"] == [] and sorted(set(result["markers"])) == list(range(files))
    assert "standby: promoted" in standby.log()
    ids = Counter()
    for name in os.listdir(tmp_path / "out"):
        with open(tmp_path / "out" / name) as f:
            ids.update(json.loads(line)["id"] for line in f)
    assert sorted(ids) == list(range(records)) and set(ids.values()) == {1}, "exactly once"
    run_sos_as(sos_server, key, "restore", "-q", NS, str(tmp_path / "restored"), ok=True)
    assert committed_batches(str(tmp_path / "restored" / "queries" / "q1")) == set(range(files))
    assert run_sos_as(sos_server, key, "verify", "-q", NS, ok=True).returncode == 0


# ------------------------------------------------------------------ the crash loop (item 5)

#: 6 events, one of each kind the weights below allow: seed 681 draws (the draws do not depend
#: on timing) a server kill, a kill of the active gateway (its cache kept), an executor kill, a
#: total loss restored by a gateway on an empty cache, a split-brain attempt (zombie) and a
#: kill of the standby (restarted on an empty cache). SOS_SOAK_PAIR_KILLS=N runs longer.
PAIR_KILLS = max(6, int(os.environ.get("SOS_SOAK_PAIR_KILLS", "6")))
PAIR_TIMEOUT = max(840, 100 * PAIR_KILLS)


def _node_isolation_problem():
    from tools.cluster import can_isolate_nodes

    return can_isolate_nodes()


@pytest.mark.spark
@pytest.mark.skipif(
    _node_isolation_problem() is not None, reason=f"cluster nodes cannot be isolated here: {_node_isolation_problem()}"
)
@pytest.mark.timeout(PAIR_TIMEOUT + 60)
def test_cluster_crash_loop_with_a_gateway_pair(tmp_path):
    """scripts/soak --cluster --gateway-pair, bounded: kills of the active gateway (the
    standby takes over), split-brain attempts (the active paused past its lease, resumed and
    sent a write), kills of the standby, with server, executor and total-loss events: exactly
    once throughout, every split-brain write refused."""
    import json
    import sys

    from tools import child_env

    pytest.importorskip("pyspark")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.soak",
            "--cluster",
            "--gateway-pair",
            "--seed",
            "681",
            "--duration",  # the events end the run (--max-kills), not the clock
            str(PAIR_TIMEOUT - 120),
            "--max-kills",
            str(PAIR_KILLS),
            "--weights",
            "gateway=3,zombie=2,standby=1,server=1,executor=1,worker=0,driver=0,all=1",
            "--delay",  # the gap between events (one uniform draw whatever its bounds: same events)
            "0.2",
            "2",
            "--workdir",
            str(tmp_path / "soak"),
        ],
        capture_output=True,
        text=True,
        cwd=root,
        env=child_env(),
        timeout=PAIR_TIMEOUT,
    )
    lines = proc.stdout.splitlines()
    result = next((json.loads(ln.split(" ", 1)[1]) for ln in reversed(lines) if ln.startswith("SOAK-RESULT ")), None)
    assert result is not None, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert result["violations"] == [], "\n".join(lines[-40:])
    assert proc.returncode == 0, "\n".join(lines[-40:])
    assert result["mode"] == "cluster-pair" and result["kill_events"] == PAIR_KILLS
    kills = result["kills"]
    for kind in ("gateway", "zombie", "standby", "server", "executor", "all"):
        assert kills[kind] >= 1, (kind, kills)
    g = result["gateway_restarts"]
    assert g["failovers"] == kills["gateway"] + kills["zombie"], g
    assert g["split-brain-refused"] == kills["zombie"], g
    assert result["records_final"] > 0 and result["checks"] >= result["kill_events"]
