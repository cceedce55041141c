"""Issue 17, items 9 and 12 (cache part): the gateway at the namespace's quota, and
requests that must not follow links planted in the gateway's cache.

Real parts only: a real ``sos-server`` process (its quota set with ``sos-server quota``),
a real ``sos gateway`` child process spoken to over HTTP by ``requests``, and
``sos restore`` to check what the journal holds.
"""

from __future__ import annotations

import errno
import os
import pathlib
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sos_client import Client
from sos_journal import JournaledTree, JournalWriter, restore
from sos_journal.rebuild.restore import rebuild_cache
from sos_journal.testing import tree_state
from spark_plugin.gateway.process import GatewayProcess
from tests.gateway.support import remote, restored
from tests.support import server_cli, token_for

pytestmark = [pytest.mark.hostile]

NS = "gwq"
DSQUOTA = "org.apache.hadoop.hdfs.protocol.DSQuotaExceededException"
#: a bound no answer should come near, even on a loaded 2-core machine; the gateway on
#: today's main never answers at all (its barrier waits for the quota forever)
PATIENCE = 60


def set_quota(srv, namespace: str, size: str) -> None:
    out = server_cli("quota", "--data", str(srv.data_dir), namespace, size)
    assert out.returncode == 0, out.stderr


class Gw:
    """A running ``sos gateway`` (optionally as another user) and a token for it."""

    def __init__(self, srv, key: str, tmp_path, *, name: str = "gateway", uid: int | None = None):
        cache = tmp_path / f"{name}-cache"
        if uid is not None:  # where that user can reach it (pytest's tmp_path is root's, 0700)
            cache = pathlib.Path(tempfile.mkdtemp(prefix="sos-gateway-as-user-"))
            os.chown(cache, uid, uid)
        cache.mkdir(exist_ok=True)
        log_path = str(tmp_path / f"{name}.log")
        if uid is None:
            self.proc = GatewayProcess(NS, str(cache), srv.address, key, log_path=log_path).start()
        else:  # the same command, run by an unprivileged user
            self.proc = _AsUser(uid, NS, str(cache), srv.address, key, log_path=log_path).start()
        self.cache = cache
        self.tree = cache / "tree"
        self.url = self.proc.url
        self.headers = {"Authorization": f"Bearer {token_for(self.url, key, NS, timeout=PATIENCE)}"}
        self.local = threading.local()

    @property
    def session(self) -> requests.Session:
        """One session per thread (requests' sessions are not thread-safe)."""
        s = getattr(self.local, "s", None)
        if s is None:
            s = self.local.s = requests.Session()
            s.headers.update(self.headers)
        return s

    def u(self, path: str, **params) -> str:
        return f"{self.url}/webhdfs/v1{urllib.parse.quote(path)}?{urllib.parse.urlencode(params)}"

    def create(self, path: str, data: bytes, **params) -> requests.Response:
        r = self.session.put(self.u(path, op="CREATE", **params), allow_redirects=False, timeout=PATIENCE)
        if r.status_code != 307:
            return r
        return self.session.put(r.headers["Location"], data=data, timeout=PATIENCE)

    def op(self, method: str, path: str, **params) -> requests.Response:
        return self.session.request(method, self.u(path, **params), timeout=PATIENCE)

    def stop(self) -> int | None:
        return self.proc.stop()

    def remove_cache(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)


@pytest.fixture
def gateways():
    """Gw(...) through this fixture: every gateway is stopped (and a cache made for another
    user removed) even when the test fails."""
    started: list[Gw] = []

    def start(*args, **kwargs) -> Gw:
        gw = Gw(*args, **kwargs)
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.proc.kill()
        if gw.cache.name.startswith("sos-gateway-as-user-"):
            gw.remove_cache()


class _AsUser(GatewayProcess):
    def __init__(self, uid: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.uid = uid

    def command(self) -> list[str]:
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", *super().command()]


def assert_dsquota(r: requests.Response) -> str:
    assert r.status_code == 403, (r.status_code, r.text)
    exc = remote(r)
    assert exc["exception"] == "DSQuotaExceededException" and exc["javaClassName"] == DSQUOTA, exc
    return exc["message"]


def classify(path: str, body: bytes, message: str, journaled: dict[str, bytes]) -> None:
    """What the journal holds for a request refused for the quota, as its message says:
    nothing; the whole change (its barrier failed: kept in the spool, shipped in order once
    the quota allows); or a file's first N bytes (a body refused between two pieces)."""
    partial = re.search(r"keeps its first (\d+) bytes", message)
    if partial:
        journaled[path] = body[: int(partial.group(1))]
    elif "cannot become durable" in message:
        journaled[path] = body
    else:
        assert "nothing was changed" in message, message


# ---------------------------------------------------------------------------- item 9


@pytest.mark.slow
def test_gateway_at_the_quota_refuses_with_dsquota_never_hangs_and_restores_what_it_said(
    sos_server, tmp_path, gateways
):
    key = sos_server.keygen(NS, "append")
    set_quota(sos_server, NS, "64K")
    gw = gateways(sos_server, key, tmp_path)
    acknowledged: dict[str, bytes] = {}  # told 201: must be restored exactly
    journaled: dict[str, bytes] = {}  # told 403 by a barrier: applied, kept in the spool

    # fill the quota through the gateway, one file after the other
    for i in range(200):
        path, body = f"/fill/f{i:03}", bytes([65 + i % 26]) * 6000
        r = gw.create(path, body)
        if r.status_code == 201:
            acknowledged[path] = body
            continue
        classify(path, body, assert_dsquota(r), journaled)
        break
    else:
        pytest.fail("200 files of 6000 bytes never reached a 64 KiB quota")
    assert acknowledged, "the quota was reached before any file"

    # the next CREATE and RENAME are refused at once, before they change anything
    for attempt in (
        lambda: gw.create("/after", b"refused"),
        lambda: gw.op("PUT", "/fill/f000", op="RENAME", destination="/fill/moved"),
        lambda: gw.op("PUT", "/made", op="MKDIRS"),
        lambda: gw.op("POST", "/fill/f000", op="APPEND"),
        lambda: gw.op("DELETE", "/fill/f000", op="DELETE"),
    ):
        started = time.monotonic()
        assert "nothing was changed" in assert_dsquota(attempt())
        assert time.monotonic() - started < PATIENCE / 2

    # 64 at once (more than the gateway's 32 worker threads), then reads still answer
    def hostile(i: int) -> requests.Response:
        if i % 2:
            return gw.create(f"/par/p{i}", b"p" * 4000)
        return gw.op("PUT", f"/fill/f{i % len(acknowledged):03}", op="RENAME", destination=f"/par/r{i}")

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(hostile, range(64)))
    for r in answers:
        assert "nothing was changed" in assert_dsquota(r)
    r = gw.op("GET", "/fill/f000", op="GETFILESTATUS")
    assert r.status_code == 200 and r.json()["FileStatus"]["length"] == 6000, r.text
    r = gw.op("GET", "/fill", op="LISTSTATUS")
    names = {e["pathSuffix"] for e in r.json()["FileStatuses"]["FileStatus"]}
    assert names == {p.rsplit("/", 1)[1] for p in [*acknowledged, *journaled]}
    r = gw.op("GET", "/fill/f000", op="OPEN")
    assert r.status_code == 200 and r.content == acknowledged["/fill/f000"]

    # the operator raises the quota on the live server: the spool drains by itself and
    # changes are accepted again
    set_quota(sos_server, NS, "64M")
    deadline = time.monotonic() + PATIENCE
    while True:
        r = gw.create("/later", b"after the quota was raised")
        if r.status_code == 201:
            break
        assert "nothing was changed" in assert_dsquota(r)
        assert time.monotonic() < deadline, "writes never came back after the quota was raised"
        time.sleep(0.2)
    acknowledged["/later"] = b"after the quota was raised"
    r = gw.op("PUT", "/fill/f000", op="RENAME", destination="/fill/moved")
    assert r.json() == {"boolean": True}
    acknowledged["/fill/moved"] = acknowledged.pop("/fill/f000")
    assert gw.stop() == 0

    # the journal holds what the client was told succeeded, plus the change whose barrier
    # failed (complete, as its message said); nothing of the refused requests
    want = {"fill": None, **{p[1:]: b for p, b in {**acknowledged, **journaled}.items()}}
    assert restored(sos_server, key, tmp_path / "restored", NS) == want


@pytest.mark.slow
def test_writer_and_fsspec_at_the_quota_fail_with_edquot_and_drain_when_raised(sos_server, tmp_path):
    """The writer behind the mount and fsspec: the quota state is in its status, a barrier
    fails promptly (JournalQuotaExceeded, EDQUOT) with the spool kept, a new change is
    refused before it touches the cache, and raising the quota drains everything."""
    from sos_journal import JournalQuotaExceeded
    from spark_plugin.fsspec.filesystem import SOSFileSystem, close_all

    key = sos_server.keygen(NS, "append")
    set_quota(sos_server, NS, "64K")
    writer = JournalWriter(
        lambda: Client(sos_server.address, key, NS, timeout=PATIENCE),
        NS,
        str(tmp_path / "spool"),
        sync=True,
        max_backoff=0.5,
    )
    tree = JournaledTree(str(tmp_path / "cache"), writer, rebuild=rebuild_cache).open()
    failure = None
    for i in range(200):
        try:
            tree.create(f"f{i}")
            tree.write(f"f{i}", 0, b"w" * 6000)
            tree.sync()
        except JournalQuotaExceeded as exc:
            failure = exc
            break
    assert failure is not None and failure.os_errno == errno.EDQUOT, failure
    started = time.monotonic()
    with pytest.raises(JournalQuotaExceeded) as blocked:
        tree.sync()  # records not acknowledged: fails promptly, they stay in the spool
    assert blocked.value.applied and time.monotonic() - started < PATIENCE / 2
    status = writer.status()
    assert status["state"] == "quota_exceeded" and status["unshipped_bytes"] > 0, status
    before = tree_state(tree.local_path(""))
    with pytest.raises(JournalQuotaExceeded) as refused:
        tree.mkdir("refused")
    assert not refused.value.applied
    assert tree_state(tree.local_path("")) == before  # refused before the cache changed

    # fsspec over its own cache (the writer above holds the namespace: another one fences
    # it; so the check of fsspec comes after, in a namespace of its own)
    set_quota(sos_server, NS, "64M")
    tree.sync()  # drains
    assert writer.status()["state"] == "ok"
    tree.mkdir("accepted")
    tree.close()
    assert tree_state(str(restore_to(sos_server, key, tmp_path / "r1"))) == tree_state(str(tmp_path / "cache"))

    ns2 = "gwq-fs"
    key2 = sos_server.keygen(ns2, "append")
    set_quota(sos_server, ns2, "64K")
    fs = SOSFileSystem(server=sos_server.address, key=key2, cache_dir=str(tmp_path / "fs"), skip_instance_cache=True)
    try:
        with pytest.raises(OSError) as over:
            for i in range(200):
                fs.pipe_file(f"sos://{ns2}/f{i}", b"x" * 6000)  # close waits for the server
        assert over.value.errno == errno.EDQUOT, over.value
        with pytest.raises(OSError) as again:
            fs.mkdir(f"sos://{ns2}/refused")
        assert again.value.errno == errno.EDQUOT
        assert not fs.exists(f"sos://{ns2}/refused")
    finally:
        close_all(timeout=0)


def restore_to(srv, key: str, target):
    restore(lambda: Client(srv.address, key, NS, timeout=PATIENCE), NS, str(target))
    return target


# ---------------------------------------------------------------------------- item 12 (cache)


@pytest.mark.slow
def test_links_planted_in_the_cache_are_never_followed(sos_server, tmp_path, gateways):
    key = sos_server.keygen(NS, "append")
    gw = gateways(sos_server, key, tmp_path)
    assert gw.create("/d/real", b"journaled").status_code == 201
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret"
    secret.write_bytes(b"not the gateway's to serve")
    os.chmod(secret, 0o600)
    os.utime(secret, ns=(10**18, 10**18))
    before = os.stat(secret)
    # another local user (or a bad restore) plants links in the cache
    os.symlink(secret, gw.tree / "link")
    os.symlink(outside, gw.tree / "dlink")
    os.symlink(secret, gw.tree / "d" / "inner")
    os.link(secret, gw.tree / "hard")  # root may hard-link anything
    try:
        for path in ("/link", "/dlink/secret", "/d/inner", "/hard"):
            r = gw.op("GET", path, op="OPEN")
            assert r.status_code in (403, 404) and b"not the gateway" not in r.content, (path, r.text)
            r = gw.op("PUT", path, op="SETPERMISSION", permission="777")
            assert r.status_code in (403, 404), (path, r.text)
            r = gw.op("PUT", path, op="SETTIMES", modificationtime="1000", accesstime="1000")
            assert r.status_code in (403, 404), (path, r.text)
        for path in ("/link", "/dlink/secret", "/d/inner", "/dlink"):
            assert gw.op("GET", path, op="GETFILESTATUS").status_code == 404, path
        listed = {e["pathSuffix"] for e in gw.op("GET", "/", op="LISTSTATUS").json()["FileStatuses"]["FileStatus"]}
        assert listed == {"d", "hard"}  # links are not entries of the journal
        assert gw.op("GET", "/dlink", op="LISTSTATUS").status_code == 404
        summary = gw.op("GET", "/", op="GETCONTENTSUMMARY").json()["ContentSummary"]
        assert summary["length"] == len(b"journaled") + before.st_size  # the hard link only
        # a recursive DELETE of a directory holding a link is refused before any change
        r = gw.op("DELETE", "/d", op="DELETE", recursive="true")
        assert r.status_code == 403 and remote(r)["exception"] == "IOException", r.text
        assert (gw.tree / "d" / "real").read_bytes() == b"journaled"
        after = os.stat(secret)
        assert (stat.S_IMODE(after.st_mode), after.st_mtime_ns, after.st_nlink) == (0o600, 10**18, 2)
        assert secret.read_bytes() == b"not the gateway's to serve"
        assert os.path.islink(gw.tree / "link") and os.path.islink(gw.tree / "dlink")
    finally:
        for name in ("link", "dlink", "hard", "d/inner"):
            os.unlink(gw.tree / name)
    assert gw.stop() == 0
    assert restored(sos_server, key, tmp_path / "restored", NS) == {"d": None, "d/real": b"journaled"}


@pytest.mark.slow
def test_setpermission_is_masked_and_000_on_the_root_leaves_a_non_root_gateway_working(sos_server, tmp_path, gateways):
    key = sos_server.keygen(NS, "append")
    # as nobody where the test can (the case that broke), else as the user running the tests
    uid = 65534 if os.geteuid() == 0 and shutil.which("setpriv") else None
    gw = gateways(sos_server, key, tmp_path, uid=uid)
    assert gw.create("/dir/f", b"data").status_code == 201

    def permission(path: str) -> str:
        r = gw.op("GET", path, op="GETFILESTATUS")
        assert r.status_code == 200, r.text
        return r.json()["FileStatus"]["permission"]

    for path, asked, given in [
        ("/dir/f", "777", "755"),
        ("/dir/f", "1777", "755"),
        ("/dir/f", "000", "600"),
        ("/dir/f", "1640", "640"),
        ("/dir/f", "640", "640"),
        ("/dir", "777", "755"),
        ("/dir", "000", "700"),
        ("/dir", "775", "755"),
        ("/", "000", "700"),
        ("/", "777", "755"),
        ("/", "000", "700"),
    ]:
        r = gw.op("PUT", path, op="SETPERMISSION", permission=asked)
        assert r.status_code == 200, r.text
        assert permission(path) == given, (path, asked)
        mode = stat.S_IMODE(os.lstat(gw.tree / path.lstrip("/")).st_mode)
        assert format(mode, "o") == given
    # the gateway still uses its own cache after 000 on the root and on a directory
    assert gw.create("/dir/g", b"more").status_code == 201
    assert gw.create("/top", b"top").status_code == 201
    assert gw.op("GET", "/dir/f", op="OPEN").content == b"data"
    names = {e["pathSuffix"] for e in gw.op("GET", "/", op="LISTSTATUS").json()["FileStatuses"]["FileStatus"]}
    assert names == {"dir", "top"}
    assert gw.stop() == 0


@pytest.mark.slow
@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing: no FUSE")
def test_mount_at_the_quota_answers_edquot_instead_of_hanging(sos_server, tmp_path):
    """The FUSE mount shares the writer: an fsync at the quota fails with EDQUOT (today it
    waits forever), and a new change is refused with EDQUOT before it reaches the cache."""
    pytest.importorskip("pyfuse3")
    from spark_plugin.mount.process import MountProcess

    ns = "gwq-mount"
    key = sos_server.keygen(ns, "append")
    set_quota(sos_server, ns, "64K")
    mnt = tmp_path / "mnt"
    mp = MountProcess(
        ns, str(mnt), str(tmp_path / "cache"), sos_server.address, key, log_path=str(tmp_path / "mount.log")
    ).start()
    errors: list[OSError] = []

    def fill() -> None:
        try:
            for i in range(200):
                with open(mnt / f"f{i}", "wb") as f:
                    f.write(b"m" * 6000)
                    f.flush()
                    os.fsync(f.fileno())  # a barrier
            errors.append(OSError(0, "200 files never reached the quota"))
        except OSError as exc:
            errors.append(exc)

    try:
        filler = threading.Thread(target=fill, daemon=True)
        filler.start()
        filler.join(PATIENCE)
        assert not filler.is_alive(), "fsync at the quota did not answer"
        assert errors and errors[0].errno == errno.EDQUOT, errors
        with pytest.raises(OSError) as refused:
            os.mkdir(mnt / "refused")
        assert refused.value.errno == errno.EDQUOT
        assert not (tmp_path / "cache" / "tree" / "refused").exists()
        set_quota(sos_server, ns, "64M")
        deadline = time.monotonic() + PATIENCE
        while True:
            try:
                os.mkdir(mnt / "accepted")
                break
            except OSError as exc:
                assert exc.errno == errno.EDQUOT and time.monotonic() < deadline, exc
                time.sleep(0.2)
        assert mp.stop() == 0
    finally:
        if mp.proc is not None and mp.proc.poll() is None:
            mp.kill()
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
