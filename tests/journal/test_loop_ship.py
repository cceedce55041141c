"""Rounds shipped from a trio event loop (sos_journal/writer/loop_ship.py), against a real sos-server.

The loop's transport sends the rounds the replicator's own logic chooses and reports what the
server answered through the same bookkeeping; whatever fails is the thread's again, with its
verdicts: an APPEND that landed but whose answer was lost is confirmed by an identical retry,
bytes this writer did not send stop it, a newer epoch fences it. Every wait is for an event.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import pytest
import trio

from sos_client import Client
from sos_client.aio import AsyncClient
from sos_journal import JournaledTree, JournalWriter, WriterFenced
from sos_journal.errors import JournalError
from sos_journal.rebuild.restore import rebuild_cache
from sos_journal.writer.loop_ship import LoopShipper

WAIT = 120
_ns = itertools.count()


def _open(server, tmp_path, **kw):
    ns = f"loop{next(_ns)}-{os.getpid()}"
    key = server.keygen(ns, "append")
    w = JournalWriter(lambda: Client(server.address, key, ns, timeout=60), ns, str(tmp_path / "spool"), **kw)
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.sync()
    w.loop_client_factory = lambda: AsyncClient(server.address, key, ns, timeout=60, reconnect_timeout=0.0)
    return ns, key, w, t


def _server_bytes(server, ns, key, w):
    """The server's copy of every spool segment equals the spool (nothing missing or doubled)."""
    with Client(server.address, key, ns, timeout=60) as c:
        for seg in list(w._segs):
            assert c.read(seg.name) == seg.pread(seg.written, 0)


def _ship(w, target):
    async def main():
        shipper = LoopShipper(w, w.loop_client_factory)
        try:
            return await shipper.ship(target), shipper.rounds, shipper.failures
        finally:
            await shipper.aclose()

    return trio.run(main)


def test_a_round_shipped_from_the_loop_is_acknowledged_as_the_threads(server, tmp_path):
    # a long linger: the thread holds the records back, so the loop's round is what ships them
    ns, key, w, t = _open(server, tmp_path)
    w.linger = 60.0
    t.create("f")
    t.write("f", 0, b"x" * 5000)
    target = w.last_seq
    assert w.acked_seq < target
    assert w.durable_now(target, wake=False) is False
    shipped, rounds, failures = _ship(w, target)
    assert (shipped, rounds, failures) == (True, 1, 0)
    assert w.acked_seq == target and w.durable_now(target) is True
    _server_bytes(server, ns, key, w)
    t.close()


def test_a_lost_answer_is_confirmed_by_an_identical_retry(server, tmp_path):
    # the round lands on the server, its answer is lost (the loop reports a failure): the
    # thread asks the server's length and re-sends those bytes, which the server compares
    ns, key, w, t = _open(server, tmp_path, max_backoff=0.05)
    w.linger = 60.0
    t.create("h")
    t.write("h", 0, b"y" * 3000)
    target = w.last_seq
    rnd = w.claim_round(target)
    assert rnd is not None and rnd.offset == rnd.seg.confirmed
    with Client(server.address, key, ns, timeout=60) as c:
        for chunk, at in zip(rnd.chunks, itertools.accumulate([rnd.offset, *map(len, rnd.chunks)]), strict=False):
            c.append(rnd.seg.name, at, chunk, epoch=w.epoch)
    w.round_failed(rnd)
    assert w.claim_round(target) is None  # the thread's until its next success
    w.barrier(target, timeout=WAIT)
    assert w.acked_seq >= target
    _server_bytes(server, ns, key, w)
    t.write("h", 3000, b"z")  # and rounds may be claimed again after the thread's success
    assert _ship(w, w.last_seq)[0] is True
    t.close()


def test_bytes_this_writer_did_not_send_stop_it(server, tmp_path):
    ns, key, w, t = _open(server, tmp_path, max_backoff=0.05)
    w.linger = 60.0
    t.create("i")
    t.write("i", 0, b"a" * 2000)
    target = w.last_seq
    rnd = w.claim_round(target)
    assert rnd is not None
    forged = bytes(len(rnd.chunks[0]))  # other bytes at the round's offset (same epoch)
    with Client(server.address, key, ns, timeout=60) as c:
        c.append(rnd.seg.name, rnd.offset, forged, epoch=w.epoch)
    w.round_failed(rnd)
    with pytest.raises(JournalError):
        w.barrier(target, timeout=WAIT)
    assert w.acked_seq < target
    w.abandon()


def test_a_fenced_writer_stops_when_the_loop_ships(server, tmp_path):
    ns, key, w, t = _open(server, tmp_path, max_backoff=0.05)
    w.linger = 60.0
    with Client(server.address, key, ns, timeout=60) as c:
        c.fence(w.epoch + 1)
    t.create("j")
    target = w.last_seq
    shipped, _rounds, failures = _ship(w, target)
    assert (shipped, failures) == (False, 1)  # handed to the thread, which gets the verdict
    with pytest.raises(WriterFenced):
        w.barrier(target, timeout=WAIT)
    w.abandon()


def test_the_thread_ships_nothing_while_a_round_is_claimed(server, tmp_path):
    ns, key, w, t = _open(server, tmp_path)
    t.create("k")
    target = w.last_seq
    rnd = w.claim_round(target)
    if rnd is None:  # the thread took it first: it is shipping; wait for it and claim the next
        w.barrier(target, timeout=WAIT)
        t.write("k", 0, b"q")
        target = w.last_seq
        w.linger = 60.0
        rnd = w.claim_round(target)
    assert rnd is not None
    with w._cv:  # the claimed round is out: the thread has nothing to ship meanwhile
        assert w._next_task() is None
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (w.barrier(target, timeout=WAIT), done.set()))
    waiter.start()
    w.round_failed(rnd)  # the thread takes over
    waiter.join(WAIT)
    assert done.is_set() and w.acked_seq >= target
    _server_bytes(server, ns, key, w)
    t.close()


def test_records_nobody_waits_for_are_shipped_by_the_polling_thread(server, tmp_path):
    # the gateway's writer: appends do not wake its replicator, which looks for records every
    # linger by itself; a record no barrier ever waits for still reaches the server
    ns, key, w, t = _open(server, tmp_path)
    w.linger = 0.05
    t.create("p")  # (the thread waits without a poll until this wakes it)
    w.barrier(timeout=WAIT)
    t.write("p", 0, b"s" * 100)  # now it polls: this append wakes nobody
    target = w.last_seq
    deadline = time.monotonic() + WAIT
    while w.acked_seq < target:
        assert time.monotonic() < deadline, "a record nobody waits for was never shipped"
        time.sleep(0.01)
    _server_bytes(server, ns, key, w)
    t.close()
