"""Issue 31, the operator's path: the commands of docs/DEPLOY.md ("Keys": the quota;
"Replacing a lost server") and docs/SPARK.md ("Is my batch committed?", "A gateway pair") run
as written, only addresses, ports and paths swapped for the test's, against real parts: sos-server
processes with TLS and a tier on moto's S3 server, `sos gateway` processes (a pair with
--durability tier and HTTPS), `sos`, `sos-server`, curl, and Hadoop's own WebHDFS client (a JVM
with pyspark's jars) fetching its token through a name that resolves to both gateways of a pair.
Also what the docs say of the helpers: gateway_checkpoint's signature, the default token URL,
the commit label the metrics serve, and the first gateway after a loss (item 10)."""

from __future__ import annotations

import glob
import inspect
import os
import pathlib
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request

import pytest
import requests
from deploy_support import documented_line

from spark_plugin.gateway.process import READY_MARKER, GatewayProcess
from spark_plugin.gateway.run import LEASE_GONE_MIN, lease_gone
from spark_plugin.spark import gateway_checkpoint, gateway_conf
from tools import child_env
from tools.server import LISTENING, ServerProcess

pytestmark = pytest.mark.slow
pytest_plugins = ["tier_support"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = (ROOT / "docs" / "DEPLOY.md").read_text()
SPARK = (ROOT / "docs" / "SPARK.md").read_text()
NS = "sparkjob"
TIMEOUT = 120


# ---------------------------------------------------------------------------- reading the docs


def section(doc: str, heading: str) -> str:
    """The text under ``heading`` (a line of #s and a title) up to the next heading of its
    level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    out, fenced = [], False
    for line in doc.split(f"\n{heading}\n", 1)[1].splitlines(keepends=True):
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,%d} " % level, line):
            break
        out.append(line)
    return "".join(out)


def commands(text: str, lang: str = "sh") -> list[str]:
    """The command lines of the ``lang`` blocks of ``text``: continuations joined, comment
    lines and trailing ``  # ...`` comments dropped."""
    out: list[str] = []
    for block in re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL):
        joined = re.sub(r"\\\n\s*", "", block)
        for line in joined.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def swap(line: str, subs: dict[str, str]) -> str:
    for old, new in subs.items():
        assert old in line, (old, line)
        line = line.replace(old, new)
    return line


def env(**extra: str) -> dict[str, str]:
    """The environment a user's shell would have: this checkout's commands on PATH."""
    bindir = os.path.dirname(sys.executable)
    return child_env() | {"PATH": bindir + os.pathsep + os.environ.get("PATH", "")} | extra


def sh(line: str, cwd, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=TIMEOUT
    )


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


class Background:
    """A documented long-running command (a server, a gateway) run by bash in a session of
    its own, its output in a log; ready once ``marker`` appears there."""

    def __init__(self, line: str, cwd, log: pathlib.Path, marker: str, **extra: str) -> None:
        self.log_path = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", line], cwd=cwd, env=env(**extra), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(lambda: marker in self.log() or self.proc.poll() is not None, TIMEOUT, marker)
        assert marker in self.log(), self.log()[-4000:]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def line(self, marker: str) -> str:
        return next(line for line in self.log().splitlines() if marker in line)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=60)


def certificates(tmp_path) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path, pathlib.Path]:
    """docs/DEPLOY.md's two openssl lines, run as written in ``tmp_path``: the server's
    certificate and key, the gateway's."""
    for cn in ("CN=sos-server", "CN=sos-gateway"):
        done = sh(documented_line("openssl req", cn), tmp_path)
        assert done.returncode == 0, done.stderr
    tls = tmp_path / "deploy" / "tls"
    return tls / "tls.crt", tls / "tls.key", tls / "gateway.crt", tls / "gateway.key"


def token(url: str, key: str, verify=True) -> str:
    r = requests.post(
        url + "/oauth2/token",
        data={"grant_type": "client_credentials", "client_id": NS, "client_secret": key},
        verify=verify,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["access_token"]


def put(url: str, tok: str, path: str, data: bytes, verify=True) -> requests.Response:
    h = {"Authorization": f"Bearer {tok}"}
    r = requests.put(
        f"{url}/webhdfs/v1{path}?op=CREATE&overwrite=true", headers=h, allow_redirects=False, verify=verify, timeout=60
    )
    if r.status_code != 307:
        return r
    return requests.put(r.headers["Location"], data=data, headers=h, verify=verify, timeout=60)


def commit(url: str, tok: str, batch: int, verify=True, chk: str = "checkpoint") -> None:
    """Spark's commit of batch N: offsets/N, then a temp file renamed onto commits/N."""
    assert put(url, tok, f"/{chk}/offsets/{batch}", b"v1\noffsets", verify).status_code == 201
    tmp = f"/{chk}/commits/.{batch}.tmp"
    assert put(url, tok, tmp, b'v1\n{"nextBatchWatermarkMs":0}', verify).status_code == 201
    r = requests.put(
        f"{url}/webhdfs/v1{tmp}?op=RENAME&destination=/{chk}/commits/{batch}",
        headers={"Authorization": f"Bearer {tok}"},
        verify=verify,
        timeout=60,
    )
    assert r.status_code == 200 and r.json() == {"boolean": True}, r.text


def listing(url: str, tok: str, path: str, verify=True) -> list[str]:
    r = requests.get(
        f"{url}/webhdfs/v1{path}?op=LISTSTATUS", headers={"Authorization": f"Bearer {tok}"}, verify=verify, timeout=60
    )
    assert r.status_code == 200, r.text
    return sorted((s["pathSuffix"] for s in r.json()["FileStatuses"]["FileStatus"]), key=int)


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metrics_url(log: str) -> str:
    found = re.search(r"metrics on (http://[^/\s]+)/metrics", log)
    assert found, log[-3000:]
    return found.group(1)


def free_port(*hosts: str) -> int:
    """A port free on every one of ``hosts``."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for h in hosts[1:]:
                with socket.socket() as t:
                    t.bind((h, port))
        except OSError:
            continue
        return port
    raise AssertionError("no port free on " + ", ".join(hosts))


# ---------------------------------------------------------------------------- what the docs say


def test_the_documented_signature_of_gateway_checkpoint_is_the_real_one():
    """Item 5: SPARK.md's signature line names every parameter, in order, with its default."""
    found = re.search(r"`gateway_checkpoint\((.*?)\) ->\s+GatewayCheckpoint`", SPARK, re.DOTALL)
    assert found, "no signature line of gateway_checkpoint in SPARK.md"
    documented = [p.strip() for p in " ".join(found.group(1).split()).split(",") if p.strip() != "*"]
    real = []
    for name, p in inspect.signature(gateway_checkpoint).parameters.items():
        if p.default is inspect.Parameter.empty:
            real.append(name)
        elif isinstance(p.default, str) and name == "checkpoint":
            real.append(f'{name}="{p.default}"')
        elif name == "retry_spec":
            real.append(f"{name}=GATEWAY_RETRY_SPEC")
        else:
            real.append(f"{name}={p.default!r}")
    assert documented == real


def test_the_default_token_url_of_a_pair_is_the_standby():
    """Item 4: without token_url the token endpoint is the last gateway's (the standby in the
    documented order), which the loss of the active leaves reachable; token_url wins."""
    conf = gateway_conf(["https://gw-a:9870", "https://gw-b:9870/"], "myjob", "k.s")
    assert conf["dfs.webhdfs.oauth2.refresh.url"] == "https://gw-b:9870/oauth2/token"
    conf = gateway_conf(["https://gw-a:9870", "https://gw-b:9870"], "myjob", "k.s", token_url="https://pair:9870/")
    assert conf["dfs.webhdfs.oauth2.refresh.url"] == "https://pair:9870/oauth2/token"
    assert gateway_conf("https://gw:9870", "myjob", "k.s")["dfs.webhdfs.oauth2.refresh.url"] == (
        "https://gw:9870/oauth2/token"
    )
    pair = section(SPARK, "### A gateway pair: fail over in seconds (issue 22)")
    assert "the **last** URL" in pair and "resolves to both" in pair


def test_the_commit_label_example_is_what_is_served():
    """Item 6: the label example of DEPLOY.md is the path in the namespace (the value
    served is checked in test_is_my_batch_committed_as_documented)."""
    metrics = section(DEPLOY, "## Gateway metrics")
    assert "/myjob/checkpoint" not in metrics
    assert '`checkpoint="/checkpoint"` for `swebhdfs://gateway:9870/checkpoint`' in metrics


def test_a_lease_whose_renewals_stopped_is_gone():
    """Item 10: the rule that tells a dead previous writer of a pair from a live one."""
    every_2_5 = [100.0, 102.5, 105.0, 107.5]
    assert lease_gone(every_2_5, now=110.0) is None  # renewed 2.5 s ago: alive
    assert lease_gone(every_2_5, now=107.5 + LEASE_GONE_MIN + 1) == pytest.approx(LEASE_GONE_MIN + 1)
    slow = [0.0, 30.0, 60.0]  # a 2-minute lease renews every 30 s
    assert lease_gone(slow, now=60 + 100) is None and lease_gone(slow, now=60 + 121) == pytest.approx(121)
    assert lease_gone([], now=1e9) is None  # no lease: nothing to tell by


# ---------------------------------------------------------------------------- DEPLOY.md, Keys


def test_documented_quota_commands(sos_server, tmp_path):
    """Item 2: the quota lines of "Keys" carry --data and run as written on a live server's
    data directory: set, then read back, in the documented format."""
    lines = [line for line in commands(section(DEPLOY, "## Keys")) if line.startswith("sos-server quota")]
    assert len(lines) == 2 and all("--data /data" in line for line in lines), lines
    sos_server.keygen(NS)
    subs = {"/data": sos_server.data_dir}
    for line in lines:
        done = sh(swap(line, subs), tmp_path)
        assert done.returncode == 0, done.stderr
        assert re.fullmatch(rf"{NS}\t10737418240\tused 0 \(objects 0, data bytes 0\)\n", done.stdout), done.stdout


# ---------------------------------------------------------------------------- SPARK.md, Is my batch committed?


def test_is_my_batch_committed_as_documented(sos_server_factory, tmp_path):
    """Items 7 and 6: the block's lines as written against a TLS server (its certificate from
    DEPLOY.md's openssl line, at the documented path), only the server's address and the
    metrics port swapped. 13 batches: the newest is 12, which `ls` alone would list before 7,
    8, 9; batch 41 never committed (exit 1); the metric's label is the documented one."""
    crt, key_file, _gc, _gk = certificates(tmp_path)
    srv = sos_server_factory(args=["--tls-cert", crt, "--tls-key", key_file])
    key = srv.keygen(NS)
    (tmp_path / "myjob-read.key").write_text(srv.keygen(NS, "read") + "\n")
    gw = GatewayProcess(
        NS,
        str(tmp_path / "cache"),
        srv.address,
        key,
        extra_args=["--tls-ca", str(crt), "--metrics", ":0"],
        log_path=str(tmp_path / "gateway.log"),
    ).start()
    try:
        tok = token(gw.url, key)
        for n in range(13):
            commit(gw.url, tok, n)
        curl, export, newest, batch = commands(section(SPARK, "### Is my batch committed?"))
        port = metrics_url(gw.log()).rpartition(":")[2]
        got = sh(swap(curl, {"127.0.0.1:9102": f"127.0.0.1:{port}"}), tmp_path)
        assert got.stdout == 'sos_gateway_last_commit_batch{checkpoint="/checkpoint"} 12.0\n', got
        assert export.startswith("export SOS_SERVER=") and "SOS_TLS_CA=deploy/tls/tls.crt" in export
        export = swap(export, {"sos-server:7070": srv.address})
        peek = str(tmp_path / "peek")
        run = lambda line: sh(f"{export}\n{swap(line, {' myjob ': f' {NS} ', '/tmp/peek': peek})}", tmp_path)  # noqa: E731
        done = run(newest)
        assert done.returncode == 0 and done.stdout == "12\n", done
        assert sorted(os.listdir(tmp_path / "peek" / "checkpoint" / "commits"))[-1] == "9"  # what ls shows last
        missing = run(batch)
        assert missing.returncode == 1 and "41" in missing.stderr and missing.stdout == "", missing
        shutil.rmtree(tmp_path / "peek41", ignore_errors=True)
        five = run(batch.replace("checkpoint:41", "checkpoint:5"))
        assert five.returncode == 0 and five.stdout == "5\n", five
        # without the certificate the same command says what is missing
        bare = sh(f"{export.replace('SOS_TLS_CA=deploy/tls/tls.crt ', '')}\n{newest.replace('/tmp/peek', 'p2').replace(' myjob ', f' {NS} ')}", tmp_path)
        assert bare.returncode != 0 and "SOS_TLS_CA" in bare.stderr, bare
    finally:
        gw.stop()
