"""The server's test helpers (its fixtures are the root conftest's: ``sos_server``,
``sos_server_factory``, ``server``): frames by hand on a socket (:class:`Wire`), the crash
writer whose appends a killed server must keep (:func:`writer`, :func:`check_object`), the
memory of a process."""

from __future__ import annotations

import hashlib
import socket
import struct

import psutil

from sos_wire import events as ev
from sos_wire.auth import Key
from sos_wire.connection import decode_body, encode_event
from sos_wire.crc import crc32c
from sos_wire.frames import Op
from tests.conftest import RawClient

TIMEOUT = 60

#: where the crash writer appends (tests/server/test_crash.py, test_wal.py)
WRITER_NS = "crash"
WRITER_OBJECTS = ["j/a", "j/b", "j/c"]
WINDOW = 24  # appends in flight per connection


def rss(pid: int) -> int:
    """The resident memory of the process ``pid`` now, in bytes."""
    return psutil.Process(pid).memory_info().rss


class Wire:
    """Frames by hand over a socket to a real server; replies decoded with the reference codec's
    bodies."""

    def __init__(self, srv, *, source: str | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT)
        if source:
            self.sock.bind((source, 0))
        self.sock.connect(srv.host_port)
        self.buf = b""
        self.nonce = b""
        self.next_id = 100

    def close(self) -> None:
        self.sock.close()

    def rid(self) -> int:
        self.next_id += 1
        return self.next_id

    def send(self, event) -> int:
        self.sock.sendall(encode_event(event))
        return event.request_id

    def reply(self):
        """The next reply event; EOFError when the server closed the connection."""
        while True:
            if len(self.buf) >= 16:
                opcode, rid, n = self.buf[3], *struct.unpack(">II", self.buf[4:12])
                if len(self.buf) >= 16 + n:
                    body, self.buf = self.buf[16 : 16 + n], self.buf[16 + n :]
                    return decode_body(Op(opcode), rid, body)
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                raise EOFError
            self.buf += data

    def error(self) -> ev.Error:
        r = self.reply()
        assert isinstance(r, ev.Error), r
        return r

    def is_open(self) -> bool:
        """A PING answered with PONG: open; EOF or a reset: closed."""
        rid = self.rid()
        try:
            self.send(ev.Ping(rid, b"open?"))
            r = self.reply()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return False
        assert r == ev.Pong(rid, b"open?"), r
        return True

    def hello(self) -> None:
        self.send(ev.Hello(self.rid(), "table", 1, 1))
        r = self.reply()
        assert isinstance(r, ev.HelloOk), r
        self.nonce = r.nonce

    def login(self, key: str, namespace: str) -> None:
        self.hello()
        k = Key.parse(key)
        self.send(ev.Auth(self.rid(), k.key_id, namespace, k.proof(self.nonce, namespace)))
        assert isinstance(self.reply(), ev.AuthOk)


def chunk(obj: str, offset: int) -> bytes:
    """The append a writer sends at *offset* of *obj*: size and bytes are a function of both."""
    h = hashlib.sha256(f"{obj}:{offset}".encode()).digest()
    cap = 100_000 if h[4] % 4 == 0 else 6_000
    size = 1 + int.from_bytes(h[:4], "big") % cap
    return (h * (size // 32 + 1))[:size]


def writer(address, key, start, acked, reached, stop_after, errors):
    """Pipeline appends until the connection dies; record acks; set *reached* after
    *stop_after* acks (the test then kills the server)."""
    next_off = dict(start)
    inflight: dict[int, tuple[str, int]] = {}
    got = 0
    i = 0
    try:
        c = RawClient(address, timeout=120)
        try:
            r = c.login(key, WRITER_NS)
            if not isinstance(r, ev.AuthOk):
                errors.append(f"login: {r}")
                return
            while True:
                while len(inflight) < WINDOW:
                    obj = WRITER_OBJECTS[i % len(WRITER_OBJECTS)]
                    i += 1
                    data = chunk(obj, next_off[obj])
                    rid = c.rid()
                    c.send(ev.Append(rid, obj, next_off[obj], 0, crc32c(data), data))
                    next_off[obj] += len(data)
                    inflight[rid] = (obj, next_off[obj])
                r = c.next()
                obj, end = inflight.pop(r.request_id)
                if not isinstance(r, ev.AppendOk) or r.length != end:
                    errors.append(f"{obj}@{end}: {r}")
                    return
                acked[obj] = max(acked[obj], end)
                got += 1
                if got == stop_after:
                    reached.set()
        finally:
            c.close()
    except (EOFError, OSError):
        return  # the server died under us: expected
    finally:
        reached.set()


def check_object(c: RawClient, obj: str, acked: int) -> int:
    st = c.stat(obj)
    if isinstance(st, ev.Error):
        assert acked == 0, f"{obj}: acked {acked} bytes but the object is gone: {st}"
        return 0
    assert st.length >= acked, f"{obj}: acked {acked} but only {st.length} bytes survived"
    data = c.read(obj)
    assert isinstance(data, bytes), data
    assert len(data) == st.length
    pos = 0
    while pos < len(data):  # every stored byte belongs to a whole append the writer sent
        want = chunk(obj, pos)
        assert data[pos : pos + len(want)] == want, f"{obj}: bytes at {pos} are not what was appended"
        pos += len(want)
    assert pos == len(data)
    return st.length
