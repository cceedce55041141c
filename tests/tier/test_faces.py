"""Durability "tier" through the faces (issue 19 item 3): ``sos gateway --durability tier``,
``sos mount --durability tier`` and fsspec's ``durability="tier"`` return from a commit (the
rename onto ``commits/N``) only once the server's object-store tier, the bucket, holds it.

Real parts: ``sos-server serve --tier`` on moto's S3 server on 127.0.0.1 (tests/tier/support.py),
a real ``sos gateway`` child spoken to in plain HTTP (requests), a real ``sos mount`` child
(FUSE), the fsspec filesystem in this process. The proof each time: right after the commit
returns, the server is SIGKILLed and its data directory deleted, and ``sos restore --from URL``
(the bucket alone) has the committed file. The server's upload interval is an hour, so what the
bucket holds got there because the barrier's TIER_WAIT asked for it (protocol.md 1.11).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import urllib.parse
import uuid

import pytest
import requests

from spark_plugin.spark import restore_to_batch
from tests.support import start_gateway, tree_snapshot

pytest_plugins = ["tests.tier.support"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WAIT = 120.0
NEVER = "1h"  # an upload interval no test waits for: only a barrier's TIER_WAIT uploads


def restore_from(url: str, ns: str, out) -> dict:
    """``sos restore NS OUT --from URL`` (no server, no key); the restored tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("SOS_SERVER", "SOS_KEY", "SOS_KEY_FILE")}
    r = subprocess.run(
        [sys.executable, "-m", "sos_client.cli", "restore", "-q", ns, str(out), "--from", url],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    return tree_snapshot(out)


def lose_server(srv) -> None:
    """The server and its disk are gone."""
    srv.kill()
    shutil.rmtree(srv.data_dir)


class Http:
    """Plain HTTP to a gateway: a bearer token from /oauth2/token, WebHDFS requests."""

    def __init__(self, url: str, ns: str, key: str) -> None:
        self.url = url
        r = requests.post(
            url + "/oauth2/token",
            data={"grant_type": "client_credentials", "client_id": ns, "client_secret": key},
            timeout=WAIT,
        )
        assert r.status_code == 200, r.text
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {r.json()['access_token']}"

    def u(self, path: str, **params: str) -> str:
        return f"{self.url}/webhdfs/v1{urllib.parse.quote(path)}?{urllib.parse.urlencode(params)}"

    def mkdirs(self, path: str) -> None:
        r = self.session.put(self.u(path, op="MKDIRS"), timeout=WAIT)
        assert r.status_code == 200 and r.json() == {"boolean": True}, r.text

    def create(self, path: str, data: bytes) -> requests.Response:
        r = self.session.put(self.u(path, op="CREATE", overwrite="false"), allow_redirects=False, timeout=WAIT)
        assert r.status_code == 307, r.text
        return self.session.put(r.headers["Location"], data=data, timeout=WAIT)

    def rename(self, src: str, dst: str) -> requests.Response:
        return self.session.put(self.u(src, op="RENAME", destination=dst), timeout=WAIT)

    def close(self) -> None:
        self.session.close()


def spark_commit(http: Http, n: int, body: bytes) -> None:
    """What Spark does for batch n through webhdfs://: offsets/N, then a temporary file renamed
    onto commits/N."""
    r = http.create(f"/chk/offsets/{n}", b"offsets %d" % n)
    assert r.status_code == 201, r.text
    tmp = f"/chk/commits/.{n}.{uuid.uuid4().hex}.tmp"
    r = http.create(tmp, body)
    assert r.status_code == 201, r.text
    r = http.rename(tmp, f"/chk/commits/{n}")
    assert r.status_code == 200 and r.json() == {"boolean": True}, r.text


# ------------------------------------------------------------------ the gateway
def test_gateway_tier_rename_returns_once_the_bucket_holds_it(sos_server_factory, new_bucket, tmp_path):
    url = new_bucket()
    srv = sos_server_factory(args=["--tier", url, "--tier-interval", NEVER])
    key = srv.keygen("gwt", "append")
    gw = start_gateway(srv, tmp_path, namespace="gwt", key=key, name="gw-gwt", durability="tier")
    assert "durability tier" in gw.ready_line
    http = Http(gw.url, "gwt", key)
    try:
        http.mkdirs("/chk/offsets")
        http.mkdirs("/chk/commits")
        for n in range(2):
            spark_commit(http, n, b"batch %d" % n)
        lose_server(srv)  # right after the RENAME replied
    finally:
        http.close()
        gw.kill()
    got = restore_from(url, "gwt", tmp_path / "restored")
    assert got["chk/commits/1"] == b"batch 1" and got["chk/offsets/1"] == b"offsets 1"
    assert not [p for p in got if p.endswith(".tmp")]
    # the Spark helper: the checkpoint as batch 0 committed, from the bucket alone
    at0 = restore_to_batch("gwt", str(tmp_path / "at0"), "chk", 0, from_url=url)
    at0_tree = tree_snapshot(at0)
    assert at0_tree["commits/0"] == b"batch 0" and "commits/1" not in at0_tree
    with pytest.raises(ValueError, match="from_url"):
        restore_to_batch("gwt", str(tmp_path / "x"), "chk", 0, from_url=url, server="127.0.0.1:1")


def cli(module: str, *args: str, key: str, timeout: float = WAIT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SOS_KEY_FILE", "SOS_SERVER")}
    env["SOS_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def assert_one_line_failure(r: subprocess.CompletedProcess, prefix: str) -> str:
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    ours = [line for line in r.stderr.splitlines() if line.startswith("sos: ")]
    assert len(ours) == 1 and ours[0].startswith(prefix), r.stderr
    return ours[0]


def test_faces_with_durability_tier_refuse_a_server_without_a_tier(sos_server, tmp_path):
    """A configuration error, said at start in one line (exit 1), nothing served: the gateway
    and the mount, on a new namespace and on one that holds a journal."""
    key = sos_server.keygen("nt", "append")
    for attempt in ("new", "with a journal"):
        r = cli(
            "spark_plugin.gateway.cli",
            "nt",
            "--listen",
            "127.0.0.1:0",
            "--cache",
            str(tmp_path / f"gw-{attempt}"),
            "--server",
            sos_server.address,
            "--durability",
            "tier",
            key=key,
        )
        line = assert_one_line_failure(r, "sos: gateway failed: ")
        assert "no object-store tier" in line and "sos-server serve --tier URL" in line, line
        assert "ready on" not in r.stderr
        if attempt == "new":  # a journal on the server: the writer's open asks about it
            gw = start_gateway(sos_server, tmp_path, namespace="nt", key=key, name="gw-nt")
            gw.stop()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = cli(
        "spark_plugin.mount.cli",
        "nt",
        str(mnt),
        "--cache",
        str(tmp_path / "mount-cache"),
        "--server",
        sos_server.address,
        "--durability",
        "tier",
        key=key,
    )
    line = assert_one_line_failure(r, "sos: mount failed: ")
    assert "no object-store tier" in line, line
    assert not os.path.ismount(mnt)
    # --async waits for nothing: with --durability tier it is a usage error (2), before anything
    for module, extra in (
        ("spark_plugin.gateway.cli", ["--listen", "127.0.0.1:0"]),
        ("spark_plugin.mount.cli", [str(mnt)]),
    ):
        r = cli(module, "nt", *extra, "--server", sos_server.address, "--durability", "tier", "--async", key=key)
        assert r.returncode == 2 and "--async" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli("spark_plugin.gateway.cli", "nt", "--listen", "127.0.0.1:0", "--durability", "bucket", key=key)
    assert r.returncode == 2 and "invalid choice" in r.stderr


# ------------------------------------------------------------------ the store down
def test_gateway_answers_a_bucket_behind_as_retriable_and_goes_on_once_it_is_back(
    sos_server_factory, own_moto, tmp_path
):
    """The store down: a RENAME past --tier-patience answers 403 RetriableException (HDFS's
    "try later"), the change applied and durable on the server; once the store is back the
    next commit replies and the bucket holds both."""
    import boto3

    boto3.client("s3").create_bucket(Bucket="down")
    url = "s3://down/faces"
    srv = sos_server_factory(args=["--tier", url])  # the default interval (1 s)
    key = srv.keygen("gwd", "append")
    gw = start_gateway(srv, tmp_path, namespace="gwd", key=key, name="gw-gwd", durability="tier", tier_patience=2)
    http = Http(gw.url, "gwd", key)
    try:
        http.mkdirs("/chk/offsets")
        http.mkdirs("/chk/commits")
        spark_commit(http, 0, b"batch 0")
        own_moto.stop()
        tmp = "/chk/commits/.1.tmp"
        # the temp file of a commit is answered from the spool (--barrier commit, protocol.md
        # 3.4): the RENAME onto commits/1 below waits for it
        assert http.create(tmp, b"batch 1").status_code == 201
        r = http.create("/outside/file", b"x")
        assert r.status_code == 403, r.text  # the body's barrier: the bucket is behind
        doc = r.json()["RemoteException"]
        assert doc["exception"] == "RetriableException"
        assert doc["javaClassName"] == "org.apache.hadoop.ipc.RetriableException"
        assert "durable on the SOS server" in doc["message"] and "Nothing is lost" in doc["message"]
        r = http.rename(tmp, "/chk/commits/1")
        assert r.status_code == 403 and r.json()["RemoteException"]["exception"] == "RetriableException", r.text
        # the change was applied: the namespace shows it
        st = http.session.get(http.u("/chk/commits/1", op="GETFILESTATUS"), timeout=WAIT)
        assert st.status_code == 200 and st.json()["FileStatus"]["length"] == len(b"batch 1")
        own_moto.start()
        # until the bucket has caught up, a barrier may still run out of its 2 s: probe with
        # barriers (each CREATE body is one) until one replies, then commit
        for i in range(60):
            if http.create(f"/probe-{i}", b"p").status_code == 201:
                break
        else:
            pytest.fail("the bucket never caught up with the store back")
        spark_commit(http, 2, b"batch 2")
        lose_server(srv)
    finally:
        http.close()
        gw.kill()
    got = restore_from(url, "gwd", tmp_path / "restored")
    assert got["chk/commits/1"] == b"batch 1" and got["chk/commits/2"] == b"batch 2"


# ------------------------------------------------------------------ the mount
@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing: no FUSE")
def test_mount_tier_rename_onto_commits_returns_once_the_bucket_holds_it(sos_server_factory, new_bucket, tmp_path):
    pytest.importorskip("pyfuse3")
    from spark_plugin.spark import start_mount

    url = new_bucket()
    srv = sos_server_factory(args=["--tier", url, "--tier-interval", NEVER])
    key = srv.keygen("mnt", "append")
    mnt = tmp_path / "mnt"
    mount = start_mount(
        "mnt",
        str(mnt),
        server=srv.address,
        key=key,
        cache_dir=str(tmp_path / "cache"),
        log_path=str(tmp_path / "mount.log"),
        durability="tier",
    )
    try:
        assert "durability tier" in mount.log()
        chk = mnt / "chk"
        (chk / "offsets").mkdir(parents=True)
        (chk / "commits").mkdir()
        (chk / "offsets" / "0").write_bytes(b"offsets 0")
        tmp = chk / "commits" / f".0.{uuid.uuid4().hex}.tmp"
        tmp.write_bytes(b"batch 0")
        os.rename(tmp, chk / "commits" / "0")  # the barrier: returns once the bucket holds it
        lose_server(srv)
    finally:
        mount.kill()
    got = restore_from(url, "mnt", tmp_path / "restored")
    assert got["chk/commits/0"] == b"batch 0" and got["chk/offsets/0"] == b"offsets 0"


@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing: no FUSE")
def test_mount_reports_a_bucket_behind_as_etimedout(sos_server_factory, own_moto, tmp_path):
    pytest.importorskip("pyfuse3")
    import boto3

    from spark_plugin.spark import start_mount

    boto3.client("s3").create_bucket(Bucket="mdown")
    srv = sos_server_factory(args=["--tier", "s3://mdown/faces"])
    key = srv.keygen("mdn", "append")
    mnt = tmp_path / "mnt"
    mount = start_mount(
        "mdn",
        str(mnt),
        server=srv.address,
        key=key,
        cache_dir=str(tmp_path / "cache"),
        log_path=str(tmp_path / "mount.log"),
        durability="tier",
        tier_patience=2,
    )
    try:
        commits = mnt / "chk" / "commits"
        commits.mkdir(parents=True)
        (commits / ".0.tmp").write_bytes(b"batch 0")
        os.rename(commits / ".0.tmp", commits / "0")
        own_moto.stop()
        (commits / ".1.tmp").write_bytes(b"batch 1")
        with pytest.raises(OSError) as info:
            os.rename(commits / ".1.tmp", commits / "1")
        assert info.value.errno == errno.ETIMEDOUT
        # applied (the kernel may cache the failed rename's names, so look at the mount's cache)
        assert (tmp_path / "cache" / "tree" / "chk" / "commits" / "1").read_bytes() == b"batch 1"
        own_moto.start()
        for i in range(60):  # fsync is a barrier: until one returns, the bucket is catching up
            fd = os.open(mnt / f"probe-{i}", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.fsync(fd)
                break
            except TimeoutError:
                continue
            finally:
                os.close(fd)
        else:
            pytest.fail("the bucket never caught up with the store back")
        (commits / ".2.tmp").write_bytes(b"batch 2")
        os.rename(commits / ".2.tmp", commits / "2")
    finally:
        code = mount.stop()
    assert code == 0, mount.log()
    assert "ETIMEDOUT" in mount.log()


# ------------------------------------------------------------------ fsspec
def test_fsspec_durability_tier(sos_server_factory, new_bucket, sos_server, tmp_path):
    from sos_journal import JournalTierUnavailable
    from spark_plugin.fsspec.filesystem import SOSFileSystem, close_all

    url = new_bucket()
    srv = sos_server_factory(args=["--tier", url, "--tier-interval", NEVER])
    key = srv.keygen("fs", "append")
    fs = SOSFileSystem(
        server=srv.address, key=key, cache_dir=str(tmp_path / "c"), durability="tier", skip_instance_cache=True
    )
    try:
        fs.makedirs("fs/chk/commits", exist_ok=True)
        fs.pipe_file("fs/chk/commits/.0.tmp", b"batch 0")
        # one writer per namespace and cache in a process: the other durability is refused, clearly
        other = SOSFileSystem(server=srv.address, key=key, cache_dir=str(tmp_path / "c"), skip_instance_cache=True)
        with pytest.raises(ValueError, match="durability 'tier'"):
            other.ls("fs")
        fs.mv("fs/chk/commits/.0.tmp", "fs/chk/commits/0")  # the barrier
        lose_server(srv)
    finally:
        for ns in list(fs._handles.values()):
            ns.opened.writer.abandon()
        close_all(timeout=0)
    assert restore_from(url, "fs", tmp_path / "restored")["chk/commits/0"] == b"batch 0"
    with pytest.raises(ValueError, match="durability"):
        SOSFileSystem(server=sos_server.address, key=key, durability="bucket", skip_instance_cache=True)
    # a server without a tier: refused at the namespace's first use
    nt_key = sos_server.keygen("fsnt", "append")
    fs2 = SOSFileSystem(
        server=sos_server.address,
        key=nt_key,
        cache_dir=str(tmp_path / "c2"),
        durability="tier",
        skip_instance_cache=True,
    )
    with pytest.raises(JournalTierUnavailable, match="--tier"):
        fs2.pipe_file("fsnt/x", b"x")
    close_all(timeout=0)
