"""A corrupted byte in a stored journal segment, end to end.

The journal is written through the journal core (JournaledTree over a JournalWriter)
against a real ``sos-server``; then one byte of the server's object file is flipped on
disk. Expected: reads raise ``Corrupt``; ``sos verify NS`` names the broken segment and
where, and exits non-zero; ``sos restore NS DIR`` stops before the damage, says where,
and exits non-zero. Nothing after the broken record may be replayed.

Two ways of flipping: while the server runs (bit rot under a live server) and while it is
stopped, then restarted (what an operator's disk does between two runs): start-up must not
mistake a bad frame in the middle of an object for a torn tail.
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from sos_client import Client, Corrupt
from sos_journal import JournaledTree, JournalWriter
from sos_journal.rebuild.restore import rebuild_cache
from tests.support import flip_byte, run_sos_as, server_metric

pytestmark = [pytest.mark.hostile]

NS = "rot"
N_FILES = 8
BROKEN = 5  # the file whose WRITE record gets the flipped byte
TIMEOUT = 120


def _payload(i: int) -> bytes:
    return (f"PAYLOAD-{i}-" * 50).encode()


@pytest.fixture
def journal(sos_server, tmp_path):
    """Write N_FILES files, one durable sync each; returns facts about what was written."""
    key = sos_server.keygen(NS, "append")

    def factory():
        return Client(sos_server.address, key, NS, timeout=TIMEOUT)

    writer = JournalWriter(factory, NS, str(tmp_path / "spool"))
    tree = JournaledTree(str(tmp_path / "cache"), writer, rebuild=rebuild_cache).open()
    try:
        for i in range(N_FILES):
            tree.create(f"f{i}")
            tree.write(f"f{i}", 0, _payload(i))
            tree.sync()  # durable on the server before the next file: one APPEND per file
    finally:
        tree.close()
        writer.close()
    with factory() as c:
        segs = [e for e in c.list("gen/") if e.name.endswith(".seg")]
        assert len(segs) == 1, segs
        seg = segs[0].name
        stored = c.read(seg)
    logical = stored.find(_payload(BROKEN)[:40])
    assert logical > 0
    return {
        "srv": sos_server,
        "key": key,
        "factory": factory,
        "seg": seg,
        "stored": stored,
        "logical": logical,
        "tmp": tmp_path,
    }


def _flip_on_disk(srv, marker: bytes) -> str:
    """Flip one byte of *marker* inside the server's object file; returns the file's path."""
    hits = []
    for path in glob.glob(os.path.join(srv.data_dir, "ns", NS, "objects", "*", "*")):
        with open(path, "rb") as f:
            data = f.read()
        i = data.find(marker)
        if i >= 0:
            hits.append((path, i + 7))
    assert len(hits) == 1, hits
    path, pos = hits[0]
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())
    return path


def _check_damage_reported(j, *, restart: bool) -> tuple[str, str]:
    srv, key, seg = j["srv"], j["key"], j["seg"]
    # reads report it (a range entirely before the damage is still served)
    with j["factory"]() as c:
        assert c.stat(seg)[0] == len(j["stored"]), "acknowledged bytes were cut off"
        with pytest.raises(Corrupt) as ei:
            c.read(seg)
        assert seg in str(ei.value)
        assert c.read(seg, 0, 100) == j["stored"][:100]
    verify = run_sos_as(srv, key, "verify", "-q", NS)
    vout = verify.stdout + verify.stderr
    assert verify.returncode != 0, vout
    assert seg in vout and "BROKEN" in vout, vout
    target = j["tmp"] / ("restored-restart" if restart else "restored")
    restore = run_sos_as(srv, key, "restore", "-q", NS, str(target))
    rout = restore.stdout + restore.stderr
    assert restore.returncode != 0, rout
    assert seg in rout and "offset" in rout, rout
    restored = sorted(os.listdir(target)) if target.exists() else []
    # nothing after the damage was replayed
    assert not {f"f{i}" for i in range(BROKEN + 1, N_FILES)} & set(restored), restored
    if f"f{BROKEN}" in restored:
        assert (target / f"f{BROKEN}").read_bytes() != _payload(BROKEN)
    return vout, rout


def test_flipped_byte_under_a_running_server_is_reported_by_read_verify_and_restore(journal):
    _flip_on_disk(journal["srv"], _payload(BROKEN)[:40])
    _check_damage_reported(journal, restart=False)


def test_flipped_byte_while_stopped_survives_restart_and_is_reported(journal):
    srv = journal["srv"]
    srv.stop()
    _flip_on_disk(srv, _payload(BROKEN)[:40])
    srv.start()
    _check_damage_reported(journal, restart=True)
    # and the records after the damaged one are still on the server, byte for byte
    with journal["factory"]() as c:
        tail_from = journal["logical"] + len(_payload(BROKEN))
        assert c.read(journal["seg"], tail_from, 0) == journal["stored"][tail_from:]


def test_verify_and_restore_locate_the_damage_precisely(journal):
    """verify names the broken record's offset (not the whole segment from 0); restore
    replays every record before it and none after it."""
    _flip_on_disk(journal["srv"], _payload(BROKEN)[:40])
    vout, rout = _check_damage_reported(journal, restart=False)
    starts = [int(m) for m in re.findall(re.escape(journal["seg"]) + r" \[(\d+),", vout)]
    assert starts, vout
    assert 0 < starts[0] <= journal["logical"], vout
    target = journal["tmp"] / "restored"
    for i in range(BROKEN):
        assert (target / f"f{i}").read_bytes() == _payload(i), (i, rout)


# -- start-up repair never cuts acknowledged bytes --------------------------------------
#
# Only what a crash during an unacknowledged write can leave is cut at start-up (a partial
# frame header, a frame the file ends inside of, zero bytes). Damage is kept: the object
# keeps its length, READs of the damaged bytes answer CORRUPT, APPEND and SEAL to it are
# refused with CORRUPT saying why, STAT and LIST still work.

FRAMES = [bytes([ord("a") + i]) * (1000 * (i + 1)) for i in range(5)]  # 1000 "a", 2000 "b", ...


def _object_frames(path: str) -> list[tuple[int, int]]:
    """(file offset, data length) of every frame of a server object file."""
    from sos_server.storage import FRAME, FRAME_HDR, SEAL_LEN, decode_header

    with open(path, "rb") as f:
        data = f.read()
    _name, pos = decode_header(data)
    out = []
    while pos + FRAME_HDR <= len(data):
        n, _crc = FRAME.unpack_from(data, pos)
        if n == SEAL_LEN:
            break
        out.append((pos, n))
        pos += FRAME_HDR + n
    return out


def _object_path(srv, ns: str, name: str) -> str:
    from sos_server.storage import object_file_name

    h2, h = object_file_name(name)
    return os.path.join(srv.data_dir, "ns", ns, "objects", h2, h)


@pytest.fixture
def five_frames(sos_server):
    """An object "obj" of 5 acknowledged appends (one stored frame each), server stopped."""
    key = sos_server.keygen(NS, "append")
    with Client(sos_server.address, key, NS, timeout=TIMEOUT) as c:
        n = 0
        for chunk in FRAMES:
            n = c.append("obj", n, chunk)
    sos_server.stop()
    path = _object_path(sos_server, NS, "obj")
    frames = _object_frames(path)
    assert [n for _, n in frames] == [len(x) for x in FRAMES]
    return sos_server, key, path, frames


def _assert_damaged_and_refusing(c, name: str, length: int) -> None:
    """STAT/LIST work with the full length; APPEND and SEAL answer CORRUPT saying why."""
    assert c.stat(name) == (length, False)
    assert [(e.name, e.length) for e in c.list("")] == [(name, length)]
    with pytest.raises(Corrupt) as ei:
        c.append(name, length, b"more")
    assert "damaged" in str(ei.value) and "refuses appends" in str(ei.value)
    with pytest.raises(Corrupt):
        c.seal(name)
    assert c.stat(name) == (length, False)  # nothing changed


def test_flipped_frame_length_in_the_middle_loses_no_acknowledged_byte(five_frames):
    srv, key, path, frames = five_frames
    size = os.path.getsize(path)
    pos3 = frames[2][0]
    flip_byte(path, pos3 + 1)  # the 2nd byte of frame 3's length field: it now says ~5.9 MB
    srv.start()
    assert os.path.getsize(path) == size, "start-up cut bytes"
    whole = b"".join(FRAMES)
    lo, hi = 3000, 6000  # frame 3 holds logical bytes [3000, 6000)
    with Client(srv.address, key, NS, timeout=TIMEOUT) as c:
        assert c.read("obj", 0, lo) == whole[:lo]  # the frames before
        assert c.read("obj", hi, 0) == whole[hi:]  # and after
        for off, ln in [(lo, 1), (hi - 1, 1), (0, 0), (2000, 2000)]:
            with pytest.raises(Corrupt) as ei:
                c.read("obj", off, ln)
            assert "obj" in str(ei.value) and str(pos3) in str(ei.value)
        _assert_damaged_and_refusing(c, "obj", len(whole))
    # one damaged range counted and logged at error level, no torn-tail repair
    errors = [
        rec
        for rec in map(json.loads, (ln for ln in srv.log_text().splitlines() if ln.startswith("{")))
        if rec.get("level") == "error"
    ]
    assert len(errors) == 1
    assert server_metric(srv, "sos_damaged_ranges_total") == 1
    assert server_metric(srv, "sos_torn_tail_repairs_total") == 0


def test_flipped_payload_byte_of_the_last_frame_is_kept_as_damage(five_frames):
    """A complete last frame that fails its checksum may be acknowledged bytes gone bad:
    kept, not taken for a torn write."""
    srv, key, path, frames = five_frames
    size = os.path.getsize(path)
    flip_byte(path, size - 10)
    srv.start()
    assert os.path.getsize(path) == size, "start-up cut bytes"
    whole = b"".join(FRAMES)
    with Client(srv.address, key, NS, timeout=TIMEOUT) as c:
        assert c.read("obj", 0, 10000) == whole[:10000]
        with pytest.raises(Corrupt):
            c.read("obj", 10000, 0)
        with pytest.raises(Corrupt):
            c.read("obj")
        _assert_damaged_and_refusing(c, "obj", len(whole))
    assert server_metric(srv, "sos_torn_tail_repairs_total") == 0
    assert server_metric(srv, "sos_damaged_ranges_total") == 1


def test_partial_last_frame_is_still_cut_back(five_frames):
    """A frame the file ends inside of (a power loss during an unacknowledged append) is a
    torn tail: cut, and appends continue at the cut."""
    srv, key, path, frames = five_frames
    pos5, n5 = frames[4]
    with open(path, "r+b") as f:
        f.truncate(pos5 + 8 + n5 // 2)
    srv.start()
    assert os.path.getsize(path) == pos5
    assert (
        server_metric(srv, "sos_torn_tail_repairs_total") == 1 and server_metric(srv, "sos_damaged_ranges_total") == 0
    )
    whole4 = b"".join(FRAMES[:4])
    with Client(srv.address, key, NS, timeout=TIMEOUT) as c:
        assert c.stat("obj") == (len(whole4), False)
        assert c.read("obj") == whole4
        assert c.append("obj", len(whole4), FRAMES[4]) == len(whole4) + len(FRAMES[4])
        assert c.read("obj") == b"".join(FRAMES)
    assert server_metric(srv, "sos_torn_tail_repairs_total") == 1
    assert server_metric(srv, "sos_damaged_ranges_total") == 0


def test_flipped_frame_length_in_a_journal_segment_fails_restore(journal):
    """The journal view of the first case: restore must not take the segment for a write
    in progress and exit 0 (it did when start-up cut the object at the damaged header)."""
    srv = journal["srv"]
    srv.stop()
    path = _object_path(srv, NS, journal["seg"])
    frames = _object_frames(path)
    with open(path, "rb") as f:
        data = f.read()
    marker = data.find(_payload(BROKEN)[:40])
    hit = [p for p, n in frames if p < marker < p + 8 + n]
    assert len(hit) == 1 and hit[0] != frames[-1][0]
    flip_byte(path, hit[0] + 1)
    srv.start()
    _check_damage_reported(journal, restart=True)


def test_writer_stops_on_a_damaged_segment_instead_of_retrying_forever(sos_server, tmp_path):
    """The server restarts with damage in the segment a running writer appends to: APPEND
    answers CORRUPT from then on. That is fatal for the writer (a clear error at the next
    barrier), not a transient failure retried until the barrier times out."""
    key = sos_server.keygen(NS, "append")
    writer = JournalWriter(
        lambda: Client(sos_server.address, key, NS, timeout=TIMEOUT), NS, str(tmp_path / "spool"), max_backoff=0.1
    )
    tree = JournaledTree(str(tmp_path / "cache"), writer, rebuild=rebuild_cache).open()
    try:
        for i in range(3):
            tree.create(f"f{i}")
            tree.write(f"f{i}", 0, _payload(i))
            tree.sync()
        with Client(sos_server.address, key, NS, timeout=TIMEOUT) as c:
            seg = [e.name for e in c.list("gen/") if e.name.endswith(".seg")][-1]
        sos_server.stop()
        path = _object_path(sos_server, NS, seg)
        flip_byte(path, _object_frames(path)[1][0] + 1)  # a frame length in the middle: damage
        sos_server.start()
        tree.create("after")
        with pytest.raises(Exception) as ei:
            writer.barrier(timeout=TIMEOUT)  # a writer that retried forever would time out here
        assert not isinstance(ei.value, TimeoutError), ei.value
        err = ei.value if isinstance(ei.value, Corrupt) else ei.value.__cause__
        assert isinstance(err, Corrupt) and "damaged" in str(err), repr(ei.value)
    finally:
        tree.close()
        writer.close(timeout=5)
