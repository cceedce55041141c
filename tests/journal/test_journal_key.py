"""Hostile input, round 3 (issue 26 item 2): the bucket is storage, not authority.

Someone who can write to the bucket, or who holds the SOS server's data and keys, but not the
namespace's journal key, must not be able to change what a restore gives. Real parts: a real
sos-server process, a journal written through open_namespace with a journal key, its objects
copied into a ``file://`` tier by ``sos_tier.Uploader`` (as a tiering server does), then:

* a planted record with a valid CRC appended as a piece to the open segment in the bucket:
  ``sos restore --from`` and ``sos verify --from`` refuse (exit 3) naming the object and offset;
* a record appended through the server with the namespace's append key (at the current epoch):
  ``sos restore`` from the server, from a replacement server bootstrapped from the bucket, and
  an empty-cache open_namespace all refuse;
* a wrong key and no key refuse; the record format's authenticated form is checked against the
  construct definition, and the chain refuses reordered, replayed and moved records.

Each refusal test fails on 70eb7dc (where the planted records were restored, exit 0).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from sos_client import Client
from sos_journal import restore, verify
from sos_journal.errors import JournalAuthError, JournalKeyRequired
from sos_journal.format import layout
from sos_journal.format.auth import ChainCheck, JournalKeys, SegmentKeys, Signer
from sos_journal.format.record_layout import build_record, parse_record
from sos_journal.format.records import Create, Encrypted, Marker, RecordDecoder, Write, decode_all, encode
from sos_journal.testing import tree_state
from sos_journal.tree.open import open_namespace
from sos_journal.writer import auth as writer_auth
from sos_server.tier_bootstrap import bootstrap
from sos_tier import LocalStore, Uploader
from tests.support import run_sos
from tools.server import ServerProcess

pytestmark = [pytest.mark.hostile, pytest.mark.slow]

WAIT = 180
PIECE = 700
SECRET = b"the-plaintext-of-a-known-file " * 20
KEY = "5c" * 32  # the namespace's journal key (64 hex digits)

#: `sos` with none of this process's SOS_* variables
sos_alone = functools.partial(run_sos, drop=("SOS_*",))


@dataclass
class Origin:
    base: str
    srv: ServerProcess
    ns: str
    key: str  # the SOS server's append key of ns
    objects: dict[str, tuple[bytes, bool]]
    state: dict  # the tree as written
    keys_dir: str  # a backup of the server's key files of ns

    def factory(self):
        return Client(self.srv.address, self.key, self.ns, timeout=60)


def _copy_to(store: LocalStore, ns: str, objects: dict[str, tuple[bytes, bool]]) -> None:
    up = Uploader(store, max_piece=PIECE)
    for name, (data, sealed) in objects.items():
        up.sync(ns, name, lambda b, e, d=data: d[b:e], len(data), sealed)
        assert up.uploaded(ns, name) == len(data)


def _objects(c: Client) -> dict[str, tuple[bytes, bool]]:
    return {e.name: (c.read(e.name), bool(e.sealed)) for e in c.list("")}


def _open_segment(objects: dict[str, tuple[bytes, bool]]) -> str:
    segs = sorted(n for n in objects if layout.parse_segment_name(n))
    assert not objects[segs[-1]][1], "the newest segment is open (unsealed)"
    return segs[-1]


def _forged(data: bytes, seg: str, *, sign=None, op=None) -> bytes:
    """A WRITE over the known file (or ``op``) with a valid CRC, as the next record of ``seg``."""
    last = decode_all(data, seg)[-1]
    return encode(op or Write("d/secret", 0, b"EVIL" * 8), last.seq + 1, last.time_ns + 1, sign)


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("jauth"))
    srv = ServerProcess(os.path.join(base, "data"), log_path=os.path.join(base, "server.log")).start()
    ns = f"ja{os.getpid()}"
    key = srv.keygen(ns, "append")
    try:
        o = Origin(base, srv, ns, key, {}, {}, os.path.join(base, "keys-backup"))
        on = open_namespace(ns, os.path.join(base, "cache"), client_factory=o.factory, journal_key=KEY)
        t = on.tree
        t.mkdir("d")
        t.create("d/.secret.tmp")
        t.write("d/.secret.tmp", 0, SECRET)
        t.rename("d/.secret.tmp", "d/secret", overwrite=False)
        t.mkdir("chk")
        t.mkdir("chk/commits")
        t.create("chk/commits/.0.tmp")
        t.rename("chk/commits/.0.tmp", "chk/commits/0", overwrite=False)
        t.marker("spark.batch", b'{"checkpoint": "chk", "query_id": "q", "batch_id": 0}')
        o.state = tree_state(t.local_path(""))
        on.close()
        with o.factory() as c:
            o.objects = _objects(c)
        shutil.copytree(os.path.join(base, "data", "ns", ns, "keys"), o.keys_dir)
        yield o
    finally:
        srv.stop()


def _bucket(o: Origin, tmp_path, objects=None) -> str:
    store = LocalStore((tmp_path / "tier").as_uri())
    try:
        _copy_to(store, o.ns, objects or o.objects)
    finally:
        store.close()
    return (tmp_path / "tier").as_uri()


def _plant_piece(o: Origin, url: str, forged: bytes) -> tuple[str, int]:
    """Append ``forged`` as a new piece of the open segment in the bucket (what someone who can
    write to the bucket can do); returns the segment and the forged record's offset."""
    seg = _open_segment(o.objects)
    data = o.objects[seg][0]
    new = data + forged
    store = LocalStore(url)
    try:
        up = Uploader(store, max_piece=PIECE)
        up.learn(o.ns)
        up.sync(o.ns, seg, lambda b, e: new[b:e], len(new), False)
        assert up.uploaded(o.ns, seg) == len(new)
    finally:
        store.close()
    return seg, len(data)


# ---------------------------------------------------------------- the bucket
def test_the_bucket_as_written_restores_and_verifies_with_the_key(origin, tmp_path):
    url = _bucket(origin, tmp_path)
    r = sos_alone("restore", origin.ns, str(tmp_path / "out"), "--from", url, "-q", env={"SOS_JOURNAL_KEY": KEY})
    assert r.returncode == 0, r.stderr
    assert tree_state(str(tmp_path / "out")) == origin.state
    v = sos_alone("verify", origin.ns, "--from", url, "-q", env={"SOS_JOURNAL_KEY": KEY})
    assert v.returncode == 0, v.stdout + v.stderr
    assert "every record authenticated by journal key bfe1df15f390fb5f" in v.stdout, v.stdout


def test_the_bucket_and_the_server_s_disk_hold_no_plaintext(origin, tmp_path):
    """Encryption (protocol.md 2.5): a copied bucket, or the server's data directory, shows
    neither the known file's content nor its name, nor the marker's payload."""
    _bucket(origin, tmp_path)
    needles = [SECRET[:29], b"d/secret", b".secret.tmp", b"query_id"]
    seen = 0
    for root in (tmp_path / "tier", os.path.join(origin.base, "data")):
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                with open(os.path.join(dirpath, f), "rb") as fh:
                    data = fh.read()
                seen += len(data)
                for needle in needles:
                    assert needle not in data, (needle, os.path.join(dirpath, f))
    assert seen > len(SECRET)  # the journal is there, sealed


@pytest.mark.parametrize("how", ["unsigned", "other-key"])
def test_a_planted_piece_with_valid_crcs_is_refused_by_restore_and_verify_from_the_bucket(origin, tmp_path, how):
    url = _bucket(origin, tmp_path)
    seg = _open_segment(origin.objects)
    sign = None
    if how == "other-key":
        sign = Signer(JournalKeys.parse(secrets.token_hex(32)), origin.ns)
        sign.restart(layout.parse_segment_name(seg).generation)
    seg, offset = _plant_piece(origin, url, _forged(origin.objects[seg][0], seg, sign=sign))
    env = {"SOS_JOURNAL_KEY": KEY}
    out = tmp_path / "out"
    r = sos_alone("restore", origin.ns, str(out), "--from", url, "-q", env=env)
    assert r.returncode == 3, r.stderr
    assert seg in r.stderr and f"offset {offset}" in r.stderr and "not authentic" in r.stderr, r.stderr
    # what came before the planted record is the tree as written: the forgery changed nothing
    assert (out / "d" / "secret").read_bytes() == SECRET
    v = sos_alone("verify", origin.ns, "--from", url, "-q", env=env)
    assert v.returncode == 3, v.stdout + v.stderr
    assert v.stdout.split("\n")[0].endswith("BROKEN"), v.stdout
    assert f"{seg} [{offset}," in v.stdout, v.stdout
    # the key file option works the same as the environment
    kf = tmp_path / "journal.key"
    kf.write_text(KEY + "\n")
    r2 = sos_alone("restore", origin.ns, str(tmp_path / "out2"), "--from", url, "-q", "--journal-key-file", str(kf))
    assert r2.returncode == 3 and seg in r2.stderr, r2.stderr


def test_a_wrong_key_or_no_key_refuses(origin, tmp_path):
    url = _bucket(origin, tmp_path)
    wrong = sos_alone(
        "restore", origin.ns, str(tmp_path / "a"), "--from", url, "-q", env={"SOS_JOURNAL_KEY": "ab" * 32}
    )
    assert wrong.returncode == 3 and "wrong journal key" in wrong.stderr, wrong.stderr
    none = sos_alone("restore", origin.ns, str(tmp_path / "b"), "--from", url, "-q")
    assert none.returncode == 3 and "no journal key was given" in none.stderr, none.stderr
    assert not os.path.exists(tmp_path / "b" / "d" / "secret")
    v = sos_alone("verify", origin.ns, "--from", url, "-q")
    assert v.returncode == 3 and "no journal key was given" in v.stdout, v.stdout
    bad = sos_alone("restore", origin.ns, str(tmp_path / "c"), "--from", url, "-q", env={"SOS_JOURNAL_KEY": "short"})
    assert bad.returncode == 1 and "malformed journal key" in bad.stderr and "short" not in bad.stderr, bad.stderr


# ---------------------------------------------------------------- the server
def _server_copy(origin: Origin, tmp_path) -> ServerProcess:
    data = tmp_path / "data"
    origin.srv.stop()
    try:
        shutil.copytree(origin.srv.data_dir, data)
    finally:
        origin.srv.start()
    return ServerProcess(data, log_path=tmp_path / "copy.log").start()


@pytest.fixture
def forged_server(origin, tmp_path):
    """A copy of the origin's server whose open segment got a record appended with the
    namespace's append key at the current epoch (someone holding the server's data and keys)."""
    srv = _server_copy(origin, tmp_path)
    seg = _open_segment(origin.objects)
    old = origin.objects[seg][0]
    with Client(srv.address, origin.key, origin.ns, timeout=60) as c:
        epoch = layout.parse_segment_name(seg).epoch
        c.append(seg, len(old), _forged(old, seg), epoch=epoch)
        objects = _objects(c)
    try:
        yield srv, seg, len(old), objects
    finally:
        srv.stop()


def test_a_forged_append_through_the_server_is_refused_by_restore_and_an_empty_cache(origin, forged_server, tmp_path):
    srv, seg, offset, objects = forged_server
    env = {"SOS_JOURNAL_KEY": KEY, "SOS_KEY": origin.key}
    r = sos_alone("restore", origin.ns, str(tmp_path / "out"), "--server", srv.address, "-q", env=env)
    assert r.returncode == 3 and seg in r.stderr and f"offset {offset}" in r.stderr, r.stderr
    v = sos_alone("verify", origin.ns, "--server", srv.address, "-q", env=env)
    assert v.returncode == 3 and seg in v.stdout, v.stdout

    def fac():
        return Client(srv.address, origin.key, origin.ns, timeout=60)

    with pytest.raises(JournalAuthError) as ei:
        restore(fac, origin.ns, str(tmp_path / "lib"), journal_key=KEY)
    assert ei.value.segment == seg and ei.value.offset == offset
    # a writer (gateway, mount, fsspec) opened on an empty cache rebuilds it by restore: refused
    with pytest.raises(JournalAuthError) as ei2:
        open_namespace(origin.ns, str(tmp_path / "cache"), client_factory=fac, journal_key=KEY)
    assert ei2.value.segment == seg and ei2.value.offset == offset


def test_a_replacement_server_built_from_a_forged_bucket_restores_nothing_forged(origin, forged_server, tmp_path):
    srv, seg, offset, objects = forged_server
    url = _bucket(origin, tmp_path, objects)
    data = tmp_path / "replacement"
    shutil.copytree(origin.keys_dir, data / "ns" / origin.ns / "keys")
    store = LocalStore(url)
    try:
        report = bootstrap(str(data), store)
    finally:
        store.close()
    assert report.problems == []
    new = ServerProcess(data, log_path=tmp_path / "replacement.log").start()
    try:
        env = {"SOS_JOURNAL_KEY": KEY, "SOS_KEY": origin.key}
        r = sos_alone("restore", origin.ns, str(tmp_path / "out"), "--server", new.address, "-q", env=env)
        assert r.returncode == 3 and seg in r.stderr and f"offset {offset}" in r.stderr, r.stderr
    finally:
        new.stop()


# ---------------------------------------------------------------- writers
def test_a_writer_without_the_key_refuses_before_fencing(origin, tmp_path):
    with origin.factory() as c:
        names_before = sorted(e.name for e in c.list(""))
    with pytest.raises(JournalKeyRequired) as ei:
        open_namespace(origin.ns, str(tmp_path / "cache"), client_factory=origin.factory)
    assert "nothing was fenced" in str(ei.value)
    with origin.factory() as c:
        assert sorted(e.name for e in c.list("")) == names_before
    with pytest.raises(JournalAuthError, match="not in this writer's key ring"):
        open_namespace(origin.ns, str(tmp_path / "cache2"), client_factory=origin.factory, journal_key="ab" * 32)


def test_without_a_key_the_journal_works_as_before_and_the_writer_warns(tmp_path, caplog):
    srv = ServerProcess(tmp_path / "data", log_path=tmp_path / "server.log").start()
    try:
        ns = "plain"
        key = srv.keygen(ns, "append")

        def fac():
            return Client(srv.address, key, ns, timeout=60)

        env_backup = {k: os.environ.pop(k) for k in ("SOS_JOURNAL_KEY", "SOS_JOURNAL_KEY_FILE") if k in os.environ}
        try:
            with caplog.at_level(logging.WARNING, logger=writer_auth.log.name):
                on = open_namespace(ns, str(tmp_path / "cache"), client_factory=fac)
            assert any("unauthenticated" in r.getMessage() for r in caplog.records)
            on.tree.create("f")
            on.tree.write("f", 0, b"plain")
            on.close()
            restore(fac, ns, str(tmp_path / "out"))
            assert (tmp_path / "out" / "f").read_bytes() == b"plain"
            # adopting a key: the writer starts a generation under it; restores need it from then on
            on = open_namespace(ns, str(tmp_path / "cache"), client_factory=fac, journal_key=KEY)
            on.tree.create("g")
            on.close()
        finally:
            os.environ.update(env_backup)
        s = restore(fac, ns, str(tmp_path / "out2"), journal_key=KEY)
        assert s.generation == 2 and sorted(os.listdir(tmp_path / "out2")) == ["f", "g"]
        with pytest.raises(JournalKeyRequired):
            restore(fac, ns, str(tmp_path / "out3"), journal_key=None)
        assert verify(fac, ns, journal_key=KEY).problems  # generation 1 is not authenticated
        # generation 1 alone, as written before the key, needs none
        restore(fac, ns, str(tmp_path / "out4"), generation=1)
    finally:
        srv.stop()


# ---------------------------------------------------------------- the format and the chain
def _signed(ns: str, generation: int, ops, key: str = KEY, first_seq: int = 1, encrypt: bool = True) -> bytes:
    sign = Signer(JournalKeys.parse(key), ns, encrypt=encrypt)
    sign.restart(generation)
    sign.epoch = 1
    out = []
    for i, op in enumerate(ops):
        rec = encode(op, first_seq + i, 1_000 + i, sign)
        sign.prev = rec[-16:]
        out.append(rec)
    return b"".join(out)


def test_the_authenticated_form_matches_the_construct_definition_byte_for_byte():
    keys = JournalKeys.parse(KEY)
    data = _signed("ns", 1, [Create("a", 0o644), Write("a", 0, b"xyz"), Marker("m", b"p")], encrypt=False)
    recs = decode_all(data, "seg")
    pos = 0
    for rec in recs:
        one = data[pos : pos + rec.size]
        assert one[8] & 0x80 and rec.key_id == keys.signer.key_id and len(rec.tag) == 16
        assert build_record(rec.op, rec.seq, rec.time_ns, one[-24:]) == one
        parsed = parse_record(one, "seg", pos)
        assert (parsed.op, parsed.key_id, parsed.tag) == (rec.op, rec.key_id, rec.tag)
        pos += rec.size
    # golden vector of protocol.md 2.5 (key 0x5c * 32, namespace "ns", generation 1)
    assert data[: recs[0].size].hex() == GOLDEN_CREATE
    doc = (Path(__file__).resolve().parents[2] / "protocol.md").read_text()
    section = doc[doc.index("## 2.5 ") : doc.index("# Part 3")]
    block = section[section.index("**Example.**") :].split("```")[1]
    assert "".join(block.split()) == GOLDEN_CREATE
    assert keys.signer.fingerprint in section
    # encrypted: without the key the body is sealed (an Encrypted op), with it the same ops
    sealed = _signed("ns", 1, [Create("a", 0o644), Write("a", 0, b"xyz"), Marker("m", b"p")])
    seg = layout.segment_name(1, 1, 1)
    opaque = decode_all(sealed, seg)
    assert all(type(r.op) is Encrypted and r.tag for r in opaque)
    assert b"xyz" not in sealed
    pos = 0
    for rec in opaque:
        one = sealed[pos : pos + rec.size]
        assert one[8] & 0xC0 == 0xC0
        assert build_record(rec.op, rec.seq, rec.time_ns, one[-24:]) == one
        assert parse_record(one, seg, pos).op == rec.op
        pos += rec.size
    dec = RecordDecoder(seg, keys=SegmentKeys(keys, "ns", seg))
    dec.feed(sealed)
    assert [r.op for r in dec] == [r.op for r in recs]
    block2 = section[section.index("**Encrypted example.**") :].split("```")[1]
    assert "".join(block2.split()) == sealed[: opaque[0].size].hex()


GOLDEN_CREATE = "".join(
    [
        *["00000030", "6f47c67c", "83", "0000000000000001", "00000000000003e8", "0001", "61", "000001a4"],
        *["bfe1df15f390fb5f", "c7525022d0470a62e2b96cf10e282004"],  # key fingerprint, tag
    ]
)


def _check(data: bytes, ns: str, generation: int, key: str | None = KEY):
    keys = JournalKeys.parse(key) if key else None
    chk = ChainCheck(keys, ns, generation)
    dec = RecordDecoder(
        layout.segment_name(generation, 1, 1), keys=chk.for_segment(layout.segment_name(generation, 1, 1))
    )
    dec.feed(data)
    for rec in dec:
        chk.check(rec)


def test_the_chain_refuses_moved_reordered_and_spliced_records():
    ops = [Create("a"), Write("a", 0, b"1"), Write("a", 1, b"2"), Write("a", 2, b"3")]
    good = _signed("ns", 3, ops)
    _check(good, "ns", 3)
    with pytest.raises(JournalAuthError, match=r"fails authentication|does not open"):
        _check(good, "other", 3)  # another namespace
    with pytest.raises(JournalAuthError, match=r"fails authentication|does not open"):
        _check(good, "ns", 4)  # another generation
    plain = _signed("ns", 3, ops, encrypt=False)
    _check(plain, "ns", 3)  # authenticated, not encrypted: read as well
    with pytest.raises(JournalAuthError, match="fails authentication"):
        _check(plain, "other", 3)
    recs = decode_all(good)
    parts = [good[r.offset : r.offset + r.size] for r in recs]
    with pytest.raises(JournalAuthError, match="record 3 fails"):
        _check(parts[0] + parts[2], "ns", 3)  # a record dropped from the middle
    # a fork: the same places written with other contents (a zombie writer's refused appends
    # that the server kept): spliced after the real records, each verifies alone, not chained
    fork = _signed("ns", 3, [Create("a"), Write("a", 0, b"X"), Write("a", 1, b"Y"), Write("a", 2, b"Z")])
    fparts = [fork[r.offset : r.offset + r.size] for r in decode_all(fork)]
    with pytest.raises(JournalAuthError, match="record 3 fails"):
        _check(parts[0] + parts[1] + fparts[2], "ns", 3)
    # an unauthenticated record mixed in
    with pytest.raises(JournalAuthError, match="not authenticated"):
        _check(parts[0] + encode(Write("a", 0, b"x"), 2, 5), "ns", 3)
    with pytest.raises(JournalKeyRequired):
        _check(good, "ns", 3, key=None)


def test_a_standby_tail_follows_the_key_s_records_and_refuses_a_forged_one(origin, tmp_path, monkeypatch):
    from spark_plugin.gateway.pair.standby import Tailer

    monkeypatch.setenv("SOS_JOURNAL_KEY", KEY)
    srv = _server_copy(origin, tmp_path)
    try:

        def fac():
            return Client(srv.address, origin.key, origin.ns, timeout=60)

        tailer = Tailer(fac, origin.ns, str(tmp_path / "standby"))
        with fac() as c:
            tailer.step(c)
            assert tree_state(str(tmp_path / "standby")) == origin.state
            # the writer goes on (an empty cache: rebuilt, then a new generation): followed
            on = open_namespace(origin.ns, str(tmp_path / "cache"), client_factory=fac, journal_key=KEY)
            on.tree.create("d/more")
            on.close()
            assert tailer.step(c) > 0
            assert (tmp_path / "standby" / "d" / "more").exists()
            objects = _objects(c)
            seg = _open_segment(objects)
            old = objects[seg][0]
            c.append(seg, len(old), _forged(old, seg), epoch=layout.parse_segment_name(seg).epoch)
            with pytest.raises(JournalAuthError) as ei:
                tailer.step(c)
            assert ei.value.segment == seg and ei.value.offset == len(old)
            assert (tmp_path / "standby" / "d" / "secret").read_bytes() == SECRET
        tailer.close()
    finally:
        srv.stop()


def test_a_gateway_on_an_empty_cache_refuses_a_forged_journal(origin, forged_server, tmp_path):
    """The face a cluster runs: `sos gateway --journal-key-file` restoring its empty cache from a
    server whose journal got a forged append exits non-zero naming the segment and offset."""
    from sos_client.process import ChildStartError
    from spark_plugin.gateway.process import GatewayProcess

    srv, seg, offset, _objects_ = forged_server
    kf = tmp_path / "journal.key"
    kf.write_text(KEY + "\n")
    gw = GatewayProcess(
        origin.ns,
        str(tmp_path / "gw-cache"),
        srv.address,
        origin.key,
        log_path=str(tmp_path / "gw.log"),
        extra_args=["--journal-key-file", str(kf)],
    )
    with pytest.raises(ChildStartError) as ei:
        gw.start(timeout=120)
    gw.stop()
    text = str(ei.value)
    assert "not authentic" in text and seg in text and f"offset {offset}" in text, text[-2000:]
    assert KEY not in text


def test_a_planted_commit_is_no_batch_to_restore_to(origin, tmp_path):
    """`sos restore --batch` scans the journal for the commit: a commit file planted in the
    bucket (a CREATE of chk/commits/1) is refused, not restored as batch 1."""
    url = _bucket(origin, tmp_path)
    env = {"SOS_JOURNAL_KEY": KEY}
    ok = sos_alone("restore", origin.ns, str(tmp_path / "b0"), "--from", url, "--batch", "chk:0", "-q", env=env)
    assert ok.returncode == 0 and (tmp_path / "b0" / "chk" / "commits" / "0").exists(), ok.stderr
    seg = _open_segment(origin.objects)
    seg, offset = _plant_piece(origin, url, _forged(origin.objects[seg][0], seg, op=Create("chk/commits/1")))
    r = sos_alone("restore", origin.ns, str(tmp_path / "b1"), "--from", url, "--batch", "chk:1", "-q", env=env)
    assert r.returncode == 3 and seg in r.stderr and f"offset {offset}" in r.stderr, r.stderr
    assert not (tmp_path / "b1" / "chk" / "commits" / "1").exists()
