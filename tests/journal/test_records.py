"""Journal record codec and layout: round trips, the documented example, garbage -> typed error."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sos_journal.errors import JournalCorrupt
from sos_journal.format import layout
from sos_journal.format.records import (
    MAX_DATA,
    MAX_FILE_SIZE,
    Create,
    Delete,
    Marker,
    Mkdir,
    RecordDecoder,
    Rename,
    Rmdir,
    SnapshotEnd,
    Truncate,
    Write,
    decode_all,
    encode,
    split_write,
)

DOC = Path(__file__).resolve().parents[2] / "protocol.md"

seg_part = st.text(alphabet="abcXYZ019._-é", min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))
paths = st.lists(seg_part, min_size=1, max_size=4).map("/".join)
u64 = st.integers(0, 2**64 - 1)
off_t = st.integers(0, MAX_FILE_SIZE - 300)
ops = st.one_of(
    st.builds(Mkdir, paths, st.integers(0, 0o7777)),
    st.builds(Rmdir, paths),
    st.builds(Create, paths, st.integers(0, 0o7777)),
    st.builds(Write, paths, off_t, st.binary(max_size=300)),
    st.builds(Truncate, paths, off_t),
    st.builds(Rename, paths, paths, st.booleans()),
    st.builds(Delete, paths),
    st.builds(Marker, st.text(max_size=40), st.binary(max_size=200)),
    st.builds(SnapshotEnd, u64),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(ops, u64, u64), max_size=8), st.integers(1, 50))
def test_round_trip_any_split(items, step):
    data = b"".join(encode(op, seq, t) for op, seq, t in items)
    dec = RecordDecoder("s")
    got = []
    for i in range(0, len(data), step):  # fed in arbitrary pieces
        dec.feed(data[i : i + step])
        got.extend(dec)
    assert dec.pending == 0
    assert [(r.op, r.seq, r.time_ns) for r in got] == items
    offsets = [r.offset for r in got]
    assert offsets == sorted(offsets) and (not got or offsets[0] == 0)


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=1, max_size=200))
def test_garbage_raises_typed_error_or_waits(blob):
    dec = RecordDecoder("gen/0000000001/0000000001-0000000001.seg")
    dec.feed(blob)
    try:
        list(dec)
    except JournalCorrupt as e:
        assert e.segment == "gen/0000000001/0000000001-0000000001.seg"
        assert e.offset == 0
    else:
        assert dec.pending == len(blob)  # a prefix of a record: nothing decoded


def test_every_flipped_byte_is_detected():
    rec = encode(Write("chk/a", 7, b"payload"), 5, 123)
    good = encode(Mkdir("d"), 4, 120)
    for i in range(len(rec)):
        bad = bytearray(rec)
        bad[i] ^= 0x40
        d = RecordDecoder("seg")
        d.feed(good + bytes(bad) + b"\0" * 64)
        try:
            got = list(d)
        except JournalCorrupt as e:
            assert e.offset == len(good) and e.segment == "seg", (i, e)
            assert "seg" in str(e) and str(len(good)) in str(e)
        else:
            # only a flipped length can make the record look longer than the bytes at hand:
            # then it is never decoded (a reader at the end of the segment reports it torn)
            assert i < 4 and len(got) == 1 and d.pending > 0, i


def test_truncated_tail_is_reported_by_decode_all():
    data = encode(Mkdir("d"), 1, 1) + encode(Create("d/f"), 2, 2)
    with pytest.raises(JournalCorrupt, match="truncated") as ei:
        decode_all(data[:-3], "x.seg")
    assert ei.value.offset == len(encode(Mkdir("d"), 1, 1))
    assert len(decode_all(data[:-3], allow_partial=True)) == 1


def test_layout_violations_are_corrupt():
    # length below the minimum
    with pytest.raises(JournalCorrupt, match="length"):
        decode_all(struct.pack(">II", 3, 0) + b"\0" * 20)
    # valid CRC but trailing bytes after the body
    import crc32c

    rest = bytes([7]) + struct.pack(">QQ", 1, 1) + b"\x00\x01a" + b"junk"
    with pytest.raises(JournalCorrupt, match="trailing"):
        decode_all(struct.pack(">II", len(rest), crc32c.crc32c(rest)) + rest)
    # valid CRC, unknown type
    rest = bytes([77]) + struct.pack(">QQ", 1, 1)
    with pytest.raises(JournalCorrupt, match="unknown record type"):
        decode_all(struct.pack(">II", len(rest), crc32c.crc32c(rest)) + rest)
    # valid CRC, path escaping the tree
    rest = bytes([7]) + struct.pack(">QQ", 1, 1) + b"\x00\x05../etc"[:7]
    rest = bytes([7]) + struct.pack(">QQ", 1, 1) + struct.pack(">H", 6) + b"../etc"
    with pytest.raises(JournalCorrupt, match="bad path"):
        decode_all(struct.pack(">II", len(rest), crc32c.crc32c(rest)) + rest)


@pytest.mark.parametrize("bad", ["", "/abs", "a//b", "a/./b", "../x", "a/..", "a\0b"])
def test_encode_refuses_bad_paths(bad):
    with pytest.raises(ValueError):
        encode(Create(bad), 1, 1)


def test_offsets_beyond_off_t_are_refused_on_encode():
    with pytest.raises(ValueError):
        encode(Write("f", MAX_FILE_SIZE, b"x"), 1, 1)
    with pytest.raises(ValueError):
        encode(Truncate("f", MAX_FILE_SIZE + 1), 1, 1)
    assert decode_all(encode(Truncate("f", MAX_FILE_SIZE), 1, 1))[0].op.size == MAX_FILE_SIZE


def test_write_data_is_capped_and_split():
    with pytest.raises(ValueError):
        encode(Write("f", 0, b"x" * (MAX_DATA + 1)), 1, 1)
    parts = list(split_write("f", 10, b"y" * (2 * MAX_DATA + 5)))
    assert [(p.offset, len(p.data)) for p in parts] == [
        (10, MAX_DATA),
        (10 + MAX_DATA, MAX_DATA),
        (10 + 2 * MAX_DATA, 5),
    ]


def test_documented_hex_example_decodes():
    text = DOC.read_text().split("\n# Part 2: the journal format\n", 1)[1]
    block = re.search(r"```hex\n(.*?)```", text, re.S).group(1)
    hexdigits = "".join(line for line in block.splitlines() if not line.startswith("#"))
    data = bytes.fromhex(hexdigits.replace(" ", ""))
    assert len(data) == 261
    recs = decode_all(data, "gen/0000000001/0000000001-0000000001.seg")
    t0 = 1763900000000000000
    assert [(r.seq, r.time_ns, r.offset) for r in recs] == [
        (i + 1, t0 + 1000 * i, off) for i, off in enumerate([0, 33, 67, 108, 160, 205])
    ]
    assert [r.op for r in recs] == [
        SnapshotEnd(1),
        Mkdir("chk", 0o755),
        Create("chk/.a.tmp", 0o644),
        Write("chk/.a.tmp", 0, b"hi\n"),
        Rename("chk/.a.tmp", "chk/a", False),
        Marker("spark.batch", b'{"batch_id":0}'),
    ]
    # and the code encodes exactly those bytes
    assert b"".join(encode(r.op, r.seq, r.time_ns) for r in recs) == data


def test_segment_names():
    n = layout.segment_name(3, 1234, 2)
    assert n == "gen/0000000003/0000001234-0000000002.seg"
    assert layout.parse_segment_name(n) == layout.SegmentName(3, 1234, 2)
    assert layout.ready_name(3) == "gen/0000000003/ready"
    assert layout.parse_ready_name("gen/0000000003/ready") == 3
    for junk in ["gen/3/1-2.seg", "gen/0000000003/0000001234-0000000002.se", "x/0000000003/ready"]:
        assert layout.parse_segment_name(junk) is None and layout.parse_ready_name(junk) is None
    with pytest.raises(ValueError):
        layout.segment_name(-1, 1, 1)
