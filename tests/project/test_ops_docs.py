"""Issue 31, the operator's path: the commands of docs/DEPLOY.md ("Keys": the quota;
"Replacing a lost server") and docs/SPARK.md ("Is my batch committed?", "A gateway pair") run
as written, only addresses, ports and paths swapped for the test's, against real parts: sos-server
processes with TLS and a tier on moto's S3 server, `sos gateway` processes (a pair with
--durability tier and HTTPS), `sos`, `sos-server`, curl, and Hadoop's own WebHDFS client (a JVM
with pyspark's jars) fetching its token through a name that resolves to both gateways of a pair.
Also what the docs say of the helpers: gateway_checkpoint's signature, the default token URL,
the commit label the metrics serve, and the first gateway after a loss (item 10)."""

from __future__ import annotations

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

import pytest
import requests

from spark_plugin.gateway.process import READY_MARKER, GatewayProcess
from spark_plugin.gateway.run import LEASE_GONE_MIN, lease_gone
from spark_plugin.spark import gateway_checkpoint, gateway_conf
from tests.deploy.support import documented_line
from tests.support import hadoop_jars, metrics_url, scrape, token_for, wait_for, webhdfs_create
from tools import child_env
from tools.jvm import LIGHT_JVM_OPTIONS
from tools.server import LISTENING, ServerProcess

pytestmark = [pytest.mark.day2, pytest.mark.slow]
pytest_plugins = ["tests.tier.support"]

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
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


class Background:
    """A documented long-running command (a server, a gateway) run by bash in a session of
    its own, its output in a log; ready once ``marker`` appears there."""

    def __init__(self, line: str, cwd, log: pathlib.Path, marker: str, **extra: str) -> None:
        self.log_path = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", line],
                cwd=cwd,
                env=env(**extra),
                stdout=out,
                stderr=subprocess.STDOUT,
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


def commit(url: str, tok: str, batch: int, verify=True, chk: str = "checkpoint") -> None:
    """Spark's commit of batch N: offsets/N, then a temp file renamed onto commits/N."""
    assert webhdfs_create(url, tok, f"/{chk}/offsets/{batch}", b"v1\noffsets", verify).status_code == 201
    tmp = f"/{chk}/commits/.{batch}.tmp"
    assert webhdfs_create(url, tok, tmp, b'v1\n{"nextBatchWatermarkMs":0}', verify).status_code == 201
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


def test_the_pair_python_block_runs_and_says_what_it_returns():
    """SPARK.md's gateway_checkpoint block of "A gateway pair", run as written (no session:
    builder None): the location its comment gives, the token URL it passes."""
    pair = section(SPARK, "### A gateway pair: fail over in seconds (issue 22)")
    (block,) = re.findall(r"```python\n(.*?)```", pair, re.DOTALL)
    scope: dict[str, object] = {"builder": None, "KEY": "0123456789abcdef.00", "gateway_checkpoint": gateway_checkpoint}
    exec(block, scope)
    chk = scope["chk"]
    said = re.search(r'# chk == "([^"]+)"', block)
    assert said and chk == said.group(1) == "swebhdfs://sos-myjob/checkpoint"
    assert chk.conf["spark.hadoop.dfs.webhdfs.oauth2.refresh.url"] == "https://sos-gateway-pair:9870/oauth2/token"


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
    # the section's `docker exec <server> ...` lines, run as they run inside the container
    docker = [line for line in commands(section(DEPLOY, "## Keys")) if line.startswith("docker exec <server> ")]
    roles = []
    for line in docker:
        done = sh(swap(line, {"docker exec <server> ": "", "/data": sos_server.data_dir}), tmp_path)
        assert done.returncode == 0 and re.fullmatch(r"[0-9a-f]{16}\.[0-9a-f]{64}\n", done.stdout), done
        roles.append(line.split("--role ")[1])
    assert roles == ["append", "token"]
    listed = sh(f"sos-server keys list --data {sos_server.data_dir} {NS}", tmp_path).stdout
    assert sorted(row.split("\t")[2] for row in listed.splitlines()) == ["append", "append", "token"], listed


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
        tok = token_for(gw.url, key, NS)
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
        bare = sh(
            f"{export.replace('SOS_TLS_CA=deploy/tls/tls.crt ', '')}\n{newest.replace('/tmp/peek', 'p2').replace(' myjob ', f' {NS} ')}",
            tmp_path,
        )
        assert bare.returncode != 0 and "SOS_TLS_CA" in bare.stderr, bare
    finally:
        gw.stop()


# ---------------------------------------------------------------------------- DEPLOY.md, Replacing a lost server


def test_replacing_a_lost_server_as_documented(moto, new_bucket, tmp_path):
    """Items 9 and 10: a server with --tier and a gateway with --durability tier and a lease;
    batches committed; the gateway SIGKILLed, the server SIGKILLed, its disk and the cache
    deleted. Then the block of "Replacing a lost server" as written (keys from the backup into
    0700 directories, new keys, the quota, all before the start; the server on that directory
    with the same --tier and TLS): the rebuild accepts them and keeps them, and a gateway on an
    empty cache serves every committed batch, logging an ordinary takeover (the lost writer's
    lease stopped), not FENCED A LIVE WRITER?."""
    url = new_bucket()
    crt, tls_key, _gc, _gk = certificates(tmp_path)
    old = ServerProcess(tmp_path / "old-data", ["--tier", url, "--tls-cert", crt, "--tls-key", tls_key]).start()
    key = old.keygen(NS)
    gw = GatewayProcess(
        NS,
        str(tmp_path / "old-cache"),
        old.address,
        key,
        durability="tier",
        extra_args=["--tls-ca", str(crt), "--lease", "1s"],
        log_path=str(tmp_path / "old-gateway.log"),
    ).start()
    try:
        tok = token_for(gw.url, key, NS)
        for n in range(3):
            commit(gw.url, tok, n)  # durability tier: in the bucket once committed
        backup = tmp_path / "backup"
        assert (
            sh(
                f"mkdir -p {backup}/ns/{NS} && cp -a {old.data_dir}/ns/{NS}/keys {backup}/ns/{NS}/keys", tmp_path
            ).returncode
            == 0
        )
    finally:
        gw.kill()
        old.kill()
    lost_at = time.time()
    shutil.rmtree(old.data_dir)
    shutil.rmtree(tmp_path / "old-cache")

    lines = commands(section(DEPLOY, "## Replacing a lost server"))
    assert len(lines) == 5 and lines[-1].startswith("sos-server serve"), lines
    data = tmp_path / "new-data"
    for line in lines[:-1]:
        done = sh("umask 022\n" + line.replace("/data", str(data)).replace("/backup", str(backup)), tmp_path)
        assert done.returncode == 0, (line, done.stderr)
    for d in (data, data / "ns", data / "ns" / NS, data / "ns" / NS / "keys"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    for f in (data / "ns" / NS / "keys").iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    assert os.listdir(data / "ns" / NS / "objects") == []  # keygen and quota made it: accepted
    new_key = (tmp_path / "sparkjob-append.key").read_text().strip()
    subs = {
        "/data": str(data),
        "0.0.0.0:7070": "127.0.0.1:0",
        "s3://my-bucket/sos": url,
        "/tls/tls.crt": str(crt),
        "/tls/tls.key": str(tls_key),
    }
    server = Background(swap(lines[-1], subs), tmp_path, tmp_path / "new-server.log", LISTENING)
    gw2 = None
    try:
        address = server.line(LISTENING).split(LISTENING, 1)[1].split()[0].strip('",')
        quota = sh(f"sos-server quota --data {data} {NS}", tmp_path)
        assert re.match(rf"{NS}\t10737418240\tused \d+ \(objects [1-9]", quota.stdout), quota  # kept, and filled
        time.sleep(max(0.0, lost_at + LEASE_GONE_MIN + 1 - time.time()))
        gw2 = GatewayProcess(
            NS,
            str(tmp_path / "new-cache"),
            address,
            new_key,
            durability="tier",
            extra_args=["--tls-ca", str(crt)],
            log_path=str(tmp_path / "new-gateway.log"),
        ).start()
        tok = token_for(gw2.url, key, NS)  # the backed-up key too
        assert listing(gw2.url, tok, "/checkpoint/commits") == ["0", "1", "2"]
        commit(gw2.url, tok, 3)  # the query goes on
        log = gw2.log()
        assert "FENCED A LIVE WRITER?" not in log, log[-3000:]
        assert re.search(r"took over namespace .* its lease was last renewed \d+ s ago: it had stopped", log), log[
            -3000:
        ]
    finally:
        if gw2 is not None:
            gw2.stop()
        server.kill(signal.SIGTERM)


def test_the_first_writer_after_a_loss_without_a_lease_says_it_is_expected(sos_server, tmp_path):
    """Item 10, the other case: a previous writer without a lease (no heartbeat) whose last
    record is recent: the warning stays, and says that after a loss it is expected."""
    key = sos_server.keygen(NS)
    first = GatewayProcess(NS, str(tmp_path / "c1"), sos_server.address, key).start()
    try:
        commit(first.url, token_for(first.url, key, NS), 0)
    finally:
        first.kill()
    second = GatewayProcess(NS, str(tmp_path / "c2"), sos_server.address, key).start()
    try:
        log = second.log()
        assert "FENCED A LIVE WRITER?" in log and "Expected after a loss" in log, log[-3000:]
    finally:
        second.stop()


# ---------------------------------------------------------------------------- SPARK.md, A gateway pair


def test_gateway_pair_as_documented(moto, new_bucket, tmp_path):
    """Items 1 and 3: the pair's three commands as written (HTTPS with DEPLOY.md's gateway
    certificate, --durability tier against a server with a tier and TLS, --metrics on both);
    the standby logs what it will run with, serves metrics as a standby, is promoted by the
    documented `sos gateway promote` line, logs the options its writer opens with, fences the
    active (exit 3) and serves the next commit, which its metrics report."""
    url = new_bucket()
    crt, tls_key, gw_crt, gw_key = certificates(tmp_path)
    srv = ServerProcess(tmp_path / "data", ["--tier", url, "--tls-cert", crt, "--tls-key", tls_key]).start()
    key = srv.keygen("myjob")
    pair = section(SPARK, "### A gateway pair: fail over in seconds (issue 22)")
    active_line, standby_line, promote_line = commands(pair, "bash")
    assert "--standby" in standby_line and "--standby" not in active_line, (active_line, standby_line)
    ports = {"a": free_port("127.0.0.1"), "b": free_port("127.0.0.1")}
    started: list[Background] = []
    try:
        for name, line in (("a", active_line), ("b", standby_line)):
            subs = {
                "<append key>": key,
                "0.0.0.0:9870": f"127.0.0.1:{ports[name]}",
                "sos-server:7070": srv.address,
                "sos-ca.pem": str(crt),
                "/var/cache/sos-gateway/myjob": str(tmp_path / f"cache-{name}"),
                f"gw-{name}.pem": str(gw_crt),
                f"gw-{name}.key": str(gw_key),
                f"gw-{name}:9870": f"localhost:{ports[name]}",
                "--metrics :9102": "--metrics :0",
            }
            started.append(Background(swap(line, subs), tmp_path, tmp_path / f"gw-{name}.log", READY_MARKER))
        active, standby = started
        a_url, b_url = (f"https://127.0.0.1:{ports[n]}" for n in "ab")
        assert re.search(
            r"once promoted, the writer runs with sync, durability tier, .*HTTPS, advertised as localhost:\d+, lease 10 s",
            standby.log(),
        ), standby.log()[-3000:]
        b_metrics = metrics_url(standby.log())
        assert scrape(b_metrics)['sos_gateway_role{role="standby"}'] == 1
        tok = token_for(a_url, key, "myjob", verify=str(gw_crt))
        for n in range(2):
            commit(a_url, tok, n, verify=str(gw_crt))
        done = sh(
            swap(promote_line, {"<append key>": key, "https://127.0.0.1:9870": b_url, "gw-b.pem": str(gw_crt)}),
            tmp_path,
        )
        assert done.returncode == 0 and "promoted: writer epoch" in done.stdout, done
        assert re.search(r"the namespace's writer opens with sync, durability tier, .*HTTPS", standby.log())
        wait_for(lambda: active.proc.poll() is not None, 60, "the fenced active stops")
        assert active.proc.returncode == 3, active.log()[-3000:]
        tok = token_for(b_url, key, "myjob", verify=str(gw_crt))
        commit(b_url, tok, 2, verify=str(gw_crt))
        assert listing(b_url, tok, "/checkpoint/commits", verify=str(gw_crt)) == ["0", "1", "2"]
        m = scrape(b_metrics)
        assert (
            m['sos_gateway_role{role="active"}'] == 1
            and m['sos_gateway_last_commit_batch{checkpoint="/checkpoint"}'] == 2
        )
    finally:
        for b in started:
            b.kill(signal.SIGTERM)
        srv.stop()


# ---------------------------------------------------------------------------- the token URL, with Hadoop's client


def test_a_token_url_resolving_to_both_gateways_survives_the_loss_of_the_first(sos_server, tmp_path):
    """Item 4, what SPARK.md recommends: the token URL's name resolves to both gateways of a
    pair (here by a hosts file bind-mounted in a private mount namespace of the JVM, as a
    headless Service's DNS name does). The gateway at the first address is SIGKILLed; a JVM
    started afterwards (a new executor) gets its token from the other one through Hadoop's own
    token provider and commits. The same JVM given the first gateway's URL alone (the old
    default) fails; given the helper's default (the last URL) it works."""
    jars = hadoop_jars()
    if shutil.which("javac") is None or shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs pyspark's Hadoop jars, javac, unshare and root (a private /etc/hosts)")
    classes = tmp_path / "classes"
    light = LIGHT_JVM_OPTIONS.split()  # C1 only, serial GC: half the CPU of a short-lived JVM
    subprocess.run(
        [
            "javac",
            *[f"-J{o}" for o in light],
            "-cp",
            os.path.join(jars, "*"),
            "-d",
            str(classes),
            str(ROOT / "tests" / "data" / "HaWriter.java"),
        ],
        check=True,
        timeout=300,
    )
    port = free_port("127.0.0.1", "127.0.0.2")
    key = sos_server.keygen(NS)
    first = GatewayProcess(
        NS,
        str(tmp_path / "c1"),
        sos_server.address,
        key,
        listen=f"127.0.0.1:{port}",
        extra_args=["--lease", "3"],
        log_path=str(tmp_path / "first.log"),
    ).start()
    second = GatewayProcess(
        NS,
        str(tmp_path / "c2"),
        sos_server.address,
        key,
        listen=f"127.0.0.2:{port}",
        extra_args=["--standby", "--lease", "3"],
        log_path=str(tmp_path / "second.log"),
    ).start()
    hosts = tmp_path / "hosts"
    # each address's own name first: Hadoop names a gateway by a reverse lookup of its address
    # (NetUtils.getHostPortString), which must not give the shared name
    hosts.write_text("127.0.0.1 localhost\n127.0.0.2 gw-b\n127.0.0.1 sos-pair\n127.0.0.2 sos-pair\n")
    addresses = f"127.0.0.1:{port},127.0.0.2:{port}"

    def jvm(token_url: str, run: str, *props: str) -> subprocess.CompletedProcess[str]:
        java = [
            "java",
            *light,
            *props,
            "-cp",
            f"{jars}/*:{classes}",
            "HaWriter",
            "sosha",
            addresses,
            token_url,
            NS,
            "2",
        ]
        script = f"mount --bind {hosts} /etc/hosts && exec " + " ".join([*java, str(tmp_path / f"STOP-{run}")])
        return subprocess.run(
            ["unshare", "-m", "sh", "-c", script],
            env=dict(os.environ, SOS_KEY=key),
            capture_output=True,
            text=True,
            timeout=300,
        )

    order = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind {hosts} /etc/hosts && getent ahostsv4 sos-pair"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()
    assert [a for a in order if a.startswith("127.")][::3] == ["127.0.0.1", "127.0.0.2"], order  # the dead one first
    try:
        first.kill()  # the first address of the name: connections refused from now on
        wait_for(lambda: "standby: promoted" in second.log(), 60, "the standby's promotion")
        both = jvm(f"http://sos-pair:{port}/oauth2/token", "both")
        assert both.returncode == 0 and both.stdout.split("\n")[-2] == "DONE", (both.stdout, both.stderr[-3000:])
        assert "COMMITTED 1" in both.stdout
        default = gateway_conf([f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"], NS, key)
        last = jvm(default["dfs.webhdfs.oauth2.refresh.url"], "default")
        assert last.returncode == 0 and "DONE" in last.stdout, (last.stdout, last.stderr[-3000:])
        lost = jvm(
            f"http://127.0.0.1:{port}/oauth2/token",
            "lost",
            "-Dhawriter.attempts=1",
            "-Dhadoop.dfs.http.client.retry.max.attempts=2",
        )
        assert lost.returncode != 0 and "Unable to obtain access token" in lost.stdout + lost.stderr, lost.stdout
    finally:
        first.kill()
        second.kill()
