"""The blocking client against a REAL sos-server process (tests/conftest.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from sos_client import (
    BadNameError,
    ChecksumMismatch,
    Client,
    ConnectionLost,
    Fenced,
    OffsetMismatch,
    SealedError,
    SOSError,
    SOSNotFound,
    SOSPermissionError,
    TooLarge,
)
from sos_wire import ErrorCode, Key, KeyRole


@pytest.fixture
def client(server, ns):
    name, key, _ = ns
    with Client(server.address, key, name, timeout=60) as c:
        yield c


def test_handshake_ping_and_role(client, server, ns):
    assert client.ping(b"hello") == b"hello"
    assert client.role == KeyRole.APPEND
    with Client(server.address, Key.parse(ns[2]), ns[0], timeout=60) as reader:
        assert reader.role == KeyRole.READ


def test_append_stat_read(client):
    assert client.append("a/b", 0, b"hello") == 5
    assert client.append("a/b", 5, bytearray(b" world")) == 11
    assert client.stat("a/b") == (11, False)
    assert client.read("a/b") == b"hello world"
    assert client.read("a/b", 6) == b"world"
    assert client.read("a/b", 2, 3) == b"llo"
    assert client.read("a/b", 11) == b""
    assert client.append("empty", 0, b"") == 0
    assert client.stat("empty") == (0, False)
    assert client.read("empty") == b""


def test_retry_of_a_landed_append_is_acknowledged_not_doubled(client):
    client.append("log", 0, b"abc")
    client.append("log", 3, b"def")
    assert client.append("log", 3, b"def") == 6  # the same bytes again: acknowledged
    assert client.append("log", 0, b"abc") == 3
    assert client.read("log") == b"abcdef"


def test_offset_mismatch_carries_the_current_length(client):
    client.append("log", 0, b"abcdef")
    with pytest.raises(OffsetMismatch) as info:
        client.append("log", 3, b"XYZ")  # different bytes at an old offset
    assert info.value.length == 6
    assert info.value.code == ErrorCode.OFFSET_MISMATCH
    assert "t" in str(info.value) and "log" in str(info.value) and "6" in str(info.value)
    with pytest.raises(OffsetMismatch) as info:
        client.append("log", 9, b"x")  # a gap
    assert info.value.length == 6
    with pytest.raises(OffsetMismatch) as info:
        client.append("new", 4, b"x")
    assert info.value.length == 0
    assert client.read("log") == b"abcdef"  # the connection survived every refusal


def test_not_found(client):
    with pytest.raises(SOSNotFound) as info:
        client.stat("missing/obj")
    assert isinstance(info.value, FileNotFoundError)
    assert "missing/obj" in str(info.value)
    with pytest.raises(FileNotFoundError):
        client.read("missing/obj")
    with pytest.raises(FileNotFoundError):
        client.seal("missing/obj")


def test_seal(client):
    client.append("s", 0, b"data")
    assert client.seal("s") == 4
    assert client.seal("s") == 4  # idempotent
    assert client.stat("s") == (4, True)
    with pytest.raises(SealedError) as info:
        client.append("s", 4, b"more")
    assert info.value.code == ErrorCode.SEALED
    assert "s" in str(info.value)
    assert [e.sealed for e in client.list("s")] == [True]


def test_fence(client):
    client.append("f", 0, b"a", epoch=0)
    with pytest.raises(Fenced) as info:
        client.append("f", 1, b"b", epoch=1)  # above the fence: an epoch is taken with FENCE first
    assert info.value.epoch == 0
    assert client.fence(5) == 5
    with pytest.raises(Fenced) as info:
        client.append("f", 1, b"b", epoch=4)
    assert info.value.epoch == 5
    with pytest.raises(Fenced):
        client.seal("f", epoch=4)
    assert client.append("f", 1, b"b", epoch=5) == 2
    with pytest.raises(Fenced) as info:
        client.fence(5)  # must be greater than the current fence
    assert info.value.epoch == 5


class _CorruptingRelay:
    """A TCP relay between a client and the server that flips one byte of the first
    client->server occurrence of ``needle`` (damage in transit, after the client's CRC)."""

    def __init__(self, target: tuple[str, int], needle: bytes) -> None:
        import socket

        self.target, self.needle = target, needle
        self.sockets: list = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.sockets.append(self.listener)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        down, _ = self.listener.accept()
        up = socket.create_connection(self.target)
        self.sockets += [down, up]
        threading.Thread(target=self._pipe, args=(up, down, False), daemon=True).start()
        self._pipe(down, up, True)

    def __enter__(self) -> _CorruptingRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        for sock in self.sockets:
            sock.close()

    def _pipe(self, src, dst, corrupt: bool) -> None:
        import socket

        done = not corrupt
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            if not done:  # (the needle is small and arrives in one piece here)
                at = data.find(self.needle)
                if at >= 0:
                    data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]
                    done = True
            dst.sendall(data)


def test_data_damaged_in_transit_is_refused_and_nothing_written(server, ns):
    name, key, _ = ns
    host, port = server.address.rsplit(":", 1)
    with (
        _CorruptingRelay((host, int(port)), b"payload-to-damage") as relay,
        Client(relay.address, key, name, timeout=60) as c,
    ):
        with pytest.raises(ChecksumMismatch) as info:
            c.append("c", 0, b"payload-to-damage")
        assert info.value.code == ErrorCode.CHECKSUM_MISMATCH
        assert c.ping() == b""  # refused, not disconnected
    with Client(server.address, key, name, timeout=60) as direct, pytest.raises(SOSNotFound):
        direct.stat("c")


def test_bad_names_are_refused_locally_and_the_servers_bad_name_is_the_same_class(client, server, ns):
    for bad in ("../x", "/abs", "a//b", "", "a\x00b"):
        with pytest.raises(BadNameError) as info:
            client.stat(bad)
        assert isinstance(info.value, ValueError)
    # the server's own refusal (a raw frame: the client never sends such a name) maps to it too
    from sos_client.errors import error_from_reply
    from sos_wire import events as ev
    from tests.conftest import RawClient

    with RawClient(server.address) as raw:
        raw.login(ns[1], ns[0])
        reply = raw.call(ev.Stat(raw.rid(), "../etc/passwd"))
    assert isinstance(reply, ev.Error) and reply.code is ErrorCode.BAD_NAME
    err = error_from_reply(reply, "stat ../etc/passwd")
    assert isinstance(err, BadNameError) and err.code == ErrorCode.BAD_NAME
    assert client.ping() == b""


def test_permissions(server, ns):
    name, key, read_key = ns
    with Client(server.address, read_key, name, timeout=60) as reader:
        with pytest.raises(SOSPermissionError) as info:
            reader.append("x", 0, b"no")
        assert info.value.code == ErrorCode.FORBIDDEN
        assert isinstance(info.value, PermissionError)
        with pytest.raises(SOSPermissionError):
            reader.fence(9)
        with pytest.raises(SOSNotFound):
            reader.stat("x")  # reading is allowed
    # a wrong secret, and a valid key used for another namespace
    bad = Key(Key.parse(key).key_id, bytes(32))
    with pytest.raises(SOSPermissionError) as info:
        Client(server.address, bad, name, timeout=60)
    assert info.value.code == ErrorCode.AUTH_FAILED
    with pytest.raises(SOSPermissionError):
        Client(server.address, key, name + "x", timeout=60)
    with pytest.raises(SOSPermissionError, match="no key"):
        Client(server.address, "", name)
    with pytest.raises(SOSPermissionError, match="bad key"):
        Client(server.address, "not-a-key", name)
    with pytest.raises(BadNameError):
        Client(server.address, key, "Bad/Namespace")


def test_list_by_prefix(client):
    for n in ("gen/1/a", "gen/1/b", "gen/2/a", "other"):
        client.append(n, 0, n.encode())
    assert [(e.name, e.length) for e in client.list("gen/1/")] == [("gen/1/a", 7), ("gen/1/b", 7)]
    assert [e.name for e in client.list()] == ["gen/1/a", "gen/1/b", "gen/2/a", "other"]
    assert list(client.list("nothing")) == []


def test_append_many_pipelined(client, monkeypatch):
    from sos_wire.connection import Connection

    most = [0]
    real_send = Connection.send_parts

    def spy(self, event):
        out = real_send(self, event)
        most[0] = max(most[0], self.in_flight)
        return out

    monkeypatch.setattr(Connection, "send_parts", spy)
    rng = __import__("random").Random(7)
    chunks = [rng.randbytes(rng.randint(0, 3000)) for _ in range(3000)]
    chunks += [os.urandom(3 << 20)]  # one chunk larger than a piece: split
    total = sum(map(len, chunks))
    assert client.append_many("big", 0, iter(chunks), window_bytes=1 << 20) == total
    assert most[0] > 1, "append_many never had two appends in flight"
    assert client.stat("big") == (total, False)
    assert client.read("big") == b"".join(chunks)
    # continuing at the end, and from a generator of memoryviews
    more = [memoryview(b"xyz")] * 10
    assert client.append_many("big", total, more) == total + 30
    assert client.read("big", total) == b"xyz" * 10


def test_append_many_refused_midway_reports_first_error_and_connection_survives(client):
    client.append("m", 0, b"0123456789")
    with pytest.raises(OffsetMismatch) as info:
        client.append_many("m", 5, [b"abc", b"def"])
    assert info.value.length == 10
    assert client.stat("m") == (10, False)
    assert client.append_many("m", 10, []) == 10  # nothing to send: nothing sent


def test_append_too_large_for_one_frame(client):
    with pytest.raises(TooLarge, match="append_many"):
        client.append("huge", 0, bytes(9 << 20))
    assert client.append_many("huge", 0, [bytes(9 << 20)]) == 9 << 20
    assert client.stat("huge") == (9 << 20, False)


def test_read_iter_streams_in_bounded_steps(client):
    data = os.urandom(3 << 20)
    client.append_many("r", 0, [data])
    chunks = list(client.read_iter("r", step=256 * 1024))
    assert b"".join(chunks) == data
    assert max(map(len, chunks)) <= 256 * 1024
    assert b"".join(client.read_iter("r", 1000, 600_000, step=100_000)) == data[1000:601_000]
    with pytest.raises(SOSError) as info:
        client.read("r", len(data) + 1)
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_threads_share_one_client(client):
    errors = []

    def work(i):
        try:
            off = 0
            for j in range(20):
                off = client.append(f"th/{i}", off, f"{i}:{j};".encode())
            assert client.read(f"th/{i}") == b"".join(f"{i}:{j};".encode() for j in range(20))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert len(list(client.list("th/"))) == 4


def test_connection_refused_is_connection_lost(ns):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ConnectionLost) as info:
        Client(f"127.0.0.1:{port}", ns[1], ns[0], timeout=5)
    assert isinstance(info.value, ConnectionError)


def test_closed_client_refuses_calls(server, ns):
    c = Client(server.address, ns[1], ns[0], timeout=60)
    c.close()
    with pytest.raises(ConnectionLost, match="closed"):
        c.ping()


def test_reconnect_and_lazy_reconnect(client, server):
    client.append("rc", 0, b"x")
    client.reconnect()
    assert client.stat("rc") == (1, False)
    client._sock.close()  # the connection breaks under the client's feet
    assert client.stat("rc") == (1, False)  # reconnected and retried once


def _wait_for_log(srv, text: str, count: int = 1) -> None:
    deadline = time.monotonic() + 120
    while srv.log_text().count(text) < count:
        assert time.monotonic() < deadline, f"the server never logged {text!r} {count} times"
        time.sleep(0.05)


def test_connection_closed_by_the_idle_timeout_is_reopened_transparently(sos_server_factory):
    """The server closes idle connections (--idle-timeout, 10 minutes by default); a
    long-lived client notices before it sends and reconnects, even for FENCE (which is
    never retried blindly)."""
    srv = sos_server_factory(args=["--idle-timeout", "1"], start=False)
    key = srv.keygen("idle", "append")
    srv.start()
    with Client(srv.address, key, "idle", timeout=60) as c:
        assert c.append("x", 0, b"a") == 1
        _wait_for_log(srv, "idle timeout, closing", 1)
        assert c.fence(5) == 5  # first call on the closed connection: not retried, must not fail
        assert c.stat("x") == (1, False)
        _wait_for_log(srv, "idle timeout, closing", 2)
        assert c.append("x", 1, b"b", epoch=5) == 2
        _wait_for_log(srv, "idle timeout, closing", 3)
        assert c.read("x") == b"ab"
        assert [e.name for e in c.list("")] == ["x"]
        assert c.ping(b"p") == b"p"
    assert srv.log_text().count('"authenticated"') >= 4
