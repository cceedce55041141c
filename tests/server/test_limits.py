"""Issue 17, items 5, 7, 10 and 12 (the quota part), against real ``sos-server`` processes.

- 5: 16 source addresses x 8 silent connections filled the 128 pre-AUTH slots and every
  new client got BUSY. Now the oldest unauthenticated connection is evicted (ERROR BUSY,
  request id 0, then the close) to make room, and the per-address cap still refuses.
- 7: the byte quota counted data bytes only: a 64 KiB quota let a tenant make thousands of
  empty objects. Now each object is charged OBJECT_CHARGE (4 KiB) plus its data, and the
  default per-namespace object cap is 10,000.
- 10: the token role: a key that AUTHs (role 3) and may do nothing else at the server
  but PING, and that `sos gateway` exchanges for an append bearer token.
- 12: a quota set with `sos-server quota` binds connections already open.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import subprocess
import sys
import threading

import pytest
import requests

from sos_client import Client
from sos_wire import events as ev
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.events import KeyRole
from tests.conftest import RawClient
from tests.support import server_cli, server_metric, wait_for

pytestmark = [pytest.mark.hostile]

NS = "round2"
TIMEOUT = 120
OBJECT_CHARGE = 4096  # what each object costs the byte quota besides its data (protocol.md 1.9)


# -- item 5: the pre-AUTH pool ------------------------------------------------------------


def _silent(srv, host: str) -> socket.socket:
    """A connection from *host* (any 127.0.0.0/8 address is this machine) that sends nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(TIMEOUT)
    sock.bind((host, 0))
    sock.connect(srv.host_port)
    return sock


def _busy_then_closed(sock: socket.socket) -> bool:
    """Read until EOF: True if the server sent exactly one ERROR BUSY with request id 0."""
    raw = b""
    while True:
        data = sock.recv(1 << 16)
        if not data:
            break
        raw += data
    if len(raw) < 16 + 10 or raw[:4] != b"SO\x01\xff":
        return False
    (rid, body_len) = struct.unpack(">II", raw[4:12])
    (code,) = struct.unpack(">H", raw[16:18])
    return rid == 0 and code == ErrorCode.BUSY and len(raw) == 16 + body_len


def _readable(socks: dict[int, tuple[str, socket.socket]]) -> list[int]:
    poller = select.poll()
    for _, s in socks.values():
        poller.register(s.fileno(), select.POLLIN)
    fds = {s.fileno(): i for i, (_, s) in socks.items()}
    return [fds[fd] for fd, _ in poller.poll(0)]


def test_silent_connections_from_16_addresses_do_not_lock_clients_out(sos_server_factory):
    # a long handshake timeout: the crowd is never closed for it (a crowd that reconnects
    # at once achieves the same); default pool: 128, 8 per address
    srv = sos_server_factory(args=["--handshake-timeout", "10m"], start=False)
    key = srv.keygen(NS, "append")
    srv.start()
    crowd: dict[int, tuple[str, socket.socket]] = {}
    hosts = [f"127.0.0.{2 + a}" for a in range(16)]
    try:
        for host in hosts:
            for _ in range(8):
                crowd[len(crowd)] = (host, _silent(srv, host))
        wait_for(
            lambda: server_metric(srv, "sos_unauthenticated_connections") == 128, TIMEOUT, "128 connections waiting"
        )
        # the per-address cap still refuses a ninth from one address (nothing is evicted for it)
        with _silent(srv, hosts[0]) as ninth:
            assert _busy_then_closed(ninth)
        evicted = 0
        next_id = len(crowd)
        for round_ in range(5):
            # a real client gets in while the pool is full, and works
            with Client(srv.address, key, NS, timeout=TIMEOUT) as c:
                assert c.append(f"r/{round_}", 0, b"in") == 2
                assert c.stat(f"r/{round_}") == (2, False)
            evicted += 1
            # it took the slot of one silent connection: that one got BUSY and the close
            wait_for(lambda: bool(_readable(crowd)), TIMEOUT, "a silent connection evicted")
            gone = _readable(crowd)
            assert len(gone) == 1, gone
            host, sock = crowd.pop(gone[0])
            assert _busy_then_closed(sock)
            sock.close()
            # the crowd reconnects at once: the pool is full again
            crowd[next_id] = (host, _silent(srv, host))
            next_id += 1
            wait_for(lambda: server_metric(srv, "sos_unauthenticated_connections") == 128, TIMEOUT, "128 waiting again")
        assert not _readable(crowd)  # nobody else was touched
        assert server_metric(srv, "sos_unauthenticated_evicted_total") == evicted
    finally:
        for _, s in crowd.values():
            s.close()


def test_evicted_connection_that_was_mid_handshake_is_told_busy(sos_server_factory):
    """A small pool (2): a connection that sent HELLO but never AUTH is evicted by a newer
    one all the same (oldest first), with ERROR BUSY; the newer one authenticates."""
    srv = sos_server_factory(args=["--max-unauthenticated", "2", "--handshake-timeout", "10m"], start=False)
    key = srv.keygen(NS, "append")
    srv.start()
    old = RawClient(srv.address)
    other = RawClient(srv.address)
    try:
        assert isinstance(old.call(ev.Hello(old.rid(), "slow", 1, 1)), ev.HelloOk)
        assert isinstance(other.call(ev.Ping(other.rid(), b"")), ev.Pong)
        with RawClient(srv.address) as newcomer:
            assert isinstance(newcomer.login(key, NS), ev.AuthOk)
            reply = old.next()
            assert isinstance(reply, ev.Error) and reply.request_id == 0 and reply.code is ErrorCode.BUSY, reply
            assert "not authenticated" in reply.message
            with pytest.raises((EOFError, ConnectionResetError)):
                old.next()
            assert isinstance(newcomer.append("n", 0, b"x"), ev.AppendOk)
        assert isinstance(other.call(ev.Ping(other.rid(), b"")), ev.Pong)  # one eviction, one victim
    finally:
        old.close()
        other.close()


# -- item 7: objects cost quota -----------------------------------------------------------


def test_empty_objects_with_long_names_stop_at_quota_over_charge(sos_server_factory):
    srv = sos_server_factory(start=False)
    out = server_cli("keygen", "--data", str(srv.data_dir), NS, "--role", "append", "--quota", "64K")
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()
    srv.start()
    long = "x" * 200 + "/" + "y" * 200 + "/"
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, NS), ev.AuthOk)
        made = 0
        while True:
            r = c.append(f"{long}{made:05d}", 0, b"")
            if not isinstance(r, ev.AppendOk):
                break
            made += 1
            assert made <= 64 * 1024 // OBJECT_CHARGE, "the quota does not count objects"
        assert made == 64 * 1024 // OBJECT_CHARGE == 16
        assert isinstance(r, ev.Error) and r.code is ErrorCode.QUOTA_EXCEEDED and "quota of 65536" in r.message, r
        # nothing partial: the refused object does not exist, on the wire or on disk
        st = c.call(ev.Stat(c.rid(), f"{long}{made:05d}"))
        assert isinstance(st, ev.Error) and st.code is ErrorCode.NOT_FOUND, st
        listed = c.call(ev.List(c.rid(), "", "", 1000))
        assert len(listed.entries) == made
    files = [f for _, _, fs in os.walk(os.path.join(srv.data_dir, "ns", NS, "objects")) for f in fs]
    assert len(files) == made and not [f for f in files if ".tmp-" in f]


def test_object_charge_and_data_share_the_quota_exactly(sos_server_factory):
    srv = sos_server_factory(start=False)
    key = srv.keygen(NS, "append")
    assert server_cli("quota", "--data", str(srv.data_dir), NS, str(3 * 4096 + 100)).returncode == 0
    srv.start()
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, NS), ev.AuthOk)
        assert isinstance(c.append("a", 0, b"x" * 100), ev.AppendOk)  # 4196 charged
        assert isinstance(c.append("b", 0, b""), ev.AppendOk)  # 8292
        r = c.append("c", 0, b"z")  # 12389 > 12388
        assert isinstance(r, ev.Error) and r.code is ErrorCode.QUOTA_EXCEEDED, r
        assert isinstance(c.append("c", 0, b""), ev.AppendOk)  # exactly the quota
        r = c.append("a", 100, b"z")  # growing an object: the same sum
        assert isinstance(r, ev.Error) and r.code is ErrorCode.QUOTA_EXCEEDED, r
        assert isinstance(c.append("a", 0, b"x" * 100), ev.AppendOk)  # identical retries: whatever the quota
        assert isinstance(c.call(ev.Stat(c.rid(), "c")), ev.StatOk)


def test_the_default_object_cap_is_10000_per_namespace(sos_server_factory, tmp_path):
    """No --max-objects: the 10,001st object of a namespace is QUOTA_EXCEEDED (the data on
    tmpfs, where the 10,000 creations' fsyncs cost nothing)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    import tempfile

    with tempfile.TemporaryDirectory(dir=base) as data:
        srv = sos_server_factory(data_dir=os.path.join(data, "data"), start=False)
        key = srv.keygen(NS, "append")
        srv.start()
        n = 10_001
        with RawClient(srv.address) as c:
            assert isinstance(c.login(key, NS), ev.AuthOk)
            frames = b"".join(c.conn.send(ev.Append(c.rid(), f"o/{i:05d}", 0, 0, crc32c(b""), b"")) for i in range(n))
            sender = threading.Thread(target=c.send_raw, args=(frames,), daemon=True)
            sender.start()  # pipelined; the replies are read meanwhile
            replies = [c.next() for _ in range(n)]
            sender.join(TIMEOUT)
        refused = [r for r in replies if isinstance(r, ev.Error)]
        assert len(replies) - len(refused) == 10_000
        assert len(refused) == 1 and refused[0].code is ErrorCode.QUOTA_EXCEEDED, refused[:3]
        assert "10000 objects" in refused[0].message
        srv.stop()


# -- item 12: a quota change binds open connections ---------------------------------------


def test_quota_lowered_on_the_live_server_binds_an_open_connection(sos_server_factory):
    srv = sos_server_factory(start=False)
    key = srv.keygen(NS, "append")
    srv.start()
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, NS), ev.AuthOk)
        assert isinstance(c.append("log", 0, b"x" * 1000), ev.AppendOk)  # no quota yet
        out = server_cli("quota", "--data", str(srv.data_dir), NS, "4K")  # below 4096 + 1000 charged
        used = "used 5096 (objects 1, data bytes 1000)"  # over it: the quota shows beside the usage
        assert out.returncode == 0 and out.stdout == f"{NS}\t4096\t{used}\n", (out.stdout, out.stderr)
        r = c.append("log", 1000, b"y")  # the same connection, opened before the change
        assert isinstance(r, ev.Error) and r.code is ErrorCode.QUOTA_EXCEEDED and "quota of 4096" in r.message, r
        # raised again (and removed): taken up at once too
        assert server_cli("quota", "--data", str(srv.data_dir), NS, "1M").returncode == 0
        assert isinstance(c.append("log", 1000, b"y"), ev.AppendOk)
        assert server_cli("quota", "--data", str(srv.data_dir), NS, "4K").returncode == 0
        assert isinstance(c.append("log", 1001, b"y"), ev.Error)
        assert server_cli("quota", "--data", str(srv.data_dir), NS, "none").returncode == 0
        assert isinstance(c.append("log", 1001, b"y"), ev.AppendOk)


# -- item 10: the token role --------------------------------------------------------------


def _token_key(srv) -> str:
    out = server_cli("keygen", "--data", str(srv.data_dir), NS, "--role", "token")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_token_key_authenticates_and_is_forbidden_everything_but_ping(sos_server_factory):
    srv = sos_server_factory(start=False)
    append_key = srv.keygen(NS, "append")
    token_key = _token_key(srv)
    srv.start()
    with RawClient(srv.address) as w:  # something to read, at epoch 1
        assert isinstance(w.login(append_key, NS), ev.AuthOk)
        assert w.call(ev.Fence(w.rid(), 1)) == ev.FenceOk(w.conn._next_id, 1)
        assert isinstance(w.append("obj", 0, b"data", epoch=1), ev.AppendOk)
    with RawClient(srv.address) as c:
        ok = c.login(token_key, NS)
        assert ok == ev.AuthOk(c.conn._next_id, KeyRole.TOKEN)
        for request in (
            ev.Fence(c.rid(), 2),
            ev.Append(c.rid(), "obj", 4, 1, crc32c(b"x"), b"x"),
            ev.Append(c.rid(), "new", 0, 1, crc32c(b""), b""),
            ev.Read(c.rid(), "obj", 0, 0),
            ev.List(c.rid(), "", "", 10),
            ev.Stat(c.rid(), "obj"),
            ev.Seal(c.rid(), "obj", 1),
        ):
            r = c.call(request)
            assert isinstance(r, ev.Error) and r.code is ErrorCode.FORBIDDEN, (request, r)
            assert r.request_id == request.request_id and "gateway" in r.message, r
        assert c.call(ev.Ping(c.rid(), b"still here")).payload == b"still here"  # the connection lives on
    with RawClient(srv.address) as w:  # nothing changed: the fence, the object
        assert isinstance(w.login(append_key, NS), ev.AuthOk)
        assert w.read("obj") == b"data"
        r = w.call(ev.Fence(w.rid(), 0))
        assert isinstance(r, ev.Error) and r.code is ErrorCode.FENCED and r.length == 1, r
        assert w.call(ev.List(w.rid(), "", "", 10)).entries == (ev.ListEntry("obj", 4, False),)


def test_sos_commands_say_a_token_key_is_gateway_only(sos_server_factory):
    srv = sos_server_factory(start=False)
    token_key = _token_key(srv)
    srv.start()
    with Client(srv.address, token_key, NS, timeout=TIMEOUT) as c:
        assert c.role is KeyRole.TOKEN
        assert c.ping(b"p") == b"p"
    env = dict(os.environ, SOS_KEY=token_key)
    for args in (["ls", NS], ["stat", f"{NS}/x"], ["cat", f"{NS}/x"]):
        out = subprocess.run(
            [sys.executable, "-m", "sos_client.cli", *args, "--server", srv.address],
            capture_output=True,
            text=True,
            env=env,
            timeout=TIMEOUT,
        )
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert "gateway-only key" in out.stderr and "token role" in out.stderr, out.stderr
    from sos_journal.tree.open import open_namespace

    with pytest.raises(PermissionError, match="gateway-only key"):
        open_namespace(NS, str(srv.data_dir) + "-cache", server=srv.address, key=token_key, timeout=TIMEOUT)


def test_the_gateway_exchanges_a_token_key_for_an_append_token(sos_server_factory, tmp_path):
    from spark_plugin.gateway.process import GatewayProcess

    srv = sos_server_factory(start=False)
    gateway_key = srv.keygen(NS, "append")
    token_key = _token_key(srv)
    srv.start()
    gw = GatewayProcess(
        NS,
        str(tmp_path / "cache"),
        srv.address,
        gateway_key,
        listen="127.0.0.1:0",
        log_path=str(tmp_path / "gateway.log"),
    ).start()
    try:
        r = requests.post(
            gw.url + "/oauth2/token",
            data={"grant_type": "client_credentials", "client_id": NS, "client_secret": token_key},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200, r.text
        h = {"Authorization": f"Bearer {r.json()['access_token']}"}
        url = f"{gw.url}/webhdfs/v1/chk/f"
        r = requests.put(url, params={"op": "CREATE"}, headers=h, allow_redirects=False, timeout=TIMEOUT)
        assert r.status_code == 307, r.text
        r = requests.put(r.headers["Location"], data=b"through the gateway", headers=h, timeout=TIMEOUT)
        assert r.status_code == 201, r.text
        r = requests.get(url, params={"op": "OPEN"}, headers=h, timeout=TIMEOUT)
        assert r.status_code == 200 and r.content == b"through the gateway"
    finally:
        gw.stop()
