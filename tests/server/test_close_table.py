"""protocol.md 1.8 says in one table which ERRORs close the connection. Every row of that
table is provoked here against a real ``sos-server``, and the code, the request id and
whether the connection stays open are compared with what the row says. A row without a
scenario here, or a scenario without a row, fails too."""

from __future__ import annotations

import os
import re
import socket
import struct
from pathlib import Path

import pytest

from sos_wire import events as ev
from sos_wire.auth import Key
from sos_wire.connection import encode_event
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.frames import DEFAULT_MAX_BODY
from tests.server.support import Wire
from tests.support import frame

DOC = Path(__file__).resolve().parents[2] / "protocol.md"
NS = "table"
TIMEOUT = 60


def close_table() -> dict[str, tuple[str, str, str]]:
    """{when: (code, request id, then)} from the table under "## 1.8 Errors"."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## 1.8 Errors\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    head = "| when | code | request id | then |"
    assert head in section
    lines = section.split(head, 1)[1].strip().splitlines()
    for line in lines[1:]:  # after the |---| line
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, line
        rows[cells[0]] = (cells[1], cells[2], cells[3])
    return rows


# Each scenario provokes its row on a fresh connection and returns
# (the ERROR, the id of the frame it is about, the Wire to probe for open/closed).


def busy(env):
    holder = env.wire(env.busy_server)
    holder.login(env.busy_key, NS)  # authenticated: the server is full now (an unauthenticated one is evicted)
    w = env.wire(env.busy_server)
    return w.error(), None, w


def evicted(env):
    victim = env.wire(env.busy_server)
    assert victim.is_open()  # accepted and counted: the server is full now
    newcomer = env.wire(env.busy_server)
    assert newcomer.is_open()  # not refused: the victim made room
    return victim.error(), None, victim


def bad_magic_or_crc(env):
    w = env.authed()
    w.sock.sendall(b"XX" + bytes(14))
    e = w.error()
    w2 = env.authed()
    h = bytearray(frame(0x03, 7, bytes(4)))
    h[15] ^= 0xFF
    w2.sock.sendall(bytes(h))
    e2 = w2.error()
    assert (e2.code, e2.request_id, w2.is_open()) == (e.code, e.request_id, False)
    return e, 7, w


def id_zero_or_in_flight(env):
    w = env.authed()
    w.sock.sendall(frame(0x03, 0, struct.pack(">I", 0)))
    e = w.error()
    # the same id twice, back to back: the STAT is still in flight when the second arrives
    w2 = env.authed()
    w2.sock.sendall(encode_event(ev.Stat(9, "x")) + encode_event(ev.Stat(9, "y")))
    replies = []
    while True:
        try:
            replies.append(w2.reply())
        except EOFError:
            break
    errors = [r for r in replies if isinstance(r, ev.Error) and r.code is ErrorCode.BAD_FRAME]
    assert len(errors) == 1 and errors[0].request_id == 0, replies
    return e, 0, w


def bad_version(env):
    w = env.authed()
    w.sock.sendall(frame(0x03, 7, struct.pack(">I", 0), version=2))
    return w.error(), 7, w


def too_large(env):
    w = env.authed()
    w.sock.sendall(frame(0x06, 7, b"", body_len=DEFAULT_MAX_BODY + 1))
    e = w.error()
    w2 = env.wire()  # before AUTH the limit is 4096 (1.9)
    w2.sock.sendall(frame(0x03, 8, b"", body_len=4097))
    e2 = w2.error()
    assert (e2.code, e2.request_id, w2.is_open()) == (e.code, 8, False)
    return e, 7, w


def reply_opcode(env):
    w = env.authed()
    w.sock.sendall(frame(0x86, 7, bytes(8)))
    return w.error(), 7, w


def bad_body(env):
    w = env.authed()
    w.sock.sendall(frame(0x05, 7, struct.pack(">H", 10) + b"abc"))  # STAT name says 10 bytes, has 3
    return w.error(), 7, w


def eof_inside_frame(env):
    w = env.authed()
    w.sock.sendall(frame(0x03, 7, b"", body_len=100) + b"short")
    w.sock.shutdown(socket.SHUT_WR)
    e = w.error()
    w2 = env.authed()
    w2.sock.sendall(b"SO\x01")  # inside the header: no request id to give
    w2.sock.shutdown(socket.SHUT_WR)
    e2 = w2.error()
    assert (e2.code, e2.request_id) == (e.code, 0)
    with pytest.raises(EOFError):
        w2.reply()
    # is_open would send a PING on a socket shut for writing: read to the close instead
    with pytest.raises(EOFError):
        w.reply()
    return e, 7, None


def third_failed_auth(env):
    w = env.wire()
    w.hello()
    k = Key.parse(env.key)
    for i in range(3):
        rid = w.rid()
        w.send(ev.Auth(rid, k.key_id, NS, bytes(32)))
        e = w.error()
        assert e.code is ErrorCode.AUTH_FAILED
        if i < 2:
            assert w.is_open()
    return e, rid, w


def key_removed(env):
    key = env.srv.keygen(NS, "append")
    w = env.wire()
    w.login(key, NS)
    os.unlink(os.path.join(env.srv.data_dir, "ns", NS, "keys", Key.parse(key).key_id.hex()))
    rid = w.send(ev.Stat(w.rid(), "x"))
    return w.error(), rid, w


def hello_no_common_version(env):
    w = env.wire()
    rid = w.send(ev.Hello(w.rid(), "future", 2, 3))
    return w.error(), rid, w


def unknown_opcode(env):
    w = env.authed()
    w.sock.sendall(frame(0x42, 7, b"whatever"))
    return w.error(), 7, w


def ping_too_long(env):
    w = env.wire()
    w.sock.sendall(frame(0x03, 7, struct.pack(">I", 65) + bytes(65)))
    return w.error(), 7, w


def other_refusals(env):
    w = env.authed()
    checks = [
        (ev.Stat(w.rid(), "missing"), ErrorCode.NOT_FOUND),
        (ev.Append(w.rid(), "a", 0, 0, crc32c(b"x") ^ 1, b"x"), ErrorCode.CHECKSUM_MISMATCH),
        (ev.Append(w.rid(), "a", 5, 0, crc32c(b"x"), b"x"), ErrorCode.OFFSET_MISMATCH),
        (ev.Read(w.rid(), "../x", 0, 0), ErrorCode.BAD_NAME),
        (ev.Hello(w.rid(), "again", 1, 1), ErrorCode.BAD_REQUEST),
    ]
    for event, code in checks:
        rid = w.send(event)
        e = w.error()
        assert (e.code, e.request_id) == (code, rid), e
        assert w.is_open()
    rid = w.send(ev.Fence(w.rid(), 0))  # not above the fence
    e = w.error()
    assert e.code is ErrorCode.FENCED
    return e, rid, w


SCENARIOS = {
    "at accept: the server is over a connection limit": busy,
    "before AUTH: evicted to make room for a newer connection (1.9)": evicted,
    "a frame header with bad magic or a bad header_crc": bad_magic_or_crc,
    "a frame header with request id 0, or an id still in flight": id_zero_or_in_flight,
    "a frame header with a version other than the negotiated one": bad_version,
    "a frame header whose body_len is over the server's limit (1.9)": too_large,
    "a frame header with a reply opcode": reply_opcode,
    "a body that does not match its layout (1.3)": bad_body,
    "the peer closes its side inside a frame": eof_inside_frame,
    "AUTH failing for the third time on the connection": third_failed_auth,
    "a request after the key of the connection was removed or changed (1.6)": key_removed,
    "HELLO with no common version (1.7)": hello_no_common_version,
    "a frame with an unknown opcode (1.5)": unknown_opcode,
    "PING with a payload over 64 bytes": ping_too_long,
    "any other refusal of a request": other_refusals,
}


def test_every_row_has_a_scenario_and_every_scenario_a_row():
    assert set(close_table()) == set(SCENARIOS)


class Env:
    """A server of the test's own, and (started only by the scenarios that ask for it: two of
    them) a second one that takes a single connection."""

    def __init__(self, factory) -> None:
        self._factory = factory
        self.srv = factory()
        self.key = self.srv.keygen(NS, "append")
        self._busy: tuple | None = None
        self.later: list[Wire] = []

    def _busy_pair(self) -> tuple:
        if self._busy is None:
            srv = self._factory(args=["--max-connections", "1", "--handshake-timeout", "10m"])
            self._busy = (srv, srv.keygen(NS, "append"))
        return self._busy

    @property
    def busy_server(self):
        return self._busy_pair()[0]

    @property
    def busy_key(self) -> str:
        return self._busy_pair()[1]

    def wire(self, srv=None) -> Wire:
        w = Wire(srv or self.srv)
        self.later.append(w)  # closed at the end of the test
        return w

    def authed(self) -> Wire:
        w = self.wire()
        w.login(self.key, NS)
        return w


@pytest.fixture
def env(sos_server_factory):
    e = Env(sos_server_factory)
    yield e
    for w in e.later:
        w.close()


@pytest.mark.parametrize("when", list(SCENARIOS))
def test_the_row_matches_the_server(env, when):
    code, rid_rule, then = close_table()[when]
    error, frame_id, wire = SCENARIOS[when](env)
    if code != "its code":
        assert error.code is ErrorCode[code], (when, error)
    if rid_rule == "0":
        assert error.request_id == 0, (when, error)
    else:
        assert re.fullmatch(r"(frame|AUTH|request|HELLO|PING)'s id( \(0 inside the header\))?", rid_rule), rid_rule
        assert error.request_id == frame_id and frame_id, (when, error)
    assert then in ("closes", "stays open"), then
    if wire is not None:
        assert wire.is_open() == (then == "stays open"), (when, error)
        wire.close()
