"""Issue 30: a query does not stop because its gateway went away, even while a file's body
is in flight (the data PUT after CREATE's redirect).

- Hadoop's own client (tests/java/RideHarness.java) writes a file through ``sos gateway``
  with the settings the Spark helper writes (``gateway_conf(..., ride_through=True)`` and
  the shipped jar); the gateway is SIGKILLed in the middle of the body (after half of it was
  flushed to the gateway) and restarted: the write completes and the file holds exactly its
  bytes, through FileSystem and through FileContext (Spark's checkpoint file manager), from
  memory and spilled to disk. Without the jar the same write fails (the control).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time

import pytest

from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import gateway_conf, ride_through_jar

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = os.path.dirname(os.path.abspath(__file__))
NS = "ride"


def _jars() -> str:
    import pyspark

    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
    if not glob.glob(os.path.join(jars, "hadoop-client-api-*.jar")):
        pytest.skip("pyspark has no Hadoop client jars")
    return jars


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """(classpath without the ride-through jar, the jar, env)."""
    if shutil.which("java") is None or shutil.which("javac") is None:
        pytest.skip("no JDK (java and javac) on this machine")
    jars = _jars()
    subprocess.run([os.path.join(HERE, "..", "scripts", "build-jar"), sys.executable], check=True, timeout=300)
    jar = ride_through_jar()
    assert jar is not None, "scripts/build-jar built no jar"
    classes = tmp_path_factory.mktemp("ride-harness")
    subprocess.run(
        [
            "javac",
            "-nowarn",
            "-d",
            str(classes),
            "-cp",
            os.path.join(jars, "*"),
            os.path.join(HERE, "java", "RideHarness.java"),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    env = dict(os.environ, LC_ALL="C.UTF-8", LANG="C.UTF-8", JAVA_TOOL_OPTIONS="-Xshare:auto")
    return f"{classes}{os.pathsep}{os.path.join(jars, '*')}", jar, env


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


def _write_across_a_kill(harness, gw, key, mode, name, size, *, ride=True, restart_first=True, extra=()):
    classpath, jar, env = harness
    conf = gateway_conf(gw.url, NS, key, ride_through=ride)
    args = [f"{k}={v}" for k, v in conf.items()] + list(extra)
    cp = f"{classpath}{os.pathsep}{jar}" if ride else classpath
    uri = f"webhdfs://{gw.listen}/files/{name}"
    proc = subprocess.Popen(
        ["java", "-cp", cp, "RideHarness", mode, uri, str(size), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == "MID":
                break
        assert lines and lines[-1] == "MID", "\n".join([*lines, proc.stderr.read()[:3000]])
        gw.kill()  # half the body is at the gateway: it dies with the request in flight
        if restart_first:
            gw.restart()
            proc.stdin.write("go\n")
            proc.stdin.flush()
        else:  # the client finds the gateway down and waits for it
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(1.5)
            gw.restart()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, lines + out.splitlines(), err


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
