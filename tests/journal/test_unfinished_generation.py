"""Hostile input round 3 (issue 26 item 1): a writer opening on an empty cache never starts from
an empty (or an older) tree when the namespace has history in a generation that is not complete.

The reported attack, with real processes: a sos-server with a ``file://`` tier, a writer whose
barriers wait for the bucket, one byte planted in the bucket past the seal of ``gen/1/ready``
(keys are conditional creates: a bucket accepts new keys even under object lock), a replacement
server bootstrapped from the bucket (it holds that ``ready`` unsealed: generation 1 is not
complete and ``sos restore`` exits 4), then a new ``sos gateway`` on an empty cache. Before the
fix that gateway started generation 2 from an EMPTY tree in 5 runs of 6 (its rebuild raced the
seal of ``ready`` it owed its predecessor) and every restore from then on exited 0 with 0
files. The crash during a rotation (the writer SIGKILLed after SNAPSHOT_END and the records
after it reached the server, before it created ``ready``) and a first snapshot cut short are the
other ways to a namespace with records and no complete generation. protocol.md 2.1, "Opening
over a generation that is not complete", says what a writer does: it finishes the newest
generation whose snapshot is whole from its records, and refuses (JournalIncomplete) when none
is whole.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.parse

import pytest
import requests

from sos_client.blocking import Client
from sos_journal.errors import JournalIncomplete
from sos_journal.format import layout
from sos_journal.tree.open import open_namespace
from sos_tier.layout import piece_key
from sos_tier.store import LocalStore
from sos_wire.crc import crc32c
from spark_plugin.gateway.process import GatewayProcess
from tests.support import run_sos_as, tree_snapshot
from tools import child_env

pytestmark = [pytest.mark.hostile, pytest.mark.slow, pytest.mark.timeout(300)]

NS = "job"
WAIT = 120.0
READY1 = layout.ready_name(1)
#: a small checkpoint: what a writer had made durable before the damage or the crash
FILES = {
    "chk/offsets/0": b"offsets 0",
    "chk/commits/0": b"commit 0",
    "chk/state/0/1.delta": b"state " * 100,
}


def put(tree, path: str, data: bytes) -> None:
    """Spark's way: a temporary file renamed onto ``path`` (its directories made first)."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        d = "/".join(parts[:i])
        if not os.path.isdir(tree.local_path(d)):
            tree.mkdir(d)
    tmp = "/".join([*parts[:-1], f".{parts[-1]}.tmp"])
    tree.create(tmp)
    tree.write(tmp, 0, data)
    tree.rename(tmp, path, overwrite=False)


def files(root) -> dict[str, bytes]:
    """The files below ``root`` (directories left out)."""
    return {p: v for p, v in tree_snapshot(root).items() if v is not None}


def restore(srv, key: str, out) -> tuple[int, str, dict]:
    """``sos restore NS OUT``: exit status, stderr and the restored tree."""
    r = run_sos_as(srv, key, "restore", "-q", NS, str(out))
    return r.returncode, r.stderr, (files(out) if os.path.isdir(out) else {})


def generations(srv, key: str) -> dict[int, layout.GenerationInfo]:
    with Client(srv.address, key, NS, timeout=60) as c:
        return layout.scan_listing(c.list(layout.GEN_PREFIX))


class Http:
    """Plain HTTP to a gateway: a bearer token from /oauth2/token, then WebHDFS requests."""

    def __init__(self, url: str, key: str) -> None:
        self.url = url
        r = requests.post(
            url + "/oauth2/token",
            data={"grant_type": "client_credentials", "client_id": NS, "client_secret": key},
            timeout=WAIT,
        )
        assert r.status_code == 200, r.text
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {r.json()['access_token']}"

    def u(self, path: str, **params: str) -> str:
        return f"{self.url}/webhdfs/v1{urllib.parse.quote(path)}?{urllib.parse.urlencode(params)}"

    def read(self, path: str) -> bytes | None:
        r = self.session.get(self.u(path, op="OPEN"), timeout=WAIT)
        return r.content if r.status_code == 200 else None

    def commit(self, n: int, body: bytes) -> None:
        tmp = f"/chk/commits/.{n}.tmp"
        r = self.session.put(self.u(tmp, op="CREATE", overwrite="false"), allow_redirects=False, timeout=WAIT)
        assert r.status_code == 307, r.text
        r = self.session.put(r.headers["Location"], data=body, timeout=WAIT)
        assert r.status_code == 201, r.text
        r = self.session.put(self.u(tmp, op="RENAME", destination=f"/chk/commits/{n}"), timeout=WAIT)
        assert r.status_code == 200 and r.json() == {"boolean": True}, r.text

    def close(self) -> None:
        self.session.close()


# ------------------------------------------------------------------ the reported attack
def test_byte_past_ready_seal_then_replacement_server_and_new_gateway_keep_the_tree(sos_server_factory, tmp_path):
    tier = tmp_path / "tier"
    tier.mkdir()
    url = tier.as_uri()
    tier_args = ["--tier", url, "--tier-interval", "1h"]  # only the writer's barriers upload
    a = sos_server_factory(args=tier_args)
    key = a.keygen(NS, "append")
    read_key = a.keygen(NS, "read")
    w = open_namespace(NS, str(tmp_path / "cache-a"), server=a.address, key=key, durability="tier")
    try:
        for path, data in FILES.items():
            put(w.tree, path, data)
        w.tree.sync(wait=True)  # in the bucket, ready's seal marker included
    finally:
        w.close()
    a.stop()

    # the attack: one more key, a piece of ready past its seal (a conditional create succeeds)
    store = LocalStore(url)
    try:
        store.put_once(piece_key(NS, READY1, 0, 1, crc32c(b"x")), b"x")
    finally:
        store.close()
    # the replacement server: an empty data directory, the key files back, the same tier
    data_b = tmp_path / "data-b"
    shutil.copytree(os.path.join(a.data_dir, "ns", NS, "keys"), data_b / "ns" / NS / "keys")
    b = sos_server_factory(data_b, args=tier_args)
    gens = generations(b, key)
    assert gens[1].ready_object == (0, False) and not gens[1].ready  # held not complete
    rc, err, _ = restore(b, key, tmp_path / "before")
    assert rc == 4, err  # nothing complete: nothing to restore, said so

    # a reader's view of the namespace (a mount with a read key) shows the history, not an empty
    # tree (it seals nothing: before the fix this view was empty every time)
    ro = open_namespace(NS, str(tmp_path / "cache-ro"), server=b.address, key=read_key, allow_read_only=True)
    try:
        assert files(ro.tree_dir) == FILES
    finally:
        ro.close()

    gw = GatewayProcess(NS, str(tmp_path / "cache-gw"), b.address, key, log_path=str(tmp_path / "gw.log")).start()
    http = Http(gw.url, key)
    try:
        for path, data in FILES.items():
            assert http.read("/" + path) == data, path
        http.commit(1, b"commit 1")
    finally:
        http.close()
        assert gw.stop() == 0
    rc, err, got = restore(b, key, tmp_path / "after")
    assert rc == 0, err
    assert got == {**FILES, "chk/commits/1": b"commit 1"}
    assert generations(b, key)[2].ready  # the history goes on in generation 2, from generation 1's tree


# ------------------------------------------------------------------ a writer killed mid-rotation
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from sos_journal.tree.open import open_namespace
    from sos_journal.format.records import SnapshotEnd
    from sos_journal.writer.replicator import Replicator
    from sos_journal.writer.writer import JournalWriter

    server, key, ns, cache, mode, flags = sys.argv[1:7]
    written, crash = os.path.join(flags, "written"), os.path.join(flags, "at-the-crash-point")

    def crash_point():
        open(crash, "w").close()
        time.sleep(3600)  # the test SIGKILLs the process here

    if mode.startswith("ready"):
        # the rotation to generation `target`: SNAPSHOT_END and the records after it reach the
        # server (as when they go out in one round), then the writer dies before creating ready
        target = int(mode[len("ready"):])
        make_ready = Replicator._make_ready

        def hooked(self, client, pending):
            if pending[0] != target:
                return make_ready(self, client, pending)
            while not os.path.exists(written):
                time.sleep(0.01)
            while True:
                with self._cv:
                    todo = [s for s in self._segs if s.shipped < s.written]
                if not todo:
                    break
                self._ship(client, todo[0])
            crash_point()

        Replicator._make_ready = hooked
    else:
        # the first snapshot (of a cache that already held files) cut before its SNAPSHOT_END
        append = JournalWriter.append

        def hooked_append(self, op):
            if isinstance(op, SnapshotEnd) and op.generation == 1:
                while True:
                    with self._cv:
                        if self._unshipped() == 0:
                            break
                    time.sleep(0.01)
                crash_point()
            return append(self, op)

        JournalWriter.append = hooked_append

    def put(tree, path, data):
        parts = path.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if not os.path.isdir(tree.local_path(d)):
                tree.mkdir(d)
        tmp = "/".join(parts[:-1] + ["." + parts[-1] + ".tmp"])
        tree.create(tmp)
        tree.write(tmp, 0, data)
        tree.rename(tmp, path, overwrite=False)

    w = open_namespace(ns, cache, server=server, key=key, sync=False, generation_bytes=64 * 1024)
    put(w.tree, "chk/offsets/0", b"offsets 0")
    put(w.tree, "chk/commits/0", b"commit 0")
    if mode == "ready2":
        w.tree.sync(wait=True)  # generation 1 complete, these records durable
        put(w.tree, "chk/state/big", b"b" * (100 * 1024))  # past generation_bytes: generation 2 starts
    put(w.tree, "chk/offsets/1", b"offsets 1")
    put(w.tree, "chk/commits/1", b"commit 1")
    open(written, "w").close()
    time.sleep(3600)
    """
)

AFTER_CRASH = {
    "chk/offsets/0": b"offsets 0",
    "chk/commits/0": b"commit 0",
    "chk/offsets/1": b"offsets 1",
    "chk/commits/1": b"commit 1",
}


def crashed_writer(tmp_path, srv, key: str, mode: str, cache) -> None:
    """Run the writer of CHILD in ``mode`` until it reaches its crash point, then SIGKILL it."""
    script = tmp_path / "writer.py"
    script.write_text(CHILD)
    flags = tmp_path / f"flags-{mode}"
    flags.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(script), srv.address, key, NS, str(cache), mode, str(flags)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + WAIT
        while not (flags / "at-the-crash-point").exists():
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the writer never reached its crash point"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()


@pytest.mark.parametrize("generation", [1, 2])
def test_writer_killed_before_ready_then_new_writer_on_an_empty_cache_keeps_every_record(
    sos_server, tmp_path, generation
):
    key = sos_server.keygen(NS, "append")
    crashed_writer(tmp_path, sos_server, key, f"ready{generation}", tmp_path / "cache-dead")
    gens = generations(sos_server, key)
    assert max(gens) == generation and gens[generation].ready_object is None and gens[generation].total_bytes
    rc, err, got = restore(sos_server, key, tmp_path / "before")
    if generation == 1:
        assert rc == 4, err  # no generation complete
    else:  # generation 1's end; generation 2's records are not used (and said so)
        assert rc == 0 and "generation 2 is not complete" in err, err
        assert got["chk/commits/0"] == b"commit 0" and "chk/commits/1" not in got

    # a new writer on an empty cache (the fsspec/mount/gateway opener) continues from every record
    w = open_namespace(NS, str(tmp_path / "cache-new"), server=sos_server.address, key=key)
    try:
        tree = files(w.tree_dir)
        assert {p: tree.get(p) for p in AFTER_CRASH} == AFTER_CRASH
        put(w.tree, "chk/offsets/2", b"offsets 2")
    finally:
        w.close()
    rc, err, got = restore(sos_server, key, tmp_path / "after")
    assert rc == 0, err
    assert {p: got.get(p) for p in AFTER_CRASH} == AFTER_CRASH and got["chk/offsets/2"] == b"offsets 2"
    assert "chk/state/big" in got or generation == 1
    gens = generations(sos_server, key)
    assert gens[generation + 1].ready and gens[generation + 1].first_seq > gens[generation].segments[-1].first_seq
    r = run_sos_as(sos_server, key, "verify", NS)
    assert r.returncode == 0, r.stdout + r.stderr  # one chain, nothing damaged


def test_first_snapshot_cut_short_is_refused_and_its_writer_cache_finishes_it(sos_server, tmp_path):
    key = sos_server.keygen(NS, "append")
    cache = tmp_path / "cache-first"
    (cache / "tree" / "chk").mkdir(parents=True)
    (cache / "tree" / "chk" / "a").write_bytes(b"a" * 5000)
    (cache / "tree" / "chk" / "b").write_bytes(b"b" * 7000)
    crashed_writer(tmp_path, sos_server, key, "snapshot", cache)
    gens = generations(sos_server, key)
    assert list(gens) == [1] and gens[1].ready_object is None and gens[1].total_bytes
    listing = sorted((s.name, s.length) for s in gens[1].segments)

    # a writer on an empty cache: no tree to continue, refused, nothing written
    with pytest.raises(JournalIncomplete) as exc:
        open_namespace(NS, str(tmp_path / "cache-empty"), server=sos_server.address, key=key)
    msg = str(exc.value)
    assert "generation 1" in msg and "--cache" in msg and f"sos verify {NS}" in msg
    gens = generations(sos_server, key)
    assert list(gens) == [1] and sorted((s.name, s.length) for s in gens[1].segments) == listing
    rc, err, _ = restore(sos_server, key, tmp_path / "none")
    assert rc == 4, err
    # the same through the `sos gateway` command: it does not start, and says why
    gw = GatewayProcess(NS, str(tmp_path / "cache-gw"), sos_server.address, key, log_path=str(tmp_path / "gw.log"))
    with pytest.raises(Exception, match="SNAPSHOT_END"):
        gw.start()
    gw.kill()
    assert list(generations(sos_server, key)) == [1]

    # what the message says: the writer's own cache (tree and spool) finishes it
    w = open_namespace(NS, str(cache), server=sos_server.address, key=key)
    w.close()
    rc, err, got = restore(sos_server, key, tmp_path / "after")
    assert rc == 0, err
    assert got == {"chk/a": b"a" * 5000, "chk/b": b"b" * 7000}


def test_restore_refuses_an_empty_tree_a_writer_started_over_records_and_a_writer_recovers_them(sos_server, tmp_path):
    """A namespace an older writer damaged: generation 1 not complete (its writer killed before
    ready) with records, then generation 2 started from an EMPTY tree (what 70eb7dc's rebuild
    did: no complete generation, so an empty cache). Restore does not call that empty tree the
    namespace's; the next writer continues from generation 1's records."""
    key = sos_server.keygen(NS, "append")
    crashed_writer(tmp_path, sos_server, key, "ready1", tmp_path / "cache-dead")

    def start_over(_factory, _namespace, _cache_dir) -> int:  # the old rebuild: nothing complete, an empty tree
        return 0  # (the tree emptied the cache before calling it)

    w = open_namespace(NS, str(tmp_path / "cache-old"), server=sos_server.address, key=key, rebuild=start_over)
    w.close()
    gens = generations(sos_server, key)
    assert gens[2].ready and not gens[1].ready_object  # an empty generation 2 over generation 1's records

    r = run_sos_as(sos_server, key, "restore", "-q", NS, str(tmp_path / "empty"))
    assert r.returncode == 1, r.stderr
    msg = " ".join(r.stderr.split())
    assert "generation 2" in msg and "generation 1" in msg and "--generation 2" in msg, msg
    assert not (tmp_path / "empty").exists()  # nothing written
    rc, err, got = restore(sos_server, key, tmp_path / "chosen")
    assert rc == 1 and got == {}
    r = run_sos_as(sos_server, key, "restore", "-q", NS, str(tmp_path / "g2"), "--generation", "2")
    assert r.returncode == 0 and files(tmp_path / "g2") == {}, r.stderr  # the empty tree, when asked for

    w = open_namespace(NS, str(tmp_path / "cache-new"), server=sos_server.address, key=key)
    try:
        assert files(w.tree_dir) == AFTER_CRASH
    finally:
        w.close()
    rc, err, got = restore(sos_server, key, tmp_path / "after")
    assert rc == 0 and got == AFTER_CRASH, err
    assert generations(sos_server, key)[3].ready
