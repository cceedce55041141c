"""Unit tests of the writer, tree, replay, restore and verify over the in-memory store.

(The same properties are proven against a real sos-server in test_journal_server.py.)
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from sos_journal import (
    JournaledTree,
    JournalWriter,
    PositionUnavailable,
    SpoolStale,
    TargetNotEmpty,
    WriterFenced,
    restore,
    verify,
)
from sos_journal.errors import BatchNotFound, JournalCorrupt
from sos_journal.format import layout
from sos_journal.format.records import Create, Mkdir, RecordDecoder, SnapshotEnd, Write
from sos_journal.memstore import MemStore
from sos_journal.rebuild.restore import rebuild_cache
from sos_journal.testing import tree_state
from sos_journal.tree import tree as tree_mod

WAIT = 120  # generous: never reached unless something is broken


def make(tmp_path, store, name="w", cache="cache", **kw):
    w = JournalWriter(store.factory, "ns", str(tmp_path / f"spool-{name}"), **kw)
    t = JournaledTree(str(tmp_path / cache), w, rebuild=rebuild_cache).open()
    return w, t


def all_records(store):
    out = []
    for name in sorted(store.objects, key=lambda n: layout.parse_segment_name(n) or layout.SegmentName(0, 0, 0)):
        if layout.parse_segment_name(name):
            d = RecordDecoder(name)
            d.feed(bytes(store.objects[name]))
            out.extend(d)
            assert d.pending == 0
    return out


def assert_journal_exact(store, last_seq):
    seqs = [r.seq for r in all_records(store)]
    assert seqs == list(range(1, last_seq + 1)), "missing or doubled records"


def test_tree_ops_restore_and_verify(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store, segment_bytes=300)
    t.mkdir("chk")
    t.create("chk/.a.tmp")
    t.write("chk/.a.tmp", 0, b"hello world")
    t.rename("chk/.a.tmp", "chk/a", overwrite=False)
    t.create("chk/b", 0o600)
    t.write("chk/b", 3, b"xyz")  # sparse start
    t.truncate("chk/b", 5)
    t.mkdir("chk/d")
    t.rmdir("chk/d")
    t.create("chk/c")
    t.unlink("chk/c")
    t.marker("note", b"\x00\x01")
    t.sync()
    assert w.acked_seq == w.last_seq
    s = restore(store.factory, "ns", str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out")) == tree_state(t.local_path(""))
    assert s.files == 2 and s.last_seq == w.last_seq and s.bytes == 11 + 5
    assert os.stat(tmp_path / "out" / "chk" / "b").st_mode & 0o777 == 0o600
    rep = verify(store.factory, "ns")
    assert rep.ok and rep.records == w.last_seq, rep.text()
    # full segments were sealed, the newest is not
    segs = [n for n in store.objects if layout.parse_segment_name(n)]
    assert len(segs) >= 2
    assert all(n in store.sealed for n in sorted(segs)[:-1])
    t.close()


def test_rename_noreplace_refuses_and_journals_nothing(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store)
    t.create("a")
    t.create("b")
    t.mkdir("d1")
    t.mkdir("d2")
    before = w.last_seq
    with pytest.raises(FileExistsError):
        t.rename("a", "b", overwrite=False)
    with pytest.raises(FileExistsError):
        t.rename("d1", "d2", overwrite=False)
    assert w.last_seq == before
    assert os.path.exists(t.local_path("a")) and os.path.exists(t.local_path("b"))
    t.rename("a", "b", overwrite=True)
    assert not os.path.exists(t.local_path("a"))
    with pytest.raises(FileNotFoundError):
        t.unlink("nope")
    with pytest.raises(ValueError):
        t.create("../escape")
    t.close()


def test_rename_noreplace_fallback_without_renameat2(tmp_path, monkeypatch):
    monkeypatch.setattr(tree_mod, "_renameat2", None)
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    with pytest.raises(FileExistsError):
        tree_mod.rename_noreplace(str(tmp_path / "a"), str(tmp_path / "b"))
    tree_mod.rename_noreplace(str(tmp_path / "a"), str(tmp_path / "c"))
    assert (tmp_path / "c").read_text() == "a" and not (tmp_path / "a").exists()
    (tmp_path / "d").mkdir()
    tree_mod.rename_noreplace(str(tmp_path / "d"), str(tmp_path / "e"))
    assert (tmp_path / "e").is_dir()


def test_barrier_waits_for_the_store_and_lost_acks_are_not_doubled(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store, max_backoff=0.05)
    t.create("f")
    t.sync()
    store.down = True
    t.write("f", 0, b"a" * 1000)
    with pytest.raises(TimeoutError):
        w.barrier(timeout=0.3)  # cannot be durable while the store is down
    assert w.acked_seq < w.last_seq
    store.down = False
    store.fail_appends = 2  # data lands, ack is lost: the retry must not double it
    t.write("f", 1000, b"b" * 1000)
    w.barrier(timeout=WAIT)
    assert w.acked_seq == w.last_seq
    assert_journal_exact(store, w.last_seq)
    t.close()
    restore(store.factory, "ns", str(tmp_path / "out"))
    assert (tmp_path / "out" / "f").read_bytes() == b"a" * 1000 + b"b" * 1000


def test_async_mode_blocks_appends_beyond_max_lag(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store, sync=False, max_lag_bytes=64 << 10, max_backoff=0.05)
    t.create("f")
    t.rename("f", "g", overwrite=True)  # async: returns without waiting for the server
    store.down = True
    peaks = []

    def writer():
        for i in range(64):
            t.write("g", i * 4096, b"z" * 4096)
            peaks.append(w.unshipped_bytes)

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    th.join(2.0)
    assert th.is_alive(), "append must block while the unshipped spool exceeds max_lag_bytes"
    assert len(peaks) < 64
    store.down = False
    th.join(WAIT)
    assert not th.is_alive()
    assert max(peaks) <= (64 << 10) + 4096 + 200
    w.barrier(timeout=WAIT)
    t.close()
    assert_journal_exact(store, w.last_seq)


def test_resume_from_spool_after_crash_ships_everything_once(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store, segment_bytes=2000)
    for i in range(5):
        t.create(f"f{i}")
        t.write(f"f{i}", 0, bytes([i]) * 700)
    t.sync()
    store.down = True  # the rest stays in the spool
    for i in range(5, 10):
        t.create(f"f{i}")
        t.write(f"f{i}", 0, bytes([i]) * 700)
    last = w.last_seq
    w.abandon()
    # an empty, never-shipped segment and a torn record at the end of the spool
    spool = tmp_path / "spool-w"
    segs = sorted(spool.glob("gen/*/*.seg"))
    with open(segs[-1], "ab") as f:
        f.write(b"\x00\x00\x01\x00garbage")
    gdir = segs[-1].parent
    (gdir / f"{last + 1:010d}-{w.epoch:010d}.seg").write_bytes(b"")
    store.down = False
    w2 = JournalWriter(store.factory, "ns", str(spool), segment_bytes=2000)
    t2 = JournaledTree(
        str(tmp_path / "cache"), w2, rebuild=rebuild_cache
    ).open()  # crash flag set: cache rebuilt from the journal
    assert w2.last_seq == last and w2.epoch > w.epoch
    t2.sync()
    assert_journal_exact(store, last)
    t2.create("after")
    t2.sync()
    assert_journal_exact(store, last + 1)
    t2.close()
    restore(store.factory, "ns", str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out")) == tree_state(str(tmp_path / "cache"))
    assert sorted(os.listdir(tmp_path / "out")) == sorted([f"f{i}" for i in range(10)] + ["after"])
    assert verify(store.factory, "ns").ok


def test_resume_completes_a_record_cut_in_the_middle_on_the_server(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store)
    t.create("f")
    t.sync()
    store.down = True
    for i in range(4):
        t.write("f", i * 3000, bytes([i + 1]) * 3000)
    last = w.last_seq
    w.abandon()
    store.down = False
    # the server got the first record and half of the second (a multi-frame append cut short)
    (seg,) = sorted((tmp_path / "spool-w").glob("gen/*/*.seg"))
    name = str(seg.relative_to(tmp_path / "spool-w"))
    shipped = len(store.objects.get(name, b""))
    data = seg.read_bytes()
    rec_len = 8 + int.from_bytes(data[shipped : shipped + 4], "big")
    store.objects[name] = bytearray(data[: shipped + rec_len + rec_len // 2])
    w2 = JournalWriter(store.factory, "ns", str(tmp_path / "spool-w"))
    w2.open()
    w2.barrier(timeout=WAIT)
    assert_journal_exact(store, last)
    w2.close()
    restore(store.factory, "ns", str(tmp_path / "out"))
    assert (tmp_path / "out" / "f").read_bytes() == b"".join(bytes([i + 1]) * 3000 for i in range(4))


def test_second_writer_fences_the_first(tmp_path):
    store = MemStore()
    w1, t1 = make(tmp_path, store, name="1", cache="c1")
    t1.create("a")
    t1.sync()
    w2, t2 = make(tmp_path, store, name="2", cache="c2")  # fresh spool+cache: rebuilt from server
    assert t2.rebuilt and os.path.exists(t2.local_path("a"))
    assert w2.epoch > w1.epoch
    t1.create("b")  # lands in the spool, the server refuses it
    with pytest.raises(WriterFenced):
        t1.sync()
    with pytest.raises(WriterFenced):
        t1.create("c")
    t2.create("z")
    t2.sync()
    t2.close()
    restore(store.factory, "ns", str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["a", "z"]
    # the first writer's spool is now stale: it must not fence the second and write over it
    w1.close(timeout=1)
    w3 = JournalWriter(store.factory, "ns", str(tmp_path / "spool-1"))
    with pytest.raises(SpoolStale):
        w3.open()


def test_generations_snapshots_and_restore_at_every_position(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store, generation_bytes=1500, segment_bytes=900)
    states = {0: {}}  # seq -> tree after it

    def step(fn, *a, **kw):
        before = w.last_seq
        fn(*a, **kw)  # one record, possibly followed by a whole snapshot (new generation)
        states[before + 1] = tree_state(t.local_path(""))

    step(t.mkdir, "d")
    for i in range(12):
        step(t.create, f"d/.f{i}.tmp")
        step(t.write, f"d/.f{i}.tmp", 0, bytes([65 + i]) * (100 + 37 * i))
        step(t.rename, f"d/.f{i}.tmp", f"d/f{i}", overwrite=False)
        if i % 3 == 2:
            step(t.unlink, f"d/f{i - 2}")
    t.sync()
    gens = layout.scan_listing(store.client().list("gen/"))
    assert len(gens) >= 3 and all(g.ready for g in gens.values())
    # snapshot records carry their own seqs; the tree does not change during a snapshot
    last = w.last_seq
    expected, cur = {}, {}
    for seq in range(0, last + 1):
        cur = states.get(seq, cur)
        expected[seq] = cur
    for seq in range(0, last + 1):
        out = tmp_path / f"at{seq}"
        restore(store.factory, "ns", str(out), position=seq)
        assert tree_state(str(out)) == expected[seq], seq
    rep = verify(store.factory, "ns")
    assert rep.ok, rep.text()
    # retention removed generation 1: old positions are refused, newer ones still work
    for name in [n for n in store.objects if n.startswith(layout.gen_prefix(1))]:
        del store.objects[name]
    with pytest.raises(PositionUnavailable):
        restore(store.factory, "ns", str(tmp_path / "old"), position=3)
    restore(store.factory, "ns", str(tmp_path / "new"), position=last)
    assert tree_state(str(tmp_path / "new")) == expected[last]
    t.close()


def test_restore_by_time_and_by_batch(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store)
    t.mkdir("q")
    t.mkdir("q/commits")
    t.create("q/offsets")
    for n in range(3):
        t.write("q/offsets", n, b"%d" % n)
        t.create(f"q/commits/.{n}.tmp")
        t.rename(f"q/commits/.{n}.tmp", f"q/commits/{n}", overwrite=False)  # batch n commits here
        t.marker("spark.batch", json.dumps({"checkpoint": "q", "query_id": "x", "batch_id": n}).encode())
    t.unlink("q/offsets")
    t.sync()
    s = restore(store.factory, "ns", str(tmp_path / "b1"), batch="q:1")
    assert (tmp_path / "b1" / "q" / "offsets").read_bytes() == b"01"
    assert sorted(os.listdir(tmp_path / "b1" / "q" / "commits")) == ["0", "1"]
    assert s.stopped
    s = restore(store.factory, "ns", str(tmp_path / "b1b"), batch=("/q/", 1))
    assert (tmp_path / "b1b" / "q" / "offsets").read_bytes() == b"01"
    with pytest.raises(BatchNotFound):
        restore(store.factory, "ns", str(tmp_path / "b9"), batch="q:9")
    with pytest.raises(ValueError):
        restore(store.factory, "ns", str(tmp_path / "bx"), batch="nonsense")
    # by time: every record's time is a valid stopping point
    recs = all_records(store)
    mid = next(r for r in recs if r.seq == 7)
    s = restore(store.factory, "ns", str(tmp_path / "t"), at=mid.time_ns)
    assert s.last_seq >= 7
    assert all(r.time_ns <= mid.time_ns for r in recs if r.seq <= s.last_seq)
    with pytest.raises(PositionUnavailable, match="before the first record"):  # not an empty tree
        restore(store.factory, "ns", str(tmp_path / "t2"), at="1970-01-02T00:00:00Z")
    assert not (tmp_path / "t2").exists()
    t.close()


def test_restore_refuses_non_empty_target_unless_forced(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store)
    t.create("x")
    t.close()
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("precious")
    with pytest.raises(TargetNotEmpty):
        restore(store.factory, "ns", str(target))
    assert (target / "keep").read_text() == "precious"
    restore(store.factory, "ns", str(target), force=True)
    assert os.listdir(target) == ["x"]


def test_corrupt_byte_verify_names_it_restore_stops_before(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store, segment_bytes=1 << 20)
    t.create("a")
    t.write("a", 0, b"A" * 5000)
    t.create("b")
    t.write("b", 0, b"B" * 5000)
    t.create("c")
    t.sync()
    t.close()
    seg = next(n for n in store.objects if layout.parse_segment_name(n))
    recs = all_records(store)
    victim = next(r for r in recs if isinstance(r.op, Write) and r.op.path == "b")
    store.corrupt(seg, victim.offset + 100)
    rep = verify(store.factory, "ns")
    assert not rep.ok
    (p,) = rep.problems
    assert p.segment == seg and p.start == victim.offset and p.end == victim.offset + victim.size
    with pytest.raises(JournalCorrupt) as ei:
        restore(store.factory, "ns", str(tmp_path / "out"))
    assert ei.value.segment == seg and ei.value.offset == victim.offset
    assert (tmp_path / "out" / "a").read_bytes() == b"A" * 5000
    assert (tmp_path / "out" / "b").read_bytes() == b""  # created, its data record is broken
    assert not (tmp_path / "out" / "c").exists()


def test_snapshot_of_existing_cache_starts_a_generation(tmp_path):
    """Fresh spool, non-empty cache (e.g. after a point-in-time restore): new generation."""
    store = MemStore()
    cache = tmp_path / "cache"
    (cache / "d").mkdir(parents=True)
    (cache / "d" / "big").write_bytes(os.urandom(3 << 20))
    (cache / "empty").write_bytes(b"")
    w, t = make(tmp_path, store)
    t.close()
    recs = all_records(store)
    assert [type(r.op) for r in recs[:7]] == [Create, Mkdir, Create, Write, Write, Write, SnapshotEnd]
    assert all(len(r.op.data) <= 1 << 20 for r in recs if isinstance(r.op, Write))
    restore(store.factory, "ns", str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out")) == tree_state(str(cache))
    w2, t2 = make(tmp_path, store, name="again", cache="cache2")  # empty cache: rebuilt
    assert t2.rebuilt and tree_state(str(tmp_path / "cache2")) == tree_state(str(cache))
    t2.close()


def test_async_barrier_waits_for_the_ready_object_of_a_new_generation(tmp_path):
    """In async mode the records of a new generation can be acked before its ``ready``
    object exists; restore ignores such a generation, so the barrier must also wait for
    ``ready`` (else "durable" would not mean "restorable")."""
    store = MemStore()
    gate = threading.Event()
    orig_client = store.client

    def client():
        c = orig_client()
        append = c.append

        def slow_ready_append(name, offset, data, *, epoch=0):
            if layout.parse_ready_name(name) is not None and layout.parse_ready_name(name) > 1:
                gate.wait(WAIT)  # the replicator is stuck creating gen/<G>/ready
            return append(name, offset, data, epoch=epoch)

        c.append = slow_ready_append
        return c

    store.client = store.factory = client
    w, t = make(tmp_path, store, sync=False, generation_bytes=600, max_backoff=0.05)
    t.create("f")
    t.sync(wait=True)
    store.down = True  # the rotation's records and the next ones then ship in one round
    t.write("f", 0, b"x" * 1000)  # past generation_bytes: the next record starts generation 2
    t.create("g")
    assert w.generation == 2
    store.down = False
    done = threading.Event()
    th = threading.Thread(target=lambda: (w.barrier(timeout=WAIT), done.set()), daemon=True)
    th.start()
    assert not done.wait(1.0), "barrier returned while the new generation had no ready object"
    gate.set()
    assert done.wait(WAIT)
    t.close()
    out = tmp_path / "out"
    restore(store.factory, "ns", str(out))
    assert (out / "f").read_bytes() == b"x" * 1000 and (out / "g").exists()


def test_modes_are_exact_in_the_cache_and_after_restore_whatever_the_umask(tmp_path):
    """The mode given to create/mkdir is what the file gets (a FUSE caller's umask was
    already applied by the kernel); neither the tree's nor restore's umask masks it again."""
    store = MemStore()
    old = os.umask(0o077)
    try:
        w, t = make(tmp_path, store)
        t.mkdir("d", 0o775)
        t.create("d/f", 0o664)
        t.create("d/f", 0o600)  # an existing file keeps its mode (O_TRUNC, as POSIX)
        t.sync()
        cache = t.local_path("")
        assert os.stat(os.path.join(cache, "d")).st_mode & 0o7777 == 0o775
        assert os.stat(os.path.join(cache, "d", "f")).st_mode & 0o7777 == 0o664
        t.close()
        restore(store.factory, "ns", str(tmp_path / "out"))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "out" / "d").st_mode & 0o7777 == 0o775
    assert os.stat(tmp_path / "out" / "d" / "f").st_mode & 0o7777 == 0o664


def test_durable_now_answers_at_once_and_the_listener_hears_every_attempt(tmp_path):
    """What a caller that must not block (the gateway's event loop) relies on: durable_now()
    never waits; False while the replicator works on it, True once acknowledged; and the
    progress listener is called after each attempt, failed ones included."""
    store = MemStore()
    w, t = make(tmp_path, store, max_backoff=0.05)
    heard = threading.Event()
    calls: list[int] = []

    def listener() -> None:
        calls.append(w.acked_seq)
        heard.set()

    w.progress_listener = listener
    t.create("f")
    t.sync()
    assert w.durable_now() is True
    store.down = True
    heard.clear()
    t.write("f", 0, b"a" * 100)
    seq = w.last_seq
    assert w.durable_now(seq) is False  # healthy, shipping: a wait would wait
    assert heard.wait(WAIT)  # a failed attempt is reported too
    assert w.durable_now(seq) is False
    store.down = False
    for _ in range(1000):
        heard.clear()
        if w.durable_now(seq):
            break
        assert heard.wait(WAIT), "the replicator's progress was not reported"
    assert w.durable_now(seq) is True and w.acked_seq >= seq
    assert calls
    t.close()
    assert w.durable_now(seq) is True  # what was durable stays so, as barrier() says
    assert w.durable_now(seq + 1) is None  # closed: only barrier() tells (WriterClosed)


def test_durable_now_leaves_tier_durability_and_the_quota_state_to_barrier(tmp_path):
    store = MemStore()
    w, t = make(tmp_path, store)
    t.create("f")
    w._quota = RuntimeError("over quota")  # the quota state (the replicator's _attempted sets it)
    assert w.durable_now(w.last_seq + 1) is None
    w._quota = None
    assert w.durable_now(w.last_seq + 1) is False
    t.close()
    tier = JournalWriter(store.factory, "ns", str(tmp_path / "spool-tier"), durability="tier")
    assert tier.durable_now(0) is None  # a TIER_WAIT round trip: barrier() in a thread


def test_a_lingering_writer_ships_held_records_in_one_round_when_a_barrier_asks(tmp_path):
    """JournalWriter.linger (the gateway's): records no barrier waits for are held back so
    that those appended meanwhile go in one APPEND round; a barrier, durable_now() and
    close() ship them at once (a linger of an hour here: nothing else would ship them)."""
    store = MemStore()
    w, t = make(tmp_path, store)
    t.create("f")
    t.sync()
    w.linger = 3600.0
    appends = store.calls.count("append")
    for i in range(3):
        t.write("f", i, b"abc"[i : i + 1])
    seq = w.last_seq
    assert w.acked_seq < seq  # held back: nobody waits for them
    w.barrier(seq, timeout=WAIT)  # ships them now (else TimeoutError after WAIT)
    assert store.calls.count("append") == appends + 1  # the three records in one round
    heard = threading.Event()
    w.progress_listener = heard.set
    t.write("f", 3, b"d")
    seq = w.last_seq
    for _ in range(1000):  # the gateway's event loop: durable_now, then the listener
        heard.clear()
        if w.durable_now(seq):
            break
        assert heard.wait(WAIT), "a record durable_now() asked for was held back"
    assert w.durable_now(seq) is True
    t.write("f", 4, b"e")
    t.close()  # ships what is held
    assert_journal_exact(store, w.last_seq)
