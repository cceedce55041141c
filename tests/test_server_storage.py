"""Storage layer alone: frames on disk, torn-tail repair, verified reads, keys, fences."""

from __future__ import annotations

import os
import stat

import pytest

from sos_server import storage as st
from sos_server.storage import Storage, StorageError
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode


def _append(obj, data: bytes) -> int:
    n = obj.append(data, crc32c(data))
    obj.mark_synced(*obj.sync())
    return n


def _reopen(root) -> Storage:
    s = Storage(str(root))
    s.open()
    return s


def test_objects_survive_reopen_with_names_lengths_and_seal(tmp_path):
    s = Storage(str(tmp_path))
    ns = s.namespace("tenant", create=True)
    a = ns.create("a")
    ab = ns.create("a/b")  # an object and a "directory" of the same name
    _append(a, b"hello ")
    _append(a, b"world")
    _append(ab, b"x" * 1000)
    ab.write_seal()
    ab.mark_synced(*ab.sync())
    ns.create("empty")
    s.close()

    s2 = _reopen(tmp_path)
    ns2 = s2.namespace("tenant")
    assert sorted(ns2.objects) == ["a", "a/b", "empty"]
    assert ns2.get("a").read_bytes(0, 0) == b"hello world"
    assert ns2.get("a").length == 11 and not ns2.get("a").sealed
    assert ns2.get("a/b").sealed and ns2.get("a/b").length == 1000
    assert ns2.get("empty").length == 0
    assert s2.repairs == []


def test_sealed_object_refuses_append(tmp_path):
    ns = Storage(str(tmp_path)).namespace("n", create=True)
    o = ns.create("x")
    _append(o, b"abc")
    o.write_seal()
    with pytest.raises(StorageError) as ei:
        o.append(b"d", crc32c(b"d"))
    assert ei.value.code is ErrorCode.SEALED


def test_ranged_reads_use_the_index_and_match(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "INDEX_EVERY", 1000)
    ns = Storage(str(tmp_path)).namespace("n", create=True)
    o = ns.create("big")
    blob = bytes(range(256)) * 200  # 51200 bytes in frames of varying size
    pos = 0
    for size in [1, 7, 300, 4096, 999, 12000, 33797]:
        _append(o, blob[pos : pos + size])
        pos += size
    assert pos == len(blob) and o.length == len(blob)
    assert len(o._idx_logical) >= 3  # sparse index was built
    for off, ln in [(0, 0), (0, 1), (5, 10), (300, 5000), (51199, 1), (20000, 0), (8, 51192)]:
        want = blob[off:] if ln == 0 else blob[off : off + ln]
        assert o.read_bytes(off, ln) == want, (off, ln)
    # the index survives a reopen (rebuilt by the scan)
    s2 = _reopen(tmp_path)
    o2 = s2.namespace("n").get("big")
    assert o2.read_bytes(30000, 100) == blob[30000:30100]


@pytest.mark.parametrize(
    "damage",
    ["partial_header", "partial_data", "bad_crc_last", "zeros_tail", "junk_after_seal"],
)
def test_torn_tail_is_cut_back_to_last_whole_frame(tmp_path, damage):
    s = Storage(str(tmp_path))
    ns = s.namespace("n", create=True)
    o = ns.create("obj")
    _append(o, b"A" * 100)
    _append(o, b"B" * 50)
    good_size = o.file_size
    if damage == "junk_after_seal":
        o.write_seal()
        o.mark_synced(*o.sync())
        good_size = o.file_size
    path = o.path
    s.close()
    with open(path, "r+b") as f:
        f.seek(0, 2)
        if damage == "partial_header":
            f.write(b"\x00\x00\x01")
        elif damage == "partial_data":
            f.write(st.FRAME.pack(100, crc32c(b"C" * 100)) + b"C" * 40)
        elif damage == "bad_crc_last":
            f.write(st.FRAME.pack(10, crc32c(b"D" * 10) ^ 1) + b"D" * 10)
        elif damage == "zeros_tail":
            f.write(b"\x00" * 4096)
        elif damage == "junk_after_seal":
            f.write(st.FRAME.pack(3, crc32c(b"xyz")) + b"xyz")
    s2 = _reopen(tmp_path)
    o2 = s2.namespace("n").get("obj")
    assert o2.length == 150
    assert o2.read_bytes(0, 0) == b"A" * 100 + b"B" * 50
    assert os.path.getsize(path) == good_size
    assert len(s2.repairs) == 1 and s2.repairs[0].cut_bytes > 0
    assert o2.sealed == (damage == "junk_after_seal")
    if not o2.sealed:  # appends continue at the repaired end
        _append(o2, b"E")
        assert _reopen(tmp_path).namespace("n").get("obj").read_bytes(0, 0) == b"A" * 100 + b"B" * 50 + b"E"


def test_corrupt_byte_in_the_middle_is_reported_on_read(tmp_path):
    s = Storage(str(tmp_path), verify_tail=1)  # start-up verifies only the tail
    ns = s.namespace("n", create=True)
    o = ns.create("obj")
    for ch in b"abcd":
        _append(o, bytes([ch]) * 1000)
    path, hsize = o.path, o.header_size
    s.close()
    bad_pos = hsize + (st.FRAME_HDR + 1000) + st.FRAME_HDR + 500  # inside the second frame
    with open(path, "r+b") as f:
        f.seek(bad_pos)
        f.write(b"!")
    s2 = Storage(str(tmp_path), verify_tail=1)
    s2.open()
    o2 = s2.namespace("n").get("obj")
    assert o2.length == 4000  # the middle is not a torn tail: nothing cut
    assert o2.read_bytes(0, 1000) == b"a" * 1000  # frames before are fine
    assert o2.read_bytes(2000, 2000) == b"c" * 1000 + b"d" * 1000
    with pytest.raises(StorageError) as ei:
        o2.read_bytes(1500, 10)
    e = ei.value
    assert e.code is ErrorCode.CORRUPT
    assert "n/obj" in e.message and str(hsize + st.FRAME_HDR + 1000) in e.message


def test_damaged_middle_frame_is_kept_not_cut_at_start_up(tmp_path):
    """A bad frame followed by whole verified frames is damage, not a torn tail: nothing
    acknowledged after it is thrown away; reads of the bad frame answer CORRUPT."""
    s = Storage(str(tmp_path))
    o = s.namespace("n", create=True).create("obj")
    for ch in b"abc":
        _append(o, bytes([ch]) * 100)
    path, hsize = o.path, o.header_size
    s.close()
    with open(path, "r+b") as f:
        f.seek(hsize + (st.FRAME_HDR + 100) + st.FRAME_HDR + 10)  # inside frame "b"
        f.write(b"?")
    s2 = _reopen(tmp_path)
    o2 = s2.namespace("n").get("obj")
    assert o2.length == 300 and s2.repairs == []
    assert s2.corruptions == [("n", "obj", hsize + st.FRAME_HDR + 100)]
    assert o2.read_bytes(200, 100) == b"c" * 100
    with pytest.raises(StorageError) as ei:
        o2.read_bytes(0, 0)
    assert ei.value.code is ErrorCode.CORRUPT


def test_fence_is_durable_and_keys_are_private(tmp_path):
    s = Storage(str(tmp_path))
    ns = s.namespace("n", create=True)
    ns.set_fence(7)
    key = s.keygen("n", "read")
    key_id, secret = key.split(".")
    rec = s.get_key("n", bytes.fromhex(key_id))
    assert rec.role == "read" and rec.secret.hex() == secret
    mode = stat.S_IMODE(os.stat(os.path.join(s.ns_path("n"), "keys", key_id)).st_mode)
    assert mode == 0o600
    assert s.get_key("other", bytes.fromhex(key_id)) is None
    assert s.get_key("../etc", bytes.fromhex(key_id)) is None
    s2 = _reopen(tmp_path)
    assert s2.namespace("n").fence == 7
    with pytest.raises(ValueError):
        s.keygen("n", "admin")


def test_list_is_sorted_paged_and_prefixed(tmp_path):
    ns = Storage(str(tmp_path)).namespace("n", create=True)
    for name in ["b/2", "a", "b/1", "c", "b/3", "ba"]:
        ns.create(name)
    objs, more = ns.list("b/", "", 2)
    assert [o.name for o in objs] == ["b/1", "b/2"] and more
    objs, more = ns.list("b/", "b/2", 2)
    assert [o.name for o in objs] == ["b/3"] and not more
    objs, more = ns.list("", "", 1000)
    assert [o.name for o in objs] == ["a", "b/1", "b/2", "b/3", "ba", "c"] and not more


def test_second_process_lock_is_refused(tmp_path):
    a = Storage(str(tmp_path))
    a.lock()
    b = Storage(str(tmp_path))
    with pytest.raises(StorageError) as ei:
        b.lock()
    assert ei.value.code is ErrorCode.BUSY
    a.close()
    b.lock()
    b.close()


def test_rollback_cuts_unsynced_bytes(tmp_path):
    ns = Storage(str(tmp_path)).namespace("n", create=True)
    o = ns.create("x")
    _append(o, b"durable")
    o.append(b"volatile", crc32c(b"volatile"))
    assert o.length == 15
    o.rollback()
    assert o.length == 7 and o.file_size == o.synced_size
    assert os.path.getsize(o.path) == o.synced_size
    assert o.read_bytes(0, 0) == b"durable"
