"""The other direction: a broken or hostile *server*. Whatever bytes come back, at any
step (HELLO, AUTH, or the reply to STAT/READ/APPEND/LIST), ``sos_client.Client`` raises one
of its typed ``SOSError``s -- never a codec, struct or Unicode error, never a hang (the fake
server closes after its script, so every wait ends on EOF, not on a timer).
"""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sos_client import Client, SOSError
from sos_wire import events as ev
from sos_wire.auth import Key
from sos_wire.connection import encode_event
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from tests.support import accepted

pytestmark = [pytest.mark.hostile]

KEY = Key.generate()
TIMEOUT = 120


def _frame(opcode: int, rid: int, body: bytes) -> bytes:
    h = b"SO" + bytes([1, opcode]) + struct.pack(">II", rid, len(body))
    return h + struct.pack(">I", crc32c(h)) + body


class FakeServer:
    """Accepts connections; answers the n-th request of each with ``script[n](rid)``, then closes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.script = []
        self.stop = False
        self.connections_left: int | None = None  # None: serve any number of connections
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for conn in accepted(self.sock, lambda: self.stop):
            if self.connections_left is not None:
                self.connections_left -= 1
                if self.connections_left <= 0:
                    self.sock.close()  # later connects are refused: no reconnect loop
            with conn:
                conn.settimeout(TIMEOUT)
                try:
                    for step in list(self.script):
                        head = self._recv_exact(conn, 16)
                        if head is None:
                            break
                        rid, n = struct.unpack(">II", head[4:12])
                        if self._recv_exact(conn, n) is None:
                            break
                        reply = step(rid)
                        if reply is None:
                            break
                        conn.sendall(reply)
                except OSError:
                    pass

    @staticmethod
    def _recv_exact(conn, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def close(self) -> None:
        self.stop = True
        self.sock.close()


def _hello_ok(rid: int) -> bytes:
    return encode_event(ev.HelloOk(rid, 1, b"\x01" * 32, 8 << 20, "fake"))


def _auth_ok(rid: int) -> bytes:
    return encode_event(ev.AuthOk(rid, ev.KeyRole.APPEND))


def _bad_reply(kind: str, blob: bytes, code: int):
    def make(rid: int) -> bytes:
        if kind == "garbage":
            return blob
        if kind == "truncated_frame":
            return _frame(0x85, rid, blob)[: 16 + len(blob) // 2]
        if kind == "wrong_rid":
            return _frame(0x85, rid + 1, struct.pack(">QB", 1, 0))
        if kind == "wrong_reply_type":
            return encode_event(ev.FenceOk(rid, 1))
        if kind == "error_unknown_code":
            return _frame(0xFF, rid, struct.pack(">HQ", code, 0) + struct.pack(">H", 3) + b"bad")
        if kind == "error_rid0":
            return encode_event(ev.Error(0, ErrorCode.INTERNAL, 0, "going away"))
        if kind == "bad_utf8_error":
            return _frame(0xFF, rid, struct.pack(">HQH", 18, 0, 2) + b"\xff\xfe")
        if kind == "random_body":
            return _frame(0x85, rid, blob)
        if kind == "read_never_last":
            return _frame(0x87, rid, struct.pack(">QBI", 0, 0, len(blob)) + blob)
        if kind == "hello_version_2":
            return encode_event(ev.HelloOk(rid, 2, b"\x01" * 32, 8 << 20, "fake"))
        if kind == "huge_header":
            h = b"SO" + bytes([1, 0x85]) + struct.pack(">II", rid, 0xFFFFFFF0)
            return h + struct.pack(">I", crc32c(h))
        raise AssertionError(kind)

    return make


KINDS = [
    "garbage",
    "truncated_frame",
    "wrong_rid",
    "wrong_reply_type",
    "error_unknown_code",
    "error_rid0",
    "bad_utf8_error",
    "random_body",
    "read_never_last",
    "hello_version_2",
    "huge_header",
]
OPS = {
    "stat": lambda c: c.stat("a"),
    "read": lambda c: c.read("a"),
    "append": lambda c: c.append("a", 0, b"data"),
    "list": lambda c: list(c.list()),
    "seal": lambda c: c.seal("a"),
}


@pytest.fixture
def fake():
    f = FakeServer()
    yield f
    f.close()


def test_garbage_from_the_server_always_surfaces_as_a_typed_error(fake):
    seen = {}

    @settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(
        step=st.sampled_from([0, 1, 2, 2]),
        kind=st.sampled_from(KINDS),
        op=st.sampled_from(sorted(OPS)),
        blob=st.binary(max_size=64),
        code=st.integers(0, 0xFFFF),
    )
    def check(step, kind, op, blob, code):
        good = [_hello_ok, _auth_ok]
        fake.script = [*good[:step], _bad_reply(kind, blob, code)]
        try:
            with Client(fake.address, str(KEY), "ns", timeout=TIMEOUT, reconnect_timeout=0) as c:
                OPS[op](c)
        except SOSError as exc:  # typed: ConnectionLost, SOSPermissionError, Corrupt, ...
            seen[type(exc).__name__] = seen.get(type(exc).__name__, 0) + 1
        else:
            # only a reply that happens to be a valid answer may succeed (e.g. an empty LIST)
            seen["ok"] = seen.get("ok", 0) + 1

    check()
    assert seen.get("ConnectionLost", 0) > 50, seen


def test_a_list_cursor_that_does_not_advance_is_refused(fake):
    served = []

    def same_page(rid: int) -> bytes:
        served.append(rid)
        return encode_event(ev.ListOk(rid, (ev.ListEntry("a", 1, False),), True))

    fake.script = [_hello_ok, _auth_ok] + [same_page] * 50  # then the fake server hangs up
    fake.connections_left = 1
    names = []
    with Client(fake.address, str(KEY), "ns", timeout=TIMEOUT, reconnect_timeout=0) as c:
        with pytest.raises(SOSError):
            for e in c.list():
                names.append(e.name)
    assert names == ["a"] and len(served) <= 2, (len(names), len(served))
