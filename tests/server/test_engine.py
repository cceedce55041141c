"""Engine alone (real storage in a tmp dir, no sockets): append-only rules, roles, fencing,
quotas, group commit and retention."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import trio
import trio.testing

from sos_server.engine import Engine, Limits, ServerError, plan_retention
from sos_server.storage import Storage
from sos_server.wal import LogFile
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode

NS = "t"


def run_engine(tmp_path, body, *, limits=None):
    """Run ``await body(engine)`` with the syncer running."""
    storage = Storage(str(tmp_path))
    storage.namespace(NS, create=True)
    engine = Engine(storage, limits=limits)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(engine.run)
            try:
                return await body(engine)
            finally:
                n.cancel_scope.cancel()

    try:
        return trio.run(main)
    finally:
        storage.close()


async def app(engine, name, offset, data, *, epoch=0, role="append", crc=None):
    return await engine.append(NS, role, name, offset, epoch, crc32c(data) if crc is None else crc, data)


def code_of(exc_info) -> ErrorCode:
    return exc_info.value.code


def test_append_rules(tmp_path):
    async def body(e: Engine):
        assert await app(e, "o", 0, b"abc") == 3
        assert await app(e, "o", 3, b"def") == 6
        size = os.path.getsize(e.storage.namespaces[NS].get("o").path)
        # an identical retry is acknowledged again and writes nothing
        assert await app(e, "o", 0, b"abc") == 3
        assert await app(e, "o", 3, b"def") == 6
        assert os.path.getsize(e.storage.namespaces[NS].get("o").path) == size
        # anything else: OFFSET_MISMATCH with the current length
        for off, data in [(0, b"abX"), (2, b"d"), (7, b"z"), (3, b"defg"), (5, b"fg")]:
            with pytest.raises(ServerError) as ei:
                await app(e, "o", off, data)
            assert ei.value.code is ErrorCode.OFFSET_MISMATCH, (off, data)
            assert ei.value.length == 6
        # bad CRC: nothing written
        with pytest.raises(ServerError) as ei:
            await app(e, "o", 6, b"ghi", crc=crc32c(b"ghi") ^ 1)
        assert code_of(ei) is ErrorCode.CHECKSUM_MISMATCH
        assert os.path.getsize(e.storage.namespaces[NS].get("o").path) == size
        # a missing object can only start at 0; an empty append creates it
        with pytest.raises(ServerError) as ei:
            await app(e, "new", 5, b"x")
        assert code_of(ei) is ErrorCode.OFFSET_MISMATCH and ei.value.length == 0
        assert await app(e, "empty", 0, b"") == 0
        assert e.stat(NS, "empty") == (0, False)
        assert e.stat(NS, "o") == (6, False)
        with pytest.raises(ServerError) as ei:
            e.stat(NS, "nope")
        assert code_of(ei) is ErrorCode.NOT_FOUND
        for bad in ["../x", "/abs", "a//b", "a/./b", "", "x" * 2000, "a\x00b"]:
            with pytest.raises(ServerError) as ei:
                await app(e, bad, 0, b"x")
            assert code_of(ei) is ErrorCode.BAD_NAME, bad

    run_engine(tmp_path, body)


def test_prefix_of_stored_bytes_is_a_retry(tmp_path):
    async def body(e):
        await app(e, "o", 0, b"abcdef")
        # "de" is stored at 3: the same bytes at the same offset -> ack offset+len
        assert await app(e, "o", 3, b"de") == 5
        assert e.stat(NS, "o") == (6, False)

    run_engine(tmp_path, body)


def test_seal_fence_and_roles(tmp_path):
    async def body(e):
        await app(e, "o", 0, b"abc")
        with pytest.raises(ServerError) as ei:
            await app(e, "o", 3, b"x", role="read")
        assert code_of(ei) is ErrorCode.FORBIDDEN
        with pytest.raises(ServerError) as ei:
            await e.seal(NS, "read", "o", 0)
        assert code_of(ei) is ErrorCode.FORBIDDEN
        with pytest.raises(ServerError) as ei:
            await e.fence(NS, "read", 5)
        assert code_of(ei) is ErrorCode.FORBIDDEN

        assert await e.fence(NS, "append", 5) == 5
        for epoch in (5, 4, 0):
            with pytest.raises(ServerError) as ei:
                await e.fence(NS, "append", epoch)
            assert code_of(ei) is ErrorCode.FENCED and ei.value.length == 5
        with pytest.raises(ServerError) as ei:
            await app(e, "o", 3, b"x", epoch=4)
        assert code_of(ei) is ErrorCode.FENCED and ei.value.length == 5
        with pytest.raises(ServerError) as ei:
            await e.seal(NS, "append", "o", 4)
        assert code_of(ei) is ErrorCode.FENCED
        assert await app(e, "o", 3, b"d", epoch=5) == 4
        # an epoch above the fence was never taken with FENCE: refused too, nothing written
        for epoch in (6, 9, 2**64 - 1):
            with pytest.raises(ServerError) as ei:
                await app(e, "o", 4, b"e", epoch=epoch)
            assert code_of(ei) is ErrorCode.FENCED and ei.value.length == 5
            with pytest.raises(ServerError) as ei:
                await e.seal(NS, "append", "o", epoch)
            assert code_of(ei) is ErrorCode.FENCED and ei.value.length == 5
        assert e.stat(NS, "o") == (4, False)
        assert await app(e, "o", 4, b"e", epoch=5) == 5

        assert await e.seal(NS, "append", "o", 5) == 5
        assert await e.seal(NS, "append", "o", 5) == 5  # idempotent
        assert e.stat(NS, "o") == (5, True)
        with pytest.raises(ServerError) as ei:
            await app(e, "o", 5, b"f", epoch=5)
        assert code_of(ei) is ErrorCode.SEALED
        assert await app(e, "o", 3, b"de", epoch=5) == 5  # a retry of a landed append is still acked
        with pytest.raises(ServerError) as ei:
            await e.seal(NS, "append", "missing", 5)
        assert code_of(ei) is ErrorCode.NOT_FOUND

    run_engine(tmp_path, body)
    # everything above is on disk
    s = Storage(str(tmp_path))
    s.open()
    assert s.namespaces[NS].fence == 5 and s.namespaces[NS].get("o").sealed


def test_quotas(tmp_path):
    async def body(e):
        await app(e, "a", 0, b"x" * 8)
        with pytest.raises(ServerError) as ei:
            await app(e, "a", 8, b"y" * 3)
        assert code_of(ei) is ErrorCode.QUOTA_EXCEEDED
        await app(e, "b", 0, b"")
        with pytest.raises(ServerError) as ei:
            await app(e, "c", 0, b"z")
        assert code_of(ei) is ErrorCode.QUOTA_EXCEEDED
        assert await app(e, "a", 8, b"yy") == 10

    run_engine(tmp_path, body, limits=Limits(max_objects=2, max_object_size=10))


def test_group_commit_acks_only_after_sync_and_batches(tmp_path, monkeypatch):
    """While a sync is held, no append is acknowledged; the appends that arrived meanwhile
    share one fdatasync of the write-ahead log, however many objects they touch."""
    gate = threading.Event()
    calls = []
    real_sync = LogFile.sync

    def gated_sync(self):
        calls.append(self.path)
        gate.wait(120)
        return real_sync(self)

    monkeypatch.setattr(LogFile, "sync", gated_sync)

    async def body(e):
        acked = []

        for i in range(40):  # create the objects first (creation is synced by itself)
            await app(e, f"w{i}", 0, b"")

        async def writer(i):
            acked.append(await app(e, f"w{i}", 0, b"%d" % i))

        async with trio.open_nursery() as n:
            for i in range(40):
                n.start_soon(writer, i)
            with trio.fail_after(120):
                while not calls:  # the held sync has started in its thread
                    await trio.sleep(0.01)
            await trio.testing.wait_all_tasks_blocked()
            assert acked == []  # nothing is acknowledged before its sync returns
            first_batch = len(calls)
            gate.set()
        assert len(acked) == 40
        return first_batch

    first_batch = run_engine(tmp_path, body)
    assert first_batch == 1  # the held batch: one log sync
    assert len(calls) <= 2  # 40 objects touched: one fdatasync per batch, not one per object
    s = Storage(str(tmp_path))
    s.open()
    assert sorted(o.read_bytes(0, 0) for o in s.namespaces[NS].objects.values()) == sorted(b"%d" % i for i in range(40))


def test_pipelined_appends_to_one_object_share_syncs(tmp_path, monkeypatch):
    gate = threading.Event()
    calls = []
    real_sync = LogFile.sync

    def gated_sync(self):
        calls.append(self.path)
        gate.wait(120)
        return real_sync(self)

    monkeypatch.setattr(LogFile, "sync", gated_sync)

    async def body(e):
        pendings = []
        for i in range(50):  # begin in order (what the session does), finish concurrently
            pendings.append(await e.append_begin(NS, "append", "log", i, 0, crc32c(b"x"), b"x"))
        results = []

        async def fin(p):
            results.append(await e.finish(p))

        async with trio.open_nursery() as n:
            for p in pendings:
                n.start_soon(fin, p)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        assert sorted(results) == list(range(1, 51))

    run_engine(tmp_path, body)
    assert len(calls) <= 2  # 50 appends, at most 2 fdatasyncs


def test_failed_sync_cuts_back_and_reports_no_space(tmp_path, monkeypatch):
    real_sync = LogFile.sync
    fail = {"n": 1}

    def flaky_sync(self):
        if fail["n"]:
            fail["n"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_sync(self)

    async def body(e):
        await app(e, "o", 0, b"keep")
        monkeypatch.setattr(LogFile, "sync", flaky_sync)
        with pytest.raises(ServerError) as ei:
            await app(e, "o", 4, b"lost")
        assert code_of(ei) is ErrorCode.NO_SPACE
        assert e.stat(NS, "o") == (4, False)
        assert await app(e, "o", 4, b"more") == 8

    run_engine(tmp_path, body)
    s = Storage(str(tmp_path))
    s.open()
    assert s.namespaces[NS].get("o").read_bytes(0, 0) == b"keepmore"


def _gen_ns(tmp_path, spec):
    """spec: {G: (ready?, age_seconds)} -> Namespace with gen/G/... objects."""
    s = Storage(str(tmp_path))
    ns = s.namespace(NS, create=True)
    now = time.time()
    for g, (ready, age) in spec.items():
        names = [f"gen/{g:010d}/0000000001-0000000001.seg", f"gen/{g:010d}/0000000100-0000000001.seg"]
        if ready:
            names.append(f"gen/{g:010d}/ready")
        for name in names:
            o = ns.create(name)
            if name.endswith("/ready"):  # complete: empty and durably sealed
                o.write_seal()
                o.mark_synced(*o.sync())
            os.utime(o.path, (now - age, now - age))
    ns.create("outside/gen")
    o = ns.create("gen-notes")
    os.utime(o.path, (now - 10**6, now - 10**6))
    return s, ns, now


def test_retention_keeps_newest_complete_generations(tmp_path):
    s, ns, now = _gen_ns(
        tmp_path, {1: (True, 5000), 2: (True, 5000), 3: (False, 5000), 4: (True, 5000), 5: (False, 10)}
    )
    plan = plan_retention(ns, 2, 60, now=now)
    # complete: 1, 2, 4 -> keep 4 and 2 (and 3, 5: newer than the oldest kept) -> remove 1
    assert plan == sorted(n for n in ns.objects if n.startswith("gen/0000000001/"))
    assert plan_retention(ns, 3, 60, now=now) == []
    assert plan_retention(ns, 4, 60, now=now) == []  # fewer complete generations than N
    # keep 1: generations 1, 2, 3 all old -> removed; 4 and 5 kept; nothing outside gen/
    plan1 = plan_retention(ns, 1, 60, now=now)
    assert {n.split("/")[1] for n in plan1} == {"0000000001", "0000000002", "0000000003"}
    assert not any(not n.startswith("gen/") for n in plan1)


def test_retention_respects_min_age(tmp_path):
    s, ns, now = _gen_ns(tmp_path, {1: (True, 5000), 2: (True, 10), 3: (True, 10)})
    young = ns.get("gen/0000000001/ready")
    os.utime(young.path, (now - 10, now - 10))  # one young object keeps generation 1
    # generation 1 has a young object: kept; generation 2 is young too
    assert plan_retention(ns, 1, 60, now=now) == []
    os.utime(young.path, (now - 5000, now - 5000))
    # generations 2 and 3 completed 10 s ago: neither counts yet, so generation 1 stays
    assert plan_retention(ns, 1, 60, now=now) == []
    # once generation 3 has been complete for min_age, 1 goes (2 has young objects: kept)
    os.utime(ns.get("gen/0000000003/ready").path, (now - 61, now - 61))
    assert plan_retention(ns, 1, 60, now=now) == sorted(n for n in ns.objects if n.startswith("gen/0000000001/"))


def test_engine_gc_removes_files(tmp_path):
    s, ns, now = _gen_ns(tmp_path, {1: (True, 5000), 2: (True, 5000)})
    engine = Engine(s)
    paths = [ns.objects[n].path for n in ns.objects if n.startswith("gen/0000000001/")]

    async def main():
        return await engine.gc(1, 60)

    removed = trio.run(main)
    assert len(removed) == 3 and all(n.startswith("gen/0000000001/") for _, n in removed)
    assert all(not os.path.exists(p) for p in paths)
    assert not any(n.startswith("gen/0000000001/") for n in ns.objects)
    s.close()
    s2 = Storage(str(tmp_path))
    s2.open()
    assert "gen/0000000002/ready" in s2.namespaces[NS].objects
    assert not any(n.startswith("gen/0000000001/") for n in s2.namespaces[NS].objects)
