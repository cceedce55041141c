"""A full disk under a real ``sos-server``: its data directory is on a small tmpfs.

Expected: the writer gets a typed error (NO_SPACE -> ``sos_client.NoSpace``), no
acknowledged byte is lost or changed (also across a restart while full), the connection
survives, and appends work again once space returns (a filler file on the same tmpfs is
deleted). The journal writer treats NO_SPACE as transient: its barrier waits, then
completes once space is back, and a restore has everything.
"""

from __future__ import annotations

import errno
import os
import time

import pytest

from sos_client import Client, NoSpace
from sos_journal import JournaledTree, JournalWriter, restore
from sos_journal.rebuild.restore import rebuild_cache
from sos_wire.errors import ErrorCode

pytestmark = [pytest.mark.hostile]

TIMEOUT = 120
TMPFS_SIZE = "8m"


def _fill(path) -> int:
    """Write *path* until the filesystem is full (down to the last byte); returns its size."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        for size in (64 << 10, 4 << 10, 512, 1):
            while True:
                try:
                    n += f.write(b"\xee" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    return n


def _server_on(tmpfs, factory, ns):
    # no byte quota: the disk fills, not the namespace's quota (by default a quarter of it)
    srv = factory(data_dir=tmpfs / "data", args=["--namespace-quota", "none"], start=False)
    key = srv.keygen(ns, "append")
    srv.start()
    return srv, key


def test_full_disk_gives_no_space_keeps_acked_bytes_and_recovers(tmpfs, sos_server_factory):
    srv, key = _server_on(tmpfs, sos_server_factory, "full")
    try:
        filler = tmpfs / "filler"
        filler.write_bytes(b"\xff" * (3 << 20))
        acked = bytearray()
        errors = []
        with Client(srv.address, key, "full", timeout=TIMEOUT) as c:
            c.append("small", 0, b"acked before the disk filled")
            # fill: big appends first, then ever smaller ones, until not even one byte fits
            for size in (256 << 10, 64 << 10, 4 << 10, 512, 16, 1):
                for _ in range(200):
                    data = os.urandom(size)
                    try:
                        assert c.append("log", len(acked), data) == len(acked) + size
                    except NoSpace as exc:
                        errors.append(exc)
                        break
                    acked += data
                else:
                    pytest.fail(f"the {TMPFS_SIZE} tmpfs never filled up with {size}-byte appends")
            assert len(errors) == 6 and len(acked) > 1 << 20
            assert all(e.code is ErrorCode.NO_SPACE for e in errors)
            # every write path reports it; nothing half-written becomes visible
            with pytest.raises(NoSpace):
                c.append_many("log", len(acked), [os.urandom(300 << 10)] * 4)
            with pytest.raises(NoSpace):
                c.append("brand-new-object", 0, b"x" * 100)
            with pytest.raises(NoSpace):
                c.fence(5)
            assert c.stat("log") == (len(acked), False)
            assert c.read("log") == acked
            assert [e.name for e in c.list()] == ["log", "small"]

        srv.restart()  # a restart while the disk is still full loses nothing either
        with Client(srv.address, key, "full", timeout=TIMEOUT) as c:
            assert c.read("log") == acked
            assert c.read("small") == b"acked before the disk filled"
            # the stop's checkpoint gave back what the write-ahead log held: fill that too
            _fill(tmpfs / "filler2")
            with pytest.raises(NoSpace):
                c.append("log", len(acked), os.urandom(64 << 10))

            filler.unlink()  # space returns
            more = os.urandom(1 << 20)
            assert c.append_many("log", len(acked), [more]) == len(acked) + len(more)
            assert c.append("brand-new-object", 0, b"x" * 100) == 100
            assert c.fence(5) == 5
            assert c.read("log") == acked + more
    finally:
        srv.stop()


def test_journal_writer_waits_out_a_full_disk_and_loses_nothing(tmpfs, sos_server_factory, tmp_path):
    srv, key = _server_on(tmpfs, sos_server_factory, "jfull")

    def factory():
        return Client(srv.address, key, "jfull", timeout=TIMEOUT)

    before, during = os.urandom(200 << 10), os.urandom(300 << 10)
    try:
        writer = JournalWriter(factory, "jfull", str(tmp_path / "spool"), max_backoff=0.5)
        tree = JournaledTree(str(tmp_path / "cache"), writer, rebuild=rebuild_cache).open()
        try:
            tree.create("before")
            tree.write("before", 0, before)
            tree.sync()
            filler = tmpfs / "filler"
            _fill(filler)
            tree.create("during")
            tree.write("during", 0, during)
            with pytest.raises(TimeoutError):
                writer.barrier(timeout=3)  # cannot be durable: the server's disk is full
            deadline = time.monotonic() + TIMEOUT
            while not isinstance(writer.last_error, NoSpace):
                assert time.monotonic() < deadline, f"replicator never saw NO_SPACE: {writer.last_error!r}"
                time.sleep(0.1)
            filler.unlink()
            writer.barrier()  # space is back: everything ships
        finally:
            tree.close()
            writer.close()
        summary = restore(factory, "jfull", str(tmp_path / "restored"))
        assert (tmp_path / "restored" / "before").read_bytes() == before
        assert (tmp_path / "restored" / "during").read_bytes() == during
        assert summary.files == 2
    finally:
        srv.stop()
