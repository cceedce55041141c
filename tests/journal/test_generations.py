"""Issue 9, journal side: generations that do not form one chain (item 3), bytes in the
writer's segments that it did not send (item 4), a private spool (item 15), and the places
protocol.md Part 2 left to guess (position 0, a record cut at a generation's end, records of
a generation without a valid ``ready``).

Each attack runs against a REAL sos-server process; the attacker is another append key of
the same namespace speaking the protocol through ``sos_client.Client``. A few details are
unit-tested over the in-memory store.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
from pathlib import Path

import pytest

from sos_client import Client
from sos_client.errors import Fenced, SOSError
from sos_journal import GenerationBreak, JournaledTree, JournalError, JournalWriter, restore, verify
from sos_journal.format import layout
from sos_journal.format.records import Create, Mkdir, Rename, SnapshotEnd, Write, encode
from sos_journal.memstore import MemStore
from sos_journal.rebuild.restore import chain_breaks, list_generations, rebuild_cache
from sos_journal.testing import tree_state
from tests.journal.support import new_ns
from tests.support import client_factory, run_sos_as

WAIT = 180
T0 = 1_763_900_000_000_000_000
PROTOCOL = Path(__file__).resolve().parents[2] / "protocol.md"
_n = itertools.count()


@pytest.fixture(scope="module")
def sos_server(server):
    """The module's shared server (conftest)."""
    return server


def records(ops, first_seq: int) -> bytes:
    return b"".join(encode(op, first_seq + i, T0 + first_seq + i) for i, op in enumerate(ops))


def publish(
    c,
    generation: int,
    first_seq: int,
    ops,
    *,
    epoch: int = 0,
    ready: bool | None = True,
    tail: bytes = b"",
    seal: bool = False,
) -> int:
    """Write one segment of ``ops`` (+ raw ``tail``) and, if ``ready``, a sealed empty ready
    (``ready=False``: an empty ready left unsealed; None: none). Returns the last seq."""
    name = layout.segment_name(generation, first_seq, epoch)
    if epoch:
        try:  # the server takes appends only at the namespace's fence: hold it first
            c.fence(epoch)
        except Fenced:
            pass  # already there (a FENCE must go up)
    c.append(name, 0, records(ops, first_seq) + tail, epoch=epoch)
    if seal:
        c.seal(name, epoch=epoch)
    if ready is not None:
        c.append(layout.ready_name(generation), 0, b"", epoch=epoch)
        if ready:
            c.seal(layout.ready_name(generation), epoch=epoch)
    return first_seq + len(ops) - 1


def put_file(t: JournaledTree, path: str, data: bytes) -> None:
    t.create(path)
    t.write(path, 0, data)


# ---------------------------------------------------------------- item 3: generations form one chain
def test_forged_far_future_generation_is_refused_by_restore_verify_and_a_new_writer(sos_server, tmp_path):
    ns, key = new_ns(sos_server, "g")
    fac = client_factory(sos_server, ns, key)
    w = JournalWriter(fac, ns, str(tmp_path / "spool"))
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.mkdir("chk")
    put_file(t, "chk/a", b"real-1")
    t.sync(wait=True)
    # the attacker: another append key of the namespace. The server refuses a far-future
    # generation outright (generations grow by one, protocol.md 2.1) ...
    attacker = sos_server.keygen(ns, "append")
    with Client(sos_server.address, attacker, ns, timeout=60) as c:
        with pytest.raises(SOSError, match="generations grow by one"):
            publish(c, layout.MAX_GENERATION, 1, [Create("evil"), SnapshotEnd(layout.MAX_GENERATION)], epoch=w.epoch)
        # ... so it publishes a small complete generation 2 that does not continue generation 1
        # (its snapshot starts at seq 1), with the writer's epoch: the fence lets it through
        publish(c, 2, 1, [Create("evil"), Write("evil", 0, b"attacker"), SnapshotEnd(2)], epoch=w.epoch)
    # the live writer still gets its acks, for records restore must return
    put_file(t, "chk/b", b"acknowledged after the forgery")
    t.sync(wait=True)
    live = tree_state(t.local_path(""))
    t.close()

    target = tmp_path / "out"
    r = run_sos_as(sos_server, key, "restore", "-q", ns, str(target))
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "generation 2 does not continue generation 1" in r.stderr, r.stderr
    assert "nothing written" in r.stderr and "Traceback" not in r.stderr
    assert not target.exists()
    with pytest.raises(GenerationBreak) as ei:
        restore(fac, ns, str(tmp_path / "lib"))
    assert ei.value.generation == 2 and ei.value.previous == 1
    assert not (tmp_path / "lib").exists()

    v = run_sos_as(sos_server, key, "verify", "-q", ns)
    assert v.returncode == 3, (v.returncode, v.stdout, v.stderr)
    assert re.search(r"BROKEN gen/0000000002/\S+ .*does not continue generation 1", v.stdout), v.stdout

    # the way out: the writer's generation alone, with every acknowledged record
    r = run_sos_as(sos_server, key, "restore", "-q", "--generation", "1", ns, str(tmp_path / "gen1"))
    assert r.returncode == 0, r.stderr
    assert "warning: restoring generation 1 alone" in r.stderr
    assert tree_state(str(tmp_path / "gen1")) == live

    # a new writer refuses clearly (it used to die on "generation 10000000000 outside ...")
    w2 = JournalWriter(fac, ns, str(tmp_path / "spool2"))
    with pytest.raises(GenerationBreak, match="refuses to open"):
        JournaledTree(str(tmp_path / "cache2"), w2, rebuild=rebuild_cache).open()
    # and so does the first writer when it comes back on its spool
    w3 = JournalWriter(fac, ns, str(tmp_path / "spool"))
    with pytest.raises(GenerationBreak, match="does not continue generation 1"):
        w3.open()


def test_a_forged_next_generation_breaks_the_chain_once_the_writer_goes_on(sos_server, tmp_path):
    ns, key = new_ns(sos_server, "g")
    fac = client_factory(sos_server, ns, key)
    w = JournalWriter(fac, ns, str(tmp_path / "spool"))
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    put_file(t, "a", b"one")
    t.sync(wait=True)
    end = w.last_seq
    attacker = sos_server.keygen(ns, "append")
    with Client(sos_server.address, attacker, ns, timeout=60) as c:
        # generation 2, numbered and sequenced as the writer's next one would be
        publish(c, 2, end + 1, [Create("evil"), SnapshotEnd(2)], epoch=w.epoch)
    put_file(t, "b", b"two")  # the writer goes on in generation 1
    t.sync(wait=True)
    live = tree_state(t.local_path(""))
    last = w.last_seq
    # when it starts generation 2 itself, it finds the foreign objects there and stops
    with pytest.raises(JournalError, match="generation 2 that this writer starts already holds"):
        w.rotate([Create("a"), Write("a", 0, b"one"), Create("b"), Write("b", 0, b"two")])
    t.close()

    with pytest.raises(GenerationBreak) as ei:
        restore(fac, ns, str(tmp_path / "out"))
    assert f"generation 2 does not continue generation 1: it starts with record {end + 1}" in str(
        ei.value
    ) and f"generation 1 ends with record {last}" in str(ei.value), str(ei.value)
    rep = verify(fac, ns)
    assert not rep.ok and any("does not continue generation 1" in p.message for p in rep.problems), rep.text()
    s = restore(fac, ns, str(tmp_path / "gen1"), generation=1)
    assert tree_state(str(tmp_path / "gen1")) == live and s.warnings


def test_a_writer_does_not_start_a_generation_someone_else_already_wrote_into(tmp_path):
    store = MemStore()
    w = JournalWriter(store.factory, "ns", str(tmp_path / "spool"))
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.create("a")
    t.sync(wait=True)
    c = store.client()  # a ready planted for the next generation (issue 9 item 2's names)
    c.append(layout.ready_name(2), 0, b"", epoch=w.epoch)
    c.seal(layout.ready_name(2), epoch=w.epoch)
    with pytest.raises(JournalError, match="already holds gen/0000000002/ready"):
        w.rotate([Create("a")])
    t.close()


def _store_with(generations):
    """A MemStore holding {generation: (first_seq, ops, ready)} (ready: True sealed, False
    unsealed, None none, bytes: a ready holding those bytes)."""
    store = MemStore()
    c = store.client()
    c.fence(1)  # appends carry the fence's epoch, as on the server
    for g, (first, ops, ready) in generations.items():
        name = layout.segment_name(g, first, 1)
        c.append(name, 0, records(ops, first), epoch=1)
        c.seal(name, epoch=1)
        if ready is not None:
            c.append(layout.ready_name(g), 0, ready if isinstance(ready, bytes) else b"", epoch=1)
            if ready is not False:
                c.seal(layout.ready_name(g), epoch=1)
    return store


def _breaks(store):
    c = store.client()
    return [str(b) for b in chain_breaks(c, list_generations(c))]


def test_chain_breaks_unit():
    g1 = (1, [SnapshotEnd(1), Create("a")], True)  # records 1..2
    assert _breaks(_store_with({1: g1, 2: (3, [SnapshotEnd(2)], True)})) == []
    # a gap in the numbers; a first record that is not the one after the previous end
    assert "expected generation 2" in _breaks(_store_with({1: g1, 3: (3, [SnapshotEnd(3)], True)}))[0]
    assert "starts with record 5" in _breaks(_store_with({1: g1, 2: (5, [SnapshotEnd(2)], True)}))[0]
    assert "starts with record 1" in _breaks(_store_with({1: g1, 2: (1, [SnapshotEnd(2)], True)}))[0]
    # generation 0; a ready without segments above the oldest generation (not below it)
    assert "start at 1" in _breaks(_store_with({0: (1, [SnapshotEnd(0)], True), 1: (2, [SnapshotEnd(1)], True)}))[0]
    store = _store_with({5: (10, [SnapshotEnd(5)], True)})
    c = store.client()
    c.append(layout.ready_name(4), 0, b"", epoch=1)  # what a retention stopped halfway leaves
    assert _breaks(store) == []
    c.append(layout.ready_name(9999), 0, b"", epoch=1)
    assert _breaks(store) == ["generation 9999 has a ready object but no segment: no writer wrote that generation"]


def test_the_last_generation_number_is_refused_clearly_not_a_crash(tmp_path):
    g = layout.MAX_GENERATION
    store = _store_with({g: (1, [SnapshotEnd(g)], True)})
    w = JournalWriter(store.factory, "ns", str(tmp_path / "spool"))
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    assert w.generation == g
    t.create("x")
    with pytest.raises(JournalError, match="last one a segment name can hold"):
        w.rotate([])
    t.close()


# ---------------------------------------------------------------- ready: empty and sealed
def test_a_ready_holding_bytes_does_not_complete_a_generation_and_stops_the_writer(tmp_path):
    store = MemStore()
    w = JournalWriter(store.factory, "ns", str(tmp_path / "spool"))
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.create("a")
    w.rotate([Create("a")])
    t.close()
    # as if the writer had died before creating gen 2's ready, and someone else made one
    ready = layout.ready_name(2)
    store.sealed.discard(ready)
    store.objects[ready] = bytearray(b"x")
    gens = list_generations(store.client())
    assert gens[1].ready and not gens[2].ready and "holds 1 bytes" in gens[2].ready_problem
    w = JournalWriter(store.factory, "ns", str(tmp_path / "spool"))
    t = JournaledTree(
        str(tmp_path / "cache"), w, rebuild=rebuild_cache
    ).open()  # resumes on its spool: creates the missing ready
    with pytest.raises(JournalError, match="ready object is empty"):
        t.sync(wait=True)
    t.close()
    assert not list_generations(store.client())[2].ready


def test_a_writer_seals_an_empty_ready_its_predecessor_left_unsealed(tmp_path):
    store = MemStore()
    w = JournalWriter(store.factory, "ns", str(tmp_path / "spool"))
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.create("a")
    t.close()
    store.sealed.discard(layout.ready_name(1))  # as if its writer died between APPEND and SEAL
    assert not list_generations(store.client())[1].ready
    w = JournalWriter(store.factory, "ns", str(tmp_path / "spool2"))  # without the spool that knew
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.create("b")
    t.sync(wait=True)
    t.close()
    assert layout.ready_name(1) in store.sealed
    assert verify(store.factory, "ns").ok


# ---------------------------------------------------------------- item 4: foreign bytes
def test_writer_does_not_count_a_foreign_segment_as_its_own(sos_server, tmp_path):
    ns, key = new_ns(sos_server, "f")
    fac = client_factory(sos_server, ns, key)
    # segment_bytes=1: every record opens a segment, so its name is known in advance
    w = JournalWriter(fac, ns, str(tmp_path / "spool"), segment_bytes=1)
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.create("f")
    t.sync(wait=True)
    seq = w.last_seq + 1
    name = layout.segment_name(w.generation, seq, w.epoch)
    real, forged = b"real data!", b"FORGED!!!!"
    attacker = sos_server.keygen(ns, "append")
    with Client(sos_server.address, attacker, ns, timeout=60) as c:
        c.append(name, 0, encode(Write("f", 0, forged), seq, T0), epoch=w.epoch)  # same length
    t.write("f", 0, real)
    assert len(encode(Write("f", 0, real), seq, T0)) == len(encode(Write("f", 0, forged), seq, T0))
    with pytest.raises(JournalError, match="did not send them"):
        t.sync(wait=True)  # used to return: the forged record counted as the writer's
    assert w.acked_seq < seq
    t.close()


def test_writer_does_not_count_foreign_bytes_after_an_offset_mismatch(tmp_path):
    store = MemStore()
    w = JournalWriter(store.factory, "ns", str(tmp_path / "spool"), sync=False)
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.create("f")
    t.sync(wait=True)
    seg = w._cur.name
    at = len(store.objects[seg])
    store.down = True  # the replicator cannot ship the next record...
    t.write("f", 0, b"real data!")
    # ...while someone else appends a record of the same length where it will go
    store.objects[seg] += encode(Write("f", 0, b"FORGED!!!!"), w.last_seq, T0)
    assert len(store.objects[seg]) - at == w._cur.written - at
    store.down = False
    with pytest.raises(JournalError, match="did not send them"):
        w.barrier(timeout=WAIT)
    assert w.acked_seq < w.last_seq
    t.close()


def test_writer_resumes_on_its_own_bytes_after_a_lost_ack(tmp_path):
    """The comparison accepts what the writer did send (an ack lost, then a STAT)."""
    store = MemStore()
    w = JournalWriter(store.factory, "ns", str(tmp_path / "spool"), segment_bytes=200)
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    store.fail_appends = 2  # two appends land but their acks are lost
    for i in range(6):
        put_file(t, f"f{i}", bytes([i]) * 90)
    t.sync(wait=True)
    live = tree_state(t.local_path(""))
    t.close()
    restore(store.factory, "ns", str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out")) == live


# ---------------------------------------------------------------- item 15: a private spool
def test_spool_files_are_0600_in_0700_directories_whatever_the_umask(sos_server, tmp_path):
    ns, key = new_ns(sos_server, "p")
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o777)
    old = os.umask(0)
    try:
        os.chmod(spool, 0o777)
        w = JournalWriter(client_factory(sos_server, ns, key), ns, str(spool), segment_bytes=300, sync=False)
        t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
        t.create("secret", 0o600)
        t.write("secret", 0, b"s" * 1000)
        w.rotate([Create("secret", 0o600), Write("secret", 0, b"s" * 1000)])  # a snapshot_end file
        names = set()
        for root, _dirs, files in os.walk(spool):
            assert stat.S_IMODE(os.stat(root).st_mode) == 0o700, root
            for f in files:
                try:  # the replicator removes segments once sealed
                    mode = stat.S_IMODE(os.lstat(os.path.join(root, f)).st_mode)
                except FileNotFoundError:
                    continue
                assert mode == 0o600, (root, f, oct(mode))
                names.add(f)
        assert {"LOCK", "tree-dirty", "snapshot_end"} <= names and any(n.endswith(".seg") for n in names)
        t.close()
    finally:
        os.umask(old)


# ---------------------------------------------------------------- spec: position 0
def test_position_0_is_the_first_snapshot_and_the_spec_says_so(sos_server, tmp_path):
    ns, key = new_ns(sos_server, "z")
    fac = client_factory(sos_server, ns, key)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "pre").write_bytes(b"there before the namespace")
    w = JournalWriter(fac, ns, str(tmp_path / "spool"))
    t = JournaledTree(str(cache), w, rebuild=rebuild_cache).open()
    first = tree_state(str(cache))
    end_of_snapshot = w.last_seq  # CREATE, WRITE, SNAPSHOT_END(1)
    assert end_of_snapshot == 3
    t.create("later")
    t.close()
    for n in range(end_of_snapshot + 1):
        restore(fac, ns, str(tmp_path / f"p{n}"), position=n)
        assert tree_state(str(tmp_path / f"p{n}")) == first, n
    section = " ".join(PROTOCOL.read_text().split("## 2.1 Objects")[1].split("## 2.2")[0].split())
    assert "position 0 is the empty tree" not in section
    assert "Position 0 is therefore the tree generation 1's snapshot holds" in section


# ---------------------------------------------------------------- spec: a record cut at a generation's end
def test_a_record_cut_at_the_end_of_a_generation_continued_by_the_next_one(sos_server, tmp_path):
    ns, key = new_ns(sos_server, "c")
    cut = encode(Write("a", 0, b"two"), 7, T0 + 7)
    g1 = [SnapshotEnd(1), Mkdir("q"), Mkdir("q/commits"), Create("q/commits/0"), Create("a"), Write("a", 0, b"one")]
    with Client(sos_server.address, key, ns, timeout=60) as c:
        # generation 1 ends inside record 7 (its writer died mid-append; the next one sealed it)
        publish(c, 1, 1, g1, tail=cut[:20], seal=True, epoch=1)
        # generation 2 starts with record 7, the one that was cut
        publish(
            c,
            2,
            7,
            [
                Mkdir("q"),
                Mkdir("q/commits"),
                Create("q/commits/0"),
                Create("a"),
                Write("a", 0, b"one"),
                SnapshotEnd(2),
                Write("a", 0, b"two"),
            ],
            epoch=2,
        )
    v = run_sos_as(sos_server, key, "verify", "-q", ns)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "abandoned partial record at offset" in v.stdout and "generation 2 starts with record 7" in v.stdout
    # batch 0 committed in generation 1: finding it reads generation 1 to its end, cut record included
    r = run_sos_as(sos_server, key, "restore", "-q", "--batch", "q:0", ns, str(tmp_path / "b0"))
    assert r.returncode == 0 and "restored to position 4" in r.stderr, r.stderr
    assert "corrupt" not in r.stderr
    r = run_sos_as(sos_server, key, "restore", "-q", ns, str(tmp_path / "all"))
    assert r.returncode == 0 and (tmp_path / "all" / "a").read_bytes() == b"two", r.stderr
    # generation 1 read to its end stops before the dead bytes
    r = run_sos_as(sos_server, key, "restore", "-q", "--generation", "1", ns, str(tmp_path / "g1"))
    assert r.returncode == 0 and (tmp_path / "g1" / "a").read_bytes() == b"one", r.stderr
    assert "abandoned partial record" in r.stderr
    # the same cut record followed by a generation that starts elsewhere: corrupt, and a break
    ns2, key2 = new_ns(sos_server, "c")
    with Client(sos_server.address, key2, ns2, timeout=60) as c:
        publish(c, 1, 1, g1, tail=cut[:20], seal=True, epoch=1)
        publish(c, 2, 8, [Create("a"), SnapshotEnd(2)], epoch=2)
    v = run_sos_as(sos_server, key2, "verify", "-q", ns2)
    assert v.returncode == 3 and "segment ends inside a record" in v.stdout, v.stdout
    assert "does not continue generation 1" in v.stdout


# ---------------------------------------------------------------- spec: records before ready
@pytest.mark.parametrize("ready", [None, False], ids=["no-ready", "unsealed-ready"])
def test_records_of_a_generation_without_a_sealed_ready_are_announced_not_silently_dropped(sos_server, tmp_path, ready):
    ns, key = new_ns(sos_server, "r")
    with Client(sos_server.address, key, ns, timeout=60) as c:
        publish(c, 1, 1, [SnapshotEnd(1), Mkdir("q"), Mkdir("q/commits")], epoch=1)
        # generation 2: its snapshot, then Spark's commit of batch 0 -- but no (sealed) ready
        publish(
            c,
            2,
            4,
            [
                Mkdir("q"),
                Mkdir("q/commits"),
                SnapshotEnd(2),
                Create("q/commits/.0.tmp"),
                Rename("q/commits/.0.tmp", "q/commits/0", False),
            ],
            epoch=1,
            ready=ready,
        )
    r = run_sos_as(sos_server, key, "restore", "-q", ns, str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert tree_state(str(tmp_path / "out")) == {"q": "<dir>", "q/commits": "<dir>"}  # generation 1
    assert "warning: generation 2 is not complete" in r.stderr and "from record 4 on" in r.stderr, r.stderr
    b = run_sos_as(sos_server, key, "restore", "-q", "--batch", "q:0", ns, str(tmp_path / "batch"))
    assert b.returncode == 1, b.stderr
    assert "q/commits/0 appears at record 8, in generation 2, which is not complete" in b.stderr, b.stderr
    assert not (tmp_path / "batch").exists()
    v = run_sos_as(sos_server, key, "verify", "-q", ns)
    assert v.returncode == 0, v.stdout
    assert "WARNING generation 2 is not complete but holds records 7..8 after its SNAPSHOT_END" in v.stdout, v.stdout
