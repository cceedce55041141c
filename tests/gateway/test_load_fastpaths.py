"""The gateway's per-request savings of issue 28 item 2, each keeping its guarantees: a verified
token is remembered but still expires; calls that are microseconds run in the event loop only
when they cannot block it; the barriers of concurrent requests share one wait, and its
failure is every waiter's. (bench/load.py measures the CPU they save; tests/gateway/test_load.py.)"""

from __future__ import annotations

import functools
import os
import threading
import time

import pytest
import trio
import trio.lowlevel

from spark_plugin.gateway.http import auth
from spark_plugin.gateway.http.auth import TokenAuthority
from spark_plugin.gateway.http.operations import SharedBarrier
from spark_plugin.gateway.http.server import QUICK_LIMIT, Gateway
from spark_plugin.gateway.webhdfs.hdfs import WebHdfsError
from tests.support import ManualClock


def test_a_remembered_token_still_expires_and_a_forged_one_is_never_remembered(monkeypatch):
    clock = ManualClock()
    authority = TokenAuthority("ns", b"s" * 32, ttl=60, clock=clock)
    token, _ = authority.issue("append", "00" * 8, b"k" * 32)
    first = authority.check(token)
    assert first is not None and first.role == "append"
    assert authority.check(token) is first  # remembered: no second MAC
    forged = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    assert authority.check(forged) is None
    assert forged not in authority._verified
    clock.now += 61
    assert authority.check(token) is None  # expired, remembered or not
    assert token not in authority._verified
    # bounded: the least recently used is forgotten first, and still verifies when it comes back
    monkeypatch.setattr(auth, "VERIFIED_TOKENS", 3)
    tokens = [authority.issue("read", "00" * 8, b"k" * 32)[0] for _ in range(5)]
    for t in tokens:
        assert authority.check(t) is not None
    assert list(authority._verified) == tokens[2:]
    assert authority.check(tokens[0]) is not None and list(authority._verified) == [*tokens[3:], tokens[0]]


class FakeWriter:
    def __init__(self, room: bool = True) -> None:
        self.room = room

    def has_room(self, nbytes: int) -> bool:
        return self.room


class FakeNs:
    """What Gateway._quick and SharedBarrier use of a namespace."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.waits = True
        self.seq = 0
        self.durable_calls: list[int] = []
        self.fail: Exception | None = None
        self.observed: list[float] = []
        self.observer = self
        self.room = True
        self.writer: object = None  # no writer: SharedBarrier waits in a worker thread

    def has_room(self, nbytes: int) -> bool:
        return self.room

    def _last_seq(self) -> int:
        return self.seq

    def wait_durable(self, seq: int | None) -> None:
        self.durable_calls.append(seq or 0)
        time.sleep(0.2)
        if self.fail is not None:
            raise self.fail

    def barrier_waited(self, seconds: float) -> None:
        self.observed.append(seconds)


def _gateway(ns: FakeNs) -> Gateway:
    gw = Gateway(None, TokenAuthority("ns", b"k" * 32), lambda key: ("append", ""))  # type: ignore[arg-type]
    gw.ns = ns  # type: ignore[assignment]
    return gw


def test_quick_calls_run_inline_only_when_they_cannot_block_the_event_loop():
    ns = FakeNs()
    gw = _gateway(ns)
    loop_thread: list[int] = []

    def where() -> int:
        return threading.get_ident()

    async def main() -> dict[str, bool]:
        loop_thread.append(threading.get_ident())
        inline = {}
        inline["read"] = await gw._quick(where) == loop_thread[0]
        inline["small change"] = await gw._quick(where, change=100) == loop_thread[0]
        inline["large change"] = await gw._quick(where, change=QUICK_LIMIT + 1) == loop_thread[0]
        ns.room = False
        inline["writer without room"] = await gw._quick(where, change=100) == loop_thread[0]
        ns.room = True
        held, release = threading.Event(), threading.Event()

        def holder() -> None:
            with ns.lock:
                held.set()
                release.wait(10)

        t = threading.Thread(target=holder)
        t.start()
        held.wait(10)
        try:
            with trio.fail_after(5):
                async with trio.open_nursery() as nursery:
                    result: list[int] = []

                    async def change() -> None:
                        result.append(await gw._quick(where, change=100))

                    nursery.start_soon(change)
                    # the event loop is not stuck on the lock: the call went to a thread
                    while not result:
                        await trio.sleep(0.01)
                    release.set()
            inline["lock held elsewhere"] = result[0] == loop_thread[0]
        finally:
            release.set()
            t.join()
        return inline

    assert trio.run(main) == {
        "read": True,
        "small change": True,
        "large change": False,
        "writer without room": False,
        "lock held elsewhere": False,
    }
    assert not ns.lock._is_owned()  # type: ignore[attr-defined]


def _run_in_thread(fn, *args):
    return trio.to_thread.run_sync(fn, *args)


def test_concurrent_barriers_share_one_wait_and_each_is_observed():
    ns = FakeNs()
    shared = SharedBarrier(ns, _run_in_thread)  # type: ignore[arg-type]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for seq in range(1, 11):
                ns.seq = seq
                nursery.start_soon(shared.wait, seq)
                await trio.lowlevel.checkpoint()
        ns.seq = 12
        await shared.wait(12)  # a record after them: a wait of its own
        await shared.wait(11)  # covered by the last one: no wait at all

    trio.run(main)
    # the first wait covers what was journaled when it started; the requests that came
    # meanwhile share the next one, for all ten; then one for 12, none for 11
    calls = ns.durable_calls
    assert len(calls) == 3 and calls[0] < 10 and calls[1:] == [10, 12], calls
    assert len(ns.observed) == 12
    assert shared.covered == 12


def test_a_shared_wait_that_fails_fails_every_request_it_covers():
    ns = FakeNs()
    ns.fail = WebHdfsError("DSQuotaExceededException", "over quota")
    shared = SharedBarrier(ns, _run_in_thread)  # type: ignore[arg-type]
    errors: list[str] = []

    async def one(seq: int) -> None:
        try:
            await shared.wait(seq)
        except WebHdfsError as exc:
            errors.append(exc.exception)

    async def main() -> None:
        ns.seq = 5
        async with trio.open_nursery() as nursery:
            for seq in (5, 3, 4):
                nursery.start_soon(one, seq)
                await trio.lowlevel.checkpoint()

    trio.run(main)
    assert errors == ["DSQuotaExceededException"] * 3
    assert ns.durable_calls == [5]
    assert shared.covered == 0  # nothing was said durable


def test_without_sync_a_barrier_waits_for_nothing():
    ns = FakeNs()
    ns.waits = False
    trio.run(SharedBarrier(ns, _run_in_thread).wait, 3)  # type: ignore[arg-type]
    assert ns.durable_calls == [] and ns.observed == []


@pytest.mark.parametrize("gen_bytes,unshipped,room", [(0, 0, True), (1 << 30, 0, False), (0, 64 << 20, False)])
def test_the_writer_has_room_only_below_its_lag_bound_and_generation_size(gen_bytes, unshipped, room):
    from sos_journal.writer.writer import JournalWriter

    w = JournalWriter(lambda: None, "ns", "/nonexistent")  # type: ignore[arg-type, return-value]
    w.is_open = True
    w.generation = 1
    w._gen_bytes = gen_bytes
    w._unshipped = lambda: unshipped  # type: ignore[method-assign]
    assert w.has_room(4096) is room


def test_a_reply_is_one_write_with_its_connection_headers_and_no_header_can_be_injected():
    import socket

    from spark_plugin.gateway.http.connection import Conn

    async def main() -> tuple[bytes, bytes]:
        lis = socket.create_server(("127.0.0.1", 0))
        s2 = socket.create_connection(lis.getsockname())
        s1, _ = lis.accept()
        lis.close()
        conn = Conn(trio.SocketStream(trio.socket.from_stdlib_socket(s1)))
        conn.h11.receive_data(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.h11.next_event()  # the request
        conn.h11.next_event()  # its end
        with pytest.raises(ValueError, match="bad reply header"):
            await conn.respond(307, b"", [("location", "http://x/a\r\nSet-Cookie: stolen=1")])
        await conn.respond(200, b'{"boolean":true}', [("Location", "http://x/a%0D%0A")])
        first = s2.recv(65536)
        conn.h11.start_next_cycle()
        conn.h11.receive_data(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.h11.next_event()  # the request
        conn.h11.next_event()  # its end
        conn.closing = True  # the gateway is stopping: the reply says so
        await conn.respond(404, b"{}")
        second = s2.recv(65536)
        s2.close()
        await conn.stream.aclose()
        return first, second

    first, second = trio.run(main)
    head, _, body = first.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 ") and body == b'{"boolean":true}'
    assert b"\r\nlocation: http://x/a%0D%0A" in head and b"set-cookie" not in first.lower()
    assert b"connection: keep-alive" in head.lower() and b"keep-alive: timeout=1" in head.lower()
    assert second.startswith(b"HTTP/1.1 404 ") and b"connection: close" in second.lower()


class DurableWriter:
    """The writer's side of a wait in the event loop: durable_now() and the listener."""

    def __init__(self) -> None:
        self.durable: bool | None = False
        self.progress_listener = None
        self.asked: list[int] = []

    def durable_now(self, seq: int | None = None) -> bool | None:
        self.asked.append(seq or 0)
        return self.durable

    def acknowledge(self, durable: bool | None = True) -> None:
        """The replicator's thread: an attempt ended."""
        self.durable = durable
        assert self.progress_listener is not None
        self.progress_listener()


def test_a_healthy_writer_is_waited_for_in_the_event_loop_woken_by_its_progress():
    ns = FakeNs()
    ns.writer = writer = DurableWriter()
    shared = SharedBarrier(ns, _run_in_thread)  # type: ignore[arg-type]

    async def main() -> None:
        ns.seq = 4
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shared.wait, 4)
            nursery.start_soon(shared.wait, 3)
            await trio.sleep(0.05)
            assert shared.covered == 0  # still waiting
            # the replicator reports from its own thread, as the real one does
            await trio.to_thread.run_sync(writer.acknowledge)

    trio.run(main)
    assert ns.durable_calls == []  # no worker thread waited
    assert shared.covered == 4 and len(ns.observed) == 2
    assert writer.asked[-1] == 4


def test_a_writer_that_cannot_say_at_once_is_waited_for_by_the_blocking_barrier():
    """durable_now() None (durability tier, the quota state, a failed writer): the wait is
    the namespace's blocking one, in a worker thread, with its failure as the answer."""
    ns = FakeNs()
    ns.writer = writer = DurableWriter()
    shared = SharedBarrier(ns, _run_in_thread)  # type: ignore[arg-type]
    ns.seq = 2

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shared.wait, 2)
            await trio.sleep(0.05)
            ns.fail = WebHdfsError("DSQuotaExceededException", "over quota")
            await trio.to_thread.run_sync(writer.acknowledge, None)  # the quota state began

    with pytest.raises(BaseException) as info:
        trio.run(main)
    assert "DSQuotaExceededException" in repr(info.value) or "over quota" in repr(info.value)
    assert ns.durable_calls == [2]
    assert shared.covered == 0


def _walk_answers(cls, root, paths):
    out = []
    with cls(str(root)) as at:
        for p in paths:
            try:
                fd = at.dir_fd(p)
                out.append((p, "dir", os.fstat(fd).st_ino))
            except (OSError, ValueError) as exc:
                out.append((p, type(exc).__name__, getattr(exc, "errno", None)))
    return out


@pytest.mark.hostile
@pytest.mark.parametrize("openat2", [True, False])
def test_the_one_call_walk_answers_as_the_component_walk_and_never_follows_a_link(tmp_path, monkeypatch, openat2):
    """OneCallWalk (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) resolves the directories of
    the cache in one call with the component walk's answers: links (to inside or outside
    the cache), files where a directory is needed, missing names, odd paths; without
    openat2 (an old kernel, a seccomp filter) it is the component walk."""
    from sos_journal.beneath import Beneath
    from spark_plugin.gateway.webhdfs import walk

    if not openat2:
        monkeypatch.setattr(walk, "_syscall", None)
    root = tmp_path / "cache"
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "f").write_bytes(b"x")
    (root / "in").symlink_to("a")
    (root / "a" / "out").symlink_to(tmp_path)
    (tmp_path / "secret").mkdir()
    paths = [
        "a",
        "a/b/c",
        "a/b",
        "in",
        "in/b",
        "a/out",
        "a/out/secret",
        "f",
        "f/x",
        "nx",
        "a/nx/y",
        "a/b/c/",
        "a//b",
        "./a",
        "/a",
        "a\0b",
        "x" * 300,
        "a/" + "y" * 4200,
    ]
    assert _walk_answers(walk.OneCallWalk, root, paths) == _walk_answers(Beneath, root, paths)
    # over the namespace's own descriptor of the root, which the walk leaves open
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        shared = functools.partial(walk.OneCallWalk, root_fd=root_fd)
        assert _walk_answers(shared, root, paths) == _walk_answers(Beneath, root, paths)
        os.fstat(root_fd)  # still open
    finally:
        os.close(root_fd)
    answers = dict((p, kind) for p, kind, _ in _walk_answers(walk.OneCallWalk, root, paths))
    assert answers["in"] == answers["a/out"] == answers["a/out/secret"] == "NotADirectoryError"
    assert answers["a/b/c"] == "dir"
