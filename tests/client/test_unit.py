"""Unit tests of the client layer against a tiny in-test server built on sos_wire.

The fake server (a thread per connection, blocking sockets) lets a test script what
the server does: page lists in small pages, acknowledge out of order, apply appends
and then drop the connection before acknowledging, send garbage, never answer.
Everything else runs against the real server in the other test_client_* files.
"""

from __future__ import annotations

import socket
import threading
import tracemalloc

import pytest
import trio

from sos_client import Client, ConnectionLost, Corrupt, OffsetMismatch, SOSError
from sos_client import errors as cerr
from sos_client.aio import open_client
from sos_client.core import parse_server
from sos_wire import NEED_DATA, Connection, ErrorCode, Key, Role, encode_event
from sos_wire import events as ev
from tests.support import accepted

KEY = str(Key(b"k" * 8, b"s" * 32))


class FakeServer:
    """HELLO/AUTH always succeed; other requests go to ``self.on_request(conn_no, event)``,
    which returns a list of replies (events, or raw frame bytes), "close" or "garbage"."""

    def __init__(self, page_size: int = 1000) -> None:
        self.objects: dict[str, bytearray] = {}
        self.page_size = page_size
        self.requests: list = []
        self.record = True  # keep every request in self.requests
        self.connections = 0
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.threads: list[threading.Thread] = []
        self.stopping = False
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)

    def close(self) -> None:
        self.stopping = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self.sock.close()
        for t in self.threads:
            t.join(30)

    def _accept(self) -> None:
        for s in accepted(self.sock, lambda: self.stopping):
            with self.lock:
                self.connections += 1
                n = self.connections
            t = threading.Thread(target=self._serve, args=(s, n), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, s: socket.socket, n: int) -> None:
        conn = Connection(Role.SERVER)
        s.settimeout(60)
        with s:
            while True:
                try:
                    data = s.recv(1 << 20)
                except OSError:
                    return
                if not data:
                    return
                conn.receive_data(data)
                while (e := conn.next_event()) is not NEED_DATA:
                    if isinstance(e, ev.Hello):
                        replies = [ev.HelloOk(e.request_id, 1, bytes(32), 8 * 1024 * 1024 + 4096, "fake")]
                    elif isinstance(e, ev.Auth):
                        replies = [ev.AuthOk(e.request_id, ev.KeyRole.APPEND)]
                    else:
                        if self.record:
                            with self.lock:
                                self.requests.append(e)
                        replies = self.on_request(n, e)
                    if replies == "close":
                        return
                    if replies == "garbage":
                        s.sendall(b"this is not an SOS frame at all")
                        continue
                    try:
                        s.sendall(b"".join(r if isinstance(r, bytes) else conn.send(r) for r in replies))
                    except OSError:
                        return

    # a well-behaved default, with the idempotent-retry rule of the real server
    def on_request(self, n, e):
        return [self.answer(e)]

    def answer(self, e):
        objs = self.objects
        if isinstance(e, ev.Stat):
            if e.name not in objs:
                return ev.Error(e.request_id, ErrorCode.NOT_FOUND, 0, f"no object {e.name!r}")
            return ev.StatOk(e.request_id, len(objs[e.name]), False)
        if isinstance(e, ev.Append):
            obj = objs.setdefault(e.name, bytearray())
            end = e.offset + len(e.data)
            if e.offset == len(obj):
                obj += e.data
                return ev.AppendOk(e.request_id, end)
            if end <= len(obj) and obj[e.offset : end] == e.data:
                return ev.AppendOk(e.request_id, end)
            return ev.Error(e.request_id, ErrorCode.OFFSET_MISMATCH, len(obj), "offset mismatch")
        if isinstance(e, ev.List):
            names = sorted(n for n in objs if n.startswith(e.prefix) and n > e.after)
            page = names[: min(e.limit, self.page_size)]
            return ev.ListOk(
                e.request_id, tuple(ev.ListEntry(n, len(objs[n]), False) for n in page), len(names) > len(page)
            )
        if isinstance(e, ev.Ping):
            return ev.Pong(e.request_id, e.payload)
        return ev.Error(e.request_id, ErrorCode.UNKNOWN_OP, 0, "not in the fake")


@pytest.fixture
def fake():
    srv = FakeServer()
    yield srv
    srv.close()


def test_list_pages_with_after_cursor(fake):
    fake.page_size = 7
    for i in range(25):
        fake.objects[f"p/{i:03d}"] = bytearray(b"x" * i)
    fake.objects["q"] = bytearray()
    with Client(fake.address, KEY, "ns", timeout=60) as c:
        got = list(c.list("p/"))
    assert [(e.name, e.length) for e in got] == [(f"p/{i:03d}", i) for i in range(25)]
    lists = [r for r in fake.requests if isinstance(r, ev.List)]
    assert [r.after for r in lists] == ["", "p/006", "p/013", "p/020"]
    assert all(r.prefix == "p/" and r.limit == 1000 for r in lists)


def test_out_of_order_acks(fake):
    held = []

    def on_request(n, e):
        if isinstance(e, ev.Append):
            reply = fake.answer(e)
            held.append(reply)
            if len(held) == 4:  # acknowledge groups of four, newest first
                out = held[::-1]
                held.clear()
                return out
            return []
        return [fake.answer(e)]

    fake.on_request = on_request
    chunks = [bytes([i]) * 1000 for i in range(40)]
    with Client(fake.address, KEY, "ns", timeout=60) as c:
        assert c.append_many("o", 0, chunks, window_bytes=4000, window_frames=4) == 40_000
    assert bytes(fake.objects["o"]) == b"".join(chunks)


def test_resume_when_appends_landed_but_acks_were_lost(fake):
    """The server applies appends, then the connection drops before any ack: the client
    reconnects, STATs, re-sends at the same offsets; the server's idempotent-retry rule
    acknowledges what landed; nothing is doubled."""
    state = {"dropped": False}

    def on_request(n, e):
        if isinstance(e, ev.Append) and not state["dropped"]:
            fake.answer(e)  # applied, but never acknowledged
            if len(fake.objects.get(e.name, b"")) >= 2500:
                state["dropped"] = True
                return "close"
            return []
        return [fake.answer(e)]

    fake.on_request = on_request
    chunks = [bytes([65 + i % 26]) * 500 for i in range(20)]
    with Client(fake.address, KEY, "ns", timeout=60, reconnect_timeout=60) as c:
        assert c.append_many("r", 0, chunks, window_bytes=4000, window_frames=8) == 10_000
    assert bytes(fake.objects["r"]) == b"".join(chunks)
    assert fake.connections == 2
    resent = [r for r in fake.requests if isinstance(r, ev.Append)]
    assert any(isinstance(r, ev.Stat) for r in fake.requests)
    # the 500-byte chunks went out as 1000-byte pieces (a quarter of the window); the ones
    # not acknowledged before the drop were sent again at the same offsets
    assert sorted({r.offset for r in resent}) == list(range(0, 10_000, 1000))
    assert len(resent) > 10


def test_resume_in_the_middle_of_a_chunk_split_into_several_appends():
    """Sans-IO, deterministic. A 1.2 MB chunk is one append; a 20 MiB chunk becomes three
    (8 + 8 + 4 MiB). The first append is acknowledged, the second lands but its ack is
    lost, and the connection breaks while the third is being sent. After the resume the
    object must hold every byte once: the job must not forget the fourth piece, which it
    had made but not sent yet."""
    from sos_client.core import NEXT_CHUNK, RECV, AppendJob, Core

    store = FakeServer.__new__(FakeServer)  # just its storage rules (FakeServer.answer)
    store.objects = {}
    head, big = b"head" * 300_000, bytes(range(256)) * (80 * 1024)
    chunks = iter([head, big, b"tail"])
    job = AppendJob("big", 0, 0, window_bytes=64 << 20)

    def drive(gen, core, *, ack_lost_at=None, break_at=None):
        server = Connection(Role.SERVER)
        sends = 0
        cmd = next(gen)
        while True:
            if cmd is NEXT_CHUNK:
                value = next(chunks, None)
            elif cmd is RECV:
                value = core.conn.next_event()
                assert value is not NEED_DATA
            else:
                sends += 1
                if sends == break_at:
                    gen.close()  # what the socket driver does when sending fails
                    raise ConnectionLost("broken pipe")
                server.receive_data(b"".join(cmd))  # a frame's parts
                (request,) = [server.next_event()]
                reply = store.answer(request)
                if sends != ack_lost_at:
                    core.conn.receive_data(server.send(reply))
                value = None
            try:
                cmd = gen.send(value)
            except StopIteration as stop:
                return stop.value

    core1 = Core(Key.parse(KEY), "ns")
    with pytest.raises(ConnectionLost):
        drive(job.run(core1), core1, ack_lost_at=2, break_at=3)
    piece = core1.max_piece("big")
    assert len(store.objects["big"]) == len(head) + piece  # the second landed, unacknowledged
    assert job.acked == 0  # pipelined: all sent before any ack was read
    core2 = Core(Key.parse(KEY), "ns")
    assert drive(job.resume_check(core2), core2) == len(head) + piece
    assert drive(job.run(core2), core2) == len(head) + len(big) + 4
    assert bytes(store.objects["big"]) == head + big + b"tail"


def test_chunks_must_be_bytes_like(fake):
    with Client(fake.address, KEY, "ns", timeout=60) as c:
        with pytest.raises(TypeError, match="bytes-like"):
            c.append_many("t", 0, ["text"])
        assert c.ping(b"ok") == b"ok"


def test_resume_detects_a_server_that_lost_acknowledged_bytes(fake):
    state = {"acked": 0}

    def on_request(n, e):
        if isinstance(e, ev.Stat):
            return [ev.StatOk(e.request_id, 0, False)]  # "forgot" everything
        if isinstance(e, ev.Append):
            r = fake.answer(e)
            state["acked"] += 1
            if state["acked"] == 3 and n == 1:
                return "close"
            return [r]
        return [fake.answer(e)]

    fake.on_request = on_request
    with Client(fake.address, KEY, "ns", timeout=60) as c:
        with pytest.raises(Corrupt, match="acknowledged"):
            c.append_many("z", 0, [b"a" * 100] * 10, window_bytes=100, window_frames=1)


def test_connection_level_error_and_garbage_are_connection_lost(fake):
    fake.on_request = lambda n, e: [ev.Error(0, ErrorCode.BAD_FRAME, 0, "you sent junk")]
    with Client(fake.address, KEY, "ns", timeout=60, reconnect_timeout=0) as c:
        with pytest.raises(ConnectionLost, match="you sent junk"):
            c.ping()
    fake.on_request = lambda n, e: "garbage"
    with Client(fake.address, KEY, "ns", timeout=60, reconnect_timeout=0) as c:
        with pytest.raises(ConnectionLost, match="protocol error"):
            c.ping()
    fake.on_request = lambda n, e: [encode_event(ev.FenceOk(e.request_id, 1))]  # the wrong reply type
    with Client(fake.address, KEY, "ns", timeout=60, reconnect_timeout=0) as c:
        with pytest.raises(ConnectionLost, match="does not answer"):
            c.ping()


def test_silent_server_times_out_as_connection_lost(fake):
    fake.on_request = lambda n, e: []  # never answers (the handshake does, with time to spare)
    with Client(fake.address, KEY, "ns", timeout=60, reconnect_timeout=0) as c:
        c.timeout = 0.5
        c._sock.settimeout(0.5)
        with pytest.raises(ConnectionLost, match="no reply"):
            c.ping()

    async def main():
        async with open_client(fake.address, KEY, "ns", timeout=60, reconnect_timeout=0) as c:
            c.timeout = 0.5
            with pytest.raises(ConnectionLost, match="no reply"):
                await c.ping()

    trio.run(main)


def test_error_draining_keeps_the_connection_in_step(fake):
    def on_request(n, e):
        if isinstance(e, ev.Append) and e.offset > 0:  # every piece after the first
            return [ev.Error(e.request_id, ErrorCode.QUOTA_EXCEEDED, 0, "quota")]
        return [fake.answer(e)]

    fake.on_request = on_request
    with Client(fake.address, KEY, "ns", timeout=60) as c:
        with pytest.raises(cerr.QuotaExceeded, match="quota"):
            c.append_many("d", 0, [b"x" * 1000] * 6, window_bytes=10_000)
        assert c.ping(b"still") == b"still"  # same connection, nothing left over
    assert fake.connections == 1


def test_one_gib_append_many_holds_no_more_than_the_window(fake):
    fake.on_request = lambda n, e: (
        [ev.AppendOk(e.request_id, e.offset + len(e.data))] if isinstance(e, ev.Append) else [fake.answer(e)]
    )
    fake.record = False
    chunk = 1 << 20
    window = 8 << 20

    def gen():
        for i in range(1024):  # 1 GiB, made on the fly
            yield bytes([i % 256]) * chunk

    tracemalloc.start()
    try:
        with Client(fake.address, KEY, "ns", timeout=120) as c:
            assert c.append_many("g", 0, gen(), window_bytes=window) == 1 << 30
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Python memory of the whole process: the client's window (8 MiB) and the chunk being
    # made, plus the fake server's receive buffer (at most what is in flight: the window)
    # and a frame or two of copies. Typically ~15 MiB; holding the stream would be 1 GiB.
    assert peak < 4 * window, f"peak Python memory {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize(
    "code,cls",
    [
        (ErrorCode.OFFSET_MISMATCH, cerr.OffsetMismatch),
        (ErrorCode.FENCED, cerr.Fenced),
        (ErrorCode.SEALED, cerr.SealedError),
        (ErrorCode.CHECKSUM_MISMATCH, cerr.ChecksumMismatch),
        (ErrorCode.CORRUPT, cerr.Corrupt),
        (ErrorCode.NO_SPACE, cerr.NoSpace),
        (ErrorCode.QUOTA_EXCEEDED, cerr.QuotaExceeded),
        (ErrorCode.TOO_LARGE, cerr.TooLarge),
        (ErrorCode.BUSY, cerr.ServerBusy),
        (ErrorCode.NOT_FOUND, cerr.SOSNotFound),
        (ErrorCode.AUTH_FAILED, cerr.SOSPermissionError),
        (ErrorCode.FORBIDDEN, cerr.SOSPermissionError),
        (ErrorCode.NOT_AUTHENTICATED, cerr.SOSPermissionError),
        (ErrorCode.BAD_NAME, cerr.BadNameError),
        (ErrorCode.INTERNAL, cerr.SOSError),
        (ErrorCode.BAD_REQUEST, cerr.SOSError),
        (999, cerr.SOSError),
    ],
)
def test_error_mapping(code, cls):
    exc = cerr.error_from_reply(ev.Error(1, code, 42, "why"), "append to ns/obj at offset 3", name="obj")
    assert type(exc) is cls
    assert exc.code == code and exc.length == 42 and exc.name == "obj"
    assert str(exc).startswith("append to ns/obj at offset 3: ") and "why" in str(exc)
    if cls is cerr.OffsetMismatch:
        assert "42" in str(exc)
    if cls is cerr.Fenced:
        assert exc.epoch == 42


@pytest.mark.parametrize(
    "text,want",
    [
        ("h:1", ("h", 1)),
        ("h", ("h", 7070)),
        ("[::1]:9", ("::1", 9)),
        ("[::1]", ("::1", 7070)),
        (" 10.0.0.1:7071 ", ("10.0.0.1", 7071)),
    ],
)
def test_parse_server(text, want):
    assert parse_server(text) == want


@pytest.mark.parametrize("text", ["h:0", "h:70000", "h:x", ":5", "::1:5", "[::1", 5])
def test_parse_server_rejects(text):
    with pytest.raises(ValueError):
        parse_server(text)


def test_bad_arguments_are_value_errors_before_anything_is_sent(fake):
    with Client(fake.address, KEY, "ns", timeout=60) as c:
        with pytest.raises(ValueError):
            c.append("x", -1, b"a")
        with pytest.raises(ValueError):
            c.append("x", 0, b"a", epoch=2**64)
        with pytest.raises(TypeError, match="bytes-like"):
            c.append("x", 0, "text")
        with pytest.raises(OffsetMismatch):  # the fake answers; the connection is fine
            c.append("x", 5, b"a")
    assert not [r for r in fake.requests if isinstance(r, ev.Append) and r.offset != 5]
    with pytest.raises(SOSError):
        Client(fake.address, KEY, "NS", timeout=60)


def test_readable_now_sees_a_peer_close_even_above_fd_setsize():
    """How a client notices that the server closed its idle connection (before sending on
    it); poll, so a process with more than 1,024 descriptors is no exception."""
    import os
    import resource

    from sos_client.core import readable_now

    a, b = socket.socketpair()
    high = None
    try:
        fds = [a.fileno()]
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft > 2100:
            free = next(fd for fd in range(1900, 2100) if not _fd_open(fd))
            high = os.dup2(a.fileno(), free)
            fds.append(high)
        for fd in fds:
            assert not readable_now(fd)
        b.close()
        for fd in fds:
            assert readable_now(fd)
    finally:
        a.close()
        b.close()
        if high is not None:
            os.close(high)


def _fd_open(fd: int) -> bool:
    import os

    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


class _OneReplyServer:
    """Answers every connection's first bytes with ``reply`` (maybe nothing) and closes it;
    counts the connections (a TLS probe is a second one)."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        for conn in accepted(self.sock):
            self.connections += 1
            with conn:
                try:
                    conn.recv(4096)
                    conn.sendall(self.reply)
                except OSError:
                    pass


#: what a TLS server that sends an alert (not OpenSSL: it closes) answers a plaintext HELLO
TLS_ALERT = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46])


@pytest.mark.parametrize(
    ("reply", "says_tls", "connections"),
    [
        (TLS_ALERT, True, 1),  # a TLS record received: decided by it, no probe
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", False, 1),  # something else, not TLS: no probe
        (b"", False, 2),  # closed without a byte: a probe decides (this server speaks no TLS)
    ],
)
def test_a_failed_plain_handshake_is_explained_by_what_the_server_sent(reply, says_tls, connections):
    for use_trio in (False, True):
        srv = _OneReplyServer(reply)
        try:
            if use_trio:

                async def main(address: str) -> None:
                    async with open_client(address, KEY, "ns", timeout=5, reconnect_timeout=0):
                        pass

                with pytest.raises(ConnectionLost) as info:
                    trio.run(main, srv.address)
            else:
                with pytest.raises(ConnectionLost) as info:
                    Client(srv.address, KEY, "ns", timeout=5, reconnect_timeout=0)
            assert ("the server requires TLS: pass --tls-ca" in str(info.value)) is says_tls, info.value
            assert info.value.retryable is not says_tls
            assert srv.connections == connections
        finally:
            srv.sock.close()
