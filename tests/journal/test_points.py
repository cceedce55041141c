"""Where a point-in-time restore stops, over the in-memory store (no server).

- ``batch=(Q, N)`` stops right after the record that makes ``Q/commits/N`` exist (Spark's
  commit), whatever the ``spark.batch`` markers say or when they landed: a listener writes
  them asynchronously, possibly after batch N+1 already committed.
- Points the journal does not hold fail with a typed error and leave the target alone:
  no journal at all, a position past the last record, a time before the first record or
  before the oldest generation kept, a batch that never committed or committed before the
  oldest generation kept.
"""

from __future__ import annotations

import json
import os

import pytest

from sos_journal import (
    BatchNotFound,
    JournalCorrupt,
    JournaledTree,
    JournalNotFound,
    JournalWriter,
    PositionUnavailable,
    restore,
)
from sos_journal.format import layout
from sos_journal.format.records import RecordDecoder, SnapshotEnd, encode
from sos_journal.memstore import MemStore
from sos_journal.rebuild.restore import format_time, parse_batch, parse_time, rebuild_cache
from sos_journal.testing import tree_state


def open_tree(tmp_path, store, name="w"):
    w = JournalWriter(store.factory, "ns", str(tmp_path / f"spool-{name}"), generation_bytes=1 << 40)
    return JournaledTree(str(tmp_path / f"cache-{name}"), w, rebuild=rebuild_cache).open()


def rotate(t):
    """Start a new generation now (what the tree does on its own after generation_bytes)."""
    with t._lock:
        t.writer.rotate(t._snapshot_ops())


def atomic_write(t, path, data, *, crc=False):
    """Spark's CheckpointFileManager.createAtomic: temp file, then rename onto ``path``.
    With Hadoop's checksum file system the temp file has a .crc too, which is then renamed
    onto ``.N.crc`` (crc="rename": FileSystem-based) or deleted (crc="delete": FileContext-
    based, Spark's workaround of HADOOP-16255)."""
    d, _, name = path.rpartition("/")
    tmp = f"{d}/.{name}.1b2c.tmp"
    t.create(tmp)
    t.write(tmp, 0, data)
    if crc:
        t.create(f"{d}/..{name}.1b2c.tmp.crc")
        t.write(f"{d}/..{name}.1b2c.tmp.crc", 0, b"crc:" + data)
    t.rename(tmp, path, overwrite=False)
    if crc == "rename":
        t.rename(f"{d}/..{name}.1b2c.tmp.crc", f"{d}/.{name}.crc", overwrite=False)
    elif crc == "delete":
        t.unlink(f"{d}/..{name}.1b2c.tmp.crc")


def marker(t, n, q="q"):
    return t.marker("spark.batch", json.dumps({"checkpoint": q, "query_id": "x", "batch_id": n}).encode())


def batch(t, n, *, crc=False, q="q"):
    """One micro-batch: offsets/N, state, then the commit commits/N."""
    atomic_write(t, f"{q}/offsets/{n}", b"offsets %d" % n, crc=crc)
    atomic_write(t, f"{q}/state/{n}.delta", b"state %d" % n, crc=crc)
    atomic_write(t, f"{q}/commits/{n}", b"v1\n{}%d" % n, crc=crc)


def setup_query(t, q="q"):
    parts = q.split("/")
    for i in range(1, len(parts)):
        t.mkdir("/".join(parts[:i]))
    for d in (q, f"{q}/offsets", f"{q}/state", f"{q}/commits"):
        t.mkdir(d)


def visible(root, sub):
    p = os.path.join(root, "q", sub)
    return sorted(n for n in os.listdir(p) if not n.startswith("."))


@pytest.mark.parametrize("crc", [False, "rename", "delete"])
def test_batch_stops_at_the_commit_not_at_a_late_marker(tmp_path, crc):
    """commits/2 is renamed in BEFORE the marker of batch 1 lands: batch 1 must not bring it."""
    store = MemStore()
    t = open_tree(tmp_path, store)
    setup_query(t)
    batch(t, 0, crc=crc)
    marker(t, 0)
    batch(t, 1, crc=crc)
    batch(t, 2, crc=crc)  # the listener is slow: batch 2 commits first
    marker(t, 1)
    marker(t, 2)
    t.close()
    out = tmp_path / "b1"
    s = restore(store.factory, "ns", str(out), batch="q:1")
    assert visible(out, "commits") == ["0", "1"]
    assert visible(out, "offsets") == ["0", "1"]  # batch 2's offsets came after commits/1
    assert (out / "q" / "commits" / "1").read_bytes() == b"v1\n{}1"
    assert s.stopped
    hidden = sorted(n for n in os.listdir(out / "q" / "commits") if n.startswith("."))
    if crc == "rename":  # the checksum of commits/1 is renamed right after it: part of the commit
        assert (out / "q" / "commits" / ".1.crc").read_bytes() == b"crc:v1\n{}1"
        assert hidden == [".0.crc", ".1.crc"]
    else:  # crc == "delete": the temp checksum is removed right after the rename: part of it too
        assert hidden == []
    assert any("q/commits/1 appears at record" in n for n in s.notes)
    out2 = tmp_path / "b2"
    restore(store.factory, "ns", str(out2), batch=("q", 2))
    assert visible(out2, "commits") == ["0", "1", "2"]
    assert tree_state(str(out2)) == tree_state(t.local_path(""))  # batch 2 is the end (markers aside)


def test_batch_in_the_normal_order_and_without_any_marker(tmp_path):
    store = MemStore()
    t = open_tree(tmp_path, store)
    setup_query(t)
    for n in range(3):
        batch(t, n)
        marker(t, n)
    t.close()
    for n in range(3):
        out = tmp_path / f"b{n}"
        restore(store.factory, "ns", str(out), batch=f"q:{n}")
        assert visible(out, "commits") == [str(i) for i in range(n + 1)]
        assert visible(out, "offsets") == [str(i) for i in range(n + 1)]
    # markers only name things: a journal without them restores to the same points
    store2 = MemStore()
    t2 = open_tree(tmp_path, store2, "nomarkers")
    setup_query(t2)
    for n in range(3):
        batch(t2, n)
    t2.close()
    restore(store2.factory, "ns", str(tmp_path / "nm1"), batch="q:1")
    assert tree_state(str(tmp_path / "nm1")) == tree_state(str(tmp_path / "b1"))


def test_batch_written_in_place_includes_the_writes_that_complete_it(tmp_path):
    """A direct write of commits/N (CREATE, then WRITEs, other records in between)."""
    store = MemStore()
    t = open_tree(tmp_path, store)
    setup_query(t)
    t.create("q/commits/0")
    marker(t, 0)  # a listener that saw the file exist already
    t.write("q/commits/0", 0, b"v1\n")
    t.create("q/other")  # another thread's record in between
    t.write("q/commits/0", 3, b"{}")
    t.write("q/other", 0, b"late")
    atomic_write(t, "q/offsets/1", b"offsets 1")
    t.close()
    out = tmp_path / "b0"
    restore(store.factory, "ns", str(out), batch="q:0")
    assert (out / "q" / "commits" / "0").read_bytes() == b"v1\n{}"
    assert (out / "q" / "other").read_bytes() == b""  # stopped right after the last write of commits/0
    assert visible(out, "offsets") == []


def test_batch_completed_in_the_next_generation(tmp_path):
    """A new generation starts between the rename of commits/0 and that of its .crc."""
    store = MemStore()
    t = open_tree(tmp_path, store)
    setup_query(t)
    atomic_write(t, "q/offsets/0", b"o0")
    t.create("q/commits/.0.tmp")
    t.write("q/commits/.0.tmp", 0, b"c0")
    t.create("q/commits/..0.tmp.crc")
    t.rename("q/commits/.0.tmp", "q/commits/0", overwrite=False)
    rotate(t)
    t.rename("q/commits/..0.tmp.crc", "q/commits/.0.crc", overwrite=False)
    atomic_write(t, "q/offsets/1", b"o1")
    t.close()
    out = tmp_path / "b0"
    restore(store.factory, "ns", str(out), batch="q:0")
    assert (out / "q" / "commits" / ".0.crc").exists()
    assert visible(out, "offsets") == ["0"]


def test_the_last_commit_of_a_batch_wins_and_a_checkpoint_at_the_root(tmp_path):
    store = MemStore()
    t = open_tree(tmp_path, store)
    for d in ("offsets", "commits"):
        t.mkdir(d)
    atomic_write(t, "commits/0", b"first")
    t.create("after-first")
    t.unlink("commits/0")  # the query was reset and ran batch 0 again
    atomic_write(t, "commits/0", b"second")
    t.create("after-second")
    t.close()
    for q in ("", ".", "/"):
        out = tmp_path / f"r{len(os.listdir(tmp_path))}"
        restore(store.factory, "ns", str(out), batch=(q, 0))
        assert (out / "commits" / "0").read_bytes() == b"second"
        assert (out / "after-first").exists() and not (out / "after-second").exists()


def test_batch_not_found_names_what_the_journal_holds(tmp_path):
    store = MemStore()
    t = open_tree(tmp_path, store)
    setup_query(t)
    setup_query(t, "other/chk")
    for n in range(3):
        batch(t, n)
    batch(t, 0, q="other/chk")
    t.create("q/commits/.7.crc")  # not the commit file of batch 7
    t.close()
    with pytest.raises(BatchNotFound, match=r"checkpoint 'q' has no q/commits/7 .*its batches: 0\.\.2"):
        restore(store.factory, "ns", str(tmp_path / "x"), batch="q:7")
    with pytest.raises(BatchNotFound, match=r"no checkpoint 'mnt/q'.*checkpoints found: 'other/chk', 'q'"):
        restore(store.factory, "ns", str(tmp_path / "x"), batch="/mnt/q:1")
    assert not (tmp_path / "x").exists()  # nothing written, not even the target


def test_batch_committed_before_the_oldest_generation_kept(tmp_path):
    store = MemStore()
    t = open_tree(tmp_path, store)
    setup_query(t)
    batch(t, 0)
    rotate(t)
    batch(t, 1)
    t.close()
    restore(store.factory, "ns", str(tmp_path / "ok"), batch="q:0")  # generation 1 is still there
    for name in [n for n in store.objects if n.startswith(layout.gen_prefix(1))]:
        del store.objects[name]  # retention
    with pytest.raises(PositionUnavailable, match="batch 0 of checkpoint 'q' committed before the oldest generation"):
        restore(store.factory, "ns", str(tmp_path / "gone"), batch="q:0")
    assert not (tmp_path / "gone").exists()
    restore(store.factory, "ns", str(tmp_path / "b1"), batch="q:1")
    assert visible(tmp_path / "b1", "commits") == ["0", "1"]


@pytest.mark.parametrize("text", ["q", "q:x", "q:-1", "a/../q:1", "a//q:1"])
def test_bad_batch_arguments(text):
    with pytest.raises(ValueError):
        parse_batch(text)


def test_parse_batch_normalises_querydir():
    assert parse_batch("q:3") == ("q", 3)
    assert parse_batch("/a/b/:07") == ("a/b", 7)
    assert parse_batch("./a:1") == ("a", 1)
    assert parse_batch("host:1/chk:2") == ("host:1/chk", 2)
    assert parse_batch(":0") == ("", 0)


# ---------------------------------------------------------------- nothing to restore
def test_a_namespace_without_journal_is_an_error_and_touches_nothing(tmp_path):
    store = MemStore()
    target = tmp_path / "target"
    with pytest.raises(JournalNotFound, match="namespace 'ns' has no journal"):
        restore(store.factory, "ns", str(target))
    assert not target.exists()
    target.mkdir()
    (target / "keep").write_text("precious")
    with pytest.raises(JournalNotFound):
        restore(store.factory, "ns", str(target), force=True)  # --force does not wipe it for nothing
    assert (target / "keep").read_text() == "precious"
    # a generation whose snapshot never finished (no ready object) is nothing to restore either
    c = store.client()
    c.append(layout.segment_name(1, 1, 1), 0, encode(SnapshotEnd(1), 1, 1))
    with pytest.raises(JournalNotFound, match="no complete generation"):
        restore(store.factory, "ns", str(tmp_path / "t2"))
    # the cache rebuild of a writer is fine with it: an empty tree
    assert rebuild_cache(store.factory, "ns", str(target)) == 0
    assert os.listdir(target) == []


def test_position_past_the_end_fails_and_leaves_nothing(tmp_path):
    store = MemStore()
    t = open_tree(tmp_path, store)
    t.create("a")
    t.create("b")
    last = t.writer.last_seq
    t.close()
    s = restore(store.factory, "ns", str(tmp_path / "end"), position=last)
    assert s.last_seq == last and sorted(os.listdir(tmp_path / "end")) == ["a", "b"]
    with pytest.raises(
        PositionUnavailable, match=f"position {last + 1} is past the end of the journal: the last record is {last}"
    ):
        restore(store.factory, "ns", str(tmp_path / "past"), position=last + 1)
    assert not (tmp_path / "past").exists()
    (tmp_path / "forced").mkdir()
    (tmp_path / "forced" / "old").write_text("x")
    with pytest.raises(PositionUnavailable):
        restore(store.factory, "ns", str(tmp_path / "forced"), position=last + 100, force=True)
    assert os.listdir(tmp_path / "forced") == []


def _records(store):
    out = []
    for name in sorted(n for n in store.objects if layout.parse_segment_name(n)):
        d = RecordDecoder(name)
        d.feed(bytes(store.objects[name]))
        out.extend(d)
    return out


def test_time_before_the_first_record_or_the_oldest_generation(tmp_path):
    store = MemStore()
    t = open_tree(tmp_path, store)
    t.create("a")
    rotate(t)
    t.create("b")
    t.close()
    recs = _records(store)
    first = recs[0].time_ns
    with pytest.raises(
        PositionUnavailable,
        match=r"before the first record of the journal \(generation 1, "
        r"first record at " + format_time(first),
    ):
        restore(store.factory, "ns", str(tmp_path / "early"), at=first - 1)
    assert not (tmp_path / "early").exists()
    s = restore(store.factory, "ns", str(tmp_path / "first"), at=format_time(first))  # exact, to the ns
    assert s.last_seq >= 1
    for name in [n for n in store.objects if n.startswith(layout.gen_prefix(1))]:
        del store.objects[name]
    gen2_first = _records(store)[0].time_ns
    with pytest.raises(
        PositionUnavailable,
        match=r"before the oldest generation the server keeps \(generation 2, "
        r"first record at " + format_time(gen2_first),
    ):
        restore(store.factory, "ns", str(tmp_path / "old"), at=gen2_first - 1)
    s = restore(store.factory, "ns", str(tmp_path / "late"), at="2999-01-01T00:00:00")
    assert sorted(os.listdir(tmp_path / "late")) == ["a", "b"]


def test_time_parsing_is_exact():
    ns = 1_763_900_000_123_456_789
    assert parse_time(format_time(ns)) == ns
    assert format_time(ns) == "2025-11-23T12:13:20.123456789Z"
    assert parse_time("2025-11-23T12:13:20.123456") == ns - 789
    assert parse_time("2025-11-23T13:13:20.1+01:00") == 1_763_900_000_100_000_000
    with pytest.raises(ValueError):
        parse_time("yesterday")


def test_batch_before_a_corrupt_record_still_restores(tmp_path):
    store = MemStore()
    t = open_tree(tmp_path, store)
    setup_query(t)
    batch(t, 0)
    batch(t, 1)
    t.close()
    seg = max(n for n in store.objects if layout.parse_segment_name(n))
    victim = next(r for r in _records(store) if getattr(r.op, "path", "") == "q/offsets/.1.1b2c.tmp")
    store.corrupt(seg, victim.offset + victim.size - 1)  # batch 1's first record
    s = restore(store.factory, "ns", str(tmp_path / "b0"), batch="q:0")
    assert visible(tmp_path / "b0", "commits") == ["0"] and s.stopped
    assert any("corrupt after batch 0 committed" in n for n in s.notes)
    with pytest.raises(JournalCorrupt):  # batch 1 is behind the damage
        restore(store.factory, "ns", str(tmp_path / "b1"), batch="q:1")


def test_position_in_the_range_of_an_abandoned_generation_is_the_end_of_the_one_before(tmp_path):
    """Generation 2 never got its ready object; generation 3 starts after its numbers."""
    store = MemStore()
    t = open_tree(tmp_path, store)
    t.create("a")
    end1 = t.writer.last_seq
    rotate(t)
    t.create("b")
    rotate(t)
    t.close()
    del store.objects[layout.ready_name(2)]
    gen3_first = layout.scan_listing(store.client().list("gen/"))[3].first_seq
    for pos in (end1 + 1, gen3_first - 2):
        s = restore(store.factory, "ns", str(tmp_path / f"p{pos}"), position=pos)
        assert os.listdir(tmp_path / f"p{pos}") == ["a"] and s.last_seq == end1
        assert any("no complete generation holds" in n for n in s.notes)
