"""Many, slow and idle connections against a real ``sos-server`` process.

- 1,000 concurrent connections, each authenticated and appending, all open at once.
- Clients that send one byte a second (slowloris) or never read their replies do not stop
  a well-behaved client from completing its work while they are connected (asserted by
  completion, with generous timeouts, never by measured latency); afterwards the slow
  clients' requests complete too.
- With ``--idle-timeout``, idle and trickling connections are closed by the server.
- With ``--handshake-timeout``, connections that do not authenticate in time are closed,
  so silent ones cannot fill ``--max-connections`` for good.
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
import urllib.request

import pytest

from sos_client import Client, SOSNotFound
from sos_wire import events as ev
from sos_wire.auth import Key
from sos_wire.connection import NEED_DATA, Connection, Role
from sos_wire.crc import crc32c
from tests.support import server_metric

pytestmark = [pytest.mark.hostile]

NS = "crowd"
TIMEOUT = 120
N_CONNECTIONS = 1000


def _connect(srv) -> socket.socket:
    host, port = srv.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=TIMEOUT)


def _recv_event(sock, conn):
    while True:
        e = conn.next_event()
        if e is not NEED_DATA:
            return e
        data = sock.recv(1 << 16)
        if not data:
            raise EOFError("server closed the connection")
        conn.receive_data(data)


def _login(sock, key: str, ns: str = NS) -> Connection:
    conn = Connection(Role.CLIENT)
    sock.sendall(conn.send(ev.Hello(conn.next_request_id(), "hostile", 1, 1)))
    hello = _recv_event(sock, conn)
    k = Key.parse(key)
    sock.sendall(conn.send(ev.Auth(conn.next_request_id(), k.key_id, ns, k.proof(hello.nonce, ns))))
    assert isinstance(_recv_event(sock, conn), ev.AuthOk)
    return conn


def _closed_by_server(sock) -> bool:
    """Read until EOF (True) -- the server closed it; anything it sends first is discarded."""
    try:
        while sock.recv(1 << 16):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    return True


@pytest.fixture
def many_fds():
    """Raise this process's RLIMIT_NOFILE (the server child inherits it and raises its own)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096
    new_hard = hard if hard == resource.RLIM_INFINITY or hard >= want else want
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), new_hard))
    except (ValueError, OSError) as exc:
        pytest.skip(f"cannot raise RLIMIT_NOFILE to {want} (soft {soft}, hard {hard}): {exc}")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def test_a_thousand_concurrent_connections(many_fds, sos_server_factory):
    # all 1,000 say HELLO before any says AUTH: on a loaded machine that may take longer
    # than the default --handshake-timeout, and they are 1,000 unauthenticated connections
    # from one address at once, over the default caps; neither is what this test is about
    srv = sos_server_factory(
        args=["--handshake-timeout", "0", "--max-unauthenticated", "1024", "--max-unauthenticated-per-address", "1024"],
        start=False,
    )
    key = srv.keygen(NS, "append")
    srv.start()
    socks: list[socket.socket] = []
    conns: list[Connection] = []
    try:
        for _ in range(N_CONNECTIONS):
            socks.append(_connect(srv))
        # every phase is sent to all connections first, then every reply is collected
        for s in socks:
            c = Connection(Role.CLIENT)
            conns.append(c)
            s.sendall(c.send(ev.Hello(c.next_request_id(), "crowd", 1, 1)))
        k = Key.parse(key)
        for s, c in zip(socks, conns):
            hello = _recv_event(s, c)
            assert isinstance(hello, ev.HelloOk)
            s.sendall(c.send(ev.Auth(c.next_request_id(), k.key_id, NS, k.proof(hello.nonce, NS))))
        for s, c in zip(socks, conns):
            assert isinstance(_recv_event(s, c), ev.AuthOk)
        for i, (s, c) in enumerate(zip(socks, conns)):
            data = f"connection {i}".encode()
            s.sendall(c.send(ev.Append(c.next_request_id(), f"c/{i:04d}", 0, 0, crc32c(data), data)))
        for i, (s, c) in enumerate(zip(socks, conns)):
            reply = _recv_event(s, c)
            assert reply == ev.AppendOk(reply.request_id, len(f"connection {i}")), (i, reply)

        # all 1,000 are still open and served; a newcomer is served too
        with urllib.request.urlopen(f"http://{srv.metrics_address}/metrics", timeout=TIMEOUT) as resp:
            text = resp.read().decode()
        open_now = [ln for ln in text.splitlines() if ln.startswith("sos_open_connections ")]
        assert open_now and float(open_now[0].split()[1]) >= N_CONNECTIONS, open_now
        with Client(srv.address, key, NS, timeout=TIMEOUT) as newcomer:
            entries = list(newcomer.list("c/"))
            assert len(entries) == N_CONNECTIONS
            assert newcomer.read("c/0999") == b"connection 999"
        for s, c in zip(socks, conns):  # and each of them still answers
            s.sendall(c.send(ev.Ping(c.next_request_id(), b"still")))
        for s, c in zip(socks, conns):
            assert _recv_event(s, c).payload == b"still"
    finally:
        for s in socks:
            s.close()


class Trickler(threading.Thread):
    """Sends one frame a byte a second until *stop* is set, then the rest at once."""

    def __init__(self, srv, key, name: str, frame_len: int = 1024, *, delay: float = 1.0, login: bool = True):
        super().__init__(daemon=True)
        self.sock = _connect(srv)
        self.conn = _login(self.sock, key) if login else Connection(Role.CLIENT)
        self.data = os.urandom(frame_len)
        self.name = name
        self.frame = self.conn.send(ev.Append(self.conn.next_request_id(), name, 0, 0, crc32c(self.data), self.data))
        self.delay = delay
        self.stop = threading.Event()
        self.started_sending = threading.Event()
        self.sent = 0
        self.reply = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set() and self.sent < len(self.frame) - 1:
                self.sock.sendall(self.frame[self.sent : self.sent + 1])
                self.sent += 1
                self.started_sending.set()
                self.stop.wait(self.delay)
            if not self.stop.is_set():
                return  # never completes the frame by itself
            self.sock.sendall(self.frame[self.sent :])
            self.sent = len(self.frame)
            self.reply = _recv_event(self.sock, self.conn)
        except BaseException as exc:
            self.error = exc
            self.started_sending.set()


def test_slow_writers_and_a_non_reading_client_do_not_block_others(sos_server):
    key = sos_server.keygen(NS, "append")
    with Client(sos_server.address, key, NS, timeout=TIMEOUT) as setup:
        big = os.urandom(4 << 20)
        setup.append_many("big", 0, [big])
    slow = [Trickler(sos_server, key, f"slow/{i}") for i in range(20)]
    # a reader that asks for 64 MiB of replies and never reads them: the server's sends block
    deaf = _connect(sos_server)
    deaf_conn = _login(deaf, key)
    for _ in range(16):
        deaf.sendall(deaf_conn.send(ev.Read(deaf_conn.next_request_id(), "big", 0, 0)))
    try:
        for t in slow:
            t.start()
        for t in slow:
            assert t.started_sending.wait(TIMEOUT) and t.error is None, t.error
        # the well-behaved client does real work while all of them are connected
        with Client(sos_server.address, key, NS, timeout=TIMEOUT) as fast:
            length = 0
            for i in range(100):
                length = fast.append("fast", length, bytes([i]) * 4096)
            payload = os.urandom(8 << 20)
            assert fast.append_many("fast-bulk", 0, [payload]) == len(payload)
            assert fast.read("fast-bulk") == payload
            assert fast.read("big") == big
            assert fast.read("fast") == b"".join(bytes([i]) * 4096 for i in range(100))
        # the slow ones were mid-frame the whole time
        assert all(t.is_alive() and t.reply is None and t.error is None for t in slow)
    finally:
        deaf.close()
        for t in slow:
            t.stop.set()
        for t in slow:
            t.join(TIMEOUT)
    # once they finish their frames, they are served as well
    for t in slow:
        assert t.error is None, t.error
        assert t.reply == ev.AppendOk(t.reply.request_id, len(t.data)), t.reply
        t.sock.close()
    with Client(sos_server.address, key, NS, timeout=TIMEOUT) as c:
        for t in slow:
            assert c.read(t.name) == t.data


def test_idle_and_trickling_connections_are_closed_by_the_idle_timeout(sos_server_factory):
    srv = sos_server_factory(args=["--idle-timeout", "1"], start=False)
    key = srv.keygen(NS, "append")
    srv.start()
    with Client(srv.address, key, NS, timeout=TIMEOUT) as c:
        c.append("kept", 0, b"written before anyone idled")
    silent = _connect(srv)  # connects and says nothing
    authed = _connect(srv)
    _login(authed, key)  # authenticates, then idles
    half = _connect(srv)
    half.sendall(b"SO\x01")  # a third of a header, then nothing
    # never completes a frame: announces 1 MiB and sends a byte every 0.2 s
    trickle = Trickler(srv, key, "trickle", frame_len=1 << 20, delay=0.2)
    trickle.start()
    try:
        for s in (silent, authed, half):
            s.settimeout(TIMEOUT)
            assert _closed_by_server(s)
        trickle.join(TIMEOUT)
        assert not trickle.is_alive(), "a connection trickling bytes was never closed"
        assert isinstance(trickle.error, (BrokenPipeError, ConnectionResetError)), trickle.error
        assert trickle.sent < len(trickle.frame) - 1
    finally:
        trickle.stop.set()
        for s in (silent, authed, half, trickle.sock):
            s.close()
    # the server is fine and the data is intact; a busy client is not cut off
    with Client(srv.address, key, NS, timeout=TIMEOUT) as c:
        assert c.read("kept") == b"written before anyone idled"
        n = 0
        for _ in range(50):
            n = c.append("busy", n, b"x" * 1000)
        assert c.stat("busy") == (50_000, False)
        with pytest.raises(SOSNotFound):  # the never-finished frame wrote nothing
            c.stat("trickle")


class Pinger(threading.Thread):
    """An unauthenticated connection that says HELLO, then PINGs every *delay* seconds."""

    def __init__(self, srv, delay: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.sock = _connect(srv)
        self.conn = Connection(Role.CLIENT)
        self.delay = delay
        self.stop = threading.Event()
        self.pongs = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.sock.sendall(self.conn.send(ev.Hello(self.conn.next_request_id(), "pinger", 1, 1)))
            assert isinstance(_recv_event(self.sock, self.conn), ev.HelloOk)
            while not self.stop.is_set():
                self.sock.sendall(self.conn.send(ev.Ping(self.conn.next_request_id(), b"")))
                assert isinstance(_recv_event(self.sock, self.conn), ev.Pong)
                self.pongs += 1
                self.stop.wait(self.delay)
        except BaseException as exc:
            self.error = exc


def test_unauthenticated_connections_are_closed_by_the_handshake_timeout(sos_server_factory):
    """Silent connections filled every slot (everyone else got BUSY, for good): now a
    connection that has not authenticated --handshake-timeout after it was accepted is
    closed, PINGs or not; authenticated clients keep working throughout."""
    srv = sos_server_factory(args=["--handshake-timeout", "1", "--max-connections", "8"], start=False)
    key = srv.keygen(NS, "append")
    srv.start()
    authed = Client(srv.address, key, NS, timeout=TIMEOUT)
    silent: list[socket.socket] = []
    pinger = None
    try:
        assert authed.append("kept", 0, b"before") == 6
        pinger = Pinger(srv)  # slot 2
        pinger.start()
        silent = [_connect(srv) for _ in range(6)]  # slots 3..8: the server is full
        half = silent[0]
        half.sendall(b"SO\x01")  # and one that started a frame
        for s in silent:
            s.settimeout(TIMEOUT)
            assert _closed_by_server(s)
        pinger.join(TIMEOUT)
        assert not pinger.is_alive(), "a PINGing unauthenticated connection was never closed"
        assert isinstance(pinger.error, (EOFError, BrokenPipeError, ConnectionResetError)), pinger.error
        # the authenticated connection was not touched
        assert authed.append("kept", 6, b" after") == 12
        assert authed.read("kept") == b"before after"
        assert server_metric(srv, "sos_handshake_timeouts_total") >= 7
        # the slots are free again: a newcomer gets in (the server counts the closed ones
        # down on its own time, so allow it a moment)
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                with Client(srv.address, key, NS, timeout=TIMEOUT) as newcomer:
                    assert newcomer.read("kept") == b"before after"
                    break
            except ConnectionError:  # BUSY while closed connections are still counted
                assert time.monotonic() < deadline, "connection slots never came back"
                time.sleep(0.1)
    finally:
        if pinger is not None:
            pinger.stop.set()
            pinger.sock.close()
        for s in silent:
            s.close()
        authed.close()
