"""Issue 9, items 6, 12, 17 and 18, against a real ``sos-server`` process.

- 6: a read key pipelines 256 READs and never reads the replies. The server used to build
  every reply at once (~490 MiB for that one connection) and keep the connection for good.
  Now replies are produced within a per-connection budget, and a connection whose replies
  make no progress for ``--send-timeout`` is closed. Measured: the server's RSS (psutil).
- 12: a peer that keeps unauthenticated connections open (reconnecting as soon as one is
  closed) filled ``--max-connections``: every real client got BUSY. Now unauthenticated
  connections have their own cap and a per-address cap (and, issue 17 item 5, a full
  pool evicts its oldest connection rather than refuse a newcomer).
- 17: deleting (or changing) a key ends the sessions already opened with it.
- 18: before AUTH only small frames are accepted; the third failed AUTH closes the
  connection; failed AUTHs from one address are answered later and later.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from sos_client import Client, SOSPermissionError
from sos_wire import events as ev
from sos_wire.auth import Key
from sos_wire.errors import ErrorCode
from sos_wire.frames import DEFAULT_MAX_BODY, Op
from tests.conftest import RawClient
from tests.server.support import rss
from tests.support import client_expecting, frame, server_metric

pytestmark = [pytest.mark.hostile]

NS = "limits"
TIMEOUT = 120


def _closed(c: RawClient) -> bool:
    """True if the server closed the connection: a PING gets EOF (or a reset), not a PONG."""
    try:
        c.send(ev.Ping(c.rid(), b""))
        reply = c.next()
    except (EOFError, ConnectionResetError, BrokenPipeError):
        return True
    assert isinstance(reply, ev.Pong), reply
    return False


# -- item 6 -------------------------------------------------------------------------------


def test_unread_pipelined_reads_keep_memory_bounded_and_the_connection_is_closed(sos_server_factory):
    srv = sos_server_factory(args=["--send-timeout", "2"], start=False)
    key = srv.keygen(NS, "append")
    read_key = srv.keygen(NS, "read")
    srv.start()
    big = os.urandom(8 << 20)
    with Client(srv.address, key, NS, timeout=TIMEOUT) as c:
        c.append_many("big", 0, [big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)])
        assert c.read("big") == big  # warms the server's allocator up with whole READs
    base = rss(srv.pid)

    host, port = srv.address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel keeps little for us
    sock.settimeout(TIMEOUT)
    sock.connect((host, int(port)))
    deaf = RawClient(None, sock=sock)
    try:
        assert isinstance(deaf.login(read_key, NS), ev.AuthOk)
        # 256 READs of 8 MiB each, never a reply read: 2 GiB of replies asked for
        deaf.send_raw(b"".join(deaf.conn.send(ev.Read(deaf.rid(), "big", 0, 0)) for _ in range(256)))
        peak = base
        deadline = time.monotonic() + TIMEOUT
        while True:
            peak = max(peak, rss(srv.pid))
            assert peak - base < 64 << 20, f"server grew by {(peak - base) >> 20} MiB for one connection"
            if server_metric(srv, "sos_send_timeouts_total", 0) >= 1:
                break
            assert time.monotonic() < deadline, "a connection that does not read its replies was never closed"
            time.sleep(0.05)
    finally:
        deaf.close()
    # the server goes on serving, the data is intact
    with Client(srv.address, key, NS, timeout=TIMEOUT) as c:
        assert c.read("big") == big


# -- item 12 ------------------------------------------------------------------------------


class Hog(threading.Thread):
    """From 127.0.0.2: opens unauthenticated connections (a PING each, so the server has
    taken it) and holds them; one closed by the server is replaced at once."""

    def __init__(self, srv, want: int) -> None:
        super().__init__(daemon=True)
        self.srv, self.want = srv, want
        self.held: list[RawClient] = []
        self.busy = 0
        self.filled = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def _open(self) -> RawClient | None:
        host, port = self.srv.address.rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(TIMEOUT)
        sock.bind(("127.0.0.2", 0))
        sock.connect((host, int(port)))
        c = RawClient(None, sock=sock)
        c.send(ev.Ping(c.rid(), b""))
        try:
            r = c.next()
        except (EOFError, ConnectionResetError):
            r = None
        if isinstance(r, ev.Pong):
            return c
        assert r is None or (isinstance(r, ev.Error) and r.code is ErrorCode.BUSY and r.request_id == 0), r
        self.busy += 1
        c.close()
        return None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                while len(self.held) < self.want and not self.stop.is_set():
                    c = self._open()
                    if c is None:
                        break
                    self.held.append(c)
                self.filled.set()
                self.stop.wait(0.05)
                self.held = [c for c in self.held if not _gone(c)]
        except BaseException as exc:
            self.error = exc
            self.filled.set()
        finally:
            for c in self.held:
                c.close()


def _gone(c: RawClient) -> bool:
    c.sock.setblocking(False)
    try:
        return c.sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        c.sock.setblocking(True)


def test_a_peer_holding_unauthenticated_connections_does_not_lock_clients_out(sos_server_factory):
    # a long handshake timeout: the hog's connections are never closed for it, which is
    # what a hog that reconnects at once achieves anyway
    srv = sos_server_factory(args=["--max-connections", "16", "--handshake-timeout", "10m"], start=False)
    key = srv.keygen(NS, "append")
    srv.start()
    hog = Hog(srv, want=40)
    hog.start()
    try:
        assert hog.filled.wait(TIMEOUT) and hog.error is None, hog.error
        assert len(hog.held) == 8, len(hog.held)  # --max-unauthenticated-per-address default
        assert hog.busy >= 1
        # 50 real clients, one after the other, from 127.0.0.1: every one gets in
        for i in range(50):
            with Client(srv.address, key, NS, timeout=TIMEOUT) as c:
                assert c.append(f"c/{i}", 0, b"in") == 2
        # and 7 that stay connected at once (16 slots minus the hog's 8, one spare)
        clients = [Client(srv.address, key, NS, timeout=TIMEOUT) for _ in range(7)]
        try:
            for i, c in enumerate(clients):
                assert c.stat(f"c/{i}") == (2, False)
        finally:
            for c in clients:
                c.close()
        assert hog.error is None, hog.error
    finally:
        hog.stop.set()
        hog.join(TIMEOUT)


def test_unauthenticated_connections_have_their_own_cap(sos_server_factory):
    srv = sos_server_factory(
        args=["--max-connections", "16", "--max-unauthenticated", "3", "--handshake-timeout", "10m"], start=False
    )
    key = srv.keygen(NS, "append")
    srv.start()
    authed = RawClient(srv.address)
    waiting = []
    try:
        assert isinstance(authed.login(key, NS), ev.AuthOk)
        for i in range(3):  # from three addresses: the per-address cap is not what stops them
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(TIMEOUT)
            sock.bind((f"127.0.0.{2 + i}", 0))
            sock.connect(srv.host_port)
            c = RawClient(None, sock=sock)
            assert isinstance(c.call(ev.Ping(c.rid(), b"")), ev.Pong)
            waiting.append(c)
        # the pool is full: a fourth is not refused (issue 17 item 5), the oldest waiting
        # connection makes room for it: ERROR BUSY (request id 0), then the close
        fourth = RawClient(srv.address)
        waiting.append(fourth)
        assert isinstance(fourth.call(ev.Ping(fourth.rid(), b"")), ev.Pong)
        evicted = waiting.pop(0)
        raw = evicted.recv_raw_until_eof()
        evicted.close()
        assert raw[3] == 0xFF and struct.unpack(">I", raw[4:8])[0] == 0
        assert struct.unpack(">H", raw[16:18])[0] == ErrorCode.BUSY
        assert b"not authenticated yet" in raw
        deadline = time.monotonic() + TIMEOUT
        while server_metric(srv, "sos_unauthenticated_connections") != 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # the authenticated connection is not counted and keeps working
        assert authed.append("a", 0, b"x") == ev.AppendOk(authed.conn._next_id, 1)
        # one of the three authenticates: its slot is free for a newcomer
        assert isinstance(waiting[0].login(key, NS), ev.AuthOk)
        deadline = time.monotonic() + TIMEOUT
        while server_metric(srv, "sos_unauthenticated_connections") != 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with Client(srv.address, key, NS, timeout=TIMEOUT) as newcomer:
            assert newcomer.stat("a") == (1, False)
    finally:
        authed.close()
        for c in waiting:
            c.close()


def test_address_key_counts_ipv6_by_slash_64():
    from sos_wire.addresses import address_key

    assert address_key("127.0.0.2") == "127.0.0.2"
    assert address_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::2") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("?") == "?"


# -- item 17 ------------------------------------------------------------------------------


def _key_path(srv, key: str) -> str:
    return os.path.join(srv.data_dir, "ns", NS, "keys", Key.parse(key).key_id.hex())


def test_deleting_a_key_ends_the_sessions_opened_with_it(sos_server_factory):
    srv = sos_server_factory(start=False)
    key = srv.keygen(NS, "append")
    other = srv.keygen(NS, "append")
    srv.start()
    victim = RawClient(srv.address)
    bystander = RawClient(srv.address)
    client = Client(srv.address, key, NS, timeout=TIMEOUT)
    try:
        assert isinstance(victim.login(key, NS), ev.AuthOk)
        assert isinstance(bystander.login(other, NS), ev.AuthOk)
        assert victim.append("log", 0, b"before").length == 6
        assert client.append("log2", 0, b"before") == 6
        # a key file touched but unchanged is still the same key: nothing is revoked
        os.utime(_key_path(srv, key))
        assert victim.append("log", 6, b" touched").length == 14

        os.unlink(_key_path(srv, key))  # revoke
        r = victim.append("log", 14, b" after")
        assert isinstance(r, ev.Error) and r.code is ErrorCode.AUTH_FAILED, r
        assert r.request_id == victim.conn._next_id and "removed or changed" in r.message
        assert _closed(victim)
        with pytest.raises(SOSPermissionError):  # the blocking client: refused, typed
            client.fence(5)
        with pytest.raises(SOSPermissionError):  # and it cannot come back
            client.append("log2", 6, b" after")
        # the other key's session is untouched; nothing was appended or fenced
        assert bystander.stat("log") == ev.StatOk(bystander.conn._next_id, 14, False)
        assert bystander.stat("log2") == ev.StatOk(bystander.conn._next_id, 6, False)
        assert bystander.append("log", 14, b"!", epoch=0).length == 15
    finally:
        victim.close()
        bystander.close()
        client.close()


def test_changing_a_keys_role_ends_the_sessions_opened_with_it(sos_server_factory):
    srv = sos_server_factory(start=False)
    key = srv.keygen(NS, "append")
    srv.start()
    with RawClient(srv.address) as c:
        assert c.login(key, NS).role == ev.KeyRole.APPEND
        path = _key_path(srv, key)
        with open(path, "rb") as f:
            text = f.read().replace(b'"append"', b'"read"')
        with open(path + ".new", "wb") as f:
            f.write(text)
        os.replace(path + ".new", path)
        r = c.call(ev.Fence(c.rid(), 9))
        assert isinstance(r, ev.Error) and r.code is ErrorCode.AUTH_FAILED, r
        assert _closed(c)
    with RawClient(srv.address) as c:  # the same key now logs in as a read key
        assert c.login(key, NS).role == ev.KeyRole.READ


# -- item 18 ------------------------------------------------------------------------------


def test_frames_before_auth_are_capped_at_4_kib(srv_with_key):
    srv, key = srv_with_key
    with RawClient(srv.address) as c:
        # a 64 KiB PING before AUTH: refused on its header, before any of the body
        # (the EOF after the header: a server that waits for the body sees it end early)
        c.send_raw(frame(0x03, 5, body_len=64 << 10))
        c.sock.shutdown(socket.SHUT_WR)
        c.conn = client_expecting(Op.PING, 5)  # the PING was sent by hand: read its answer as its sender
        r = c.next()
        assert isinstance(r, ev.Error) and r.code is ErrorCode.TOO_LARGE and r.request_id == 5, r
        assert "4096" in r.message
        assert c.recv_raw_until_eof() == b""  # then the close
    with RawClient(srv.address) as c:  # a 4 KiB body is still read (and answered)
        body = struct.pack(">I", 4092) + bytes(4092)
        c.send_raw(frame(0x03, 5, body_len=len(body)) + body)
        c.conn = client_expecting(Op.PING, 5)
        r = c.next()
        assert isinstance(r, ev.Error) and r.code is ErrorCode.BAD_REQUEST, r  # PING payload over 64
        assert not _closed(c)
        # after AUTH the announced limit applies
        assert isinstance(c.login(key, NS), ev.AuthOk)
        data = os.urandom(DEFAULT_MAX_BODY - 26 - 3)
        assert c.append("big", 0, data).length == len(data)


def test_the_third_failed_auth_closes_the_connection(srv_with_key):
    srv, key = srv_with_key
    k = Key.parse(key)
    with RawClient(srv.address) as c:
        hello = c.call(ev.Hello(c.rid(), "t", 1, 1))
        for attempt in range(1, 4):
            r = c.call(ev.Auth(c.rid(), k.key_id, NS, bytes(32)))
            assert isinstance(r, ev.Error) and r.code is ErrorCode.AUTH_FAILED, r
            if attempt < 3:
                assert not _closed(c)
        assert _closed(c)
    with RawClient(srv.address) as c:  # a correct AUTH on a new connection works
        hello = c.call(ev.Hello(c.rid(), "t", 1, 1))
        assert isinstance(c.call(ev.Auth(c.rid(), k.key_id, NS, k.proof(hello.nonce, NS))), ev.AuthOk)


def test_failed_auths_from_one_address_are_answered_at_a_bounded_rate():
    from sos_server.listener import AuthFailures

    f = AuthFailures(rate=2.0, burst=3, cap=2.0, max_addresses=3)
    assert [f.failed("a", 0.0) for _ in range(7)] == [0.0, 0.0, 0.0, 0.5, 1.0, 1.5, 2.0]
    assert f.failed("a", 0.0) == 2.0  # at most cap
    assert f.failed("b", 0.0) == 0.0  # per address
    assert f.failed("a", 1.0) == 1.5  # the debt is paid back at the rate
    assert f.failed("a", 100.0) == 0.0  # and then the burst is back
    f.failed("c", 101.0)
    f.failed("d", 102.0)  # only 3 addresses are remembered: the oldest ("b") is forgotten
    assert sorted(f._seen) == ["a", "c", "d"]


@pytest.fixture
def srv_with_key(sos_server_factory):
    srv = sos_server_factory(start=False)
    key = srv.keygen(NS, "append")
    srv.start()
    return srv, key
