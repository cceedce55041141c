"""Proof tests of the journal against a REAL sos-server process (fixture ``sos_server``).

- hypothesis operation sequences on JournaledTree -> restore equals the live tree;
- restore at EVERY journal position equals the tree at that moment (across generations);
- SIGKILL of the writer process mid-stream, restart on the same spool -> nothing missing or doubled;
- SIGKILL of the server mid-stream -> the writer reconnects, same result;
- a corrupted byte in a stored segment -> `sos verify` names it (exit 3), `sos restore` stops
  before it (exit 3); restore refuses a non-empty target.
No timing assertions: every wait is for an event, with generous limits.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sos_client import Client
from sos_journal import JournaledTree, JournalWriter, restore, verify
from sos_journal.format import layout
from sos_journal.format.records import RecordDecoder, Write
from sos_journal.rebuild.restore import rebuild_cache
from sos_journal.testing import tree_state
from tests.journal.support import new_ns
from tests.support import client_factory, run_sos

WAIT = 180
_ns_counter = itertools.count()


# ---------------------------------------------------------------- hypothesis sequences
NAMES = ["a", "b", "d/x", "d/y", "e"]
op_st = st.one_of(
    st.tuples(st.just("mkdir"), st.sampled_from(["d", "e", "d/z"])),
    st.tuples(st.just("rmdir"), st.sampled_from(["d", "e", "d/z"])),
    st.tuples(st.just("create"), st.sampled_from(NAMES)),
    st.tuples(st.just("write"), st.sampled_from(NAMES), st.integers(0, 3000), st.binary(min_size=1, max_size=2500)),
    st.tuples(st.just("truncate"), st.sampled_from(NAMES), st.integers(0, 4000)),
    st.tuples(
        st.just("rename"), st.sampled_from([*NAMES, "d", "e"]), st.sampled_from([*NAMES, "d", "e"]), st.booleans()
    ),
    st.tuples(st.just("unlink"), st.sampled_from(NAMES)),
    st.tuples(st.just("marker"), st.binary(max_size=30)),
)


def apply_op(t, op):
    kind, *args = op
    try:
        if kind == "rename":
            t.rename(args[0], args[1], overwrite=args[2])
        elif kind == "marker":
            t.marker("test", args[0])
        else:
            getattr(t, kind)(*args)
        return True
    except OSError:  # FileExistsError, FileNotFoundError, IsADirectoryError, ENOTEMPTY...
        return False


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(ops=st.lists(op_st, min_size=1, max_size=40), sync=st.booleans())
def test_random_operations_restore_equals_live_tree(sos_server, tmp_path_factory, ops, sync):
    tmp = tmp_path_factory.mktemp("hyp")
    ns, key = new_ns(sos_server, "h")
    fac = client_factory(sos_server, ns, key)
    w = JournalWriter(fac, ns, str(tmp / "spool"), sync=sync, segment_bytes=4096, generation_bytes=16384)
    t = JournaledTree(str(tmp / "cache"), w, rebuild=rebuild_cache).open()
    try:
        for op in ops:
            before = w.last_seq
            if not apply_op(t, op):
                assert w.last_seq == before, f"a refused operation was journaled: {op}"
        t.sync(wait=True)
        live = tree_state(t.local_path(""))
    finally:
        t.close()
    restore(fac, ns, str(tmp / "out"))
    assert tree_state(str(tmp / "out")) == live
    assert verify(fac, ns).ok


# ---------------------------------------------------------------- every position
def test_restore_at_every_position_matches_the_tree_at_that_moment(sos_server, tmp_path):
    ns, key = new_ns(sos_server, "j")
    fac = client_factory(sos_server, ns, key)
    w = JournalWriter(fac, ns, str(tmp_path / "spool"), segment_bytes=2048, generation_bytes=2500)
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    states = {0: {}}

    def step(fn, *a, **kw):
        before = w.last_seq
        fn(*a, **kw)  # one record (then maybe a whole snapshot: a new generation)
        states[before + 1] = tree_state(t.local_path(""))

    step(t.mkdir, "chk")
    step(t.mkdir, "chk/offsets")
    step(t.mkdir, "chk/commits")
    committed = {}
    for n in range(8):
        tmpn = f"chk/offsets/.{n}.tmp"
        step(t.create, tmpn)
        step(t.write, tmpn, 0, (b"batch %d " % n) * (40 + 30 * n))
        step(t.rename, tmpn, f"chk/offsets/{n}", overwrite=False)
        step(t.create, f"chk/commits/.{n}.tmp")
        committed[n] = w.last_seq + 1  # the record that commits batch n
        step(t.rename, f"chk/commits/.{n}.tmp", f"chk/commits/{n}", overwrite=False)
        step(t.marker, "spark.batch", json.dumps({"checkpoint": "chk", "query_id": "q", "batch_id": n}).encode())
        if n >= 2:
            step(t.unlink, f"chk/offsets/{n - 2}")
        if n == 4:
            step(t.truncate, "chk/offsets/4", 7)
    t.sync()
    last = w.last_seq
    t.close()
    with Client(sos_server.address, key, ns) as c:
        gens = layout.scan_listing(c.list("gen/"))
    assert len(gens) >= 3 and all(g.ready for g in gens.values()), gens
    cur = {}
    for pos in range(0, last + 1):
        cur = states.get(pos, cur)
        out = tmp_path / f"p{pos}"
        restore(fac, ns, str(out), position=pos)
        assert tree_state(str(out)) == cur, f"position {pos}"
    # batch restore lands exactly after the record that makes chk/commits/N exist
    for n in (3, 7):
        restore(fac, ns, str(tmp_path / f"b{n}"), batch=f"chk:{n}")
        assert tree_state(str(tmp_path / f"b{n}")) == states[committed[n]]
    assert sorted(os.listdir(tmp_path / "b3" / "chk" / "offsets")) == ["1", "2", "3"]
    assert verify(fac, ns).ok


# ---------------------------------------------------------------- SIGKILL of the writer
WRITER_SCRIPT = textwrap.dedent("""
    import os, sys
    from sos_client import Client
    from sos_journal import JournalWriter, JournaledTree
    from sos_journal.rebuild.restore import rebuild_cache
    addr, key, ns, spool, cache, n, sync = sys.argv[1:]
    n = int(n)
    fac = lambda: Client(addr, key, ns, timeout=60)
    w = JournalWriter(fac, ns, spool, sync=sync == "1", segment_bytes=64 << 10,
                      max_lag_bytes=256 << 20, generation_bytes=1 << 40)
    t = JournaledTree(cache, w, rebuild=rebuild_cache).open()
    print("open", w.epoch, w.last_seq, int(t.rebuilt), flush=True)
    for name in sorted(os.listdir(t.local_path(""))):
        if name.endswith(".tmp"):
            t.unlink(name)  # a temp file of the killed run, as Spark would leave it
    have = set(os.listdir(t.local_path("")))
    for i in range(n):
        name = "f%04d" % i
        if name in have:
            continue
        data = (b"%d," % i) * (200 + 37 * i)
        t.create("." + name + ".tmp")
        for off in range(0, len(data), 4000):
            t.write("." + name + ".tmp", off, data[off:off + 4000])
        t.rename("." + name + ".tmp", name, overwrite=False)
        print("done", i, flush=True)
    t.sync(wait=True)
    t.close()
    print("finished", flush=True)
""")


def expected_file(i):
    return (b"%d," % i) * (200 + 37 * i)


@pytest.mark.parametrize("sync", ["1", "0"])
def test_sigkill_writer_mid_stream_then_restart(sos_server, tmp_path, sync):
    ns, key = new_ns(sos_server, "k")
    script = tmp_path / "writer.py"
    script.write_text(WRITER_SCRIPT)
    n = 120
    args = [
        sys.executable,
        str(script),
        sos_server.address,
        key,
        ns,
        str(tmp_path / "spool"),
        str(tmp_path / "cache"),
        str(n),
        sync,
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("done 60"):
                break
        else:
            pytest.fail(f"writer ended early: rc={proc.wait(WAIT)}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT)
        proc.stdout.close()
    out = subprocess.run(args, capture_output=True, text=True, timeout=WAIT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "finished" in out.stdout
    first = out.stdout.splitlines()[0].split()
    assert first[0] == "open" and int(first[1]) >= 2 and first[3] == "1"  # new epoch; cache rebuilt
    fac = client_factory(sos_server, ns, key)
    restore(fac, ns, str(tmp_path / "out"))
    state = tree_state(str(tmp_path / "out"))
    assert state == {f"f{i:04d}": expected_file(i) for i in range(n)}
    assert state == tree_state(str(tmp_path / "cache"))
    rep = verify(fac, ns)
    assert rep.ok, rep.text()
    assert rep.records == rep.last_seq  # every seq exactly once: nothing missing, nothing doubled


# ---------------------------------------------------------------- SIGKILL of the server
def test_sigkill_server_mid_stream_writer_reconnects(sos_server, tmp_path):
    ns, key = new_ns(sos_server, "s")
    fac = client_factory(sos_server, ns, key)
    w = JournalWriter(fac, ns, str(tmp_path / "spool"), segment_bytes=32 << 10, max_backoff=0.5)
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    progress = threading.Semaphore(0)
    errors = []
    n = 80

    def work():
        try:
            for i in range(n):
                t.create(f".f{i}.tmp")
                t.write(f".f{i}.tmp", 0, expected_file(i))
                t.rename(f".f{i}.tmp", f"f{i}", overwrite=False)
                t.sync()  # sync mode: waits for the server
                progress.release()
        except BaseException as e:
            errors.append(e)
            progress.release()

    th = threading.Thread(target=work, daemon=True)
    th.start()
    for _ in range(20):
        assert progress.acquire(timeout=WAIT)
    sos_server.kill()
    sos_server.start()  # same port
    for _ in range(10):
        assert progress.acquire(timeout=WAIT)
    sos_server.kill()
    sos_server.start()
    th.join(WAIT)
    assert not th.is_alive() and not errors, errors
    t.sync()
    assert w.acked_seq == w.last_seq
    live = tree_state(t.local_path(""))
    t.close()
    assert live == {f"f{i}": expected_file(i) for i in range(n)}
    restore(fac, ns, str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out")) == live
    rep = verify(fac, ns)
    assert rep.ok and rep.records == rep.last_seq, rep.text()


# ---------------------------------------------------------------- corruption, CLI
def _object_file(data_dir, ns, name):
    h = hashlib.sha256(name.encode()).hexdigest()
    return os.path.join(data_dir, "ns", ns, "objects", h[:2], h)


def _file_pos(path, name, logical):
    """File offset of logical byte ``logical`` of an object file (server storage layout)."""
    with open(path, "rb") as f:
        buf = f.read()
    pos = 8 + 2 + len(name.encode()) + 4
    lo = 0
    while pos < len(buf):
        n, _crc = struct.unpack_from(">II", buf, pos)
        if n == 0xFFFFFFFF:
            break
        if lo <= logical < lo + n:
            return pos + 8 + (logical - lo)
        lo += n
        pos += 8 + n
    raise AssertionError(f"logical offset {logical} not in {path}")


def test_corrupt_stored_byte_verify_names_it_and_restore_stops_before(sos_server, tmp_path):
    ns, key = new_ns(sos_server, "c")
    rkey = sos_server.keygen(ns, "read")
    fac = client_factory(sos_server, ns, key)
    w = JournalWriter(fac, ns, str(tmp_path / "spool"), segment_bytes=1 << 20)
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    for name in ["a", "b", "c"]:
        t.create(name)
        t.write(name, 0, name.encode() * 6000)
        t.sync()  # one append per file: b's records sit in a frame of their own
    t.close()
    env = {"SOS_SERVER": sos_server.address, "SOS_KEY": rkey}
    ok = run_sos("verify", ns, "-q", env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    with Client(sos_server.address, rkey, ns) as c:
        (seg,) = [e.name for e in c.list("gen/") if e.name.endswith(".seg")]
        dec = RecordDecoder(seg)
        dec.feed(c.read(seg))
    victim = next(r for r in dec if isinstance(r.op, Write) and r.op.path == "b")
    path = _object_file(sos_server.data_dir, ns, seg)
    fpos = _file_pos(path, seg, victim.offset + 500)
    with open(path, "r+b") as f:
        f.seek(fpos)
        byte = f.read(1)
        f.seek(fpos)
        f.write(bytes([byte[0] ^ 0xFF]))

    bad = run_sos("verify", ns, "-q", env=env)
    assert bad.returncode == 3, bad.stdout + bad.stderr
    assert f"BROKEN {seg} [" in bad.stdout
    start = int(bad.stdout.split(f"BROKEN {seg} [")[1].split(",")[0])
    assert start <= victim.offset  # the broken range starts at or before the damaged record

    target = tmp_path / "out"
    r = run_sos("restore", ns, str(target), "-q", env=env)
    assert r.returncode == 3, r.stderr
    assert seg in r.stderr and "offset" in r.stderr
    assert (target / "a").read_bytes() == b"a" * 6000  # everything before the damage
    assert not (target / "c").exists()  # nothing after it
    # a non-empty target is refused (exit 1) and left alone
    r2 = run_sos("restore", ns, str(target), "-q", env=env)
    assert r2.returncode == 1 and "not empty" in r2.stderr
    assert (target / "a").read_bytes() == b"a" * 6000


def test_cli_restore_at_position_and_batch(sos_server, tmp_path):
    ns, key = new_ns(sos_server, "cli")
    fac = client_factory(sos_server, ns, key)
    w = JournalWriter(fac, ns, str(tmp_path / "spool"))
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.mkdir("q")
    t.mkdir("q/commits")
    for n in range(3):
        t.create(f"q/commits/{n}")  # a direct write of the commit file counts as its commit
        t.marker("spark.batch", json.dumps({"checkpoint": "q", "query_id": "x", "batch_id": n}).encode())
    t.close()
    env = {"SOS_SERVER": sos_server.address, "SOS_KEY": key}
    r = run_sos("restore", ns, str(tmp_path / "b1"), "--batch", "q:1", env=env)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "b1" / "q" / "commits")) == ["0", "1"]
    assert "files" in r.stderr and "last record" in r.stderr  # the summary
    r = run_sos("restore", ns, str(tmp_path / "p"), "--position", "4", env=env)
    assert r.returncode == 0 and sorted(os.listdir(tmp_path / "p" / "q" / "commits")) == ["0"]
    r = run_sos("restore", ns, str(tmp_path / "x"), "--batch", "q:7", "-q", env=env)
    assert r.returncode == 1 and "checkpoint 'q' has no q/commits/7" in r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "x").exists()
    r = run_sos("restore", ns, str(tmp_path / "y"), "--position", "-4", env=env)
    assert r.returncode == 2


@pytest.mark.parametrize("case", ["wrong key", "read key"])
def test_writer_with_a_refused_key_fails_at_once_with_permission_error(sos_server, tmp_path, case):
    """A refused key is not a transient failure: open() raises PermissionError on the first
    refusal instead of retrying until its open_timeout (120 s by default)."""
    ns, key = new_ns(sos_server, "j")
    key = key.split(".")[0] + "." + "0" * 64 if case == "wrong key" else sos_server.keygen(ns, "read")
    w = JournalWriter(client_factory(sos_server, ns, key), ns, str(tmp_path / "spool"), open_timeout=WAIT)
    attempts = []
    orig = w.client_factory
    w.client_factory = lambda: (attempts.append(1), orig())[1]
    with pytest.raises(PermissionError):
        w.open()
    assert len(attempts) == 1
    assert not w.is_open
