"""Issue 30: a query does not stop because its gateway went away, even while a file's body
is in flight (the data PUT after CREATE's redirect).

- Hadoop's own client (tests/java/RideHarness.java) writes a file through ``sos gateway``
  with the settings the Spark helper writes (``gateway_conf(..., ride_through=True)`` and
  the shipped jar); the gateway is SIGKILLed in the middle of the body (after half of it was
  flushed to the gateway) and restarted: the write completes and the file holds exactly its
  bytes, through FileSystem and through FileContext (Spark's checkpoint file manager), from
  memory and spilled to disk. Without the jar the same write fails (the control).
- A RocksDB query (one run, local[2], the helper's settings) under 7 SIGKILLs of its gateway,
  3 of them inside a CREATE's body (a proxy holds the data step half sent while the gateway
  dies), the others at random moments (seed: SOS_RIDE_SEED): it finishes, exactly once.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import pytest
import requests

from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import gateway_checkpoint, gateway_conf, ride_through_jar, sos_command
from tests.gateway.support import compiled_harness, pair_gateway
from tools.demo import make_input

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
NS = "ride"


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """(classpath without the ride-through jar, the jar, env)."""
    classpath, env = compiled_harness(tmp_path_factory.mktemp("ride-harness"), "RideHarness.java")
    subprocess.run([os.path.join(HERE, "..", "scripts", "build-jar"), sys.executable], check=True, timeout=300)
    jar = ride_through_jar()
    assert jar is not None, "scripts/build-jar built no jar"
    return classpath, jar, env


class Restartable:
    """A gateway on a fixed port that the test SIGKILLs and restarts on the same cache."""

    def __init__(self, server, key, base, **kw):
        self.server, self.key, self.base, self.kw = server, key, base, kw
        self.generation = 0
        self.gw = self._start("127.0.0.1:0")
        self.listen = self.gw.url.split("//", 1)[1]

    def _start(self, listen):
        self.generation += 1
        return GatewayProcess(
            NS,
            str(self.base / "cache"),
            self.server.address,
            self.key,
            listen=listen,
            debug=True,
            log_path=str(self.base / f"gateway-{self.generation}.log"),
            **self.kw,
        ).start()

    @property
    def url(self):
        return f"http://{self.listen}"

    def kill(self):
        self.gw.kill()

    def restart(self):
        deadline = time.monotonic() + 60
        while True:  # the port may linger a moment after the kill
            try:
                self.gw = self._start(self.listen)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self):
        if self.gw.running:
            self.gw.stop()


@pytest.fixture
def restartable(sos_server, tmp_path):
    key = sos_server.keygen(NS, "append")
    gw = Restartable(sos_server, key, tmp_path)
    yield gw, key
    gw.stop()


def _run_harness(harness, mode, uri, size, conf, interrupt, *, ride=True, extra=()):
    """RideHarness writing ``uri``; ``interrupt(go)`` runs when half the body is at the
    gateway and must call ``go()`` (let the writer go on) at some point."""
    classpath, jar, env = harness
    args = [f"{k}={v}" for k, v in conf.items()] + list(extra)
    cp = f"{classpath}{os.pathsep}{jar}" if ride else classpath
    proc = subprocess.Popen(
        ["java", "-cp", cp, "RideHarness", mode, uri, str(size), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )

    def go():
        proc.stdin.write("go\n")
        proc.stdin.flush()

    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "MID":
                break
        assert lines and lines[-1] == "MID", "\n".join([*lines, proc.stderr.read()[:3000]])
        interrupt(go)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, lines + out.splitlines(), err


def _write_across_a_kill(harness, gw, key, mode, name, size, *, ride=True, restart_first=True, extra=()):
    def interrupt(go):
        gw.kill()  # half the body is at the gateway: it dies with the request in flight
        if restart_first:
            gw.restart()
            go()
        else:  # the client finds the gateway down and waits for it
            go()
            time.sleep(1.5)
            gw.restart()

    conf = gateway_conf(gw.url, NS, key, ride_through=ride)
    uri = f"webhdfs://{gw.listen}/files/{name}"
    return _run_harness(harness, mode, uri, size, conf, interrupt, ride=ride, extra=extra)


@pytest.mark.parametrize(
    ("mode", "size", "restart_first", "extra"),
    [
        ("fs", 200_000, True, ()),
        ("fc", 200_000, False, ()),
        ("fc", 3_000_000, True, ("sos.webhdfs.ride.memory.bytes=65536",)),  # spilled to disk
    ],
)
def test_a_body_in_flight_when_the_gateway_dies_is_resent(harness, restartable, mode, size, restart_first, extra):
    gw, key = restartable
    rc, out, err = _write_across_a_kill(
        harness, gw, key, mode, f"{mode}-{size}", size, restart_first=restart_first, extra=extra
    )
    assert rc == 0, err[-6000:]
    assert "FS sos.hadoop.RideThroughWebHdfsFileSystem" in out
    assert "VERIFIED" in out, (out, err[-4000:])
    assert "FAILURES 1" in out and "RESENT 1" in out, out  # the kill did break the body


def test_without_the_jar_a_body_in_flight_is_lost_with_the_query(harness, restartable):
    """The control: Hadoop's plain WebHdfsFileSystem does not resend (what the issue saw)."""
    gw, key = restartable
    rc, out, err = _write_across_a_kill(harness, gw, key, "fs", "plain", 200_000, ride=False)
    assert rc != 0 and "VERIFIED" not in out, (out, err[-3000:])


def test_sigterm_lets_a_body_in_flight_finish_before_the_gateway_exits(harness, restartable):
    """Issue 30.3: a planned restart drains. SIGTERM arrives while half a body is at the
    gateway; the rest comes after it: the gateway still takes the whole file (Hadoop's plain
    client, no resend, so the drain alone must do it: close() returns), then exits 0, and the
    file is there, whole, for the gateway that replaces it."""
    gw, key = restartable
    size = 200_000

    def interrupt(go):
        gw.gw.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # draining: no new connection, this one goes on
        go()

    conf = gateway_conf(gw.url, NS, key)
    rc, out, _err = _run_harness(
        harness, "fs", f"webhdfs://{gw.listen}/files/drained", size, conf, interrupt, ride=False
    )
    assert "CLOSED" in out, out  # the gateway answered the body before it went
    assert gw.gw.proc.wait(timeout=120) == 0, gw.gw.log()[-3000:]
    assert "in progress get" in gw.gw.log()
    gw.restart()
    tok = requests.post(
        gw.url + "/oauth2/token",
        data={"grant_type": "client_credentials", "client_id": NS, "client_secret": key},
        timeout=30,
    ).json()["access_token"]
    r = requests.get(
        gw.url + "/webhdfs/v1/files/drained?op=OPEN&data=true", headers={"Authorization": f"Bearer {tok}"}, timeout=30
    )
    assert r.status_code == 200 and r.content == bytes(i % 251 for i in range(size))


# ---------------------------------------------------------------- a gateway pair
LEASE = 3


@pytest.mark.parametrize("how", ["sigkill", "promote"])
def test_a_body_in_flight_when_the_standby_takes_over_is_resent(harness, sos_server, tmp_path, how):
    """Issue 30.1: the active of a pair dies (SIGKILL) or is replaced (`sos gateway promote`)
    while a body is in flight to it: the writer resends it to the new active."""
    key = sos_server.keygen(NS, "append")
    active = pair_gateway(sos_server, key, tmp_path, "active", namespace=NS, lease=LEASE)
    standby = pair_gateway(sos_server, key, tmp_path, "standby", "--standby", namespace=NS, lease=LEASE)

    def interrupt(go):
        if how == "sigkill":
            active.kill()
        else:
            done = subprocess.run(
                [*sos_command(), "gateway", "promote", NS, standby.url, "--server", sos_server.address],
                env=dict(os.environ, SOS_KEY=key),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
        go()

    try:
        conf = gateway_conf([active.url, standby.url], NS, key, ride_through=True)
        rc, out, err = _run_harness(harness, "fc", "webhdfs://sos-ride/files/pair", 300_000, conf, interrupt)
        assert rc == 0, err[-6000:]
        assert "VERIFIED" in out and "FAILURES 1" in out and "RESENT 1" in out, (out, err[-3000:])
        assert "standby: promoted" in standby.log()
    finally:
        for g in (active, standby):
            g.kill()


def test_a_standby_whose_active_holds_no_lease_says_so(sos_server, tmp_path):
    """Issue 30.5: an active run without --lease gives its standby nothing to watch: the standby
    warns (every minute, the first within a few seconds) instead of waiting in silence; a
    pair whose active holds a lease gets no such warning."""

    key = sos_server.keygen(NS, "append")
    bare = GatewayProcess(
        NS, str(tmp_path / "bare-cache"), sos_server.address, key, log_path=str(tmp_path / "bare.log")
    ).start()
    standby = pair_gateway(sos_server, key, tmp_path, "standby", "--standby", namespace=NS, lease=LEASE)
    try:
        tok = requests.post(
            bare.url + "/oauth2/token",
            data={"grant_type": "client_credentials", "client_id": NS, "client_secret": key},
            timeout=30,
        ).json()["access_token"]
        r = requests.put(
            bare.url + "/webhdfs/v1/a?op=CREATE&data=true",
            data=b"x",
            headers={"Authorization": f"Bearer {tok}"},
            timeout=30,
        )
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 30
        while "holds no lease" not in standby.log() and time.monotonic() < deadline:
            time.sleep(0.5)
        log = standby.log()
        warned = [
            rec
            for rec in (json.loads(line) for line in log.splitlines() if line.startswith("{"))
            if "holds no lease" in rec.get("msg", "")
        ]
        assert warned and warned[0]["level"] == "warning" and "--lease" in warned[0]["msg"], log[-3000:]
        assert "will never take over by itself" in log
    finally:
        for g in (bare, standby):
            g.kill()
    leased = pair_gateway(sos_server, key, tmp_path, "leased", namespace=NS, lease=LEASE)
    quiet = pair_gateway(sos_server, key, tmp_path, "quiet", "--standby", namespace=NS, lease=LEASE)
    try:
        time.sleep(LEASE + 4)
        assert "holds no lease" not in quiet.log(), quiet.log()[-3000:]
        assert "standby: promoted" not in quiet.log()
    finally:
        for g in (leased, quiet):
            g.kill()


# ---------------------------------------------------------------- a RocksDB query, many kills
#: a stateful query (dropDuplicates on RocksDB state) through the gateway, one run, settings
#: from gateway_checkpoint and nothing else; it prints the resends its JVM made
DRIVER = textwrap.dedent("""
    import json, os, sys, time
    cfg = json.load(open(sys.argv[1]))
    from tools.demo import write_batch_output
    from tools.demo_common import ROCKSDB_PROVIDER
    from spark_plugin.spark import gateway_checkpoint
    from tests.support import dedup_query, spark_builder

    builder = spark_builder("sos-ride-through", conf={"spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER})
    loc = gateway_checkpoint(builder, cfg["url"], cfg["ns"], os.environ["SOS_KEY"], cfg["checkpoint"])
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    batches = []

    def sink(df, batch_id):
        write_batch_output(cfg["out"], df, batch_id)
        batches.append(batch_id)
        if not os.path.exists(cfg["kills_done"]):  # slow while the gateway is being killed
            time.sleep(cfg["pause"])

    os.makedirs(cfg["out"], exist_ok=True)
    query = dedup_query(spark, cfg["input"], sink, str(loc))
    query.awaitTermination()
    ride = spark._jvm.sos.hadoop.RideThroughWebHdfsFileSystem
    with open(cfg["result"], "w") as f:
        json.dump({"batches": batches, "resent": ride.resentBodies(), "failures": ride.bodyFailures()}, f)
    spark.stop()
""")

#: the data step of a CREATE (op=CREATE ... data=true), as the proxy sees its request line
DATA_PUT = re.compile(rb"PUT /webhdfs/v1/[^ ]*op=CREATE[^ ]*data=true[^ ]* HTTP/1\.1\r\n")


def _reset(sock: socket.socket) -> None:
    """Close with a reset (what a peer whose process died leaves); shutdown first, so that
    the other pump thread blocked in recv on it wakes (close alone does not free it)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class BodyProxy:
    """A TCP proxy in front of the gateway (which advertises it, so the data steps come here
    too). Armed, it holds the next CREATE data step after forwarding its headers and part of
    its body: the gateway is then killed with that body in flight, for certain."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.armed = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()
        self.held_request = b""
        self.active = 0
        self.most_active = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        except OSError:  # the gateway is down: the client's connection fails as it would
            _reset(client)
            return
        upstream.settimeout(None)
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
            self._pump(client, upstream, True)
        finally:
            with self.lock:
                self.active -= 1

    def _pump(self, src: socket.socket, dst: socket.socket, inspect: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                m = DATA_PUT.search(data) if inspect and self.armed.is_set() else None
                if m is not None:
                    self.armed.clear()
                    end = data.find(b"\r\n\r\n", m.start())
                    cut = len(data) if end < 0 else end + 4 + (len(data) - end - 4) // 2
                    dst.sendall(data[:cut])
                    self.held_request = data[m.start() : m.end()]
                    self.held.set()
                    self.release.wait(120)
                    data = data[cut:]
                dst.sendall(data)
        except OSError:
            pass
        _reset(src)
        _reset(dst)

    def close(self) -> None:
        self.listener.close()


def _kill_loop(gw: Restartable, proxy: BodyProxy, driver: subprocess.Popen, plan: list[str], rng) -> list[dict]:
    """Kill the gateway as ``plan`` says ("body": inside a CREATE body, "random": at a random
    moment), restarting it after a random gap; returns what each kill did."""
    kills = []
    for kind in plan:
        if driver.poll() is not None:
            break
        if kind == "body":
            proxy.held.clear()
            proxy.release.clear()
            proxy.armed.set()
            if not proxy.held.wait(120):
                proxy.armed.clear()
                break
            gw.kill()
            proxy.release.set()
        else:
            time.sleep(rng.uniform(0.3, 3.0))
            if driver.poll() is not None:
                break
            gw.kill()
        down = time.monotonic()
        time.sleep(rng.uniform(0.0, 1.0))
        gw.restart()
        kills.append(
            {
                "kind": kind,
                "down_s": round(time.monotonic() - down, 2),
                "held": proxy.held_request.decode() if kind == "body" else "",
            }
        )
        time.sleep(rng.uniform(1.0, 2.5))  # the query's requests reach the new gateway
    return kills


@pytest.mark.spark
def test_a_rocksdb_query_rides_through_gateway_kills_inside_bodies_and_at_random(sos_server, tmp_path):
    """Issue 30.4: at least 6 SIGKILLs of the gateway under one run of a RocksDB query, 3
    placed inside a CREATE's body on purpose, the others at random moments: the query
    finishes, every id comes out exactly once, and its JVM did resend bodies."""
    key = sos_server.keygen(NS, "append")
    first = Restartable(sos_server, key, tmp_path)  # learn a free port, then go behind a proxy
    gw_port = int(first.listen.rsplit(":", 1)[1])
    proxy = BodyProxy(gw_port)
    first.gw.stop()
    gw = Restartable.__new__(Restartable)
    gw.server, gw.key, gw.base, gw.generation = sos_server, key, tmp_path, first.generation
    gw.kw = {"extra_args": ("--advertise", f"127.0.0.1:{proxy.port}")}
    gw.listen = first.listen
    gw.restart()
    staging, files = tmp_path / "input", 30
    make_input(str(staging), 1500, files)
    cfg = {
        "url": f"http://127.0.0.1:{proxy.port}",
        "ns": NS,
        "checkpoint": "queries/rocks",
        "input": str(staging),
        "out": str(tmp_path / "out"),
        "pause": 1.0,  # per batch, until kills_done exists: the rest of the input then runs at once
        "kills_done": str(tmp_path / "kills-done"),
        "result": str(tmp_path / "result.json"),
    }
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    (tmp_path / "driver.py").write_text(DRIVER)
    env = dict(
        os.environ, SOS_KEY=key, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
    )
    log_path = tmp_path / "driver.log"
    rng = random.Random(int(os.environ.get("SOS_RIDE_SEED", time.time())))
    try:
        with open(log_path, "wb") as logf:
            driver = subprocess.Popen(
                [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "cfg.json")],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
            )
            try:
                deadline = time.monotonic() + 300
                while not (tmp_path / "out").is_dir() or not os.listdir(tmp_path / "out"):
                    assert driver.poll() is None, log_path.read_text()[-6000:]
                    assert time.monotonic() < deadline, "the query committed no batch"
                    time.sleep(0.5)
                kills = _kill_loop(
                    gw, proxy, driver, ["body", "random", "body", "random", "body", "random", "random"], rng
                )
                (tmp_path / "kills-done").touch()
                rc = driver.wait(timeout=900)
            finally:
                if driver.poll() is None:
                    driver.kill()
    finally:
        proxy.release.set()
        gw.stop()
        proxy.close()
    print("kills:", json.dumps(kills, indent=1), "most connections at once:", proxy.most_active)
    assert rc == 0, log_path.read_text()[-8000:]
    assert len(kills) >= 6 and sum(k["kind"] == "body" for k in kills) >= 3, kills
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["batches"][-1] == files - 1, result
    assert result["failures"] >= 3 and result["resent"] >= 3, result  # the body kills broke bodies
    ids = Counter()
    for name in os.listdir(tmp_path / "out"):
        with open(tmp_path / "out" / name) as f:
            ids.update(json.loads(line)["id"] for line in f)
    assert set(ids) == set(range(1500)), "ids lost"
    assert max(ids.values()) == 1, "ids doubled"


# ---------------------------------------------------------------- the helper's settings
class _Builder:
    """What gateway_checkpoint uses of a SparkSession.Builder: config() and _options."""

    def __init__(self, **options):
        self._options = dict(options)

    def config(self, key, value):
        self._options[key] = value
        return self


def test_the_helper_registers_the_filesystem_for_the_gateways_and_ships_the_jar(harness):
    _classpath, jar, _env = harness
    b = _Builder(**{"spark.jars": "/opt/other.jar"})
    loc = gateway_checkpoint(b, "http://gw.example:9870", NS, "k.s", "chk")
    assert b._options["spark.jars"] == f"/opt/other.jar,{jar}"
    assert b._options["spark.hadoop.fs.webhdfs.impl"] == "sos.hadoop.RideThroughWebHdfsFileSystem"
    assert b._options["spark.hadoop.fs.AbstractFileSystem.webhdfs.impl"] == "sos.hadoop.RideThroughWebHdfs"
    assert b._options["spark.hadoop.sos.webhdfs.ride.authorities"] == "gw.example:9870"
    assert loc.conf["spark.hadoop.fs.swebhdfs.impl"] == "sos.hadoop.RideThroughSWebHdfsFileSystem"
    # a pair: the nameservice (what the paths name) and both addresses
    pair = gateway_checkpoint(None, ["http://a:9870", "http://b:9870"], NS, "k.s", "chk")
    assert pair.conf["spark.hadoop.sos.webhdfs.ride.authorities"] == "sos-ride,a:9870,b:9870"
    # opting out, and gateway_conf alone (no jar on any classpath): Hadoop's plain FileSystem
    off = _Builder()
    gateway_checkpoint(off, "http://gw.example:9870", NS, "k.s", "chk", ride_through=False)
    assert "spark.jars" not in off._options and "spark.hadoop.fs.webhdfs.impl" not in off._options
    assert "fs.webhdfs.impl" not in gateway_conf("http://gw.example:9870", NS, "k.s")
