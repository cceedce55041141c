"""The shared write-ahead log (sos_server/wal.py): one log fdatasync per group commit, object
files rebuilt from the log at start-up.

The process test SIGKILLs a real server at its test-only fault point
(``SOS_SERVER_TEST_FAULT=after-log-sync:N``): right after a log sync, before anything of
that group commit is acknowledged, with every object file cut back to its last
checkpointed size (the object writes lost, as a power loss could lose them). After a
restart every acknowledged byte is there, and every stored byte belongs to a whole append
the writer sent."""

from __future__ import annotations

import errno
import glob
import os
import struct
import threading

import pytest
import trio

from sos_server.engine import Engine
from sos_server.storage import Storage
from sos_server.wal import FAULT_ENV, INDIRECT_MIN, META, REC, WAL_HEAD, LogFile, log_key
from sos_wire import events as ev
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from tests.conftest import RawClient
from tests.server.support import WRITER_NS as NS
from tests.server.support import WRITER_OBJECTS as OBJECTS
from tests.server.support import check_object, writer
from tests.support import flip_byte

ROUNDS = 4


def test_sigkill_between_log_sync_and_object_write_loses_nothing(sos_server_factory, monkeypatch):
    # a small log: checkpoints (log switch, object syncs, old log deleted) happen during the run too
    srv = sos_server_factory(args=("--wal-size", "256K"), start=False)
    key = srv.keygen(NS)
    lengths = {o: 0 for o in OBJECTS}
    replayed = 0
    for n in range(ROUNDS):
        monkeypatch.setenv(FAULT_ENV, f"after-log-sync:{20 + 15 * n}")
        srv.start()
        monkeypatch.delenv(FAULT_ENV)
        acked = dict(lengths)
        reached = threading.Event()
        errors: list[str] = []
        t = threading.Thread(
            target=writer, args=(srv.address, key, lengths, acked, reached, 10**9, errors), daemon=True
        )
        t.start()
        assert srv.proc.wait(300) == -9  # the server killed itself at its fault point
        t.join(300)
        assert not t.is_alive()
        assert errors == [], errors
        assert sum(acked.values()) > sum(lengths.values())  # acks came before the fault
        srv.start()
        replayed += 1  # the objects were rebuilt from the log:
        assert srv.log_text().count("replayed the write-ahead log") == replayed
        with RawClient(srv.address) as c:
            assert isinstance(c.login(key, NS), ev.AuthOk)
            for obj in OBJECTS:
                lengths[obj] = check_object(c, obj, acked[obj])
        srv.stop()
    assert replayed == ROUNDS


def _storage_with_log(root) -> tuple[Storage, list[bytes]]:
    """A storage whose log holds three appends to "o" (synced), as a crash leaves it."""
    s = Storage(str(root))
    s.open()
    s.start_wal()
    o = s.namespace("n", create=True).create("o")
    parts = [b"one", b"two" * 100, b"three"]
    for p in parts:
        o.append(p, crc32c(p))
    assert s.wal is not None
    s.wal.current.sync()
    os.truncate(o.path, o.header_size)  # the object writes never reached the disk
    return s, parts


def test_replay_rebuilds_objects_from_the_log(tmp_path):
    _, parts = _storage_with_log(tmp_path)  # no close: a crash
    s2 = Storage(str(tmp_path))
    s2.open()
    assert s2.replayed.records == 3
    assert s2.namespaces["n"].get("o").read_bytes(0, 0) == b"".join(parts)
    s2.close()
    s3 = Storage(str(tmp_path))  # replayed once: the log is empty now, nothing changes
    s3.open()
    assert s3.replayed.records == 0
    assert s3.namespaces["n"].get("o").read_bytes(0, 0) == b"".join(parts)


def test_replay_goes_on_past_a_switched_log_files_zeros(tmp_path):
    """A crash between a log switch and its checkpoint leaves two log files; the older one
    ends in the zeros written ahead of its records. Those zeros are its clean end, not the
    log's: the records of the newer file were acknowledged too and must be replayed."""
    s = Storage(str(tmp_path))
    s.open()
    s.start_wal()
    o = s.namespace("n", create=True).create("o")
    parts = [b"one", b"two" * 100, b"three"]
    o.append(parts[0], crc32c(parts[0]))
    assert s.wal is not None
    old = s.wal.switch()  # a checkpoint begins: later records go to the spare
    for p in parts[1:]:
        o.append(p, crc32c(p))
    old.sync()
    s.wal.current.sync()
    assert os.path.getsize(old.path) > old.size  # zeros after its last record
    os.truncate(o.path, o.header_size)  # the checkpoint never synced the object: a crash
    s2 = Storage(str(tmp_path))
    s2.open()
    assert (s2.replayed.files, s2.replayed.records) == (2, 3)
    assert s2.namespaces["n"].get("o").read_bytes(0, 0) == b"".join(parts)


def test_replay_cuts_an_object_whose_records_have_a_gap(tmp_path):
    """Records lost with an older log file's unsynced tail (a power loss: zeros where they
    were) leave a gap before the object's records in the newer file: nothing from the gap
    on was acknowledged, so the object is cut where its last replayed record ended."""
    s = Storage(str(tmp_path))
    s.open()
    s.start_wal()
    o = s.namespace("n", create=True).create("o")
    parts = [b"one", b"two" * 100, b"three"]
    o.append(parts[0], crc32c(parts[0]))
    assert s.wal is not None
    keep = s.wal.current.size
    o.append(parts[1], crc32c(parts[1]))
    old = s.wal.switch()
    o.append(parts[2], crc32c(parts[2]))
    old.sync()
    s.wal.current.sync()
    with open(old.path, "r+b") as f:  # the second record never reached the disk
        f.seek(keep)
        f.write(bytes(old.size - keep))
    s2 = Storage(str(tmp_path))
    s2.open()
    assert s2.replayed.records == 1 and s2.replayed.skipped == 1
    assert s2.namespaces["n"].get("o").read_bytes(0, 0) == parts[0]
    assert not s2.corruptions


def test_damaged_log_record_is_kept_and_stops_replay(tmp_path):
    s, parts = _storage_with_log(tmp_path)
    assert s.wal is not None
    path = s.wal.current.path
    with open(path, "r+b") as f:  # one bit of the second record's data
        data = f.read()
        i = data.index(b"two")
        f.seek(i)
        f.write(b"tw\x00")
    s2 = Storage(str(tmp_path))
    s2.open()
    assert s2.replayed.records == 1 and "checksum" in s2.replayed.damaged
    assert s2.namespaces["n"].get("o").read_bytes(0, 0) == parts[0]
    assert os.path.exists(path + ".damaged")  # kept for an operator


def test_no_space_on_the_log_is_no_space_and_writes_nothing(tmp_path, monkeypatch):
    storage = Storage(str(tmp_path))
    storage.namespace("n", create=True)
    engine = Engine(storage)
    real = os.pwritev

    def pwritev(fd, bufs, pos):
        if storage.wal is not None and fd == storage.wal.current.fd and full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, pos)

    full = {"on": False}
    monkeypatch.setattr(os, "pwritev", pwritev)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            assert await engine.append("n", "append", "o", 0, 0, crc32c(b"keep"), b"keep") == 4
            size = storage.wal.current.size
            full["on"] = True
            try:
                await engine.append("n", "append", "o", 4, 0, crc32c(b"lost"), b"lost")
            except Exception as exc:
                assert getattr(exc, "code", None) is ErrorCode.NO_SPACE, exc
                assert "space" in str(exc)
            else:
                raise AssertionError("an append the log could not hold was acknowledged")
            assert storage.wal.current.size == size
            full["on"] = False
            assert engine.stat("n", "o") == (4, False)
            assert await engine.append("n", "append", "o", 4, 0, crc32c(b"more"), b"more") == 8
            nursery.cancel_scope.cancel()

    trio.run(main)
    obj = storage.namespaces["n"].get("o")
    assert os.path.getsize(obj.path) == obj.file_size  # the failed frame was cut from the file
    storage.close()
    s2 = Storage(str(tmp_path))
    s2.open()
    assert s2.namespaces["n"].get("o").read_bytes(0, 0) == b"keepmore"


def test_one_log_sync_per_group_commit_whatever_the_objects(tmp_path, monkeypatch):
    calls = []
    real = LogFile.sync

    def counting(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(LogFile, "sync", counting)
    storage = Storage(str(tmp_path))
    storage.namespace("n", create=True)
    engine = Engine(storage)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            for i in range(30):
                await engine.append("n", "append", f"o{i}", 0, 0, 0, b"")  # created (synced by itself)
            pendings = []
            for i in range(30):
                pendings.append(await engine.append_begin("n", "append", f"o{i}", 0, 0, crc32c(b"x"), b"x"))
            async with trio.open_nursery() as n2:
                for p in pendings:
                    n2.start_soon(engine.finish, p)
            nursery.cancel_scope.cancel()

    trio.run(main)
    storage.close()
    assert 1 <= len(calls) <= 2  # 30 objects in one batch (two if the first one left early)


def test_big_writes_are_synced_in_place_and_checked_at_replay(tmp_path):
    """A write of INDIRECT_MIN bytes or more is not copied into the log: replay keeps it if
    its frame is whole in the object file, and otherwise cuts the object there (it was
    never acknowledged: its group commit syncs the object file) and skips what follows."""
    big, small = os.urandom(INDIRECT_MIN), b"after"
    for lost in (False, True):
        root = tmp_path / str(lost)
        s = Storage(str(root))
        s.open()
        s.start_wal()
        o = s.namespace("n", create=True).create("o")
        o.append(b"first", crc32c(b"first"))
        assert s.wal is not None
        log_size = s.wal.current.size
        o.append(big, crc32c(big))
        assert s.wal.current.size - log_size < 100  # a header, not the data
        assert s.wal.take_indirect() == [o]
        o.append(small, crc32c(small))
        s.wal.current.sync()
        o.sync()
        if lost:  # the in-place write never reached the disk; the small one after it did
            with open(o.path, "r+b") as f:
                f.seek(o.header_size + 8 + 5 + 100)
                f.write(b"\0" * 10)
        s2 = Storage(str(root))
        s2.open()
        got = s2.namespaces["n"].get("o")
        assert got.read_bytes(0, 0) == (b"first" if lost else b"first" + big + small)
        assert not s2.corruptions


def test_records_of_a_removed_object_are_skipped_at_replay(tmp_path):
    s = Storage(str(tmp_path))
    s.open()
    s.start_wal()
    ns = s.namespace("n", create=True)
    for name in ("gone", "kept"):
        ns.create(name).append(b"data", crc32c(b"data"))
    ns.remove("gone")  # retention: its file is unlinked, its record stays in the log
    assert s.wal is not None
    s.wal.current.sync()  # no close: a crash
    s2 = Storage(str(tmp_path))
    s2.open()
    assert s2.replayed.records == 1 and s2.replayed.skipped == 1
    assert sorted(s2.namespaces["n"].objects) == ["kept"]
    assert s2.namespaces["n"].get("kept").read_bytes(0, 0) == b"data"


def test_checkpoints_go_on_after_the_spare_log_could_not_be_made(tmp_path, monkeypatch):
    """A full disk when the next spare log file is made does not stop checkpoints for good:
    the engine tries again, and once it can, the log switches and old files go."""
    from sos_server import wal as wal_mod

    real = wal_mod._new_log_file
    full = {"on": False}

    def new_log_file(d, seq):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(d, seq)

    monkeypatch.setattr(wal_mod, "_new_log_file", new_log_file)
    storage = Storage(str(tmp_path), wal_checkpoint_bytes=4096)
    storage.namespace("n", create=True)
    engine = Engine(storage)
    data = b"y" * 1000

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            wal = storage.wal
            first = wal.current.seq
            full["on"] = True
            off = 0
            with trio.fail_after(60):
                while wal.current.seq == first or wal.retired:  # one switch and its checkpoint; the spare fails
                    off = await engine.append("n", "append", "o", off, 0, crc32c(data), data)
                assert wal.spare is None
                full["on"] = False
                while wal.spare is None or wal.current.seq == first + 1:  # retried, then switched again
                    off = await engine.append("n", "append", "o", off, 0, crc32c(data), data)
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        return off

    off = trio.run(main)
    storage.close()
    s2 = Storage(str(tmp_path))
    s2.open()
    assert s2.namespaces["n"].get("o").read_bytes(0, 0) == data * (off // len(data))


# -- torn records: a crash while a record was being written ------------------------------
# The log file is written with zeros ahead of its records (ZERO_AHEAD), so a write the crash
# interrupted leaves the record's first bytes, then zeros: whole in length, failing a check.
# That record was never acknowledged (its group commit had not synced it): a torn tail,
# not damage.

TORN = [b"one", b"two" * 100, b"three"]  # acknowledged (synced)
LAST = b"four" * 200  # the append whose record the crash cut


def _records_in(path: str) -> list[tuple[int, int]]:
    """(start, end) of each record of a log file, up to the zeros after them."""
    with open(path, "rb") as f:
        data = f.read()
    out, pos = [], WAL_HEAD.size
    while pos + REC.size <= len(data):
        _, kind, _, n, nl, ml = REC.unpack_from(data, pos)
        if kind == 0:
            break
        stored = n if kind == 1 else 8 if kind == 2 else 0
        out.append((pos, pos + REC.size + nl + ml + stored))
        pos = out[-1][1]
    return out


def _zero(path: str, start: int, end: int) -> None:
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(bytes(end - start))


def _log_with_a_last_record(root) -> tuple[str, str, tuple[int, int]]:
    """A crash's data directory: TORN acknowledged (log synced), then LAST written (object
    file and log record, as the server does); (log path, object path, LAST's record)."""
    s = Storage(str(root))
    s.open()
    s.start_wal()
    o = s.namespace("n", create=True).create("o")
    for p in TORN:
        o.append(p, crc32c(p))
    assert s.wal is not None
    s.wal.current.sync()  # the group commit: TORN acknowledged
    o.append(LAST, crc32c(LAST))  # its group commit never ran
    recs = _records_in(s.wal.current.path)
    assert len(recs) == 4 and recs[-1][1] == s.wal.current.size
    assert os.path.getsize(s.wal.current.path) > s.wal.current.size  # zeros written ahead
    return s.wal.current.path, o.path, recs[-1]


# offsets in a record of object "o" of namespace "n": crc 0-3, kind 4, file offset 5-12,
# length 13-16, namespace and name lengths 17-20 (REC), the key "no", the frame header, data
KEY = 2
DATA = REC.size + KEY + 8
# where the write was cut, from the record's start, and the check the record then fails
TEARS = {
    "inside the crc": (2, "bad record (kind 0"),
    "inside the length": (15, "bad record (kind 1, length 0)"),
    "inside the name's length": (20, "record checksum mismatch"),
    "inside the key": (REC.size + 1, "record checksum mismatch"),
    "inside the frame header": (REC.size + KEY + 4, "record checksum mismatch"),
    "inside the data": (DATA + 300, "record data checksum mismatch"),
    "before the data's last byte": (DATA + len(LAST) - 1, "record data checksum mismatch"),
}


@pytest.mark.parametrize("tear", TEARS)
def test_a_torn_last_record_is_a_torn_tail_not_damage(tmp_path, caplog, tear):
    """The record's first bytes reached the file, the rest of it is zeros, and so is
    everything after it: replay ends there quietly, every acknowledged record is replayed,
    no .damaged file (before the fix: "damaged write-ahead log record", the file renamed)."""
    log_path, obj_path, (start, end) = _log_with_a_last_record(tmp_path)
    cut, why = TEARS[tear]
    assert start + cut < end
    _zero(log_path, start + cut, end)
    caplog.set_level("INFO", logger="sos_server.wal")
    s2 = Storage(str(tmp_path))
    s2.open()
    assert s2.replayed.damaged == ""
    assert len(s2.replayed.torn) == 1 and why in s2.replayed.torn[0], s2.replayed.torn
    assert s2.replayed.records == 3
    assert not glob.glob(os.path.join(s2.wal_dir, "*.damaged"))
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING") and "damaged" in r.message]
    assert [r for r in caplog.records if r.levelname == "INFO" and "torn record" in r.message]
    # the object file held LAST whole (written before its record): cut back, never acknowledged
    assert s2.namespaces["n"].get("o").read_bytes(0, 0) == b"".join(TORN)
    assert os.path.getsize(obj_path) == s2.namespaces["n"].get("o").file_size
    assert not s2.corruptions
    s2.close()


@pytest.mark.parametrize(
    "where",
    ["kind", "length", "name", "frame header", "data"],
)
def test_a_record_with_a_flipped_byte_before_a_whole_record_is_damage(tmp_path, where):
    """A flipped byte in the second record, followed by two whole records: damage (error,
    the file kept as .damaged, nothing after it replayed), whichever check it fails."""
    log_path, _, _ = _log_with_a_last_record(tmp_path)
    start, end = _records_in(log_path)[1]
    at = {"kind": 4, "length": 13, "name": REC.size, "frame header": REC.size + KEY + 5, "data": DATA + 150}[where]
    flip_byte(log_path, start + at)
    s2 = Storage(str(tmp_path))
    s2.open()
    assert s2.replayed.damaged
    assert s2.replayed.records == 1
    assert os.path.exists(log_path + ".damaged")
    assert s2.namespaces["n"].get("o").read_bytes(0, 0) == TORN[0]


def test_the_last_record_with_a_flipped_byte_and_its_last_byte_written_is_damage(tmp_path):
    """Zeros follow the last record, but its last byte is there: the write was whole, so a
    checksum that fails is damage, not a torn write."""
    log_path, _, (start, end) = _log_with_a_last_record(tmp_path)
    flip_byte(log_path, start + DATA + 100)
    s2 = Storage(str(tmp_path))
    s2.open()
    assert "record data checksum mismatch" in s2.replayed.damaged
    assert os.path.exists(log_path + ".damaged")


def test_a_torn_record_followed_by_anything_but_zeros_is_damage(tmp_path):
    """The last record cut inside its data, then a non-zero byte further on in the file:
    damage, not a torn tail."""
    log_path, _, (start, end) = _log_with_a_last_record(tmp_path)
    _zero(log_path, start + DATA + 300, end)
    with open(log_path, "r+b") as f:
        f.seek(end + 4000)
        f.write(b"\x01")
    s2 = Storage(str(tmp_path))
    s2.open()
    assert "record data checksum mismatch" in s2.replayed.damaged
    assert os.path.exists(log_path + ".damaged")


def test_a_torn_record_in_an_older_log_file_ends_that_file_only(tmp_path):
    """A torn record ends its file's records, as its zeros would: a newer log file may hold
    acknowledged records (a failed log sync of the switching batch: those appends were
    refused and rolled back in the newer file; the appends after them were acknowledged
    there), so the replay goes on with it. An object whose torn record was in the older file
    and whose next record is in the newer one is cut where its last replayed record ended
    (nothing from the torn record on was acknowledged)."""
    s = Storage(str(tmp_path))
    s.open()
    s.start_wal()
    ns = s.namespace("n", create=True)
    a, b = ns.create("a"), ns.create("b")
    a.append(b"a1", crc32c(b"a1"))
    b.append(b"b1", crc32c(b"b1"))
    b.append(b"b2" * 100, crc32c(b"b2" * 100))  # torn below
    assert s.wal is not None
    old = s.wal.switch()
    a.append(b"a2", crc32c(b"a2"))  # acknowledged: the newer file's group commit
    b.append(b"b3", crc32c(b"b3"))  # follows the torn record: never acknowledged
    old.sync()
    s.wal.current.sync()
    start, end = _records_in(old.path)[-1]
    _zero(old.path, start + DATA + 50, end)
    s2 = Storage(str(tmp_path))
    s2.open()
    assert s2.replayed.damaged == "" and len(s2.replayed.torn) == 1
    assert s2.replayed.files == 2
    assert s2.namespaces["n"].get("a").read_bytes(0, 0) == b"a1a2"
    assert s2.namespaces["n"].get("b").read_bytes(0, 0) == b"b1"
    assert not s2.corruptions


def _log_record(namespace: str, name: str, fpos: int, data: bytes) -> bytes:
    """A whole write record, as WriteAheadLog writes it."""
    frame_hdr = struct.pack(">II", len(data), crc32c(data))
    meta = META.pack(1, fpos, 8 + len(data)) + log_key(namespace, name)
    return struct.pack(">I", crc32c(frame_hdr, crc32c(meta))) + meta + frame_hdr + data


def test_sigkilled_server_with_a_torn_log_record_starts_with_every_acknowledged_append(sos_server_factory):
    """A real server SIGKILLed after acknowledged appends; the crash cut the record of the
    next append (written into its object file first, as the server does, then its record
    torn inside its data in the newest log file). The server starts, the log says "torn
    record", nothing is damaged, and every object holds exactly what was acknowledged.
    Then a flipped byte in a record followed by whole records: still damage."""
    srv = sos_server_factory()
    key = srv.keygen(NS)
    acked: dict[str, bytes] = {}
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, NS), ev.AuthOk)
        for i in range(30):
            obj = OBJECTS[i % len(OBJECTS)]
            data = os.urandom(100 + 97 * i)
            r = c.append(obj, len(acked.get(obj, b"")), data)
            assert isinstance(r, ev.AppendOk), r
            acked[obj] = acked.get(obj, b"") + data
    srv.kill()  # SIGKILL: no checkpoint, the log holds every acknowledged append
    wal_dir = os.path.join(srv.data_dir, "wal")
    logs = sorted(p for p in glob.glob(os.path.join(wal_dir, "*.log")) if _records_in(p))
    assert logs, os.listdir(wal_dir)
    newest = logs[-1]
    recs = _records_in(newest)
    assert len(recs) >= 30
    storage = Storage(srv.data_dir)
    obj_path = storage.object_path(NS, OBJECTS[0])
    fpos = os.path.getsize(obj_path)
    data = os.urandom(3000)
    record = _log_record(NS, OBJECTS[0], fpos, data)
    with open(obj_path, "r+b") as f:  # the object write came first and was whole
        f.seek(fpos)
        f.write(record[-(8 + len(data)) :])
    with open(newest, "r+b") as f:  # the record's write was cut inside its data
        tail_start = recs[-1][1]
        f.seek(tail_start)
        assert f.read(len(record)) == bytes(len(record))  # zeros written ahead
        f.seek(tail_start)
        f.write(record[: len(record) // 2])
    srv.start()
    log_text = srv.log_text()
    assert "ends in a torn record" in log_text and "damaged write-ahead log record" not in log_text
    assert not glob.glob(os.path.join(wal_dir, "*.damaged"))
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, NS), ev.AuthOk)
        for obj, want in acked.items():
            assert c.read(obj) == want, obj
    # damage: a byte of a record's data flipped, whole records after it
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, NS), ev.AuthOk)
        for i in range(6):
            obj = OBJECTS[i % len(OBJECTS)]
            more = os.urandom(500)
            r = c.append(obj, len(acked[obj]), more)
            assert isinstance(r, ev.AppendOk), r
            acked[obj] += more
    srv.kill()
    logs = sorted(p for p in glob.glob(os.path.join(wal_dir, "*.log")) if _records_in(p))
    start, _ = _records_in(logs[-1])[-3]
    flip_byte(logs[-1], start + REC.size + 40)
    srv.start()
    assert "damaged write-ahead log record" in srv.log_text()
    assert glob.glob(os.path.join(wal_dir, "*.damaged"))
