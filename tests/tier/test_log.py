"""The bucket as a batched log (issue 29, protocol.md 4.2a, 4.3a, 4.3b):

- one flushed object per flush holds every namespace's new bytes, with its index; readers
  take its entries as pieces (restore, verify, scan), alone or next to per-object pieces;
- compaction rewrites them into per-object pieces, then deletes them; the server killed at
  each step (after a flush landed, after compaction wrote its pieces, after it deleted the
  flushed objects) loses nothing and no reader gets a byte twice;
- a damaged index is reported by its key and never read; a bucket of the previous layout (per
  object pieces only) still reads (tests/tier/test_layout.py, test_restore.py);
- PUTs: one per flush for many namespaces and waiters at once, released together.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from sos_tier import LocalStore, open_store, read_object, scan
from sos_tier.log import LOG_PREFIX, decode_batch, encode_batch, log_key
from sos_tier.uploader import CRASH_ENV, FlushItem, Uploader
from sos_wire import events as ev
from sos_wire.crc import crc32c
from tests.support import protocol_part, scrape, wait_for
from tests.tier.support import bucket, bucket_sos, login, tier_wait

pytest_plugins = ["tests.tier.support"]


@pytest.fixture
def store(tmp_path):
    s = LocalStore((tmp_path / "bucket").as_uri())
    yield s
    s.close()


def _items(data: dict[tuple[str, str], bytes], sealed: frozenset = frozenset()) -> list[FlushItem]:
    return [
        FlushItem(ns, name, (lambda b, e, d=body: d[b:e]), len(body), (ns, name) in sealed, 7 if sealed else None)
        for (ns, name), body in data.items()
    ]


def _log_keys(store) -> list[str]:
    return [k.key for k in store.list(LOG_PREFIX)]


def test_one_flushed_object_holds_every_namespace_and_readers_find_it(store):
    data = {
        ("a", "seg"): b"x" * 5000,
        ("a", "gen/1/ready"): b"",
        ("b", "lease"): b"owner 1\n",
        ("c", "/".join(["n" * 200] * 4)): b"L",
    }
    u = Uploader(store)
    res = u.flush(_items(data, frozenset({("a", "gen/1/ready")})))
    assert res.key is not None and res.objects == 4 and res.bytes == 5009
    assert _log_keys(store) == [res.key]  # ONE object, whatever the number of namespaces
    assert not list(store.list("v1/ns/"))  # nothing per object yet (a long name needs no name key)
    states = scan(store, verify=True)
    assert sorted(states) == ["a", "b", "c"]
    for (ns, name), body in data.items():
        obj = states[ns].objects[name]
        assert obj.exists and obj.length == len(body) and states[ns].all_problems() == []
        assert read_object(store, ns, name) == body
    assert states["a"].objects["gen/1/ready"].sealed
    # a second flush carries only what is new
    data[("b", "lease")] += b"owner 2\n"
    res2 = u.flush(_items(data))
    assert res2.objects == 1 and res2.bytes == 8
    assert read_object(store, "b", "lease") == b"owner 1\nowner 2\n"
    assert u.flush(_items(data)).key is None  # nothing new: no PUT


def test_compaction_rewrites_into_pieces_then_deletes_and_both_read_once(store):
    data = {("a", "seg"): b"", ("b", "seg"): b""}
    u = Uploader(store)
    for i in range(30):  # thirty flushes of small appends
        for k in data:
            data[k] += f"record {i} of {k[0]}\n".encode()
        u.flush(_items(data))
    assert len(_log_keys(store)) == 30
    batches, bad = u.flushed_objects()
    assert bad == {} and len(batches) == 30
    # step 1 alone (pieces written, flushed objects kept): a reader finds both, reads each byte once
    for k, body in data.items():
        u.sync(k[0], k[1], lambda b, e, d=body: d[b:e], len(body))
    states = scan(store, verify=True)
    for (ns, name), body in data.items():
        assert states[ns].all_problems() == []
        assert read_object(store, ns, name) == body
        assert not states[ns].objects[name].pieces[0].flushed  # ties go to the per-object piece
    res = u.compact(batches, {(it.namespace, it.name): it for it in _items(data)})
    assert res.deleted == 30 and res.left == {}
    assert _log_keys(store) == []
    for (ns, name), body in data.items():
        assert read_object(store, ns, name) == body
        assert len(scan(store, ns)[ns].objects[name].pieces) == 1


def test_a_foreign_flushed_object_with_other_bytes_stays(store):
    # another process flushed "a/seg" with bytes this server does not hold: never deleted
    other = Uploader(store)
    other.flush(_items({("a", "seg"): b"zombie bytes"}))
    mine = Uploader(store)
    batches, _ = mine.flushed_objects()
    res = mine.compact(batches, {(i.namespace, i.name): i for i in _items({("a", "seg"): b"server bytes"})})
    assert res.deleted == 0 and list(res.left) == [batches[0].key]
    assert len(_log_keys(store)) == 1
    problems = scan(store, "a", verify=True)["a"].all_problems()
    assert [p.kind for p in problems] == ["conflict"]  # two histories: reported, never chosen


@pytest.mark.parametrize(
    "clobber",
    [
        lambda b: b"XXXXXXXX" + b[8:],  # not a flushed object's head
        lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:],  # the index fails its CRC32C
        lambda b: b[:-3],  # entries outside the object
    ],
)
def test_a_damaged_index_is_reported_by_its_key_and_never_read(store, tmp_path, clobber):
    body, _ = encode_batch([("a", "seg", 0, b"hello world")], [])
    key = log_key(1, "00" * 8)
    path = tmp_path / "bucket" / key
    path.parent.mkdir(parents=True)
    path.write_bytes(clobber(body))
    st = scan(store, "a").get("a")
    assert st is not None and "seg" not in st.objects
    assert [(p.kind, p.key) for p in st.all_problems()] == [("damage", key)]


def test_the_index_format_of_protocol_4_2a():
    body, entries = encode_batch([("job1", "gen/1/seg", 200, b"abc"), ("job1", "e", 0, b"")], [("job1", "r", 0, None)])
    n = int.from_bytes(body[8:12], "big")
    index = body[16 : 16 + n]
    assert body[:8] == b"SOSLOG1\n" and int.from_bytes(body[12:16], "big") == crc32c(index)
    crc = crc32c(b"abc")
    assert index == (
        b'{"entries":[["job1","gen/1/seg",200,203,%d,0],["job1","e",0,0,0,3]],"seals":[["job1","r",0,null]]}' % crc
    )
    assert body[16 + n :] == b"abc"
    b = decode_batch(log_key(5, "ab" * 8), body)
    assert b.entries[0].at == 16 + n and b.seals[0].length == 0


# ---------------------------------------------------------------------------------------------
# the server


def _restart(srv, point: str | None) -> None:
    if point is None:
        os.environ.pop(CRASH_ENV, None)
    else:
        os.environ[CRASH_ENV] = point
    try:
        srv.start()
    finally:
        os.environ.pop(CRASH_ENV, None)


def _append_and_wait(c, name: str, body: bytes, at: int) -> int:
    r = c.append(name, at, body, epoch=1)
    assert isinstance(r, ev.AppendOk), r
    return r.length


@pytest.mark.slow
@pytest.mark.parametrize("point", ["flushed", "compacted", "deleted"])
def test_server_killed_at_each_step_loses_nothing_and_reads_nothing_twice(sos_server_factory, new_bucket, point):
    url = new_bucket()
    args = ["--tier", url, "--tier-compact", "1s"]
    srv = sos_server_factory(args=args, start=False)
    _restart(srv, point)
    want: dict[str, bytes] = {"seg": b"", "lease": b""}
    try:
        with login(srv, "crash") as c:
            assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
            for i in range(20):
                for name in want:
                    body = f"{name} {i}\n".encode()
                    _append_and_wait(c, name, body, len(want[name]))
                    want[name] += body
                r = tier_wait(c, "seg", len(want["seg"]), 5_000)
                if not isinstance(r, ev.TierWaitOk):
                    break
                time.sleep(0.1)
    except (EOFError, OSError):
        pass  # the crash point ended the server under us
    wait_for(lambda: not srv.alive(), what=f"the server to stop at the crash point {point}")
    _restart(srv, None)
    with login(srv, "crash") as c:
        for name in want:
            length = c.stat(name).length
            assert length >= 1 and c.read(name).startswith(want[name][:length])
            r = tier_wait(c, name, length, 60_000)
            assert isinstance(r, ev.TierWaitOk) and r.tiered == length, r
            want[name] = c.read(name)
    store_ = open_store(url)
    try:
        state = bucket(url, "crash")
        assert state.all_problems() == []
        for name, body in want.items():
            # while the restarted server compacts: every byte once, the server's bytes (a read
            # listing a flushed object and the piece compacted from it, both of one range,
            # once took them for a conflict and ended there)
            assert read_object(store_, "crash", name) == body
        wait_for(lambda: not _log_keys(store_), what="compaction to delete every flushed object")
        for name, body in want.items():
            assert read_object(store_, "crash", name) == body
    finally:
        store_.close()


@pytest.mark.slow
def test_one_flush_releases_every_waiter_and_puts_follow_the_flush_cadence(sos_server_factory, new_bucket):
    url = new_bucket()
    flush = 0.25
    srv = sos_server_factory(args=["--tier", url, "--tier-flush", f"{flush}s", "--tier-compact", "1h"])
    spaces = [f"ns{i}" for i in range(12)]
    results: dict[str, int] = {}

    clients = {ns: login(srv, ns) for ns in spaces}  # logged in one by one (the unauthenticated bound)

    def query(ns: str) -> None:
        c = clients[ns]
        n = 0
        for i in range(7):  # a barrier per batch
            n = _append_and_wait(c, "seg", b"batch %d\n" % i, n)
            w = tier_wait(c, "seg", n, 30_000)
            assert isinstance(w, ev.TierWaitOk), w
        results[ns] = n

    for c in clients.values():
        assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
    before = scrape(srv.metrics_address).get("sos_tier_flushes_total", 0.0)
    t0 = time.monotonic()
    threads = [threading.Thread(target=query, args=(ns,)) for ns in spaces]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    elapsed = time.monotonic() - t0
    for c in clients.values():
        c.close()
    assert len(results) == len(spaces)
    flushes = scrape(srv.metrics_address)["sos_tier_flushes_total"] - before
    # 12 namespaces x 7 barriers = 84 waits; at most one flush per --tier-flush sustained, plus
    # the token bucket's 3 saved slots (protocol.md 4.3a item 2) and one in flight at the start
    assert flushes <= elapsed / flush + 3 + 1, (flushes, elapsed)
    assert flushes < 84
    for ns in spaces:
        assert bucket(url, ns).objects["seg"].length == results[ns]


@pytest.mark.slow
def test_compaction_puts_share_the_flush_cadence_on_a_loaded_server(sos_server_factory, new_bucket):
    """protocol.md 4.3b: compaction's PUTs spend the flushes' slots, so a server that flushes
    at every slot and compacts beside it still makes at most one PUT per --tier-flush
    sustained (plus the saved slots), and compaction makes progress all the same."""
    url = new_bucket()
    flush = 0.2
    srv = sos_server_factory(args=["--tier", url, "--tier-flush", f"{flush}s", "--tier-compact", "1s"])
    spaces = [f"ns{i}" for i in range(8)]
    clients = {ns: login(srv, ns) for ns in spaces}
    for c in clients.values():
        assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
    stop = time.monotonic() + 6.0 + 1.5
    errors: list[object] = []

    def query(ns: str) -> None:  # every object grows and waits for the bucket, back to back
        c, n, i = clients[ns], {"a": 0, "b": 0}, 0
        while time.monotonic() < stop:
            name = "ab"[i % 2]
            n[name] = _append_and_wait(c, name, b"batch %d\n" % i, n[name])
            w = tier_wait(c, name, n[name], 30_000)
            if not isinstance(w, ev.TierWaitOk):
                errors.append(w)
            i += 1

    def counts() -> tuple[float, float, float]:
        m = scrape(srv.metrics_address)
        return (
            m.get('sos_tier_requests_total{op="put"}', 0.0),
            m.get("sos_tier_flushes_total", 0.0),
            m.get("sos_tier_compacted_flushes_total", 0.0),
        )

    time.sleep(1.5)  # the first compaction pass is due inside the window
    (puts0, flushes0, compacted0), t0 = counts(), time.monotonic()
    threads = [threading.Thread(target=query, args=(ns,)) for ns in spaces]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    (puts1, flushes1, _), elapsed = counts(), time.monotonic() - t0
    for c in clients.values():
        c.close()
    assert errors == []
    assert scrape(srv.metrics_address).get("sos_tier_upload_errors_total", 0.0) == 0.0  # no failed PUT
    # depth 3 saved slots, one flush in flight at the start, and the scrapes' own timing
    assert puts1 - puts0 <= elapsed / flush + 3 + 2, (puts1 - puts0, elapsed)
    # compaction PUTs under the load (no fence marker in the window; one flush PUT may be in
    # flight at the scrape: counted as a PUT, not yet as a flush)
    assert (puts1 - puts0) - (flushes1 - flushes0) >= 2, "no compaction PUT under load"
    # and the pass ends: the flushed objects it rewrote are deleted
    wait_for(lambda: counts()[2] > compacted0, timeout=60, what="a compaction pass to finish")


# ---------------------------------------------------------------------------------------------
# restore and verify (item 3): a bucket of flushed objects, then partly compacted


def _flush_in_rounds(store, ns: str, objects: dict[str, tuple[bytes, bool]], step: int) -> Uploader:
    """What a flushing server would have written: every object grown by *step* bytes a flush."""
    up = Uploader(store)
    longest = max(len(d) for d, _ in objects.values())
    for upto in [*range(step, longest, step), longest]:
        items = [
            FlushItem(
                ns, n, (lambda b, e, d=d: d[b:e]), min(upto, len(d)), sealed and upto >= len(d), 1 if sealed else None
            )
            for n, (d, sealed) in objects.items()
        ]
        up.flush(items)
    return up


def test_restore_and_verify_read_flushed_objects_alone_and_next_to_pieces(journal, tmp_path):

    j = journal
    root = tmp_path / "bucket"
    store = LocalStore(root.as_uri())
    try:
        up = _flush_in_rounds(store, j.ns, j.objects, 700)
        assert not list(store.list("v1/ns/")) and len(_log_keys(store)) > 3  # flushed objects only

        def restored(label: str) -> dict:
            out = tmp_path / label
            r = bucket_sos("restore", "-q", j.ns, str(out), "--from", root.as_uri())
            assert r.returncode == 0, r.stderr
            v = bucket_sos("verify", "-q", j.ns, "--from", root.as_uri())
            assert v.returncode == 0 and v.stdout.splitlines()[0].endswith(": OK"), v.stdout + v.stderr
            from sos_journal.testing import tree_state

            return tree_state(str(out))

        assert restored("flushed") == j.points["latest"]
        # half compacted: pieces written for every object, half the flushed objects deleted
        batches, _ = up.flushed_objects()
        local = {
            (j.ns, n): FlushItem(j.ns, n, (lambda b, e, d=d: d[b:e]), len(d), s, 1 if s else None)
            for n, (d, s) in j.objects.items()
        }
        res = up.compact(batches[: len(batches) // 2], local)
        assert res.deleted == len(batches) // 2 and res.left == {}
        assert list(store.list("v1/ns/")) and _log_keys(store)  # both
        assert restored("both") == j.points["latest"]
        res = up.compact(up.flushed_objects()[0], local)
        assert _log_keys(store) == []
        assert restored("compacted") == j.points["latest"]
    finally:
        store.close()


def test_pieces_per_object_stay_bounded_under_many_small_flushes_and_compactions(store):
    """A lease renewed every second, compacted every 10 s: pieces per object bounded."""
    body = b""
    up = Uploader(store)
    for i in range(120):  # compaction passes (20 minutes of a lease renewed every second)
        for _ in range(10):  # flushes per pass
            body += b"lease renewed by gateway-a at %08d\n" % i
            up.flush(_items({("gw", "lease"): body}))
        up.compact(up.flushed_objects()[0], {("gw", "lease"): _items({("gw", "lease"): body})[0]})
    obj = scan(store, "gw")["gw"].objects["lease"]
    assert obj.length == len(body) and _log_keys(store) == []
    assert len(obj.pieces) <= 20 and len(obj.pieces) + len(obj.extra) <= 20, len(obj.pieces)
    assert read_object(store, "gw", "lease") == body


def test_protocol_worked_example_with_flushed_objects(tmp_path):
    """protocol.md 4.7's second listing: the same history as two flushed objects."""
    seg_hex = protocol_part("## 2.4 Worked example").split("```hex", 1)[1].split("```", 1)[0]
    segment = bytes.fromhex("".join(line.split("#", 1)[0] for line in seg_hex.splitlines()).replace(" ", ""))
    part = protocol_part("## 4.7 Worked example")
    listing = part.split("```")[3].split()
    doc_index = next(line for line in part.splitlines() if line.startswith('`{"entries"')).strip("`")
    seg, ready = "gen/0000000001/0000000001-0000000001.seg", "gen/0000000001/ready"
    first, _ = encode_batch(
        [("job1", seg, 0, segment[:200]), ("job1", ready, 0, b"")], [("job1", ready, 0, 1763900000000000000)]
    )
    assert first[16 : 16 + int.from_bytes(first[8:12], "big")].decode() == doc_index
    second, entries = encode_batch([("job1", seg, 200, segment[200:])], [])
    assert entries[0][4] == 0x6BF8F009
    store = LocalStore((tmp_path / "bucket").as_uri())
    from sos_tier.layout import fence_content

    logs = [k for k in listing if k.startswith("v1/log/")]
    for key in listing:
        body = {logs[0]: first, logs[1]: second}.get(key, fence_content("job1", 1))
        store.put_once(key, body)
    state = scan(store, verify=True)["job1"]
    assert state.fence == 1 and not state.all_problems()
    assert state.objects[seg].length == 261 and not state.objects[seg].sealed
    assert state.objects[ready].sealed and state.objects[ready].length == 0
    assert read_object(store, "job1", seg) == segment


def test_one_listing_of_the_fence_copies_names_every_namespace_taken_over(store):
    from sos_tier import TierFenced

    a, b = Uploader(store), Uploader(store)
    for ns in ("n1", "n2", "n3"):
        a.check_fence(ns, 1, strict=True)  # the marker and its copy under v1/fence/
    assert sorted(k.key for k in store.list("v1/fence/")) == [f"v1/fence/{ns}/{1:016x}" for ns in ("n1", "n2", "n3")]
    assert a.fences_above({"n1": 1, "n2": 1, "n3": 1}) == set()
    b.check_fence("n2", 2, strict=True)  # another server took n2 over
    assert a.fences_above({"n1": 1, "n2": 1, "n3": 1}) == {"n2"}
    with pytest.raises(TierFenced):
        a.check_fence("n2", 1)
    # a copy alone (planted: no marker of its own) is never obeyed
    store.put_once(f"v1/fence/n3/{5:016x}", b'{"epoch":5,"namespace":"n3"}')
    assert a.fences_above({"n3": 1}) == {"n3"}
    a.check_fence("n3", 1)  # compares n3's own markers: none above 1, goes on


# ---------------------------------------------------------------------------------------------
# the zombie's bound (protocol.md 4.3a, 4.5): a real Tier on a real directory store and a real
# data directory; the listing of v1/fence/ runs beside a flush's PUT and gates the next flush


def _zombie_flushes(tmp_path, fence_fresh: float) -> tuple[list[int], str | None, list]:
    """A server at fence 1 flushes once; another server then takes the namespace over (its
    marker and the marker's copy land) and writes its own next bytes; the first appends other
    bytes and flushes three more times. The log keys after each of the four flushes, why the
    tier stopped, and the bucket's problems."""
    import trio

    from sos_server.metrics import Metrics
    from sos_server.storage import Storage
    from sos_server.tiering import Tier

    store = LocalStore((tmp_path / "bucket").as_uri())
    storage = Storage(str(tmp_path / "data"))
    ns = storage.namespace("zns", create=True)
    assert ns is not None
    ns.set_fence(1)
    obj = ns.create("log")
    counts: list[int] = []

    def append(data: bytes) -> None:
        obj.append(data, crc32c(data))
        obj.mark_synced(*obj.sync())

    async def main() -> str | None:
        tier = Tier(store, storage, Metrics(), fence_fresh=fence_fresh)
        await tier.fence("zns", 1)
        for i in range(4):
            if i == 1:  # the takeover: its marker, then the marker's copy (4.3 step 5), then its bytes
                new = Uploader(store)
                new.check_fence("zns", 2, strict=True)
                new.learn("zns")
                new.flush(_items({("zns", "log"): b"zombie 0;takeover;"}))
            append(b"zombie %d;" % i)
            tier.note(obj, len(b"zombie 0;"))
            await tier._round()
            counts.append(len(_log_keys(store)))
        return tier._ns["zns"].stopped

    try:
        stopped = trio.run(main)
        return counts, stopped, scan(store)["zns"].all_problems()
    finally:
        store.close()


def test_a_zombie_whose_listing_is_stale_lists_before_it_flushes_and_writes_nothing_more(tmp_path):
    counts, stopped, problems = _zombie_flushes(tmp_path, fence_fresh=0.0)
    assert counts == [1, 2, 2, 2]  # the new server's flush; not one of the zombie's after it
    assert stopped is not None and "another server took the namespace over" in stopped
    assert problems == []


def test_a_zombie_writes_at_most_one_flush_on_a_listing_taken_before_the_marker_landed(tmp_path):
    """The listing beside flush k gates flush k+1 (within FENCE_FRESH of it, here always): the
    marker lands between two flushes, the next one still goes (the "one more"), its own
    listing sees the copy, and the one after it is not written. The bound is not what keeps a
    reader safe: the zombie's bytes and the new server's for the same range differ in checksum,
    and a reader reports the conflict by key rather than choose (protocol.md 4.4, 4.5)."""
    counts, stopped, problems = _zombie_flushes(tmp_path, fence_fresh=3600.0)
    assert counts == [1, 3, 3, 3]  # the new server's flush and the zombie's one more
    assert stopped is not None and "another server took the namespace over" in stopped
    assert [(p.kind, p.name, p.offset) for p in problems] == [("conflict", "log", 9)]
    assert problems[0].key.startswith(LOG_PREFIX)


@pytest.mark.parametrize("same_bytes", [True, False])
def test_a_flushed_entry_and_a_piece_of_the_same_range(store, same_bytes):
    """Compaction wrote the piece, the flushed object is not deleted yet: the same bytes twice
    are read once, no problem (4.4 "Both"); other bytes in the same range are a conflict."""
    from sos_tier.layout import piece_key

    data = b"lease 0\n"
    body, _ = encode_batch([("a", "lease", 0, data if same_bytes else b"lease 9\n")], [])
    assert store.put_once(log_key(1, "00" * 8), body)
    assert store.put_once(piece_key("a", "lease", 0, len(data), crc32c(data)), data)
    st = scan(store, "a", verify=True)["a"]
    if same_bytes:
        assert st.all_problems() == [] and st.objects["lease"].length == len(data)
        assert read_object(store, "a", "lease") == data
    else:
        assert [p.kind for p in st.all_problems()] == ["conflict"] and st.objects["lease"].length == 0
