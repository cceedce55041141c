"""Restore and verify from the object-store tier's bucket alone (issue 19 item 4, protocol.md 4.4):
`sos restore NS DIR --from URL` and `sos verify NS --from URL` with no server.

Real parts: a journal written through the real path (JournalWriter + JournaledTree against a real
sos-server: several generations, Spark-like batches and their markers), the server's objects
copied into moto's S3 server on 127.0.0.1 (and a local directory) by ``sos_tier.Uploader`` in
small pieces, then the server stopped and its data directory deleted. Every restore from the
bucket is compared with the restore the server gave for the same point.
"""

from __future__ import annotations

import itertools
import re
import shutil
from dataclasses import dataclass

import pytest

from sos_journal import restore, verify
from sos_journal.format import layout
from sos_journal.format.records import SnapshotEnd
from sos_journal.read.bucket import BucketSource, BucketUnavailable
from sos_journal.rebuild.restore import format_time, rebuild_cache
from sos_journal.testing import tree_state
from sos_tier import LocalStore, Store, scan
from tests.tier.support import NO_SERVER, PIECE, Journal, bucket_sos, copy_to, make_bucket

pytest_plugins = ["tests.tier.support"]
pytestmark = pytest.mark.slow

boto3 = pytest.importorskip("boto3")

WAIT = 180
_ids = itertools.count()


def applied_up_to(stderr: str) -> int:
    m = re.search(r"applied up to record (\d+)", stderr)
    assert m, stderr
    return int(m.group(1))


def newest_tail(j: Journal, store: Store):
    """A segment of the newest generation after its snapshot (journal records only) that the
    bucket holds in at least 3 pieces, its pieces, and a piece in the middle of them after at
    least one whole record of the segment."""
    gens = layout.scan_listing(_Entry(n, len(d), s) for n, (d, s) in j.objects.items())
    newest = max(gens.values(), key=lambda g: g.generation)
    end = next(r for r in j.records if type(r.op) is SnapshotEnd and r.op.generation == newest.generation)
    objects = scan(store, j.ns)[j.ns].objects
    for s in newest.segments:
        pieces = objects[s.name].pieces
        if s.first_seq <= end.seq or len(pieces) < 3:
            continue
        victim = pieces[len(pieces) // 2]
        if any(r.segment == s.name and r.offset + r.size <= victim.begin for r in j.records):
            return s.name, pieces, victim  # whole records before it in its segment
    raise AssertionError(f"no segment fits: {newest}")


@dataclass
class _Entry:
    name: str
    length: int
    sealed: bool


def last_whole_before(j: Journal, seg: str, offset: int) -> int:
    """The seq of the last record that ends at or before *offset* of *seg* (a segment of
    journal records only: the one before it is a whole record too)."""
    here = [r for r in j.records if r.segment == seg]
    whole = [r.seq for r in here if r.offset + r.size <= offset]
    return whole[-1] if whole else here[0].seq - 1


# ---------------------------------------------------------------- the same as from the server
def test_restore_from_the_bucket_equals_restore_from_the_server(journal, tmp_path):
    j = journal
    cases = {
        "latest": [],
        "batch": ["--batch", "chk:9"],
        "at": ["--at", format_time(j.at_ns)],
        "position": ["--position", str(j.position), "--workers", "1"],
    }
    for label, opts in cases.items():
        out = tmp_path / label
        r = bucket_sos("restore", "-q", j.ns, str(out), "--from", j.url, *opts)
        assert r.returncode == 0, r.stderr
        assert tree_state(str(out)) == j.points[label], label
        assert f"restored {j.ns} into {out}" in r.stderr
    v = bucket_sos("verify", "-q", j.ns, "--from", j.url)
    assert v.returncode == 0, v.stdout + v.stderr
    assert v.stdout.splitlines()[0].endswith(": OK"), v.stdout


def test_every_position_and_the_cache_rebuild_through_the_library(journal, tmp_path):
    """A restore from the bucket at every position (~110 of them, each read from its generation's
    start). Its own copy in pieces of 2 x PIECE: every segment still spans 2-4 pieces, so reads
    still cross piece boundaries, with half the GETs (each a request to moto)."""
    j = journal
    last = j.records[-1].seq
    url = make_bucket("tier")
    from sos_tier.s3 import S3Store

    store = S3Store(url)
    try:
        copy_to(store, j.ns, j.objects, piece=2 * PIECE)
        assert max(len(o.pieces) for o in scan(store, j.ns)[j.ns].objects.values()) >= 3
    finally:
        store.close()
    with BucketSource.open(url, j.ns) as source:
        cur: dict = {}
        for pos in range(0, last + 1):
            cur = j.states.get(pos, cur)
            out = tmp_path / f"p{pos}"
            restore(source, j.ns, str(out), position=pos)
            assert tree_state(str(out)) == cur, f"position {pos}"
            shutil.rmtree(out)
        assert rebuild_cache(source, j.ns, str(tmp_path / "cache")) == last
        assert tree_state(str(tmp_path / "cache")) == j.points["latest"]
        rep = verify(source, j.ns)
        assert rep.ok and rep.records == len(j.records), rep.text()


def test_a_local_directory_tier_restores_the_same(journal, tmp_path):
    j = journal
    url = (tmp_path / "tier").as_uri()
    copy_to(LocalStore(url), j.ns, j.objects)
    r = bucket_sos("restore", "-q", j.ns, str(tmp_path / "out"), "--from", url, "--batch", "chk:9")
    assert r.returncode == 0, r.stderr
    assert tree_state(str(tmp_path / "out")) == j.points["batch"]


# ---------------------------------------------------------------- what the bucket lacks or spoils
def fresh_copy(j: Journal) -> tuple[str, Store]:
    from sos_tier.s3 import S3Store

    url = make_bucket("tier")
    store = S3Store(url)
    copy_to(store, j.ns, j.objects)
    return url, store


def test_a_damaged_piece_is_named_by_verify_and_restore_stops_before_it(journal, tmp_path, clobber):
    j = journal
    url, store = fresh_copy(j)
    seg, _pieces, victim = newest_tail(j, store)
    data = bytearray(store.get(victim.key))
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the CRC can tell
    clobber(store, victim.key, bytes(data))
    v = bucket_sos("verify", "-q", j.ns, "--from", url)
    assert v.returncode == 3, v.stdout + v.stderr
    assert f"BROKEN {seg} [" in v.stdout and f"damaged piece {victim.key}: CRC32C" in v.stdout, v.stdout
    out = tmp_path / "out"
    r = bucket_sos("restore", "-q", j.ns, str(out), "--from", url)
    assert r.returncode == 3, r.stderr
    assert r.stderr.count("\n") == 1 and seg in r.stderr and victim.key in r.stderr, r.stderr
    n = applied_up_to(r.stderr)
    assert n == last_whole_before(j, seg, victim.begin)
    assert tree_state(str(out)) == j.states[n]  # every whole record before the damage, nothing after
    # a point before the damage does not read it: exit 0
    r = bucket_sos("restore", "-q", j.ns, str(tmp_path / "before"), "--from", url, "--position", str(n))
    assert r.returncode == 0, r.stderr
    assert tree_state(str(tmp_path / "before")) == j.states[n]
    store.close()


def test_a_missing_piece_in_the_middle_stops_restore_there_and_says_so(journal, tmp_path):
    j = journal
    url, store = fresh_copy(j)
    seg, pieces, victim = newest_tail(j, store)
    store.delete([victim.key])
    after = pieces[pieces.index(victim) + 1]
    out = tmp_path / "out"
    r = bucket_sos("restore", "-q", j.ns, str(out), "--from", url)
    assert r.returncode == 3, r.stderr
    assert seg in r.stderr and f"no piece holds byte {victim.begin}" in r.stderr and after.key in r.stderr, r.stderr
    n = applied_up_to(r.stderr)
    assert n == last_whole_before(j, seg, victim.begin)
    assert tree_state(str(out)) == j.states[n]
    v = bucket_sos("verify", "-q", j.ns, "--from", url)
    assert v.returncode == 3 and f"BROKEN {seg} [" in v.stdout and after.key in v.stdout, v.stdout
    store.close()


def test_a_second_history_is_a_conflict_named_by_its_key(journal, tmp_path):
    """A zombie server's piece for a range the run holds, with other bytes (its own CRC):
    neither history is chosen; restore stops where they part and names the key."""
    from sos_tier.layout import piece_key
    from sos_wire.crc import crc32c

    j = journal
    url, store = fresh_copy(j)
    seg, _pieces, victim = newest_tail(j, store)
    other = bytearray(store.get(victim.key))
    other[10] ^= 0x55
    zkey = piece_key(j.ns, seg, victim.begin, victim.end, crc32c(bytes(other)))
    store.put_once(zkey, bytes(other))
    r = bucket_sos("restore", "-q", j.ns, str(tmp_path / "out"), "--from", url)
    assert r.returncode == 3 and "conflict" in r.stderr.lower() and zkey in r.stderr, r.stderr
    assert tree_state(str(tmp_path / "out")) == j.states[applied_up_to(r.stderr)]
    v = bucket_sos("verify", "-q", j.ns, "--from", url)
    assert v.returncode == 3 and zkey in v.stdout, v.stdout
    store.close()


# ---------------------------------------------------------------- no bucket to read
def test_an_unreachable_endpoint_or_no_credentials_fails_clearly(journal, tmp_path):
    j = journal
    r = bucket_sos(
        "restore",
        "-q",
        j.ns,
        str(tmp_path / "a"),
        "--from",
        j.url,
        env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"},
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(f"sos: cannot read the bucket {j.url}: ") and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "a").exists()
    r = bucket_sos(
        "verify", "-q", j.ns, "--from", j.url, drop=(*NO_SERVER, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cannot read the bucket" in r.stderr and "credentials" in r.stderr, r.stderr
    v = bucket_sos("verify", "-q", "nosuchns", "--from", j.url)
    assert v.returncode == 4 and f"(bucket {j.url})" in v.stderr, v.stderr


def test_from_and_a_server_option_together_is_a_usage_error(tmp_path):
    r = bucket_sos("restore", "x", str(tmp_path / "t"), "--from", "file:///nonexistent", "--server", "127.0.0.1:1")
    assert r.returncode == 2 and "--server" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = bucket_sos("verify", "x", "--from", "gs://b/p")
    assert r.returncode == 1 and "unsupported tier URL" in r.stderr, r.stderr


def test_the_library_source_reads_a_store_object(journal):
    """BucketSource over an open Store (what spark_plugin or a program passes), and its errors."""
    j = journal
    with BucketSource.open(j.url, j.ns) as source:
        c = source()
        names = [e.name for e in c.list("gen/")]
        assert names == sorted(n for n in j.objects if n.startswith("gen/"))
        seg = names[0]
        assert c.stat(seg) == (len(j.objects[seg][0]), j.objects[seg][1])
        assert c.read(seg, 100, 700) == j.objects[seg][0][100:800]
        with pytest.raises(FileNotFoundError):
            c.stat("gen/nope")
    with pytest.raises(BucketUnavailable):
        BucketSource.open("s3://" + "x" * 3 + "/p", j.ns).state()


def test_pieces_outside_the_run_are_checked_and_foreign_keys_noted(journal, tmp_path):
    """A retry's or a zombie's overlapping piece is not on the run: verify reads it anyway (a
    damaged one is BROKEN, restore unaffected); one whose bytes differ from the run's is a
    conflict for restore too. A key the layout cannot have made is a note."""
    from sos_tier.layout import namespace_prefix, piece_key
    from sos_wire.crc import crc32c

    j = journal
    url, store = fresh_copy(j)
    seg, pieces, victim = newest_tail(j, store)
    run_bytes = store.get(victim.key)
    # damaged: a copy of [begin+8, begin+100) whose content fails the CRC in its name
    part = run_bytes[8:100]
    bad = piece_key(j.ns, seg, victim.begin + 8, victim.begin + 100, crc32c(part) ^ 1)
    store.put_once(bad, part)
    store.put_once(namespace_prefix(j.ns) + "stray-file", b"?")
    v = bucket_sos("verify", "-q", j.ns, "--from", url)
    assert v.returncode == 3, v.stdout + v.stderr
    assert f"BROKEN {seg} [{victim.begin + 8}, end)" in v.stdout and f"damaged piece {bad}" in v.stdout, v.stdout
    assert "stray-file: not a key of the layout; ignored" in v.stdout, v.stdout
    r = bucket_sos("restore", "-q", j.ns, str(tmp_path / "ok"), "--from", url)
    assert r.returncode == 0, r.stderr
    assert tree_state(str(tmp_path / "ok")) == j.points["latest"]
    # other bytes, their own CRC: a conflict where they part, for restore too
    other = bytearray(run_bytes[120:200])
    other[50] ^= 0x77
    zkey = piece_key(j.ns, seg, victim.begin + 120, victim.begin + 200, crc32c(bytes(other)))
    store.put_once(zkey, bytes(other))
    r = bucket_sos("restore", "-q", j.ns, str(tmp_path / "out"), "--from", url)
    assert r.returncode == 3 and zkey in r.stderr and f"byte {victim.begin + 170}" in r.stderr, r.stderr
    n = applied_up_to(r.stderr)
    assert n == last_whole_before(j, seg, victim.begin + 170)
    assert tree_state(str(tmp_path / "out")) == j.states[n]
    store.close()
