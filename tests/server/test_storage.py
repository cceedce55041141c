"""Storage layer alone: frames on disk, torn-tail repair, verified reads, keys, fences."""

from __future__ import annotations

import os
import stat

import pytest

from sos_server import storage as st
from sos_server import stored_object
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
    monkeypatch.setattr(stored_object, "INDEX_EVERY", 1000)
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
    ["partial_header", "partial_data", "partial_data_big", "zeros_tail", "zeros_after_seal"],
)
def test_torn_tail_is_cut_back_to_last_whole_frame(tmp_path, damage):
    """What a crash during an unacknowledged write leaves is cut: fewer than 8 bytes of a
    header, a frame the file ends inside of, zero bytes (a power loss)."""
    s = Storage(str(tmp_path))
    ns = s.namespace("n", create=True)
    o = ns.create("obj")
    _append(o, b"A" * 100)
    _append(o, b"B" * 50)
    good_size = o.file_size
    if damage == "zeros_after_seal":
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
        elif damage == "partial_data_big":  # 1 MiB frame, half of it there
            data = bytes(range(256)) * 4096
            f.write(st.FRAME.pack(len(data), crc32c(data)) + data[: len(data) // 2])
        elif damage in ("zeros_tail", "zeros_after_seal"):
            f.write(b"\x00" * 4096)
    s2 = _reopen(tmp_path)
    o2 = s2.namespace("n").get("obj")
    assert o2.length == 150
    assert o2.read_bytes(0, 0) == b"A" * 100 + b"B" * 50
    assert os.path.getsize(path) == good_size
    assert len(s2.repairs) == 1 and s2.repairs[0].cut_bytes > 0
    assert s2.corruptions == [] and o2.damage == []
    assert o2.sealed == (damage == "zeros_after_seal")
    if not o2.sealed:  # appends continue at the repaired end
        _append(o2, b"E")
        assert _reopen(tmp_path).namespace("n").get("obj").read_bytes(0, 0) == b"A" * 100 + b"B" * 50 + b"E"


def _five_frames(tmp_path, sizes=(100, 200, 300, 400, 500)):
    """An object of frames of b"a"*100, b"b"*200, ...; returns (path, [frame file offsets], data)."""
    s = Storage(str(tmp_path))
    o = s.namespace("n", create=True).create("obj")
    starts, data = [], b""
    for i, size in enumerate(sizes):
        starts.append(o.file_size)
        chunk = bytes([ord("a") + i]) * size
        _append(o, chunk)
        data += chunk
    s.close()
    return o.path, starts, data


def _poke(path, pos, new: bytes):
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(new)


def _corrupt_code(obj, offset, length):
    with pytest.raises(StorageError) as ei:
        obj.read_bytes(offset, length)
    assert ei.value.code is ErrorCode.CORRUPT
    return ei.value


@pytest.mark.parametrize("byte", [0, 1, 2, 3])
@pytest.mark.parametrize("frame", [1, 4])
def test_damaged_length_field_loses_nothing(tmp_path, byte, frame):
    """One byte of a frame's length field flipped (in the middle, and in the last frame):
    nothing is cut, the length stays, the frame reads CORRUPT, every other frame reads."""
    path, starts, data = _five_frames(tmp_path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(starts[frame] + byte)
        old = f.read(1)[0]
    _poke(path, starts[frame] + byte, bytes([old ^ 0x5A]))
    s2 = _reopen(tmp_path)
    o2 = s2.namespace("n").get("obj")
    assert os.path.getsize(path) == size and s2.repairs == []
    assert o2.length == len(data) == 1500
    assert s2.corruptions == [("n", "obj", starts[frame])]
    lo, hi = sum((100, 200, 300, 400, 500)[:frame]), sum((100, 200, 300, 400, 500)[: frame + 1])
    assert o2.read_bytes(0, lo) == data[:lo]  # the frames before
    assert o2.read_bytes(hi, 0) == data[hi:]  # and after
    e = _corrupt_code(o2, lo, 1)
    assert str(starts[frame]) in e.message and "n/obj" in e.message
    _corrupt_code(o2, 0, 0)
    with pytest.raises(StorageError) as ei:  # a damaged object takes no appends
        o2.refuse_writes("append to")
    assert ei.value.code is ErrorCode.CORRUPT and "damaged" in ei.value.message


@pytest.mark.parametrize("sealed", [False, True])
def test_lying_length_with_garbage_header_keeps_everything(tmp_path, sealed):
    """Both fields of a middle frame's header overwritten: the structure after it cannot be
    trusted (journal records inside frames look just like frames), so nothing from there
    on is served, but nothing is cut and the length does not shrink below what was
    acknowledged."""
    path, starts, data = _five_frames(tmp_path)
    if sealed:
        with open(path, "ab") as f:
            f.write(st.SEAL_FRAME)
    size = os.path.getsize(path)
    _poke(path, starts[2], st.FRAME.pack(250, 0x12345678))
    s2 = _reopen(tmp_path)
    o2 = s2.namespace("n").get("obj")
    assert os.path.getsize(path) == size and s2.repairs == []
    assert o2.length >= 1500 and o2.sealed == sealed
    assert o2.read_bytes(0, 300) == data[:300]
    _corrupt_code(o2, 300, 1)
    _corrupt_code(o2, 1000, 1)
    assert o2.damage and o2.damage[0].to_end and o2.damage[0].start == 300


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\xf0\x00\x00\x00\x01", b"\x7f\x00\x00\x00\x00\x00\x00\x00"])
def test_impossible_length_in_the_middle_is_damage(tmp_path, garbage):
    path, starts, data = _five_frames(tmp_path)
    size = os.path.getsize(path)
    _poke(path, starts[3], garbage)
    s2 = _reopen(tmp_path)
    o2 = s2.namespace("n").get("obj")
    assert os.path.getsize(path) == size and s2.repairs == []
    assert o2.length >= 1500
    assert o2.read_bytes(0, 600) == data[:600]
    _corrupt_code(o2, 600, 0)


def test_bad_checksum_of_the_last_frame_is_kept(tmp_path):
    """A complete last frame whose checksum fails may be acknowledged bytes gone bad: kept
    (not taken for a torn write), reads of it answer CORRUPT, the object takes no appends."""
    path, starts, data = _five_frames(tmp_path)
    size = os.path.getsize(path)
    _poke(path, size - 7, b"!")  # a payload byte of the last frame
    s2 = _reopen(tmp_path)
    o2 = s2.namespace("n").get("obj")
    assert os.path.getsize(path) == size and s2.repairs == []
    assert o2.length == 1500
    assert s2.corruptions == [("n", "obj", starts[4])]
    assert o2.read_bytes(0, 1000) == data[:1000]
    _corrupt_code(o2, 1000, 0)
    _corrupt_code(o2, 1499, 1)
    with pytest.raises(StorageError):
        o2.refuse_writes("append to")


def test_bytes_after_a_seal_are_kept_and_reported(tmp_path):
    s = Storage(str(tmp_path))
    o = s.namespace("n", create=True).create("obj")
    _append(o, b"A" * 100)
    o.write_seal()
    o.mark_synced(*o.sync())
    sealed_size = o.file_size
    s.close()
    with open(o.path, "ab") as f:
        f.write(st.FRAME.pack(3, crc32c(b"xyz")) + b"xyz")
    s2 = _reopen(tmp_path)
    o2 = s2.namespace("n").get("obj")
    assert os.path.getsize(o.path) == sealed_size + 11 and s2.repairs == []
    assert s2.corruptions == [("n", "obj", sealed_size)]
    assert o2.sealed and o2.length == 100 and o2.read_bytes(0, 0) == b"A" * 100


def test_partial_frame_after_a_damaged_length_field_is_still_cut(tmp_path):
    """A flipped length byte in the middle and a torn write at the end (a crash later):
    the damage is kept, the torn frame is cut."""
    path, starts, data = _five_frames(tmp_path)
    size = os.path.getsize(path)
    _poke(path, starts[1] + 2, b"\x40")  # frame 2's length 200 -> 0x4000c8
    with open(path, "ab") as f:
        f.write(st.FRAME.pack(1000, crc32c(b"z" * 1000)) + b"z" * 10)
    s2 = _reopen(tmp_path)
    o2 = s2.namespace("n").get("obj")
    assert os.path.getsize(path) == size and len(s2.repairs) == 1
    assert o2.length == 1500 and s2.corruptions == [("n", "obj", starts[1])]
    assert o2.read_bytes(300, 0) == data[300:]
    _corrupt_code(o2, 100, 1)


def test_unverified_frame_before_a_cut_is_checked(tmp_path):
    """With verify_tail smaller than the last frames, a frame whose length lies can lead
    the scan into a partial "frame" inside other frames: the frame before a cut is
    checked first, so the lie is found and nothing is cut."""
    path, starts, data = _five_frames(tmp_path, sizes=(100, 200, 3000, 400, 500))
    size = os.path.getsize(path)
    # frame 3 (3000 bytes of "c") claims 2500: the scan lands inside its data, where
    # "cccc" as a length is huge, i.e. a frame the file ends inside of
    with open(path, "rb") as f:
        f.seek(starts[2])
        _n, crc = st.FRAME.unpack(f.read(8))
    _poke(path, starts[2], st.FRAME.pack(2500, crc))
    s2 = Storage(str(tmp_path), verify_tail=1)
    s2.open()
    o2 = s2.namespace("n").get("obj")
    assert os.path.getsize(path) == size and s2.repairs == []
    assert o2.length >= len(data)  # two bytes of the length changed: the structure after is unknown
    assert o2.damage[0].file_pos == starts[2] and o2.damage[0].to_end
    assert o2.read_bytes(0, 300) == data[:300]
    _corrupt_code(o2, 300, 1)
    _corrupt_code(o2, 3300, 1)


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
