"""Hostile input, end to end: every refusal reaches the public client as its typed exception.

tests/server/test_process.py already checks the ERROR codes of these cases frame by
frame (RawClient). Here the same refusals go through ``sos_client.Client`` (what the
journal, fsspec and the mount use) against a real ``sos-server`` process, and raw sockets
are used only where the client refuses to send the bytes at all (bad names, frames over
the cap, lying lengths) -- for variants the server tests do not cover. Every test also
checks that nothing was written where it must not be and that the refused connection or
a bystander keeps working.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct

import pytest

from sos_client import (
    BadNameError,
    Client,
    Fenced,
    OffsetMismatch,
    QuotaExceeded,
    SealedError,
    SOSError,
    SOSNotFound,
    SOSPermissionError,
    TooLarge,
)
from sos_wire import events as ev
from sos_wire.auth import Key
from sos_wire.connection import Connection, Role
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.frames import DEFAULT_MAX_BODY
from tests.support import frame

pytestmark = [pytest.mark.hostile]

TIMEOUT = 120  # generous: two shared cores


def _client(srv, key, ns=None) -> Client:
    return Client(srv.address, key, ns or srv.ns, timeout=TIMEOUT)


def _append_body(name: str, offset: int, data: bytes, *, data_len: int | None = None, epoch: int = 0) -> bytes:
    raw = name.encode()
    n = len(data) if data_len is None else data_len
    return struct.pack(">H", len(raw)) + raw + struct.pack(">QQII", offset, epoch, crc32c(data), n) + data


class Raw:
    """A raw socket that logs in through the codec, then sends whatever bytes we like."""

    def __init__(self, srv, key=None, ns=None) -> None:
        ns = ns or srv.ns
        host, port = srv.address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        self.conn = Connection(Role.CLIENT)
        if key is not None:
            hello = self.call(ev.Hello(self.conn.next_request_id(), "hostile", 1, 1))
            k = Key.parse(key)
            ok = self.call(ev.Auth(self.conn.next_request_id(), k.key_id, ns, k.proof(hello.nonce, ns)))
            assert isinstance(ok, ev.AuthOk), ok

    def call(self, event):
        from sos_wire.connection import NEED_DATA

        self.sock.sendall(self.conn.send(event))
        while True:
            e = self.conn.next_event()
            if e is not NEED_DATA:
                return e
            data = self.sock.recv(1 << 16)
            assert data, "server closed the connection"
            self.conn.receive_data(data)

    def frames_until_eof(self) -> list[tuple[int, int, bytes]]:
        """(opcode, request id, body) of every frame the server sends until it closes."""
        buf = b""
        while True:
            data = self.sock.recv(1 << 16)
            if not data:
                break
            buf += data
        out = []
        while len(buf) >= 16:
            op, rid, n = buf[3], struct.unpack(">I", buf[4:8])[0], struct.unpack(">I", buf[8:12])[0]
            out.append((op, rid, buf[16 : 16 + n]))
            buf = buf[16 + n :]
        assert buf == b"", f"trailing bytes {buf[:40]!r}"
        return out

    def close(self) -> None:
        self.sock.close()


def _error_codes(frames) -> list[int]:
    return [struct.unpack(">H", body[:2])[0] for op, _rid, body in frames if op == 0xFF]


@pytest.fixture(scope="module")
def shared_server(server):
    """The module's shared server (conftest)."""
    return server


_namespaces = itertools.count()


@pytest.fixture
def srv(shared_server):
    n = next(_namespaces)
    shared_server.ns, shared_server.other_ns, shared_server.no_keys_ns = f"hostile{n}", f"other{n}", f"nobody{n}"
    shared_server.key = shared_server.keygen(shared_server.ns, "append")
    shared_server.read_key = shared_server.keygen(shared_server.ns, "read")
    assert shared_server.running()
    return shared_server


# -- authentication ---------------------------------------------------------------------


@pytest.mark.parametrize("case", ["wrong_secret", "unknown_key_id", "other_namespace_key", "namespace_without_keys"])
def test_wrong_key_or_namespace_raises_permission_error(srv, case):
    good = Key.parse(srv.key)
    other = srv.keygen(srv.other_ns, "append")
    with _client(srv, other, srv.other_ns) as c:
        c.append("secret", 0, b"tenant B data")
    if case == "wrong_secret":
        key, ns = str(Key(good.key_id, os.urandom(32))), srv.ns
    elif case == "unknown_key_id":
        key, ns = str(Key.generate()), srv.ns
    elif case == "other_namespace_key":
        key, ns = srv.key, srv.other_ns  # a valid key, used on another tenant's namespace
    else:
        key, ns = srv.key, srv.no_keys_ns
    with pytest.raises(SOSPermissionError) as ei:
        _client(srv, key, ns)
    assert ei.value.code is ErrorCode.AUTH_FAILED
    assert isinstance(ei.value, PermissionError)
    assert good.secret.hex() not in str(ei.value)  # the message never echoes a secret
    # the other tenant's data is untouched; no namespace was created by the attempt
    with _client(srv, other, srv.other_ns) as c:
        assert c.read("secret") == b"tenant B data"
    assert not os.path.exists(os.path.join(srv.data_dir, "ns", srv.no_keys_ns))


def test_read_key_cannot_append_seal_or_fence(srv):
    with _client(srv, srv.key) as w:
        assert w.append("log", 0, b"written by the writer") == 21
    with _client(srv, srv.read_key) as r:
        for op in (
            lambda: r.append("log", 21, b"intruder"),
            lambda: r.append("new-object", 0, b"intruder"),
            lambda: r.append_many("log", 21, [b"x" * 1000] * 3),
            lambda: r.seal("log"),
            lambda: r.fence(99),
        ):
            with pytest.raises(SOSPermissionError) as ei:
                op()
            assert ei.value.code is ErrorCode.FORBIDDEN
        # reading is what a read key is for, and the connection survived every refusal
        assert r.read("log") == b"written by the writer"
        assert r.stat("log") == (21, False)
        with pytest.raises(SOSNotFound):
            r.stat("new-object")
    with _client(srv, srv.key) as w:  # a refused fence did not fence anyone
        assert w.append("log", 21, b"!", epoch=0) == 22


# -- fencing and sealing -------------------------------------------------------------------


def test_stale_epoch_after_fence_is_refused_and_nothing_lands(srv):
    with _client(srv, srv.key) as old, _client(srv, srv.key) as new:
        assert old.fence(1) == 1
        assert old.append("seg", 0, b"A" * 100, epoch=1) == 100
        assert new.fence(2) == 2  # a new writer takes over
        with pytest.raises(Fenced) as ei:
            old.append("seg", 100, b"B" * 100, epoch=1)
        assert ei.value.epoch == 2 and ei.value.code is ErrorCode.FENCED
        with pytest.raises(Fenced):
            old.append_many("seg", 100, [b"C" * 50_000] * 10, epoch=1)
        with pytest.raises(Fenced):
            old.seal("seg", epoch=1)
        with pytest.raises(Fenced):
            old.append("other", 0, b"x", epoch=1)
        with pytest.raises(Fenced) as ei:
            old.fence(2)  # a fence must move forward
        assert ei.value.epoch == 2
        assert new.stat("seg") == (100, False)
        with pytest.raises(SOSNotFound):
            new.stat("other")
        assert new.append("seg", 100, b"D" * 10, epoch=2) == 110
        assert old.read("seg") == b"A" * 100 + b"D" * 10


def test_sealed_object_refuses_appends_through_the_client(srv):
    with _client(srv, srv.key) as c:
        assert c.append_many("done", 0, [b"x" * 4096] * 4) == 16384
        assert c.seal("done") == 16384
        assert c.seal("done") == 16384  # idempotent
        with pytest.raises(SealedError) as ei:
            c.append("done", 16384, b"more")
        assert ei.value.code is ErrorCode.SEALED and ei.value.length == 16384
        with pytest.raises(SealedError):
            c.append_many("done", 16384, [b"y" * 10_000] * 5)
        with pytest.raises((SealedError, OffsetMismatch)):
            c.append("done", 100, b"overwrite?")
        assert c.stat("done") == (16384, True)
        assert c.read("done") == b"x" * 16384


# -- names ------------------------------------------------------------------------------------

TRAVERSAL = [
    "../hostile2/x",
    "../../etc/passwd",
    "/etc/passwd",
    "a/../../b",
    "a/./b",
    "a//b",
    "a/",
    ".",
    "..",
    "..\\..\\windows",
    "nul\x00byte",
    "new\nline",
    "x" * 1025,
    "seg/" + "y" * 256,
    "\u2215etc\u2215passwd",
]


def test_client_refuses_bad_names_before_sending(srv):
    with _client(srv, srv.key) as c:
        for name in TRAVERSAL:
            for op in (
                lambda name=name: c.append(name, 0, b"x"),
                lambda name=name: c.append_many(name, 0, [b"x"]),
                lambda name=name: c.read(name),
                lambda name=name: c.stat(name),
                lambda name=name: c.seal(name),
            ):
                with pytest.raises(BadNameError) as ei:
                    op()
                assert isinstance(ei.value, ValueError), name
        assert c.ping(b"still here") == b"still here"
        assert list(c.list()) == []
    assert sorted(os.listdir(srv.data_dir)) == ["LOCK", "ns", "wal"]


def test_server_refuses_traversal_in_every_request_kind(srv):
    """READ, SEAL and LIST with hostile names (the server tests cover APPEND and STAT)."""
    with _client(srv, srv.key) as c:
        c.append("inside", 0, b"mine")
    other = srv.keygen(srv.other_ns, "append")
    with _client(srv, other, srv.other_ns) as c:
        c.append("x", 0, b"tenant 2")
    r = Raw(srv, srv.key)
    try:
        rid = r.conn.next_request_id
        o = srv.other_ns
        for name in [f"../{o}/x", f"../../{o}/objects", "/abs", "a/./b", "\x00", "y" * 1025]:
            for req in (ev.Read(rid(), name, 0, 0), ev.Seal(rid(), name, 0)):
                reply = r.call(req)
                assert isinstance(reply, ev.Error) and reply.code is ErrorCode.BAD_NAME, (name, req, reply)
        # LIST takes a prefix, not a name: a hostile prefix just matches nothing of another tenant
        for prefix in ["../", f"../{o}/", "/", "\x00"]:
            reply = r.call(ev.List(rid(), prefix, "", 1000))
            assert isinstance(reply, ev.ListOk) and reply.entries == (), (prefix, reply)
        reply = r.call(ev.List(rid(), "", "", 1000))
        assert [e.name for e in reply.entries] == ["inside"]
    finally:
        r.close()
    with _client(srv, other, srv.other_ns) as c:
        assert c.read("x") == b"tenant 2" and [e.name for e in c.list()] == ["x"]


def test_longest_valid_names_work_and_one_more_byte_is_refused(srv):
    longest = "/".join(["s" * 255] * 3 + ["s" * 254, "t"])  # 1020 + 4 slashes = 1024 bytes
    assert len(longest.encode()) == 1024
    with _client(srv, srv.key) as c:
        assert c.append(longest, 0, b"edge") == 4
        assert c.read(longest) == b"edge"
        assert [e.name for e in c.list("s")] == [longest]
        with pytest.raises(BadNameError):
            c.append(longest + "u", 0, b"x")
    r = Raw(srv, srv.key)  # the server enforces the same boundary on its own
    try:
        reply = r.call(ev.Stat(r.conn.next_request_id(), longest + "u"))
        assert isinstance(reply, ev.Error) and reply.code is ErrorCode.BAD_NAME
    finally:
        r.close()


# -- sizes and lying lengths --------------------------------------------------------------------


def test_client_refuses_an_append_over_the_cap_and_splits_append_many(srv):
    big = os.urandom(DEFAULT_MAX_BODY)  # more than one APPEND may carry
    with _client(srv, srv.key) as c:
        with pytest.raises(TooLarge):
            c.append("big", 0, big)
        with pytest.raises(SOSNotFound):
            c.stat("big")  # nothing was sent
        assert c.append_many("big", 0, [big]) == len(big)  # split into frames under the cap
        assert c.read("big") == big


def test_oversized_frame_before_hello_is_refused_without_reading_the_body(srv):
    r = Raw(srv)
    try:
        # 4 GiB announced, nothing sent: refused on the header alone
        r.sock.sendall(frame(0x06, 5, body_len=0xFFFFFFFF))
        frames = r.frames_until_eof()
        assert _error_codes(frames) == [ErrorCode.TOO_LARGE]
    finally:
        r.close()


@pytest.mark.parametrize(
    "case", ["header_swallows_next_request", "inner_blob_longer_than_frame", "string_longer_than_frame"]
)
def test_lying_lengths_close_the_connection_and_write_nothing(srv, case):
    r = Raw(srv, srv.key)
    try:
        if case == "header_swallows_next_request":
            # the header claims the next request's bytes as its own body; neither may run
            first = _append_body("liar", 0, b"abc")
            second = frame(0x06, 9, body_len=len(_append_body("swallowed", 0, b"zzz"))) + _append_body(
                "swallowed", 0, b"zzz"
            )
            r.sock.sendall(frame(0x06, 7, body_len=len(first) + len(second)) + first + second)
        elif case == "inner_blob_longer_than_frame":
            body = _append_body("liar", 0, b"abc", data_len=1 << 20)
            r.sock.sendall(frame(0x06, 7, body_len=len(body)) + body)
        else:
            body = struct.pack(">H", 60000) + b"liar"
            r.sock.sendall(frame(0x05, 7, body_len=len(body)) + body)
        frames = r.frames_until_eof()
        assert _error_codes(frames) == [ErrorCode.BAD_FRAME], frames
    finally:
        r.close()
    with _client(srv, srv.key) as c:
        assert list(c.list()) == []  # neither "liar" nor "swallowed" exists


def test_a_bystander_survives_all_of_it(srv):
    """Errors on other connections never disturb a well-behaved client mid-stream."""
    with _client(srv, srv.key) as good:
        length = good.append("steady", 0, b"0" * 1000)
        for i in range(20):
            bad = Raw(srv, srv.key)
            try:
                bad.sock.sendall(frame(0x06, 1, body_len=0xFFFFFFF0) if i % 2 else b"GARBAGE" * 3)
                assert _error_codes(bad.frames_until_eof()) in ([ErrorCode.TOO_LARGE], [ErrorCode.BAD_FRAME])
            finally:
                bad.close()
            with pytest.raises(OffsetMismatch) as ei:
                good.append("steady", 0, b"not a retry")
            assert ei.value.length == length
            length = good.append("steady", length, bytes([48 + i % 10]) * 1000)
        assert good.read("steady") == b"0" * 1000 + b"".join(bytes([48 + i % 10]) * 1000 for i in range(20))
    with pytest.raises(SOSError):
        _client(srv, str(Key.generate()))


def test_quotas_stop_a_client_that_creates_or_grows_without_bound(sos_server_factory):
    srv = sos_server_factory(args=["--max-objects", "20", "--max-object-size", "100000"], start=False)
    key = srv.keygen("quota", "append")
    srv.start()
    with Client(srv.address, key, "quota", timeout=TIMEOUT) as c:
        for i in range(20):
            assert c.append(f"o/{i:02d}", 0, b"x") == 1
        with pytest.raises(QuotaExceeded) as ei:
            c.append("o/20", 0, b"one too many")
        assert ei.value.code is ErrorCode.QUOTA_EXCEEDED
        assert c.append("o/00", 1, b"y" * 99_999) == 100_000  # exactly the limit
        with pytest.raises(QuotaExceeded):
            c.append("o/00", 100_000, b"z")
        with pytest.raises(QuotaExceeded):
            c.append_many("o/01", 1, [b"w" * 60_000] * 2)
        # nothing beyond the limits landed, nothing before them changed
        assert len(list(c.list())) == 20
        assert c.read("o/00") == b"x" + b"y" * 99_999
        assert c.stat("o/01")[0] in (1, 60_001)  # append_many may land its first piece
        assert c.read("o/01", 0, 1) == b"x"
