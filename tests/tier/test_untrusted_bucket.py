"""Hostile input, round 3: what a bucket holds (issue 26 item 2, second bullet, and item 3).

Real ``sos-server serve --tier file://...`` processes, real files in the bucket's directory:

- a fence marker is believed only if it is what a writer writes (``{"epoch":E,"namespace":NS}``)
  and not far beyond every epoch known: the empty ``fence/ffffffffffffffff`` neither stops a
  live server (FENCE, uploads, TIER_WAIT go on; a metric and the log say so) nor fences a
  replacement server at the end of the range; a planted key in the place of the next fence
  marker refuses that FENCE at once, typed, and the next epoch passes;
- a piece that claims more than a writer ever makes (1 GiB, a sparse file) is refused unread:
  ``sos restore --from`` and a replacement server's rebuild stay within bounded memory and
  report it;
- the scan of one object's 40,000 pieces is linear;
- an object that grows by small appends (a gateway's lease, one upload per renewal) keeps a
  bounded number of pieces in the bucket, and a reader whose listing predates a merge still
  reads it whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from sos_client import Client
from sos_journal import JournaledTree, JournalWriter
from sos_journal.read.bucket import BucketSource
from sos_journal.rebuild.restore import rebuild_cache
from sos_tier import LocalStore, scan
from sos_tier.layout import (
    MAX_PIECE_BYTES,
    believe_fence,
    fence_content,
    fence_key,
    object_prefix,
    piece_key,
)
from sos_tier.uploader import Uploader
from sos_wire import events as ev
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from tests.conftest import RawClient
from tests.support import PEAK_RSS_KIB, server_metric, wait_for
from tests.tier.support import tier_wait

pytestmark = [pytest.mark.hostile, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAIT = 60.0


def plant(store: LocalStore, key: str, data: bytes = b"", *, size: int | None = None) -> str:
    """A key written behind the server's back (a rogue tool with the bucket's credentials);
    *size*: a sparse file of that many bytes instead."""
    path = os.path.join(store.root, *key.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        if size is not None:
            f.truncate(size)
    return path


def login(srv, ns: str) -> RawClient:
    c = RawClient(srv.address)
    assert isinstance(c.login(srv.keygen(ns, "append"), ns), ev.AuthOk)
    return c


def fenced_and_tiered(c: RawClient, epoch: int, name: str, data: bytes) -> None:
    """FENCE at ``epoch``, then ``data`` appended to the new object ``name`` with it and waited
    for in the tier: each answered OK."""
    assert isinstance(c.call(ev.Fence(c.rid(), epoch)), ev.FenceOk)
    assert isinstance(c.append(name, 0, data, epoch=epoch), ev.AppendOk)
    assert isinstance(tier_wait(c, name, len(data), 30_000), ev.TierWaitOk)


def tier_server(factory, tmp_path, name: str = "tier", data_dir=None, start: bool = True, args=()):
    store = LocalStore((tmp_path / name).as_uri())
    srv = factory(data_dir, args=["--tier", store.url, "--tier-interval", "0.2", *args], start=start)
    return srv, store


# ---------------------------------------------------------------------------------------------
# fence markers


def test_an_empty_end_of_range_marker_does_not_stop_a_live_server(sos_server_factory, tmp_path):
    srv, store = tier_server(sos_server_factory, tmp_path)
    with login(srv, "live") as c:
        fenced_and_tiered(c, 3, "seg", b"before")
        plant(store, fence_key("live", 2**64 - 1))  # empty, at the end of the range
        plant(store, fence_key("live", 2**32), fence_content("live", 2**32))  # well formed, far beyond
        assert isinstance(c.append("seg", 6, b" and after", epoch=3), ev.AppendOk)
        r = tier_wait(c, "seg", 16, 30_000)
        assert isinstance(r, ev.TierWaitOk) and r.tiered == 16, r  # uploads go on
        r = c.call(ev.Fence(c.rid(), 4))
        assert isinstance(r, ev.FenceOk), r  # a new writer is not refused
        assert isinstance(c.append("seg", 16, b"!", epoch=4), ev.AppendOk)
        assert isinstance(tier_wait(c, "seg", 17, 30_000), ev.TierWaitOk)
    wait_for(lambda: server_metric(srv, "sos_tier_ignored_fence_markers", 0.0, ns="live") == 2, what="the metric")
    assert server_metric(srv, "sos_tier_fenced", 0.0, ns="live") == 0
    assert "bogus fence marker" in srv.log_text() and "ffffffffffffffff" in srv.log_text()
    # the marker of epoch 4 is what a writer writes, and readers take it as the fence
    assert store.get(fence_key("live", 4)) == json.dumps({"epoch": 4, "namespace": "live"}).replace(" ", "").encode()
    state = scan(store, "live", verify=True)["live"]
    assert state.objects["seg"].length == 17
    assert {p.key for p in state.problems if p.kind == "fence"} == {fence_key("live", 2**64 - 1)}
    # a reader that knows epoch 4 (a segment's name, its own fence) does not believe 2**32
    assert believe_fence(store, "live", state.fence_markers, known=4).epoch == 4


def test_a_replacement_server_takes_no_fence_from_bogus_markers(sos_server_factory, tmp_path):
    old, store = tier_server(sos_server_factory, tmp_path)
    with login(old, "rep") as c:
        fenced_and_tiered(c, 3, "seg", b"before the loss")
    old.kill()
    plant(store, fence_key("rep", 2**64 - 1))
    plant(store, fence_key("rep", 2**40), fence_content("rep", 2**40))  # beyond every epoch known
    plant(store, fence_key("rep", 7), b"garbage")
    new, _ = tier_server(sos_server_factory, tmp_path, data_dir=tmp_path / "new-data", start=False)
    key = new.keygen("rep")
    new.start()
    with RawClient(new.address) as c:
        assert isinstance(c.login(key, "rep"), ev.AuthOk)
        assert c.read("seg") == b"before the loss"
        r = c.append("seg", 15, b"x", epoch=2)
        assert isinstance(r, ev.Error) and r.code == ErrorCode.FENCED and r.length == 3, r  # the real fence
        r = c.call(ev.Fence(c.rid(), 4))
        assert isinstance(r, ev.FenceOk), r  # FENCE is accepted
        assert isinstance(c.append("seg", 15, b" and after", epoch=4), ev.AppendOk)
        assert isinstance(tier_wait(c, "seg", 25, 30_000), ev.TierWaitOk)
    text = new.log_text()
    assert "ffffffffffffffff" in text and "0000010000000000" in text and "0000000000000007" in text


def test_a_key_planted_in_the_place_of_the_next_marker_refuses_that_fence_only(sos_server_factory, tmp_path):
    srv, store = tier_server(sos_server_factory, tmp_path)
    with login(srv, "next") as c:
        assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
        plant(store, fence_key("next", 2))  # empty: not what this server writes for epoch 2
        t0 = time.monotonic()
        r = c.call(ev.Fence(c.rid(), 2))
        assert isinstance(r, ev.Error) and r.code == ErrorCode.TIER_UNAVAILABLE, r
        assert fence_key("next", 2) in r.message and "higher epoch" in r.message, r.message
        assert time.monotonic() - t0 < 5  # at once: retrying cannot help
        fenced_and_tiered(c, 3, "o", b"data")
    assert scan(store, "next")["next"].fence == 3


def test_fence_markers_are_read_bounded(tmp_path):
    store = LocalStore((tmp_path / "t").as_uri())
    plant(store, fence_key("ns", 9), size=1 << 30)  # a marker of 1 GiB: not read at all
    plant(store, fence_key("ns", 8), fence_content("ns", 8))
    markers = [(9, fence_key("ns", 9), 1 << 30), (8, fence_key("ns", 8), len(fence_content("ns", 8)))]
    verdict = believe_fence(store, "ns", markers, known=5)
    assert verdict.epoch == 8 and [p.key for p in verdict.ignored] == [fence_key("ns", 9)]
    assert believe_fence(store, "ns", markers, known=None).epoch == 8
    assert believe_fence(store, "other", [(8, fence_key("ns", 8), 30)]).epoch == 0  # another namespace's


# ---------------------------------------------------------------------------------------------
# a piece larger than a writer makes


def _journal_in_a_bucket(factory, tmp_path) -> tuple[object, LocalStore, str]:
    """A real journal (a few files) copied to a file:// tier by a real server; (server, store, ns)."""
    srv, store = tier_server(factory, tmp_path)
    ns = "big"
    key = srv.keygen(ns, "append")

    def fac() -> Client:
        return Client(srv.address, key, ns, timeout=60)

    w = JournalWriter(fac, ns, str(tmp_path / "spool"))
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    for i in range(8):
        t.create(f"f{i}")
        t.write(f"f{i}", 0, os.urandom(4096))
    t.close()
    with fac() as c:
        want = {e.name: e.length for e in c.list("")}

    def copied() -> bool:
        st = scan(store, ns).get(ns)
        return st is not None and all(
            st.objects.get(n) is not None and st.objects[n].length == n_ for n, n_ in want.items()
        )

    wait_for(copied, what="the journal in the bucket")
    return srv, store, ns


_RESTORE = """
import resource, subprocess, sys
r = subprocess.run([sys.executable, "-m", "sos_client.cli", *sys.argv[1:]], capture_output=True, text=True)
sys.stderr.write(r.stdout + r.stderr)
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def test_a_planted_1_gib_piece_is_refused_and_restore_stays_small(sos_server_factory, tmp_path):
    srv, store, ns = _journal_in_a_bucket(sos_server_factory, tmp_path)
    seg = next(n for n in scan(store, ns)[ns].objects if n.endswith(".seg"))
    huge = piece_key(ns, seg, 0, 1 << 30, 0x12345678)
    plant(store, huge, size=1 << 30)  # sparse: costs no disk, claims 1 GiB
    proc = subprocess.run(
        [sys.executable, "-c", _RESTORE, "verify", ns, "--from", store.url],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    code, peak_kib = map(int, proc.stdout.split())
    assert peak_kib < 300 * 1024, peak_kib  # not the 1-2 GiB of reading the piece whole
    assert code == 3 and huge in proc.stderr and "writer ever makes" in proc.stderr, proc.stderr
    out = tmp_path / "restored"
    proc = subprocess.run(
        [sys.executable, "-c", _RESTORE, "restore", "-q", ns, str(out), "--from", store.url],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    code, peak_kib = map(int, proc.stdout.split())
    assert code == 0, proc.stderr
    assert peak_kib < 300 * 1024, peak_kib
    assert sorted(os.listdir(out)) == [f"f{i}" for i in range(8)]


_BOOTSTRAP = (
    PEAK_RSS_KIB
    + """
import sys
from sos_tier.store import LocalStore
from sos_server.tier_bootstrap import bootstrap
r = bootstrap(sys.argv[1], LocalStore(sys.argv[2]), workers=2)
print(r.total_bytes, peak_rss_kib())
for p in r.problems:
    print(p.kind, p.key, file=sys.stderr)
"""
)


def test_a_replacement_server_rebuild_refuses_a_planted_1_gib_piece(tmp_path):
    store = LocalStore((tmp_path / "tier").as_uri())
    data = os.urandom(100_000)
    Uploader(store).sync("ns1", "obj", lambda b, e: data[b:e], len(data), True, 1)
    huge = piece_key("ns1", "obj", 0, 1 << 30, 0)
    plant(store, huge, size=1 << 30)
    other = piece_key("ns1", "other", 0, 1 << 30, 0)  # an object of that one piece alone
    plant(store, other, size=1 << 30)
    proc = subprocess.run(
        [sys.executable, "-c", _BOOTSTRAP, str(tmp_path / "data"), store.url],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    total, peak_kib = map(int, proc.stdout.split())
    assert total == len(data)  # the real object whole; nothing of the planted pieces
    # far below one planted piece (1 GiB; reading one whole took 2 GiB): 38 MiB here
    assert peak_kib < 300 * 1024, peak_kib
    assert f"damage {huge}" in proc.stderr and f"damage {other}" in proc.stderr, proc.stderr


def test_a_listed_size_is_never_trusted_for_memory(tmp_path):
    """A piece whose name claims a small size but whose content is large is read no further
    than its name's size plus one byte (damage), whatever the key holds."""
    store = LocalStore((tmp_path / "t").as_uri())
    key = piece_key("ns", "o", 0, 10, crc32c(b"0123456789"))
    plant(store, key, b"0123456789")
    state = scan(store, "ns", verify=True)["ns"]
    assert state.objects["o"].length == 10
    plant(store, key, b"0123456789", size=MAX_PIECE_BYTES * 4)  # grown behind the listing's back
    from sos_tier.layout import Piece, TierDamage, TierPieceTooLarge, get_piece

    with pytest.raises(TierDamage, match="holds 11 bytes"):
        get_piece(store, state.objects["o"].pieces[0])
    big = Piece(piece_key("ns", "o", 0, 1 << 30, 0), 0, 1 << 30, 0, 1 << 30)  # as a listing would say
    with pytest.raises(TierPieceTooLarge):
        get_piece(store, big)  # refused before any GET (the key does not even exist)


# ---------------------------------------------------------------------------------------------
# linear reading


def test_scanning_40000_pieces_of_one_object_is_linear(tmp_path):
    store = LocalStore((tmp_path / "t").as_uri())
    base = os.path.join(store.root, *object_prefix("ns", "lease/0000000001").split("/"))
    os.makedirs(base)
    n = 40_000
    for i in range(n):  # one byte each, as many small appends would have left them
        b = bytes([i % 256])
        with open(os.path.join(base, piece_key("ns", "x", i, i + 1, crc32c(b)).rsplit("/", 1)[1]), "wb") as f:
            f.write(b)
    t0 = time.monotonic()
    obj = scan(store, "ns")["ns"].objects["lease/0000000001"]
    took = time.monotonic() - t0
    assert obj.length == n and len(obj.pieces) == n and not obj.problems
    assert took < 20, took  # quadratic: 8e8 steps, minutes


# ---------------------------------------------------------------------------------------------
# objects that grow by small appends


def test_a_lease_renewed_many_times_keeps_few_pieces(sos_server_factory, tmp_path):
    """A lease object as a gateway pair renews it (one line per renewal) with a TIER_WAIT after
    each (--durability tier): one upload per renewal. The pieces in the bucket stay few and the
    bucket holds every byte. (--tier-flush 20ms: the default 100 ms between flushes would make
    the 300 waits last 30 s; what is merged and kept does not depend on it.)"""
    srv, store = tier_server(sos_server_factory, tmp_path, args=["--tier-flush", "20ms"])
    name = "lease/0000000001"
    held = b""
    with login(srv, "pair") as c:
        assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
        for i in range(300):
            line = json.dumps({"t": 1_800_000_000_000 + i, "until": 1_800_000_010_000 + i}).encode() + b"\n"
            assert isinstance(c.append(name, len(held), line, epoch=1), ev.AppendOk)
            held += line
            r = tier_wait(c, name, len(held), 30_000)
            assert isinstance(r, ev.TierWaitOk), r
    keys = [k.key for k in store.list(object_prefix("pair", name))]
    assert len(keys) <= 24, len(keys)  # one per renewal before: 300
    with BucketSource(store, "pair") as src:
        assert src().read(name) == held


def test_a_reader_whose_listing_predates_a_merge_reads_the_object_whole(tmp_path):
    store = LocalStore((tmp_path / "t").as_uri())
    up = Uploader(store)
    data = b"".join(b"renewal %04d\n" % i for i in range(64))
    step = 13
    for end in range(step, 33 * step, step):
        up.sync("ns", "lease/0000000002", lambda b, e: data[b:e], end)
    src = BucketSource(store, "ns")
    listed = src.state().objects["lease/0000000002"]
    before = [p.key for p in listed.pieces]
    for end in range(33 * step, len(data) + 1, step):  # merges delete pieces the listing names
        up.sync("ns", "lease/0000000002", lambda b, e: data[b:e], end)
    assert any(not os.path.exists(os.path.join(store.root, *k.split("/"))) for k in before)
    assert src().read("lease/0000000002", 0, 32 * step) == data[: 32 * step]
    assert len(list(store.list(object_prefix("ns", "lease/0000000002")))) <= 8
