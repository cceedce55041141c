"""The real ``sos-server`` process on 127.0.0.1: bad input of every kind gets its typed
error while other connections keep being served; CLI commands; metrics; clean stop."""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
import urllib.request

import pytest

from sos_server.storage import Storage
from sos_wire import events as ev
from sos_wire.auth import Key
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.frames import DEFAULT_MAX_BODY
from tests.conftest import RawClient
from tests.support import frame, self_signed_cert, server_cli

NS = "proc"


def _error_of(raw: bytes) -> tuple[int, int]:
    """(request id, code) of the first frame in *raw*, which must be an ERROR."""
    assert raw[:2] == b"SO" and raw[3] == 0xFF, raw[:20]
    return struct.unpack(">I", raw[4:8])[0], struct.unpack(">H", raw[16:18])[0]


@pytest.fixture
def srv(sos_server):
    sos_server.key = sos_server.keygen(NS, "append")
    sos_server.read_key = sos_server.keygen(NS, "read")
    return sos_server


@pytest.fixture
def bystander(srv):
    """A second, well-behaved connection that must keep working through every test."""
    c = RawClient(srv.address)
    assert isinstance(c.login(srv.keygen("bystander"), "bystander"), ev.AuthOk)
    assert c.append("bystander", 0, b"ok") == ev.AppendOk(c.conn._next_id, 2)
    yield c
    # the server still serves it after whatever the test did
    assert c.append("bystander", 2, b"!") == ev.AppendOk(c.conn._next_id, 3)
    assert c.read("bystander") == b"ok!"
    c.close()


def test_typed_errors_on_one_connection_which_survives(srv, bystander):
    with RawClient(srv.address) as c:
        # unauthenticated requests
        for req in [ev.Stat(c.rid(), "a"), ev.Append(c.rid(), "a", 0, 0, 0, b""), ev.List(c.rid(), "", "", 1)]:
            r = c.call(req)
            assert isinstance(r, ev.Error) and r.code is ErrorCode.NOT_AUTHENTICATED, req
        hello = c.call(ev.Hello(c.rid(), "t", 1, 1))
        k = Key.parse(srv.key)
        # wrong key, wrong namespace
        bad = Key(k.key_id, os.urandom(32))
        r = c.call(ev.Auth(c.rid(), bad.key_id, NS, bad.proof(hello.nonce, NS)))
        assert r.code is ErrorCode.AUTH_FAILED
        other_key = srv.keygen("elsewhere", "append")
        r = c.call(ev.Auth(c.rid(), k.key_id, "elsewhere", k.proof(hello.nonce, "elsewhere")))
        assert r.code is ErrorCode.AUTH_FAILED
        r = c.call(ev.Auth(c.rid(), k.key_id, NS, k.proof(hello.nonce, NS)))
        assert isinstance(r, ev.AuthOk)

        # names
        for name in ["../../etc/passwd", "/abs", "a/../b", "a//b", "x" * 1025, "s/" + "y" * 256, "sp ace", "nul\x00"]:
            r = c.append(name, 0, b"x")
            assert r.code is ErrorCode.BAD_NAME, name
            r = c.stat(name)
            assert r.code is ErrorCode.BAD_NAME, name
        assert not any(n for n in os.listdir(srv.data_dir) if n not in ("ns", "LOCK", "wal"))

        # append rules over the wire
        assert c.append("obj", 0, b"hello").length == 5
        r = c.append("obj", 2, b"zz")
        assert r.code is ErrorCode.OFFSET_MISMATCH and r.length == 5
        r = c.append("obj", 5, b"data", crc=123)
        assert r.code is ErrorCode.CHECKSUM_MISMATCH
        assert c.call(ev.Fence(c.rid(), 3)) == ev.FenceOk(c.conn._next_id, 3)
        r = c.call(ev.Fence(c.rid(), 2))
        assert r.code is ErrorCode.FENCED and r.length == 3
        r = c.append("obj", 5, b" world", epoch=2)
        assert r.code is ErrorCode.FENCED and r.length == 3
        assert c.append("obj", 5, b" world", epoch=3).length == 11
        assert c.call(ev.Seal(c.rid(), "obj", 3)).length == 11
        r = c.append("obj", 11, b"!", epoch=3)
        assert r.code is ErrorCode.SEALED
        # a PING whose payload is over 64 bytes (the codec refuses to build one: raw bytes)
        body = struct.pack(">I", 65) + b"x" * 65
        c.send_raw(frame(0x03, 4242, body_len=len(body)) + body)
        raw = c.sock.recv(1 << 16)
        rid, code = _error_of(raw)
        assert rid == 4242 and code in (ErrorCode.BAD_REQUEST, ErrorCode.BAD_FRAME)
        del other_key

    with RawClient(srv.address) as c:  # read key
        assert isinstance(c.login(srv.read_key, NS), ev.AuthOk)
        r = c.append("obj2", 0, b"x")
        assert r.code is ErrorCode.FORBIDDEN
        assert c.read("obj") == b"hello world"
        assert c.stat("obj") == ev.StatOk(c.conn._next_id, 11, True)


def test_unknown_opcode_is_answered_and_connection_survives(srv, bystander):
    with RawClient(srv.address) as c:
        assert isinstance(c.login(srv.key, NS), ev.AuthOk)
        c.send_raw(frame(0x42, 99, body_len=5) + b"hello")
        # the codec of a client would refuse an ERROR for an id it never sent: read raw
        raw = c.sock.recv(1 << 16)
        assert _error_of(raw) == (99, ErrorCode.UNKNOWN_OP)
        from sos_wire.connection import Connection, Role

        c.conn = Connection(Role.CLIENT)
        assert isinstance(c.call(ev.Ping(c.rid(), b"alive")), ev.Pong)


@pytest.mark.parametrize(
    "case",
    ["over_cap", "length_lies_short", "length_lies_long_then_eof", "bad_magic", "bad_crc", "id_zero", "reply_op"],
)
def test_broken_frames_get_an_error_then_close(srv, bystander, case):
    with RawClient(srv.address) as c:
        assert isinstance(c.login(srv.key, NS), ev.AuthOk)
        name = "victim"
        if case == "over_cap":
            c.send_raw(frame(0x06, 7, body_len=DEFAULT_MAX_BODY + 1))  # no body needed: refused on the header
            want = ErrorCode.TOO_LARGE
        elif case == "length_lies_short":
            body = struct.pack(">H", len(name)) + name.encode() + struct.pack(">QQII", 0, 0, crc32c(b"abc"), 3) + b"abc"
            c.send_raw(frame(0x06, 7, body_len=len(body) - 2) + body)  # claims 2 bytes less than it sends
            want = ErrorCode.BAD_FRAME
        elif case == "length_lies_long_then_eof":
            c.send_raw(frame(0x03, 7, body_len=1000) + b"short")
            c.sock.shutdown(socket.SHUT_WR)
            want = ErrorCode.BAD_FRAME
        elif case == "bad_magic":
            c.send_raw(b"GET / HTTP/1.1\r\n\r\n")
            want = ErrorCode.BAD_FRAME
        elif case == "bad_crc":
            h = bytearray(frame(0x03, 7, body_len=4))
            h[-1] ^= 0xFF
            c.send_raw(bytes(h) + bytes(4))
            want = ErrorCode.BAD_FRAME
        elif case == "id_zero":
            c.send_raw(frame(0x03, 0, body_len=4) + bytes(4))
            want = ErrorCode.BAD_FRAME
        else:
            c.send_raw(frame(0x86, 7, body_len=8) + bytes(8))  # a reply sent to the server
            want = ErrorCode.BAD_FRAME
        raw = c.recv_raw_until_eof()  # the server closes after the ERROR
        assert _error_of(raw)[1] == want
    with RawClient(srv.address) as c:
        assert isinstance(c.login(srv.key, NS), ev.AuthOk)
        r = c.stat("victim")
        assert isinstance(r, ev.Error) and r.code is ErrorCode.NOT_FOUND  # nothing landed


def test_keygen_and_gc_commands(tmp_path, sos_server_factory):
    data = tmp_path / "d"
    out = server_cli("keygen", "--data", str(data), "tenant", "--role", "append")
    assert out.returncode == 0, out.stderr
    key = out.stdout.strip()
    Key.parse(key)
    bad = server_cli("keygen", "--data", str(data), "Bad/NS", "--role", "append")
    assert bad.returncode != 0 and "namespace" in bad.stderr

    srv = sos_server_factory(data_dir=data)
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, "tenant"), ev.AuthOk)
        for g in (1, 2, 3):
            assert c.append(f"gen/{g:010d}/0000000001-0000000001.seg", 0, b"seg").length == 3
            assert c.append(f"gen/{g:010d}/ready", 0, b"").length == 0
            assert isinstance(c.call(ev.Seal(c.rid(), f"gen/{g:010d}/ready", 0)), ev.SealOk)  # complete
        assert c.append("other/keep", 0, b"k").length == 1
    # gc refuses while the server holds the data directory
    busy = server_cli("gc", "--data", str(data), "--keep-generations", "1", "--min-age", "0s")
    assert busy.returncode == 1 and "in use" in busy.stderr
    srv.stop()
    gc = server_cli("gc", "--data", str(data), "--keep-generations", "2", "--min-age", "0s")
    assert gc.returncode == 0, gc.stderr
    assert "removed tenant/gen/0000000001/ready" in gc.stdout
    srv.start()
    with RawClient(srv.address) as c:
        c.login(key, "tenant")
        names = [e.name for e in c.call(ev.List(c.rid(), "", "", 100)).entries]
        assert names == [
            "gen/0000000002/0000000001-0000000001.seg",
            "gen/0000000002/ready",
            "gen/0000000003/0000000001-0000000001.seg",
            "gen/0000000003/ready",
            "other/keep",
        ]


def test_serve_retention_runs_inside_the_server(sos_server_factory):
    srv = sos_server_factory(args=["--keep-generations", "1", "--min-age", "0s", "--gc-interval", "3600"], start=False)
    key = srv.keygen("r", "append")
    srv.start()
    with RawClient(srv.address) as c:
        c.login(key, "r")
        for g in (1, 2):
            c.append(f"gen/{g:010d}/a.seg", 0, b"x")
            c.append(f"gen/{g:010d}/ready", 0, b"")
            assert isinstance(c.call(ev.Seal(c.rid(), f"gen/{g:010d}/ready", 0)), ev.SealOk)  # complete
    srv.restart()  # retention runs at start-up, then every --gc-interval
    with RawClient(srv.address) as c:
        c.login(key, "r")
        names = [e.name for e in c.call(ev.List(c.rid(), "gen/", "", 100)).entries]
        assert names == ["gen/0000000002/a.seg", "gen/0000000002/ready"]


def test_metrics_endpoint_shows_counters(srv):
    with RawClient(srv.address) as c:
        c.login(srv.key, NS)
        for i in range(5):
            assert c.append("m", i * 3, b"abc").length == (i + 1) * 3
        assert c.append("m", 0, b"zzz").code is ErrorCode.OFFSET_MISMATCH
        with urllib.request.urlopen(f"http://{srv.metrics_address}/metrics", timeout=60) as resp:
            text = resp.read().decode()
    lines = {ln.split(" ")[0]: ln.split(" ")[1] for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert float(lines["sos_appends_total"]) == 5
    assert float(lines["sos_append_bytes_total"]) == 15
    assert float(lines['sos_errors_total{code="OFFSET_MISMATCH"}']) == 1
    assert float(lines["sos_open_connections"]) >= 1
    assert float(lines["sos_sync_seconds_count"]) >= 1


def test_max_connections_answers_busy(sos_server_factory):
    # authenticated holders: unauthenticated ones would be evicted for the newcomer (issue 17
    # item 5: tests/server/test_limits.py)
    srv = sos_server_factory(args=["--max-connections", "2"])
    key = srv.keygen(NS, "append")
    a, b = RawClient(srv.address), RawClient(srv.address)
    try:
        for c in (a, b):  # make sure both are accepted and counted
            assert isinstance(c.login(key, NS), ev.AuthOk)
        with RawClient(srv.address) as third:
            raw = third.recv_raw_until_eof()
            assert _error_of(raw) == (0, ErrorCode.BUSY)
            assert b"all authenticated" in raw
    finally:
        a.close()
        b.close()
    # capacity comes back once connections close (the server notices EOF on its own time)
    deadline = time.monotonic() + 60
    while True:
        with RawClient(srv.address) as c:
            try:
                if isinstance(c.call(ev.Ping(c.rid(), b"")), ev.Pong):
                    break
            except EOFError:
                pass
        assert time.monotonic() < deadline, "connection slots never came back"
        time.sleep(0.1)


def test_sigterm_stops_cleanly_and_data_is_kept(srv):
    with RawClient(srv.address) as c:
        c.login(srv.key, NS)
        assert c.append("t", 0, b"durable").length == 7
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    assert '"stopped"' in srv.log_text() or "stopped" in srv.log_text()
    srv.start()
    with RawClient(srv.address) as c:
        c.login(srv.key, NS)
        assert c.read("t") == b"durable"


def test_serve_usage_errors(tmp_path):
    r = server_cli("serve", "--data", str(tmp_path), "--listen", "nope")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr


def test_corrupt_byte_in_the_middle_answers_corrupt(srv):
    from sos_server.storage import FRAME_HDR, encode_header, object_file_name

    with RawClient(srv.address) as c:
        c.login(srv.key, NS)
        for i, ch in enumerate(b"xyz"):
            assert c.append("damaged", i * 1000, bytes([ch]) * 1000).length == (i + 1) * 1000
    srv.stop()
    h2, h = object_file_name("damaged")
    path = os.path.join(srv.data_dir, "ns", NS, "objects", h2, h)
    bad_frame = len(encode_header("damaged")) + FRAME_HDR + 1000
    with open(path, "r+b") as f:
        f.seek(bad_frame + FRAME_HDR + 500)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    srv.start()
    with RawClient(srv.address) as c:
        c.login(srv.key, NS)
        assert c.stat("damaged").length == 3000  # nothing cut
        r = c.read("damaged")
        assert isinstance(r, ev.Error) and r.code is ErrorCode.CORRUPT
        assert "damaged" in r.message and str(bad_frame) in r.message
        assert c.read("damaged", 2000, 1000) == b"z" * 1000  # other frames still readable
        assert c.read("damaged", 0, 1000) == b"x" * 1000
        assert isinstance(c.call(ev.Ping(c.rid(), b"")), ev.Pong)


def test_tls_listener(tmp_path, sos_server_factory):
    import ssl

    cert, keyf = self_signed_cert(tmp_path, cn="127.0.0.1")
    srv = sos_server_factory(args=["--tls-cert", cert, "--tls-key", keyf], start=False)
    key = srv.keygen("tls")
    srv.start()
    ctx = ssl.create_default_context(cafile=str(cert))
    host, port = srv.host_port
    raw = socket.create_connection((host, port), timeout=60)
    with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        c = RawClient(None, sock=tls)
        assert isinstance(c.login(key, "tls"), ev.AuthOk)
        assert c.append("over-tls", 0, b"secret").length == 6
        assert c.read("over-tls") == b"secret"
        blob = os.urandom(3 << 20)  # READ_DATA frames sent in pieces (the send timeout's steps)
        assert c.append("big-over-tls", 0, blob).length == len(blob)
        assert c.read("big-over-tls") == blob
    # a plaintext client gets nowhere and the server keeps serving TLS
    with socket.create_connection((host, port), timeout=60) as plain:
        plain.sendall(frame(0x03, 1, body_len=4) + bytes(4))
        try:
            data = plain.recv(100)
        except ConnectionResetError:
            data = b""
        assert not data.startswith(b"SO")


def test_address_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        r = server_cli("serve", "--data", str(tmp_path), "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 1
    assert f"sos-server: cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr


def test_second_server_on_the_same_data_dir_is_refused(srv):
    r = server_cli("serve", "--data", srv.data_dir, "--listen", "127.0.0.1:0")
    assert r.returncode == 1 and "in use by another sos-server" in r.stderr


def test_torn_tail_is_cut_back_at_restart(srv):
    from sos_server.storage import FRAME, object_file_name

    with RawClient(srv.address) as c:
        c.login(srv.key, NS)
        assert c.append("torn", 0, b"A" * 500).length == 500
        assert c.append("torn", 500, b"B" * 300).length == 800
    srv.kill()
    h2, h = object_file_name("torn")
    path = os.path.join(srv.data_dir, "ns", NS, "objects", h2, h)
    whole = os.path.getsize(path)
    with open(path, "ab") as f:  # a frame that was being written when the power went
        f.write(FRAME.pack(4000, crc32c(b"C" * 4000)) + b"C" * 1234)
    srv.start()
    assert os.path.getsize(path) == whole
    assert "torn tail cut back" in srv.log_text()
    with RawClient(srv.address) as c:
        c.login(srv.key, NS)
        assert c.stat("torn").length == 800
        assert c.read("torn") == b"A" * 500 + b"B" * 300
        assert c.append("torn", 800, b"C").length == 801  # appends continue at the cut


def _one_line_error(r, status: int, *words: str) -> str:
    """The command failed with *status* and said so in one ``sos-server:`` line."""
    assert r.returncode == status, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("sos-server: ")]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_gc_refuses_a_data_dir_that_is_a_file_missing_or_not_a_data_dir(tmp_path):
    gc = ("gc", "--keep-generations", "1", "--min-age", "0s", "--data")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    _one_line_error(server_cli(*gc, a_file), 1, str(a_file), "not a directory")
    missing = tmp_path / "mistyped"
    _one_line_error(server_cli(*gc, missing), 1, str(missing), "does not exist")
    assert not missing.exists()  # not created
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    _one_line_error(server_cli(*gc, unrelated), 1, str(unrelated), "not an sos-server data directory")
    assert list(unrelated.iterdir()) == []  # no LOCK left behind


def test_serve_refuses_a_data_dir_that_is_a_file(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    _one_line_error(server_cli("serve", "--data", a_file, "--listen", "127.0.0.1:0"), 1, str(a_file))


def test_serve_refuses_a_damaged_fence_file_in_one_line(tmp_path):
    data = tmp_path / "data"
    Storage(str(data)).keygen("tenant", "append")
    (data / "ns" / "tenant" / "fence").write_bytes(b"7\x00garbage")
    r = server_cli("serve", "--data", data, "--listen", "127.0.0.1:0")
    _one_line_error(r, 1, str(data / "ns" / "tenant" / "fence"), "damaged")
    r = server_cli("gc", "--data", data, "--keep-generations", "1", "--min-age", "0s")
    _one_line_error(r, 1, "fence")


def test_serve_option_pairs_are_usage_errors(tmp_path):
    r = server_cli("serve", "--data", tmp_path, "--listen", "127.0.0.1:0", "--tls-cert", tmp_path / "c.pem")
    _one_line_error(r, 2, "--tls-cert and --tls-key")
    r = server_cli("serve", "--data", tmp_path, "--listen", "127.0.0.1:0", "--keep-generations", "2")
    _one_line_error(r, 2, "--keep-generations and --min-age")
    r = server_cli("serve", "--data", tmp_path, "--listen", "127.0.0.1:0", "--handshake-timeout", "soon")
    assert r.returncode == 2 and "bad duration" in r.stderr
