"""The hand-written journal record codec (records.py, the fast path) against the construct
definition (record_layout.py, protocol.md Part 2), byte for byte: every record kind, edge
sizes, random records, and malformed ones, which both refuse with JournalCorrupt."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sos_journal.errors import JournalCorrupt
from sos_journal.format.record_layout import build_record, parse_record
from sos_journal.format.records import (
    MAX_DATA,
    MAX_FILE_SIZE,
    MAX_MODE,
    Create,
    Delete,
    Marker,
    Mkdir,
    Rename,
    Rmdir,
    SnapshotEnd,
    Truncate,
    Write,
    decode_all,
    encode,
)
from sos_wire.crc import crc32c

LONG_PATH = "/".join(["s" * 255] * 16)[:4096].rstrip("/")  # 4096 bytes at most, segments of 255

EDGES = [
    Mkdir("d", 0),
    Mkdir("d", MAX_MODE),
    Rmdir("d"),
    Create("a/b", 0o644),
    Create(LONG_PATH, 0o600),
    Write("f", 0, b""),
    Write("f", 0, b"x" * MAX_DATA),
    Write("f", MAX_FILE_SIZE - 3, b"end"),
    Write("\u00e9t\u00e9/\udcff", 7, b"\x00\xff"),
    Truncate("f", 0),
    Truncate("f", MAX_FILE_SIZE),
    Rename("a", "b", False),
    Rename(LONG_PATH, "b", True),
    Delete("x"),
    Marker("spark.batch", b'{"batch_id": 3}'),
    Marker("l" * 255, b"p" * MAX_DATA),
    Marker("", b""),
    SnapshotEnd(0),
    SnapshotEnd(2**64 - 1),
]


def same(op, seq=7, time_ns=123456789):
    fast = encode(op, seq, time_ns)
    assert build_record(op, seq, time_ns) == fast
    by_layout = parse_record(fast, "seg", 40)
    (by_fast,) = decode_all(fast, "seg")
    assert by_layout.op == by_fast.op == op
    assert (by_layout.seq, by_layout.time_ns, by_layout.size) == (by_fast.seq, by_fast.time_ns, by_fast.size)


@pytest.mark.parametrize("op", EDGES, ids=lambda op: type(op).__name__)
def test_every_kind_and_edge_size_is_the_same_bytes_both_ways(op):
    same(op, seq=0)
    same(op, seq=2**64 - 1, time_ns=2**64 - 1)


segment = st.text(
    st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=20
).filter(lambda s: s not in (".", ".."))
paths = st.lists(segment, min_size=1, max_size=4).map("/".join)
u64 = st.integers(0, 2**64 - 1)
ops = st.one_of(
    st.builds(Mkdir, paths, st.integers(0, MAX_MODE)),
    st.builds(Rmdir, paths),
    st.builds(Create, paths, st.integers(0, MAX_MODE)),
    st.builds(Write, paths, st.integers(0, MAX_FILE_SIZE - 64), st.binary(max_size=64)),
    st.builds(Truncate, paths, st.integers(0, MAX_FILE_SIZE)),
    st.builds(Rename, paths, paths, st.booleans()),
    st.builds(Delete, paths),
    st.builds(Marker, st.text(max_size=30), st.binary(max_size=64)),
    st.builds(SnapshotEnd, u64),
)


@settings(max_examples=300, deadline=None)
@given(ops, u64, u64)
def test_random_records_are_the_same_bytes_both_ways(op, seq, time_ns):
    same(op, seq, time_ns)


def record(typ: int, body: bytes, *, length_delta: int = 0, crc_delta: int = 0) -> bytes:
    content = struct.pack(">BQQ", typ, 1, 2) + body
    return struct.pack(">II", len(content) + length_delta, (crc32c(content) + crc_delta) % 2**32) + content


def s16(text: bytes) -> bytes:
    return struct.pack(">H", len(text)) + text


MALFORMED = {
    "crc": record(7, s16(b"a"), crc_delta=1),
    "length below the header": struct.pack(">II", 3, 0) + b"\x07\x00\x00",
    "length above the largest record": struct.pack(">II", 1 << 30, 0) + b"\x00" * 32,
    "unknown type": record(10, s16(b"a")),
    "mode with more than permission bits": record(3, s16(b"a") + struct.pack(">I", 0o10000)),
    "overwrite flag 2": record(6, s16(b"a") + s16(b"b") + b"\x02"),
    "dot-dot path": record(7, s16(b"a/../b")),
    "absolute path": record(7, s16(b"/etc/passwd")),
    "NUL in path": record(7, s16(b"a\x00b")),
    "trailing byte": record(7, s16(b"a") + b"!"),
    "body shorter than its fields": record(4, s16(b"a") + struct.pack(">Q", 0)),
    "data above 1 MiB": record(4, s16(b"a") + struct.pack(">QI", 0, MAX_DATA + 1) + b"x" * (MAX_DATA + 1)),
    "write past the largest file": record(4, s16(b"a") + struct.pack(">QI", MAX_FILE_SIZE, 1) + b"x"),
    "truncate past the largest file": record(5, s16(b"a") + struct.pack(">Q", MAX_FILE_SIZE + 1)),
    "label above 255 bytes": record(8, s16(b"l" * 256) + struct.pack(">I", 0)),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_records_are_refused_by_both_with_journal_corrupt(name):
    data = MALFORMED[name]
    with pytest.raises(JournalCorrupt) as fast:
        decode_all(data, "seg")
    with pytest.raises(JournalCorrupt) as layout:
        parse_record(data, "seg", 0)
    assert fast.value.segment == layout.value.segment == "seg"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 12), st.binary(max_size=80))
def test_random_bodies_with_a_right_crc_get_the_same_verdict_from_both(typ, body):
    data = record(typ, body)
    try:
        (fast,) = decode_all(data, "seg")
    except JournalCorrupt:
        with pytest.raises(JournalCorrupt):
            parse_record(data, "seg", 0)
        return
    assert parse_record(data, "seg", 0).op == fast.op
