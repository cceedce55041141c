"""The tier's layout (protocol.md Part 4) and its uploader, on both backends (the ``store``
fixture: moto's S3 server and a local directory): names, the listing scan, the reader, and an
uploader stopped between pieces that resumes from the listing."""

from __future__ import annotations

import hashlib
import random
import string
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sos_tier import layout
from sos_tier.layout import (
    MAX_PLAIN_NAME,
    ObjectIncomplete,
    TierConflict,
    TierDamage,
    delete_object,
    escape_name,
    fence_content,
    fence_key,
    keys_of,
    object_prefix,
    parse_key,
    piece_key,
    read_object,
    scan,
    scan_object,
    seal_key,
    seal_time,
    unescape_name,
)
from sos_tier.store import LocalStore, PutOutcome, Store
from sos_tier.uploader import TierFenced, Uploader
from sos_wire.crc import crc32c
from sos_wire.names import validate_name
from tests.support import protocol_part

pytest_plugins = ["tests.tier.support"]  # the fixtures store (both backends) and clobber

NS = "job1"

# ---------------------------------------------------------------------------------------------
# names

_SEG_CHARS = string.ascii_letters + string.digits + "._=+,@~-"
segments = st.text(_SEG_CHARS, min_size=1, max_size=40).filter(lambda s: s not in (".", ".."))
names = st.lists(segments, min_size=1, max_size=40).map("/".join).filter(lambda n: len(n) <= 1024)


@settings(max_examples=300, deadline=None)
@given(names)
def test_escape_round_trips(name):
    e = escape_name(name)
    assert "/" not in e
    if len(name) <= MAX_PLAIN_NAME:
        assert unescape_name(e) == name
        assert parse_key(f"v1/ns/{NS}/o/{e}/seal-{0:016x}") is not None
    else:
        assert e == "!" + hashlib.sha256(name.encode()).hexdigest()
        with pytest.raises(ValueError):
            unescape_name(e)


@settings(max_examples=200, deadline=None)
@given(names, names)
def test_escape_keeps_prefixes_and_order_within_a_directory(a, b):
    """A LIST prefix of protocol names maps to a key prefix; names whose first difference is not
    at a '/' list in the same order."""
    if len(a) <= MAX_PLAIN_NAME and len(b) <= MAX_PLAIN_NAME:
        assert escape_name(a + "/" + "x").startswith(escape_name(a) + "!")
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is not None and "/" not in (a[i], b[i]):
            assert (a < b) == (escape_name(a) < escape_name(b))


def test_longest_keys_fit_s3():
    name = "/".join(["s" * 255] * 4)[:1024].rstrip("/")
    validate_name(name)
    prefix = "p" * 256
    ns = "n" * 63
    for key in (
        piece_key(ns, name, 2**64 - 2, 2**64 - 1, 2**32 - 1),
        seal_key(ns, name, 2**64 - 1),
        layout.name_key(ns, name),
        fence_key(ns, 2**64 - 1),
    ):
        assert key is not None and len(f"{prefix}/{key}".encode()) <= 1024
    plain = "a" * 255 + "/" + "b" * 255 + "/" + "c" * 130  # 642 bytes: just over
    assert escape_name(plain).startswith("!")
    assert not escape_name(plain[:MAX_PLAIN_NAME]).startswith("!")
    assert len(f"{prefix}/{piece_key(ns, plain[:MAX_PLAIN_NAME], 2**64 - 2, 2**64 - 1, 0)}".encode()) <= 1024


@pytest.mark.parametrize(
    "key",
    [
        "v1/ns/job1/o/a/0000000000000000-0000000000000001",  # no crc
        "v1/ns/job1/o/a/0000000000000005-0000000000000001-00000000",  # end before begin
        "v1/ns/job1/o/a/0000000000000005-0000000000000005-00000000",  # empty piece not at 0
        "v1/ns/job1/o/a/0000000000000000-0000000000000000-00000001",  # empty piece with a crc
        "v1/ns/job1/o/a/00000000000000AA-00000000000000BB-00000000",  # upper case
        "v1/ns/job1/o/a/seal-1",
        "v1/ns/job1/o/a/name",  # name keys only in hashed dirs
        "v1/ns/job1/o/a/b/seal-0000000000000000",  # '/' in a name is escaped
        "v1/ns/job1/o/..!a/seal-0000000000000000",  # not a valid name
        "v1/ns/Job1/fence/0000000000000001",  # not a namespace
        "v1/ns/job1/fence/1",
        "v2/ns/job1/fence/0000000000000001",
        "v1/ns/job1/other/x",
    ],
)
def test_parse_key_refuses_what_the_layout_cannot_make(key):
    assert parse_key(key) is None


def test_protocol_worked_example(tmp_path):
    """protocol.md 4.7: its listing, built from the segment of 2.4, scans as it says."""
    seg_hex = protocol_part("## 2.4 Worked example").split("```hex", 1)[1].split("```", 1)[0]
    segment = bytes.fromhex("".join(line.split("#", 1)[0] for line in seg_hex.splitlines()).replace(" ", ""))
    part = protocol_part("## 4.7 Worked example")
    listing = part.split("```", 2)[1].split()
    retry = "v1/ns/job1/o/gen!0000000001!0000000001-0000000001.seg/0000000000000000-0000000000000105-abd534cd"
    assert retry.split("/")[-1] in part
    store = LocalStore((tmp_path / "bucket").as_uri())
    for key in listing:
        pk = parse_key(key)
        assert pk is not None
        if pk.kind == "piece":
            content = segment[pk.begin : pk.end]
        else:
            content = b"{}" if pk.kind == "seal" else fence_content(pk.namespace, pk.epoch)
        if pk.kind == "piece":
            assert crc32c(content) == pk.crc
        store.put_once(key, content)
    state = scan(store, verify=True)["job1"]
    assert state.fence == 1 and not state.all_problems()
    seg = state.objects["gen/0000000001/0000000001-0000000001.seg"]
    assert seg.length == 261 and not seg.sealed and len(seg.pieces) == 2
    ready = state.objects["gen/0000000001/ready"]
    assert ready.sealed and ready.length == 0 and ready.pieces == []
    assert read_object(store, "job1", seg.name, state=seg) == segment
    retry_key = parse_key(retry)
    assert retry_key is not None and retry_key.crc == crc32c(segment)
    store.put_once(retry, segment)
    seg = scan(store, verify=True)["job1"].objects[seg.name]
    assert [p.key for p in seg.pieces] == [retry] and len(seg.extra) == 2 and seg.problems == []


# ---------------------------------------------------------------------------------------------
# helpers


def put_piece(store: Store, name: str, begin: int, data: bytes, ns: str = NS) -> str:
    key = piece_key(ns, name, begin, begin + len(data), crc32c(data))
    assert store.put_once(key, data) is PutOutcome.CREATED
    return key


def upload(
    store: Store,
    name: str,
    data: bytes,
    *,
    sealed: bool = False,
    max_piece: int = 10,
    ns: str = NS,
    uploader: Uploader | None = None,
) -> Uploader:
    up = uploader or Uploader(store, max_piece=max_piece)
    up.sync(ns, name, lambda b, e: data[b:e], len(data), sealed)
    return up


def problems(state, kind=None):
    return [p for p in state.problems if kind is None or p.kind == kind]


# ---------------------------------------------------------------------------------------------
# the scan and the reader


def test_scan_rebuilds_every_namespace(store):
    rng = random.Random(1)
    objects = {
        (NS, "gen/0000000001/0000000001-0000000001.seg"): (rng.randbytes(95), True),
        (NS, "gen/0000000001/0000000002-0000000001.seg"): (rng.randbytes(33), False),
        (NS, "gen/0000000001/ready"): (b"", True),
        (NS, "empty"): (b"", False),
        (NS, "a"): (b"x", False),
        (NS, "a/b"): (b"yy", False),  # 'a' and 'a/b' both objects
        ("other-ns", "gen/0000000001/0000000001-0000000001.seg"): (rng.randbytes(10), False),
    }
    up = Uploader(store, max_piece=16)
    for (ns, name), (data, sealed) in objects.items():
        up.sync(ns, name, lambda b, e, d=data: d[b:e], len(data), sealed, sealed_at_ns=123 if sealed else None)
    up.check_fence(NS, 7)
    states = scan(store)
    assert set(states) == {NS, "other-ns"}
    assert states[NS].fence == 7 and states["other-ns"].fence == 0
    for (ns, name), (data, sealed) in objects.items():
        obj = states[ns].objects[name]
        assert obj.exists and obj.length == len(data) and obj.sealed == sealed and obj.problems == []
        assert read_object(store, ns, name, state=obj) == data
        assert read_object(store, ns, name) == data  # one listing of its own
        assert (seal_time(store, obj) == 123) == sealed
    assert all(not s.all_problems() for s in states.values())
    # pieces cut at multiples of max_piece
    seg = states[NS].objects["gen/0000000001/0000000001-0000000001.seg"]
    assert [(p.begin, p.end) for p in seg.pieces] == [(i, min(i + 16, 95)) for i in range(0, 95, 16)]
    assert scan_object(store, NS, "never-written").exists is False


def test_read_ranges_with_parallel_ranged_gets(store, monkeypatch):
    monkeypatch.setattr(layout, "PART_SIZE", 7)  # several ranged GETs per piece
    data = random.Random(2).randbytes(500)
    upload(store, "big", data, max_piece=64)
    obj = scan_object(store, NS, "big")
    rng = random.Random(3)
    for _ in range(15):
        a = rng.randrange(0, 501)
        b = rng.randrange(a, 501)
        assert read_object(store, NS, "big", a, b, state=obj, workers=rng.choice([1, 3, 8])) == data[a:b]
    with pytest.raises(ObjectIncomplete):
        read_object(store, NS, "big", 0, 501, state=obj)
    with pytest.raises(ObjectIncomplete):
        read_object(store, NS, "big", 502, state=obj)


def test_gap_stops_the_object_and_is_reported(store):
    data = bytes(range(50))
    upload(store, "obj", data)
    store.delete([piece_key(NS, "obj", 20, 30, crc32c(data[20:30]))])
    obj = scan(store)[NS].objects["obj"]
    assert obj.length == 20 and obj.run_end == 20
    gaps = problems(obj, "gap")
    assert (
        len(gaps) == 1
        and gaps[0].offset == 20
        and gaps[0].key.endswith("000000000000001e-0000000000000028-" + f"{crc32c(data[30:40]):08x}")
    )
    assert read_object(store, NS, "obj", state=obj) == data[:20]
    with pytest.raises(ObjectIncomplete, match="no piece holds byte 20"):
        read_object(store, NS, "obj", 0, 21, state=obj)


def test_missing_first_piece_is_a_gap_at_0(store):
    put_piece(store, "obj", 5, b"later")
    obj = scan(store)[NS].objects["obj"]
    assert obj.length == 0 and [p.offset for p in problems(obj, "gap")] == [0]


def test_damaged_piece_is_named(store, clobber):
    data = bytes(range(40))
    upload(store, "obj", data)
    bad = piece_key(NS, "obj", 10, 20, crc32c(data[10:20]))
    clobber(store, bad, b"X" * 10)  # same size: only reading tells
    assert scan(store)[NS].objects["obj"].length == 40  # the listing cannot know
    with pytest.raises(TierDamage) as e:
        read_object(store, NS, "obj")
    assert e.value.key == bad
    assert read_object(store, NS, "obj", 0, 10) == data[:10]  # the bytes before it are fine
    obj = scan(store, verify=True)[NS].objects["obj"]
    assert obj.length == 10
    assert [(p.kind, p.key) for p in obj.problems] == [("damage", bad)]


def test_piece_of_the_wrong_size_is_damage_from_the_listing(store, clobber):
    data = bytes(range(30))
    upload(store, "obj", data)
    bad = piece_key(NS, "obj", 10, 20, crc32c(data[10:20]))
    clobber(store, bad, b"short")
    obj = scan(store)[NS].objects["obj"]
    assert obj.length == 10
    assert [(p.kind, p.key) for p in obj.problems] == [
        ("damage", bad),
        ("gap", piece_key(NS, "obj", 20, 30, crc32c(data[20:30]))),
    ]


def test_overlapping_pieces_with_the_same_bytes_are_accepted(store):
    """A crash and a retry that cut differently: [0,5) and [3,12) and [0,8) and [8,12)."""
    data = b"abcdefghijkl"
    for b, e in ((0, 5), (3, 12), (0, 8), (8, 12)):
        put_piece(store, "obj", b, data[b:e])
    obj = scan(store, verify=True)[NS].objects["obj"]
    assert obj.length == 12 and obj.problems == []
    assert [(p.begin, p.end) for p in obj.pieces] == [(0, 8), (3, 12)]  # those that extend furthest
    assert read_object(store, NS, "obj", state=obj) == data
    assert read_object(store, NS, "obj", 6, 10, state=obj) == data[6:10]


def test_overlapping_pieces_that_disagree_are_reported(store):
    data = b"abcdefghijkl"
    put_piece(store, "obj", 0, data[:8])
    other = put_piece(store, "obj", 3, b"deXghijkl")  # differs at byte 5
    with pytest.raises(TierConflict):
        read_object(store, NS, "obj")
    obj = scan(store, verify=True)[NS].objects["obj"]
    assert [(p.kind, p.key, p.offset) for p in obj.problems] == [("conflict", other, 5)]
    assert obj.length == 5
    assert read_object(store, NS, "obj", state=obj) == data[:5]


def test_an_extra_piece_that_disagrees_is_reported(store):
    """A zombie's piece covered by the run (not chosen): found by verify, the run cut there."""
    data = b"abcdefghijkl"
    put_piece(store, "obj", 0, data)
    zombie = put_piece(store, "obj", 4, b"efgZ")
    obj = scan(store, verify=True)[NS].objects["obj"]
    assert [(p.kind, p.key, p.offset) for p in obj.problems] == [("conflict", zombie, 7)]
    assert obj.length == 7


def test_same_range_other_checksum_is_a_conflict_from_the_listing(store):
    """Two servers wrote [0, 4) with different bytes: the checksum in the name tells them apart,
    so neither create fails, and the listing alone shows the conflict."""
    a = put_piece(store, "obj", 0, b"aaaa")
    b = put_piece(store, "obj", 0, b"bbbb")
    put_piece(store, "obj", 4, b"cc")
    obj = scan(store)[NS].objects["obj"]
    assert obj.length == 0
    assert [p.kind for p in obj.problems] == ["conflict"]
    assert {a, b} & {obj.problems[0].key}


def test_seals(store):
    upload(store, "s", b"12345", sealed=True)
    obj = scan_object(store, NS, "s")
    assert obj.sealed and obj.seal_length == 5 and obj.seal_keys == [seal_key(NS, "s", 5)]
    # sealed further than the pieces reach: a gap
    store.put_once(seal_key(NS, "t", 9), b"{}")
    put_piece(store, "t", 0, b"1234")
    t = scan_object(store, NS, "t")
    assert not t.sealed and t.length == 4 and [p.kind for p in t.problems] == ["gap"]
    # pieces past the seal, and two seals: conflicts
    store.put_once(seal_key(NS, "u", 2), b"{}")
    store.put_once(seal_key(NS, "u", 3), b"{}")
    put_piece(store, "u", 0, b"1234")
    u = scan_object(store, NS, "u")
    assert u.length == 2 and u.seal_length == 2 and sorted(p.kind for p in u.problems) == ["conflict", "conflict"]


def test_fence_highest_marker_wins(store):
    for e in (1, 5, 3):
        store.put_once(fence_key(NS, e), fence_content(NS, e))
    assert scan(store)[NS].fence == 5


def test_foreign_keys_are_reported_and_ignored(store):
    upload(store, "a", b"x")
    store.put_once(f"v1/ns/{NS}/o/a/junk", b"?")
    store.put_once(f"v1/ns/{NS}/stray", b"?")
    st_ = scan(store)[NS]
    assert st_.objects["a"].length == 1
    assert sorted(p.key for p in st_.problems if p.kind == "foreign") == [f"v1/ns/{NS}/o/a/junk", f"v1/ns/{NS}/stray"]


def test_long_names_are_hashed_and_rebuilt(store):
    name = "/".join(["d" * 200] * 5)
    data = b"long name's bytes"
    upload(store, name, data, sealed=True)
    assert object_prefix(NS, name).endswith("/!" + hashlib.sha256(name.encode()).hexdigest() + "/")
    obj = scan(store)[NS].objects[name]
    assert obj.sealed and read_object(store, NS, name, state=obj) == data
    # without its name key the pieces cannot be placed: reported
    store.delete([layout.name_key(NS, name) or ""])
    st_ = scan(store)[NS]
    assert name not in st_.objects and [p.kind for p in st_.problems] == ["damage"]


def test_retention_deletes_whole_objects(store):
    upload(store, "gen/0000000001/x", b"0123456789abc", sealed=True)
    upload(store, "gen/0000000002/x", b"keep")
    obj = scan(store)[NS].objects["gen/0000000001/x"]
    assert len(keys_of(obj)) == 3  # two pieces and the seal
    delete_object(store, obj)
    assert set(scan(store)[NS].objects) == {"gen/0000000002/x"}
    assert not scan(store)[NS].all_problems()


# ---------------------------------------------------------------------------------------------
# the uploader


class Recording:
    """A store that records every put_once and its outcome, and can stop after n puts (an
    uploader killed between pieces: nothing after the n-th put happens)."""

    def __init__(self, inner: Store, stop_after: int | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.puts: list[tuple[str, PutOutcome]] = []
        self.stop_after = stop_after

    def put_once(self, key, data):
        if self.stop_after is not None and len(self.puts) >= self.stop_after:
            raise KeyboardInterrupt("killed")
        r = self.inner.put_once(key, data)
        self.puts.append((key, r))
        return r

    def get(self, key, start=None, end=None):
        return self.inner.get(key, start, end)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, keys):
        self.inner.delete(keys)

    def close(self):
        pass


def test_uploader_killed_between_pieces_resumes_from_the_listing(store):
    data = random.Random(4).randbytes(100)
    first = Recording(store, stop_after=4)
    with pytest.raises(KeyboardInterrupt):
        upload(first, "seg", data, sealed=True, max_piece=16)
    assert [r for _, r in first.puts] == [PutOutcome.CREATED] * 4
    # a new uploader (a restarted server): no local state, only the bucket
    second = Recording(store)
    up = upload(second, "seg", data, sealed=True, max_piece=16)
    assert up.uploaded(NS, "seg") == 100
    assert [r for _, r in second.puts] == [PutOutcome.CREATED] * 4  # 3 pieces and the seal
    written = [k for k, _ in first.puts + second.puts]
    assert len(written) == len(set(written))  # nothing written twice
    obj = scan(store, verify=True)[NS].objects["seg"]
    assert obj.sealed and obj.problems == [] and read_object(store, NS, "seg", state=obj) == data
    assert [(p.begin, p.end) for p in obj.pieces] == [(i, min(i + 16, 100)) for i in range(0, 100, 16)]
    assert obj.extra == []  # no overlapping duplicates


def test_uploader_whose_put_landed_but_was_not_recorded(store):
    """Killed after the store took a piece and before the uploader noted it: the piece is in
    the listing, the next uploader goes on after it; a retry of the same put is ALREADY_SAME."""
    data = b"x" * 30
    up = Uploader(store, max_piece=10)
    up.learn(NS)  # learned an empty bucket
    put_piece(store, "o", 0, data[:10])  # ...and then its own put landed, unrecorded
    s = up.step(NS, "o", lambda b, e: data[b:e], 30)
    assert (s.kind, s.outcome) == ("piece", PutOutcome.ALREADY_SAME)
    rec = Recording(store)
    upload(rec, "o", data, max_piece=10)
    assert [k.rsplit("/", 1)[1][:33] for k, _ in rec.puts] == [
        "000000000000000a-0000000000000014",
        "0000000000000014-000000000000001e",
    ]
    assert read_object(store, NS, "o") == data


def test_uploader_retry_that_cuts_differently_overlaps_harmlessly(store):
    """A server learned the bucket, then its old self's in-flight piece [0,10) landed; the durable
    length is now 15, so it writes [0,15) (max_piece 64): overlapping, identical bytes."""
    data = bytes(range(15))
    up = Uploader(store, max_piece=64)
    up.learn(NS)
    put_piece(store, "o", 0, data[:10])
    s = up.step(NS, "o", lambda b, e: data[b:e], 15)
    assert (s.begin, s.end, s.outcome) == (0, 15, PutOutcome.CREATED)
    obj = scan(store, verify=True)[NS].objects["o"]
    assert obj.length == 15 and obj.problems == [] and len(obj.extra) == 1


def test_uploader_never_overwrites_a_conflicting_piece(store, clobber):
    data = b"0123456789"
    key = piece_key(NS, "o", 0, 10, crc32c(data))
    up = Uploader(store, max_piece=64)
    up.learn(NS)  # an empty bucket; then the key appears with other bytes (damage, or forged)
    clobber(store, key, b"damaged!!!")
    s = up.step(NS, "o", lambda b, e: data[b:e], 10)
    assert s.kind == "stuck" and key in s.message
    assert store.get(key) == b"damaged!!!"
    assert up.step(NS, "o", lambda b, e: data[b:e], 10).kind == "stuck"
    lag = up.lag(NS)
    assert "o" in lag.stuck and lag.bytes == 10 and key in (lag.last_error or "")


def test_uploader_does_not_write_behind_a_longer_bucket(store):
    upload(store, "o", b"0123456789")
    up = Uploader(store)
    s = up.step(NS, "o", lambda b, e: b"0123"[b:e], 4)
    assert s.kind == "ahead" and up.lag(NS).last_error


def test_uploader_lag_figures():
    class Clock:
        t = 100.0

        def __call__(self):
            return self.t

    clock = Clock()
    with tempfile.TemporaryDirectory() as d:
        up = Uploader(LocalStore("file://" + d), max_piece=4, clock=clock)
        data = b"abcdefghij"
        up.note(NS, "o", 6)
        clock.t = 101.0
        up.note(NS, "o", 10, sealed=True)
        clock.t = 103.5
        lag = up.lag(NS)
        assert (lag.bytes, lag.seconds, lag.pending_seals) == (10, 3.5, 1)
        assert up.pending(NS) == ["o"]
        up.step(NS, "o", lambda b, e: data[b:e], 10, True)  # [0,4)
        up.step(NS, "o", lambda b, e: data[b:e], 10, True)  # [4,8): the first mark (6) is done
        lag = up.lag(NS)
        assert (lag.bytes, lag.seconds) == (2, 2.5)
        up.sync(NS, "o", lambda b, e: data[b:e], 10, True)
        lag = up.lag(NS)
        assert (lag.bytes, lag.seconds, lag.pending_seals, lag.uploaded_bytes) == (0, 0.0, 0, 10)
        assert up.pending(NS) == [] and lag.last_error is None


def test_uploader_fence_markers(store):
    up = Uploader(store)
    up.check_fence(NS, 3)
    up.check_fence(NS, 3)  # once
    assert [k.key for k in store.list(f"v1/ns/{NS}/fence/")] == [fence_key(NS, 3)]
    newer = Uploader(store)  # a replacement server, whose writer fenced again
    newer.check_fence(NS, 4)
    with pytest.raises(TierFenced) as e:
        up.check_fence(NS, 3)  # the old one is a zombie: told, and stops
    assert e.value.bucket_epoch == 4
    with pytest.raises(TierFenced):
        up.step(NS, "o", lambda b, e: b"x"[b:e], 1)
    assert up.lag(NS).fenced
    assert list(store.list(f"v1/ns/{NS}/o/")) == []


def test_a_check_with_the_fence_read_before_this_servers_own_fence_is_no_takeover(store):
    """A flush's check reads the server's fence (3), then a FENCE on the same server raises it
    to 4 and writes marker 4 before the check lists: the check sees a marker above 3, and it
    is this server's own. Nothing is fenced and uploads go on; a marker of ANOTHER server above
    the new fence still fences."""
    up = Uploader(store)
    up.check_fence(NS, 3)
    up.check_fence(NS, 4, strict=True)  # the FENCE: its marker is written
    up.check_fence(NS, 3)  # the flush's check, with the epoch it read before the FENCE
    assert not up.lag(NS).fenced
    assert up.step(NS, "o", lambda b, e: b"x"[b:e], 1).kind != "idle"
    assert scan_object(store, NS, "o").length == 1
    Uploader(store).check_fence(NS, 5)  # a replacement server's writer fenced again
    with pytest.raises(TierFenced) as e:
        up.check_fence(NS, 3)  # stale epoch or not: 5 is above anything this server set
    assert e.value.bucket_epoch == 5 and up.lag(NS).fenced


def test_empty_objects_exist_in_the_bucket(store):
    up = Uploader(store)
    assert up.step(NS, "e", lambda b, e: b"", 0).kind == "exists"
    assert up.step(NS, "e", lambda b, e: b"", 0).kind == "idle"
    obj = scan_object(store, NS, "e")
    assert obj.exists and obj.length == 0 and not obj.sealed
    assert up.step(NS, "e", lambda b, e: b"", 0, True).kind == "seal"
    assert scan_object(store, NS, "e").sealed


def test_uploader_progress_pending_and_removal(store):
    seen = []
    up = Uploader(store, max_piece=4, on_progress=lambda *a: seen.append(a))
    up.note(NS, "empty", 0)
    up.note(NS, "o", 6, sealed=True)
    assert up.pending(NS) == ["empty", "o"]
    up.sync(NS, "empty", lambda b, e: b"", 0)
    up.sync(NS, "o", lambda b, e: b"abcdef"[b:e], 6, True)
    assert seen == [(NS, "empty", 0, False), (NS, "o", 4, False), (NS, "o", 6, False), (NS, "o", 6, True)]
    assert up.pending(NS) == [] and up.uploaded(NS, "o") == 6
    up.remove(NS, ["o"])
    assert set(scan(store)[NS].objects) == {"empty"}
    assert up.lag(NS).bytes == 0


def test_two_threads_stepping_one_object_write_each_piece_once(store):
    data = random.Random(5).randbytes(64)
    rec = Recording(store)
    up = Uploader(rec, max_piece=8)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: up.sync(NS, "o", lambda b, e: data[b:e], 64, True), range(4)))
    keys = [k for k, _ in rec.puts]
    assert len(keys) == len(set(keys)) == 9 and {r for _, r in rec.puts} == {PutOutcome.CREATED}
    assert read_object(store, NS, "o") == data


def test_zombie_and_new_server_on_one_prefix(store):
    """The old server and its replacement copy different bytes after a common start: both creates
    succeed (the checksum names them apart), readers report the conflict and stop before it, and
    the zombie is told by the fence marker of the new server."""
    common = b"0123456789"
    old, new = Uploader(store, max_piece=100), Uploader(store, max_piece=100)
    old.check_fence(NS, 1)
    old.sync(NS, "o", lambda b, e: common[b:e], 10)
    new.check_fence(NS, 2)  # the writer fenced on the new server
    new.sync(NS, "o", lambda b, e: (common + b"NEW")[b:e], 13)
    old.sync(NS, "o", lambda b, e: (common + b"OLD")[b:e], 13)  # before its next fence check
    obj = scan(store, verify=True)[NS].objects["o"]
    assert obj.length == 10 and [p.kind for p in obj.problems] == ["conflict"]
    assert read_object(store, NS, "o", state=obj) == common
    with pytest.raises(TierFenced):
        old.check_fence(NS, 1)


def test_local_list_stays_inside_its_root(tmp_path):
    s = LocalStore((tmp_path / "root").as_uri())
    (tmp_path / "secret").write_bytes(b"x")
    for prefix in ("../", "../s", "a/../../"):
        with pytest.raises(ValueError):
            list(s.list(prefix))


def test_every_name_character_survives_the_store(store):
    """S3 keys go through URLs ('+' is a space in a query string): every character a name may
    hold comes back from the listing as written."""
    name = "dir.x/A-Z_a=z+0,9@~/" + _SEG_CHARS
    data = b"chars"
    upload(store, name, data, sealed=True)
    obj = scan(store)[NS].objects[name]
    assert obj.sealed and read_object(store, NS, name, state=obj) == data
