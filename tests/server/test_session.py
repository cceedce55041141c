"""Session over trio.testing.memory_stream_pair (real engine and storage, no sockets)."""

from __future__ import annotations

import struct

import pytest
import trio
import trio.testing

from sos_server.engine import Engine
from sos_server.session import READ_CHUNK, Session
from sos_server.storage import Storage
from sos_wire import events as ev
from sos_wire.auth import Key
from sos_wire.connection import NEED_DATA, Connection, Role
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.frames import HEADER_LEN

NS = "sess"


class Peer:
    """Client side of a memory stream."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.conn = Connection(Role.CLIENT)

    async def send(self, event) -> int:
        await self.stream.send_all(self.conn.send(event))
        return event.request_id

    async def next(self):
        while True:
            e = self.conn.next_event()
            if e is not NEED_DATA:
                return e
            data = await self.stream.receive_some(1 << 20)
            if not data:
                raise EOFError
            self.conn.receive_data(data)

    async def call(self, event):
        await self.send(event)
        return await self.next()

    def rid(self) -> int:
        return self.conn.next_request_id()

    async def login(self, key: str, ns: str = NS):
        hello = await self.call(ev.Hello(self.rid(), "t", 1, 1))
        assert isinstance(hello, ev.HelloOk) and len(hello.nonce) == 32
        k = Key.parse(key)
        return await self.call(ev.Auth(self.rid(), k.key_id, ns, k.proof(hello.nonce, ns)))

    async def closed(self) -> bool:
        """True once the server closed (reads until EOF, discarding frames)."""
        while True:
            data = await self.stream.receive_some(1 << 20)
            if not data:
                return True


def run_session(
    tmp_path, body, *, idle_timeout=None, clock=None, handshake_timeout=None, pair=trio.testing.memory_stream_pair
):
    storage = Storage(str(tmp_path))
    keys = {
        "append": storage.keygen(NS, "append"),
        "read": storage.keygen(NS, "read"),
        "other": storage.keygen("other", "append"),
    }
    engine = Engine(storage)

    async def main():
        async with trio.open_nursery() as n:
            await n.start(engine.run)
            client, server = pair()
            deadline = trio.current_time() + handshake_timeout if handshake_timeout else float("inf")
            n.start_soon(
                Session(engine, server, peer="mem", idle_timeout=idle_timeout, handshake_deadline=deadline).run
            )
            try:
                await body(Peer(client), keys)
            finally:
                n.cancel_scope.cancel()

    try:
        trio.run(main, clock=clock)
    finally:
        storage.close()


def test_ping_before_auth_then_requests_need_auth(tmp_path):
    async def body(p, keys):
        r = await p.call(ev.Ping(p.rid(), b"hi"))
        assert r == ev.Pong(r.request_id, b"hi")
        r = await p.call(ev.Stat(p.rid(), "x"))
        assert isinstance(r, ev.Error) and r.code is ErrorCode.NOT_AUTHENTICATED
        r = await p.login(keys["append"])
        assert isinstance(r, ev.AuthOk) and r.role == ev.KeyRole.APPEND
        r = await p.call(ev.Stat(p.rid(), "x"))
        assert r.code is ErrorCode.NOT_FOUND

    run_session(tmp_path, body)


@pytest.mark.parametrize("case", ["wrong_secret", "wrong_namespace", "unknown_key", "bad_namespace"])
def test_auth_failures_are_typed_and_connection_survives(tmp_path, case):
    async def body(p, keys):
        hello = await p.call(ev.Hello(p.rid(), "t", 1, 1))
        k = Key.parse(keys["append"])
        ns = NS
        if case == "wrong_secret":
            k = Key(k.key_id, bytes(32))
        elif case == "wrong_namespace":
            ns = "other"  # the key belongs to NS
        elif case == "unknown_key":
            k = Key(b"\x01" * 8, k.secret)
        else:
            ns = "../../etc"
        r = await p.call(ev.Auth(p.rid(), k.key_id, ns, k.proof(hello.nonce, ns)))
        assert isinstance(r, ev.Error) and r.code is ErrorCode.AUTH_FAILED
        r = await p.call(ev.Append(p.rid(), "a", 0, 0, crc32c(b"x"), b"x"))
        assert r.code is ErrorCode.NOT_AUTHENTICATED
        assert isinstance(await p.call(ev.Ping(p.rid(), b"")), ev.Pong)
        # a correct AUTH on the same connection still works
        k = Key.parse(keys["append"])
        r = await p.call(ev.Auth(p.rid(), k.key_id, NS, k.proof(hello.nonce, NS)))
        assert isinstance(r, ev.AuthOk)

    run_session(tmp_path, body)


def test_read_key_can_read_but_not_write(tmp_path):
    async def body(p, keys):
        r = await p.login(keys["read"])
        assert r.role == ev.KeyRole.READ
        for req in [ev.Append(p.rid(), "a", 0, 0, crc32c(b"x"), b"x"), ev.Seal(p.rid(), "a", 0), ev.Fence(p.rid(), 3)]:
            r = await p.call(req)
            assert isinstance(r, ev.Error) and r.code is ErrorCode.FORBIDDEN, req
        r = await p.call(ev.List(p.rid(), "", "", 10))
        assert r.entries == () and not r.more

    run_session(tmp_path, body)


def test_pipelined_appends_and_replies_by_request_id(tmp_path):
    async def body(p, keys):
        await p.login(keys["append"])
        # 3 objects, 20 appends each, all sent before reading any reply
        p2_ids = {}
        offsets = {"log0": 0, "log1": 0, "log2": 0}
        expect = {"log0": b"", "log1": b"", "log2": b""}
        for i in range(60):
            name = f"log{i % 3}"
            data = bytes([i]) * (i * 37 + 1)
            rid = await p.send(ev.Append(p.rid(), name, offsets[name], 0, crc32c(data), data))
            offsets[name] += len(data)
            expect[name] += data
            p2_ids[rid] = offsets[name]
        # a bad one in the middle of the stream does not disturb the others
        bad = await p.send(ev.Append(p.rid(), "log0", 999999, 0, crc32c(b"z"), b"z"))
        got = {}
        for _ in range(len(p2_ids) + 1):
            r = await p.next()
            got[r.request_id] = r
        assert got.pop(bad).code is ErrorCode.OFFSET_MISMATCH
        assert {rid: r.length for rid, r in got.items()} == p2_ids
        for name, data in expect.items():
            frames = []
            await p.send(ev.Read(p.rid(), name, 0, 0))
            while True:
                r = await p.next()
                frames.append(r)
                if r.last:
                    break
            assert b"".join(f.data for f in frames) == data

    run_session(tmp_path, body)


def test_read_is_streamed_in_chunks_of_at_most_1mib(tmp_path):
    async def body(p, keys):
        await p.login(keys["append"])
        blob = bytes(range(256)) * 20000  # ~4.9 MiB in 8 appends of uneven size
        off = 0
        for size in [1, 5 << 20 >> 3, 1 << 20, 3, 700000, 1 << 20, 12345]:
            chunk = blob[off : off + size]
            r = await p.call(ev.Append(p.rid(), "big", off, 0, crc32c(chunk), chunk))
            assert isinstance(r, ev.AppendOk), r
            off += size
        rest = blob[off:]
        r = await p.call(ev.Append(p.rid(), "big", off, 0, crc32c(rest), rest))
        assert r.length == len(blob)
        for start, length in [(0, 0), (100, 2_500_000), (len(blob) - 5, 0), (len(blob), 0)]:
            rid = await p.send(ev.Read(p.rid(), "big", start, length))
            frames = []
            while True:
                f = await p.next()
                assert f.request_id == rid and isinstance(f, ev.ReadData), f
                frames.append(f)
                if f.last:
                    break
            assert all(len(f.data) <= READ_CHUNK for f in frames)
            assert [f.last for f in frames] == [False] * (len(frames) - 1) + [True]
            pos = start
            for f in frames:
                assert f.offset == pos
                pos += len(f.data)
            want = blob[start:] if length == 0 else blob[start : start + length]
            assert b"".join(f.data for f in frames) == want
        r = await p.call(ev.Read(p.rid(), "big", len(blob) + 1, 0))
        assert r.code is ErrorCode.BAD_REQUEST

    run_session(tmp_path, body)


def test_unknown_opcode_is_answered_and_connection_survives(tmp_path):
    async def body(p, keys):
        await p.login(keys["append"])
        header = b"SO" + bytes([1, 0x42]) + struct.pack(">II", 777, 3)
        await p.stream.send_all(header + struct.pack(">I", crc32c(header)) + b"abc")
        raw = b""
        while len(raw) < HEADER_LEN:
            raw += await p.stream.receive_some(1 << 16)
        # decode with a fresh client connection that expects nothing: read the ERROR by hand
        opcode, rid = raw[3], struct.unpack(">I", raw[4:8])[0]
        assert opcode == 0xFF and rid == 777
        body_len = struct.unpack(">I", raw[8:12])[0]
        while len(raw) < HEADER_LEN + body_len:
            raw += await p.stream.receive_some(1 << 16)
        code = struct.unpack(">H", raw[16:18])[0]
        assert code == ErrorCode.UNKNOWN_OP
        p.conn = Connection(Role.CLIENT)
        assert isinstance(await p.call(ev.Ping(p.rid(), b"still")), ev.Pong)

    run_session(tmp_path, body)


@pytest.mark.parametrize("garbage", ["bad_magic", "bad_header_crc", "oversized", "truncated_body_then_eof"])
def test_broken_frame_gets_error_then_close(tmp_path, garbage):
    async def body(p, keys):
        await p.login(keys["append"])
        if garbage == "bad_magic":
            data = b"XX" + bytes(14)
        elif garbage == "bad_header_crc":
            h = b"SO" + bytes([1, 3]) + struct.pack(">II", 5, 4)
            data = h + struct.pack(">I", crc32c(h) ^ 0xFFFF) + bytes(4)
        elif garbage == "oversized":
            h = b"SO" + bytes([1, 6]) + struct.pack(">II", 5, 1 << 30)
            data = h + struct.pack(">I", crc32c(h))
        else:
            h = b"SO" + bytes([1, 3]) + struct.pack(">II", 5, 100)
            data = h + struct.pack(">I", crc32c(h)) + b"short"
        await p.stream.send_all(data)
        if garbage == "truncated_body_then_eof":
            await p.stream.send_eof()
        raw = b""
        while True:
            chunk = await p.stream.receive_some(1 << 16)
            if not chunk:
                break
            raw += chunk
        assert raw[:2] == b"SO" and raw[3] == 0xFF
        code = struct.unpack(">H", raw[16:18])[0]
        want = {"oversized": ErrorCode.TOO_LARGE}.get(garbage, ErrorCode.BAD_FRAME)
        assert code == want

    run_session(tmp_path, body)


def test_idle_connection_is_closed(tmp_path):
    async def body(p, keys):
        assert isinstance(await p.call(ev.Ping(p.rid(), b"")), ev.Pong)
        with trio.fail_after(3600):  # mock clock: jumps ahead instantly
            assert await p.closed()

    run_session(tmp_path, body, idle_timeout=30, clock=trio.testing.MockClock(autojump_threshold=0))


def test_handshake_deadline_closes_unauthenticated_connections_pings_do_not_extend_it(tmp_path):
    async def body(p, keys):
        start = trio.current_time()
        pongs = 0
        with trio.fail_after(3600):  # mock clock: jumps ahead instantly
            try:
                while True:  # a PING a second: answered, but it does not buy time
                    r = await p.call(ev.Ping(p.rid(), b""))
                    assert isinstance(r, ev.Pong)
                    pongs += 1
                    await trio.sleep(1)
            except (EOFError, trio.BrokenResourceError):  # closed by the server
                pass
        assert 5 <= pongs <= 11 and trio.current_time() - start < 60

    run_session(tmp_path, body, handshake_timeout=10, clock=trio.testing.MockClock(autojump_threshold=0))


def test_handshake_deadline_closes_a_peer_that_never_reads(tmp_path):
    """HELLOs whose replies are never read block the server's send: the deadline still
    closes the connection."""

    async def body(p, keys):
        with trio.fail_after(3600):
            await p.stream.send_all(p.conn.send(ev.Hello(p.rid(), "t", 1, 1)))
            await trio.sleep(60)  # not reading: the server is stuck sending HELLO_OK
            assert await p.closed()

    run_session(
        tmp_path,
        body,
        handshake_timeout=10,
        clock=trio.testing.MockClock(autojump_threshold=0),
        pair=trio.testing.lockstep_stream_pair,
    )


def test_authenticated_connection_outlives_the_handshake_deadline(tmp_path):
    async def body(p, keys):
        assert isinstance(await p.login(keys["append"]), ev.AuthOk)
        await trio.sleep(3600)  # far past the handshake deadline, no idle timeout
        r = await p.call(ev.Stat(p.rid(), "x"))
        assert r.code is ErrorCode.NOT_FOUND

    run_session(tmp_path, body, handshake_timeout=10, clock=trio.testing.MockClock(autojump_threshold=0))


def test_read_chunks_cover_the_pieces_exactly_and_big_pieces_are_not_copied():
    """The READ path cuts stored pieces into READ_DATA chunks: every byte once, in order, no
    chunk over the limit; a chunk inside one piece is a view of it (no copy)."""
    import random

    from sos_server.session import _Chunker

    rnd = random.Random(5)
    for _ in range(50):
        pieces = [memoryview(rnd.randbytes(rnd.choice([1, 10, 100, 1000, 5000]))) for _ in range(rnd.randint(0, 12))]
        limit = rnd.choice([7, 100, 1024, 4096, 10_000])
        ch = _Chunker(pieces)
        got = []
        while True:
            c = ch.take(limit)
            if not len(c):
                break
            assert len(c) <= limit
            got.append(bytes(c))
        assert b"".join(got) == b"".join(bytes(p) for p in pieces)
    big = memoryview(bytes(range(256)) * 100)
    ch = _Chunker([big])
    c = ch.take(1000)
    assert isinstance(c, memoryview) and c.obj is big.obj
