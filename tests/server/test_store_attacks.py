"""Attacks on the server's storage and retention by a key holder (issue 9, items 2, 3, 5, 10,
11, 15 and `sos put` in a fenced namespace), against a REAL sos-server process and real
journal writers. Each test failed on the commit before the fixes (see the commit notes).

No timing assertions: waits are for events, with generous limits; "old" files are made
old with os.utime, not by sleeping.
"""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys
import time

import pytest
import trio

from sos_client import Client
from sos_client.errors import QuotaExceeded, SOSError
from sos_journal import GenerationBreak, JournaledTree, JournalWriter, restore
from sos_journal.rebuild.restore import rebuild_cache
from sos_journal.testing import tree_state
from sos_server.engine import Engine, plan_retention
from sos_server.storage import Storage
from sos_wire import events as ev
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from tests.conftest import RawClient
from tests.support import client_factory, server_cli

pytestmark = [pytest.mark.hostile]

WAIT = 180
U64_MAX = 2**64 - 1
HOUR = 3600


def sos_cli(*args: str, env: dict, input: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sos_client.cli", *args], capture_output=True, timeout=WAIT, env=env, input=input
    )


def write_journal(srv, ns: str, key: str, tmp, files: dict[str, bytes], **kw) -> JournalWriter:
    """A real journal writer writes *files* and closes (everything acknowledged)."""
    w = JournalWriter(client_factory(srv, ns, key), ns, str(tmp / f"spool-{ns}"), **kw)
    t = JournaledTree(str(tmp / f"cache-{ns}"), w, rebuild=rebuild_cache).open()
    for path, data in files.items():
        t.create(path)
        t.write(path, 0, data)
    t.sync()
    t.close()
    return w


def names(c: RawClient, prefix: str = "") -> list[str]:
    return [e.name for e in c.call(ev.List(c.rid(), prefix, "", 1000)).entries]


def current_fence(c: RawClient) -> int:
    r = c.call(ev.Fence(c.rid(), 0))  # never above a fence: FENCED tells the fence
    assert isinstance(r, ev.Error) and r.code is ErrorCode.FENCED, r
    return r.length


def age_everything(data_dir, seconds: float) -> None:
    t = time.time() - seconds
    for root, _dirs, files in os.walk(os.path.join(data_dir, "ns")):
        for f in files:
            os.utime(os.path.join(root, f), (t, t))


def complete(c: RawClient, g: int, epoch: int) -> None:
    """What a writer does to mark generation g complete: an empty ready object, sealed."""
    name = f"gen/{g:010d}/ready"
    assert isinstance(c.append(name, 0, b"", epoch=epoch), ev.AppendOk)
    assert isinstance(c.call(ev.Seal(c.rid(), name, epoch)), ev.SealOk)


class _Popen(subprocess.Popen):
    """subprocess.Popen that runs ``_Popen.setup`` in the child (rlimit, umask) first."""

    setup = None

    def __init__(self, *a, **kw):
        kw.setdefault("preexec_fn", type(self).setup)
        super().__init__(*a, **kw)


def start_with(monkeypatch, srv, setup) -> None:
    """Start *srv* with *setup* run in the server process before exec."""
    with monkeypatch.context() as m:
        m.setattr(_Popen, "setup", staticmethod(setup))
        m.setattr(subprocess, "Popen", _Popen)
        srv.start()


# ------------------------------------------------------------------ item 2: retention
def test_forged_generation_names_are_refused(sos_server, tmp_path):
    """The issue's attack: empty `gen/99999999xx/ready` appended with epoch 2^64-1 and no
    FENCE. An epoch above the fence was never taken; a generation far ahead is no next one;
    `ready` takes no bytes. Nothing of it is stored."""
    srv = sos_server
    key = srv.keygen("victim", "append")
    write_journal(srv, "victim", key, tmp_path, {"precious": b"real data"})
    with RawClient(srv.address) as c:
        c.login(key, "victim")
        before = names(c)
        fence = current_fence(c)
        for g in (9999999998, 9999999999):
            r = c.append(f"gen/{g:010d}/ready", 0, b"", epoch=U64_MAX)
            assert isinstance(r, ev.Error) and r.code is ErrorCode.FENCED and r.length == fence, r
            assert "above the fence" in r.message
            r = c.call(ev.Seal(c.rid(), "gen/0000000001/ready", U64_MAX))
            assert isinstance(r, ev.Error) and r.code is ErrorCode.FENCED, r
        # with the right epoch the number itself is refused: generations grow by one
        for g in (9999999999, 3, 0):
            r = c.append(f"gen/{g:010d}/ready", 0, b"", epoch=fence)
            assert isinstance(r, ev.Error) and r.code is ErrorCode.BAD_REQUEST, (g, r)
            assert "the next one is 2" in r.message
        # a ready object never holds bytes (not even the next generation's)
        r = c.append("gen/0000000002/ready", 0, b"x", epoch=fence)
        assert isinstance(r, ev.Error) and r.code is ErrorCode.BAD_REQUEST and "stays empty" in r.message, r
        assert names(c) == before


def test_retention_waits_min_age_after_newer_generations_complete(sos_server, tmp_path):
    """What an append key CAN do (the current epoch, the next numbers, sealed empty ready
    objects) makes two newer complete generations at once. Retention still keeps the real
    generation 1 until those have been complete for --min-age by the server's clock."""
    srv = sos_server
    key = srv.keygen("victim", "append")
    write_journal(srv, "victim", key, tmp_path, {"precious": b"real data"})
    age_everything(srv.data_dir, 30 * 24 * HOUR)  # generation 1 was written a month ago
    with RawClient(srv.address) as c:
        c.login(key, "victim")
        gen1 = names(c, "gen/0000000001/")
        assert "gen/0000000001/ready" in gen1
        fence = current_fence(c)
        for g in (2, 3):
            complete(c, g, fence)
    srv.stop()
    gc = server_cli("gc", "--data", srv.data_dir, "--keep-generations", "2", "--min-age", "1h")
    assert gc.returncode == 0, gc.stderr
    assert "removed" not in gc.stdout and "0 objects removed" in gc.stderr
    srv.start()
    with RawClient(srv.address) as c:
        c.login(key, "victim")
        assert names(c, "gen/0000000001/") == gen1
    # the forged generations do not continue generation 1 (no segments): restore refuses the
    # journal as a whole, and generation 1 alone is still there to restore
    with pytest.raises(GenerationBreak):
        restore(client_factory(srv, "victim", key), "victim", str(tmp_path / "out"))
    restore(client_factory(srv, "victim", key), "victim", str(tmp_path / "out"), generation=1, force=True)
    assert tree_state(str(tmp_path / "out")) == {"precious": b"real data"}
    # once they have been complete for min_age (time for an operator to notice), rules apply
    srv.stop()
    age_everything(srv.data_dir, 2 * HOUR)
    gc = server_cli("gc", "--data", srv.data_dir, "--keep-generations", "2", "--min-age", "1h")
    assert gc.returncode == 0, gc.stderr
    assert sorted(ln.split("victim/", 1)[1] for ln in gc.stdout.splitlines()) == gen1


def test_only_empty_durably_sealed_ready_objects_count(tmp_path):
    """`gen/G/ready` counts only if empty and sealed: an unsealed one (a client can leave it
    so) does not make G complete, nor does a damaged one."""
    s = Storage(str(tmp_path))
    ns = s.namespace("t", create=True)
    old = time.time() - 10 * HOUR
    for g in (1, 2):
        for name in (f"gen/{g:010d}/0000000001-0000000001.seg", f"gen/{g:010d}/ready"):
            o = ns.create(name)
            if g == 1 and name.endswith("ready"):
                o.write_seal()
                o.mark_synced(*o.sync())
            os.utime(o.path, (old, old))
    # generation 2's ready is empty but unsealed: not complete, generation 1 is the newest
    assert plan_retention(ns, 1, HOUR) == []
    r2 = ns.get("gen/0000000002/ready")
    r2.write_seal()
    r2.mark_synced(*r2.sync())
    os.utime(r2.path, (old, old))
    assert plan_retention(ns, 1, HOUR) == sorted(n for n in ns.objects if n.startswith("gen/0000000001/"))
    s.close()


# ------------------------------------------------------------------ item 3: far-future generation
def test_generation_numbers_only_grow_by_one(sos_server, tmp_path):
    srv = sos_server
    key = srv.keygen("gens", "append")
    with RawClient(srv.address) as c:
        c.login(key, "gens")
        assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
        # a namespace without a journal starts at generation 1
        for g in (0, 2, 9999999999):
            r = c.append(f"gen/{g:010d}/0000000001-0000000001.seg", 0, b"x", epoch=1)
            assert isinstance(r, ev.Error) and r.code is ErrorCode.BAD_REQUEST and "the next one is 1" in r.message
        assert names(c) == []
        # names under gen/ that are not generation directories are no journal: not refused
        assert isinstance(c.append("gen/notes", 0, b"n", epoch=1), ev.AppendOk)
    # a real writer writes several generations (each the next one) and stays restorable
    w = JournalWriter(
        client_factory(srv, "gens2", srv.keygen("gens2", "append")),
        "gens2",
        str(tmp_path / "spool"),
        segment_bytes=2048,
        generation_bytes=2500,
    )
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    for i in range(12):
        t.create(f"f{i}")
        t.write(f"f{i}", 0, bytes([65 + i]) * 700)
    t.sync()
    assert w.generation >= 3
    gen = w.generation
    with w.client_factory() as c2:
        # the forged far-future generation of issue 9 item 3 is refused, so is any skip
        for g in (9999999999, gen + 2):
            with pytest.raises(SOSError) as info:
                c2.append(f"gen/{g:010d}/0000000001-{w.epoch:010d}.seg", 0, b"forged", epoch=w.epoch)
            assert info.value.code is ErrorCode.BAD_REQUEST
    t.create("after")
    t.write("after", 0, b"still acknowledged and restorable")
    t.sync()
    want = tree_state(t.local_path(""))
    t.close()
    restore(w.client_factory, "gens2", str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out")) == want


# ------------------------------------------------------------------ item 5: fence bounds
def test_fence_epochs_are_bounded_and_an_operator_can_reset_them(sos_server, tmp_path):
    srv = sos_server
    key = srv.keygen("f", "append")
    with RawClient(srv.address) as c:
        c.login(key, "f")
        for epoch in (U64_MAX, 10**10, 1001):
            r = c.call(ev.Fence(c.rid(), epoch))
            assert isinstance(r, ev.Error) and r.code is ErrorCode.TOO_LARGE and r.length == 1000, r
            assert "at most 1000" in r.message
        assert current_fence(c) == 0
        assert c.call(ev.Fence(c.rid(), 1000)) == ev.FenceOk(c.conn.next_request_id() - 1, 1000)
    # a writer still takes over: FENCE(highest epoch it knows + 1), retried on FENCED
    w = write_journal(srv, "f", key, tmp_path, {"a": b"1"})
    assert w.epoch == 1001
    # a fence from an older server at 2^64-1 (or one pushed to the last epoch) locks writers
    # out; the operator resets it offline
    srv.stop()
    with open(os.path.join(srv.data_dir, "ns", "f", "fence"), "w") as f:
        f.write(f"{U64_MAX}\n")
    srv.start()
    with RawClient(srv.address) as c:
        c.login(key, "f")
        r = c.call(ev.Fence(c.rid(), 1002))
        assert isinstance(r, ev.Error) and r.code is ErrorCode.FENCED and "reset-fence" in r.message, r
    busy = server_cli("reset-fence", "--data", srv.data_dir, "f")
    assert busy.returncode == 1 and "in use" in busy.stderr
    srv.stop()
    out = server_cli("reset-fence", "--data", srv.data_dir, "f")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"f: fence {U64_MAX} -> 1001"  # the newest writer's epoch
    bad = server_cli("reset-fence", "--data", srv.data_dir, "f", "--epoch", str(10**10))
    assert bad.returncode == 2 and "9999999999" in bad.stderr
    srv.start()
    w = JournalWriter(client_factory(srv, "f", key), "f", str(tmp_path / "spool-f"))
    t = JournaledTree(str(tmp_path / "cache-f"), w, rebuild=rebuild_cache).open()
    assert w.epoch == 1002
    t.create("b")
    t.write("b", 0, b"2")
    t.sync()
    t.close()
    restore(client_factory(srv, "f", key), "f", str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out")) == {"a": b"1", "b": b"2"}
    # the top of the epoch range: nothing passes it, and the message says what to do
    srv.stop()
    assert server_cli("reset-fence", "--data", srv.data_dir, "f", "--epoch", "9999999999").returncode == 0
    srv.start()
    with RawClient(srv.address) as c:
        c.login(key, "f")
        r = c.call(ev.Fence(c.rid(), 10**10))
        assert isinstance(r, ev.Error) and r.code is ErrorCode.TOO_LARGE and "reset-fence" in r.message, r


# ------------------------------------------------------------------ item 10: descriptors, object cap
def test_many_unsealed_objects_do_not_exhaust_descriptors(sos_server_factory, monkeypatch):
    """One tenant's 450 unsealed objects under a 400-descriptor limit: every append is
    acknowledged and another tenant still connects and writes."""
    srv = sos_server_factory(start=False)
    key_a, key_b = srv.keygen("a", "append"), srv.keygen("b", "append")
    start_with(monkeypatch, srv, lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400)))
    data = {}
    with RawClient(srv.address) as c:
        c.login(key_a, "a")
        for i in range(450):
            data[f"o/{i}"] = b"%d" % i
            r = c.append(f"o/{i}", 0, data[f"o/{i}"])
            assert isinstance(r, ev.AppendOk), (i, r)
        fds = len(os.listdir(f"/proc/{srv.pid}/fd"))
        assert fds < 200, fds
        with RawClient(srv.address) as b:
            assert isinstance(b.login(key_b, "b"), ev.AuthOk)
            assert isinstance(b.append("x", 0, b"other tenant"), ev.AppendOk)
        # objects whose descriptor was closed take further appends (reopened on demand)
        for i in (0, 1, 449):
            name = f"o/{i}"
            r = c.append(name, len(data[name]), b"+")
            assert isinstance(r, ev.AppendOk), r
            data[name] += b"+"
    srv.restart()
    with RawClient(srv.address) as c:
        c.login(key_a, "a")
        for name in ("o/0", "o/1", "o/2", "o/448", "o/449"):
            assert c.read(name) == data[name]


def test_server_wide_object_cap(sos_server_factory):
    srv = sos_server_factory(args=["--max-objects-total", "30"], start=False)
    key_a, key_b = srv.keygen("a", "append"), srv.keygen("b", "append")
    srv.start()
    with RawClient(srv.address) as a, RawClient(srv.address) as b:
        a.login(key_a, "a")
        b.login(key_b, "b")
        for i in range(20):
            assert isinstance(a.append(f"o{i}", 0, b"x"), ev.AppendOk)
        for i in range(10):
            assert isinstance(b.append(f"o{i}", 0, b"x"), ev.AppendOk)
        for c in (a, b):
            r = c.append("one-more", 0, b"x")
            assert isinstance(r, ev.Error) and r.code is ErrorCode.QUOTA_EXCEEDED, r
            assert "max-objects-total" in r.message
            assert isinstance(c.append("o0", 1, b"y"), ev.AppendOk)  # existing objects still grow


def test_descriptor_cache_closes_only_clean_objects(tmp_path):
    """Engine + storage: 2 descriptors for 40 objects appended concurrently; every append
    is acknowledged after its sync and every byte is there after a restart."""
    storage = Storage(str(tmp_path), max_open_files=2)
    storage.namespace("t", create=True)
    engine = Engine(storage)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(engine.run)

            async def writer(i):
                off = 0
                for k in range(5):
                    piece = b"%d-%d;" % (i, k)
                    off = await engine.append("t", "append", f"o{i}", off, 0, crc32c(piece), piece)

            async with trio.open_nursery() as w:
                for i in range(40):
                    w.start_soon(writer, i)
            n.cancel_scope.cancel()

    trio.run(main)
    assert len(storage.files) <= 2 and storage.files.closed_by_limit > 0
    storage.close()
    s2 = Storage(str(tmp_path))
    s2.open()
    for i in range(40):
        assert s2.namespaces["t"].get(f"o{i}").read_bytes(0, 0) == b"".join(b"%d-%d;" % (i, k) for k in range(5))
    s2.close()


# ------------------------------------------------------------------ item 11: quotas
def test_namespace_byte_quota(sos_server_factory, tmp_path):
    # each object costs C besides its data (issue 17 item 7, protocol.md 1.9): the quotas
    # below are one object's charge plus the data bytes this test is about
    C = 4096
    srv = sos_server_factory(args=["--namespace-quota", str(C + 100)], start=False)
    out = server_cli("keygen", "--data", srv.data_dir, "q", "--role", "append", "--quota", str(C + 1000))
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()
    other = srv.keygen("other", "append")
    srv.start()
    with RawClient(srv.address) as c:
        c.login(key, "q")
        assert isinstance(c.append("a", 0, b"x" * 600), ev.AppendOk)
        r = c.append("a", 600, b"y" * 500)
        assert isinstance(r, ev.Error) and r.code is ErrorCode.QUOTA_EXCEEDED and f"quota of {C + 1000}" in r.message, r
        r = c.append("b", 0, b"y" * 401)  # the quota is the namespace's, over all its objects
        assert isinstance(r, ev.Error) and r.code is ErrorCode.QUOTA_EXCEEDED, r
        assert c.read("a") == b"x" * 600  # nothing written, nothing lost
        assert isinstance(c.append("a", 600, b"y" * 400), ev.AppendOk)  # exactly up to the quota
        assert isinstance(c.append("a", 0, b"x" * 600), ev.AppendOk)  # identical retries still acked
        # the operator raises it while the server runs: taken up at once
        out = server_cli("quota", "--data", srv.data_dir, "q", str(C + 2048))
        used = f"used {C + 1000} (objects 1, data bytes 1000)"  # C: one object's charge
        assert out.returncode == 0 and out.stdout == f"q\t{C + 2048}\t{used}\n", (out.stdout, out.stderr)
        with Client(srv.address, key, "q") as cl:
            assert cl.append("a", 1000, b"z" * 500) == 1500
            with pytest.raises(QuotaExceeded):
                cl.append("a", 1500, b"z" * 1000)
    # --namespace-quota applies to namespaces without their own
    with RawClient(srv.address) as c:
        c.login(other, "other")
        assert isinstance(c.append("a", 0, b"x" * 100), ev.AppendOk)
        r = c.append("a", 100, b"x")
        assert isinstance(r, ev.Error) and r.code is ErrorCode.QUOTA_EXCEEDED, r
    assert (
        server_cli("quota", "--data", srv.data_dir, "q").stdout
        == f"q\t{C + 2048}\tused {C + 1500} (objects 1, data bytes 1500)\n"
    )
    # the quota survives a restart (usage is counted again from the files)
    srv.restart()
    with RawClient(srv.address) as c:
        c.login(key, "q")
        r = c.append("a", 1500, b"z" * 549)
        assert isinstance(r, ev.Error) and r.code is ErrorCode.QUOTA_EXCEEDED, r
        assert isinstance(c.append("a", 1500, b"z" * 548), ev.AppendOk)


def test_journal_writer_over_quota_loses_nothing(sos_server_factory, tmp_path):
    """A writer over its quota keeps its records in the spool and retries; once the
    operator raises the quota everything arrives and restores."""
    srv = sos_server_factory(start=False)
    key = srv.keygen("jq", "append")
    # two objects (a segment, ready: 4 KiB each, protocol.md 1.9) and 3000 data bytes: 8,000 do not fit
    assert server_cli("quota", "--data", srv.data_dir, "jq", str(2 * 4096 + 3000)).returncode == 0
    srv.start()
    w = JournalWriter(client_factory(srv, "jq", key), "jq", str(tmp_path / "spool"), sync=False, max_backoff=0.2)
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    for i in range(8):
        t.create(f"f{i}")
        t.write(f"f{i}", 0, bytes([48 + i]) * 1000)
    deadline = time.monotonic() + WAIT
    while not isinstance(w.last_error, QuotaExceeded):
        assert time.monotonic() < deadline, f"writer never hit the quota: {w.last_error!r}"
        time.sleep(0.05)
    assert w.acked_seq < w.last_seq
    assert server_cli("quota", "--data", srv.data_dir, "jq", "1M").returncode == 0
    t.sync(wait=True)
    want = tree_state(t.local_path(""))
    t.close()
    restore(client_factory(srv, "jq", key), "jq", str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out")) == want and len(want) == 8


# ------------------------------------------------------------------ item 15: file modes
def test_object_files_are_private_whatever_the_umask(sos_server_factory, monkeypatch):
    srv = sos_server_factory(start=False)
    key = srv.keygen("p", "append")
    start_with(monkeypatch, srv, lambda: os.umask(0))
    with RawClient(srv.address) as c:
        c.login(key, "p")
        assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
        for i in range(20):
            assert isinstance(c.append(f"d/o{i}", 0, b"secret", epoch=1), ev.AppendOk)

    def modes():
        out = {}
        for root, dirs, files in os.walk(os.path.join(srv.data_dir, "ns")):
            for n in dirs + files:
                p = os.path.join(root, n)
                out[p] = stat.S_IMODE(os.lstat(p).st_mode)
        return out

    found = modes()
    assert len(found) > 20
    bad = {p: oct(m) for p, m in found.items() if m not in (0o600, 0o700)}
    assert not bad, bad
    assert all(m == 0o700 for p, m in found.items() if os.path.isdir(p))
    # files an older version left readable are made private at start-up
    srv.stop()
    some = next(p for p in found if os.path.isfile(p) and "/objects/" in p)
    os.chmod(some, 0o644)
    os.chmod(os.path.dirname(some), 0o755)
    srv.start()
    assert stat.S_IMODE(os.stat(some).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(some)).st_mode) == 0o700


# ------------------------------------------------------------------ `sos put` in a fenced namespace
def test_sos_put_works_in_a_namespace_a_writer_fenced(sos_server, tmp_path):
    srv = sos_server
    key = srv.keygen("put", "append")
    w = write_journal(srv, "put", key, tmp_path, {"j": b"journal"})
    assert w.epoch >= 1
    env = dict(os.environ, SOS_SERVER=srv.address, SOS_KEY=key)
    src = tmp_path / "notes.txt"
    src.write_bytes(b"kept beside the journal\n")
    r = sos_cli("put", "--seal", str(src), "put/notes/readme", env=env)
    assert r.returncode == 0, r.stderr
    r = sos_cli("cat", "put/notes/readme", env=env)
    assert r.returncode == 0 and r.stdout == b"kept beside the journal\n"
    r = sos_cli("put", "-", "put/notes/empty", env=env, input=b"")
    assert r.returncode == 0, r.stderr
    # the journal's names are not for sos put
    r = sos_cli("put", str(src), "put/gen/0000000002/ready", env=env)
    assert r.returncode == 2 and b"journal" in r.stderr, r.stderr
    # a read key: refused with a clear message, nothing written
    env_r = dict(env, SOS_KEY=srv.keygen("put", "read"))
    r = sos_cli("put", str(src), "put/notes/other", env=env_r)
    assert r.returncode == 1 and b"append key" in r.stderr, r.stderr
    # the journal is untouched and the writer goes on
    w2 = write_journal(srv, "put", key, tmp_path, {"k": b"more"})
    assert w2.epoch == w.epoch + 1
    restore(client_factory(srv, "put", key), "put", str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out")) == {"j": b"journal", "k": b"more"}
