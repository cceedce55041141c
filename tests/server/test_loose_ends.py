"""The spec's loose ends (issue 17): questions a client written from protocol.md alone had
to guess at. Each is settled by one rule in protocol.md, and each rule is provoked here
against the real thing: a real ``sos-server`` over raw sockets (Part 1), the ``sos``
command against it (Part 2), a real ``sos gateway`` over HTTP (Part 3)."""

from __future__ import annotations

import os
import struct
import time

import pytest

from sos_client import Client
from sos_journal import cli as jcli
from sos_journal.format import layout
from sos_journal.format.records import Create, Mkdir, SnapshotEnd, encode
from sos_wire import events as ev
from sos_wire.auth import Key
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from tests.conftest import RawClient
from tests.server.support import Wire
from tests.support import frame, run_sos_as, server_cli

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "protocol.md")
WAIT = 180
MAX_EPOCH = 9_999_999_999
U64_MAX = 2**64 - 1

NS = "table"


def closed(w: Wire) -> bool:
    """The server closed the connection (the next read is EOF or a reset)."""
    try:
        w.reply()
    except (EOFError, ConnectionResetError):
        return True
    return False


class Wires:
    """Fresh connections to one server (closed at the end of the test) and a key of NS."""

    def __init__(self, srv) -> None:
        self.srv = srv
        self.key = srv.keygen(NS, "append")
        self.made: list[Wire] = []

    def __call__(self) -> Wire:
        w = Wire(self.srv)
        self.made.append(w)
        return w


@pytest.fixture
def wire(server):
    wires = Wires(server)
    yield wires
    for w in wires.made:
        w.close()


# ---------------------------------------------------------------- 1.5/1.6: before AUTH


def test_an_unknown_opcode_is_unknown_op_before_hello_and_before_auth_too(wire):
    w = wire()
    w.sock.sendall(frame(0x42, 5, b"whatever"))  # before HELLO
    e = w.error()
    assert (e.code, e.request_id) == (ErrorCode.UNKNOWN_OP, 5), e
    assert w.is_open()
    w.hello()
    w.sock.sendall(frame(0x7F, 6, b""))  # after HELLO, before AUTH
    e = w.error()
    assert (e.code, e.request_id) == (ErrorCode.UNKNOWN_OP, 6), e
    rid = w.send(ev.Stat(w.rid(), "x"))  # a known request still needs AUTH
    e = w.error()
    assert (e.code, e.request_id) == (ErrorCode.NOT_AUTHENTICATED, rid), e
    assert w.is_open()


def test_an_auth_before_hello_is_not_authenticated_and_no_failed_auth(wire):
    w = wire()
    k = Key.parse(wire.key)
    for _ in range(5):  # more than the three failures that close a connection
        rid = w.send(ev.Auth(w.rid(), k.key_id, NS, bytes(32)))
        e = w.error()
        assert (e.code, e.request_id) == (ErrorCode.NOT_AUTHENTICATED, rid), e
    w.hello()
    for _ in range(2):  # two real failures: still open
        w.send(ev.Auth(w.rid(), k.key_id, NS, bytes(32)))
        assert w.error().code is ErrorCode.AUTH_FAILED
    rid = w.send(ev.Auth(w.rid(), k.key_id, NS, k.proof(w.nonce, NS)))
    assert w.reply() == ev.AuthOk(rid, ev.KeyRole.APPEND)
    # an AUTH after AUTH_OK is BAD_REQUEST and changes nothing
    rid = w.send(ev.Auth(w.rid(), k.key_id, NS, bytes(32)))
    e = w.error()
    assert (e.code, e.request_id) == (ErrorCode.BAD_REQUEST, rid), e
    rid = w.send(ev.Stat(w.rid(), "missing"))
    assert w.error().code is ErrorCode.NOT_FOUND


def test_a_ping_after_the_key_was_revoked_is_auth_failed_and_closes(wire, server):
    key = server.keygen(NS, "append")
    w = wire()
    w.login(key, NS)
    assert w.is_open()
    os.unlink(os.path.join(server.data_dir, "ns", NS, "keys", Key.parse(key).key_id.hex()))
    rid = w.send(ev.Ping(w.rid(), b"still there?"))
    e = w.error()
    assert (e.code, e.request_id) == (ErrorCode.AUTH_FAILED, rid), e
    assert "removed or changed" in e.message
    assert closed(w)
    # before AUTH a PING needs no key: it is answered whatever the keys
    w2 = wire()
    assert w2.is_open()


# ---------------------------------------------------------------- 1.7: versions


def test_a_hello_after_unsupported_version_gets_hello_ok_and_a_third_one_bad_request(wire):
    w = wire()
    rid = w.send(ev.Hello(w.rid(), "future", 2, 3))
    e = w.error()
    assert (e.code, e.request_id) == (ErrorCode.UNSUPPORTED_VERSION, rid), e
    w.hello()  # the connection is as before HELLO: this one is answered HELLO_OK
    rid = w.send(ev.Hello(w.rid(), "again", 1, 1))
    e = w.error()
    assert (e.code, e.request_id) == (ErrorCode.BAD_REQUEST, rid), e
    k = Key.parse(wire.key)  # the nonce of the HELLO_OK stands
    rid = w.send(ev.Auth(w.rid(), k.key_id, NS, k.proof(w.nonce, NS)))
    assert w.reply() == ev.AuthOk(rid, ev.KeyRole.APPEND)


@pytest.mark.parametrize("versions", [(1, 0), (2, 1), (255, 0)])
def test_a_hello_with_min_above_max_is_unsupported_version_and_stays_open(wire, versions):
    w = wire()
    rid = w.send(ev.Hello(w.rid(), "odd", *versions))
    e = w.error()
    assert (e.code, e.request_id) == (ErrorCode.UNSUPPORTED_VERSION, rid), e
    assert w.is_open()
    w.hello()


@pytest.mark.parametrize("opcode", [0x01, 0x03], ids=["HELLO", "PING"])
def test_a_version_2_frame_before_hello_is_unsupported_version_and_closes(wire, opcode):
    w = wire()
    body = struct.pack(">H", 4) + b"next" + bytes([1, 2]) if opcode == 0x01 else struct.pack(">I", 0)
    w.sock.sendall(frame(opcode, 9, body, version=2))
    e = w.error()
    assert (e.code, e.request_id) == (ErrorCode.UNSUPPORTED_VERSION, 9), e
    assert closed(w)


def test_header_checks_come_in_the_order_of_1_3(wire):
    w = wire()  # version before body_len: a version-2 header announcing 4 GiB
    w.sock.sendall(frame(0x03, 9, b"", version=2, body_len=2**32 - 1))
    assert (w.error().code, closed(w)) == (ErrorCode.UNSUPPORTED_VERSION, True)
    w = wire()  # header_crc before version
    h = bytearray(frame(0x03, 9, b"", version=2, body_len=4))
    h[15] ^= 0xFF
    w.sock.sendall(bytes(h))
    e = w.error()
    assert (e.code, e.request_id, closed(w)) == (ErrorCode.BAD_FRAME, 0, True)
    w = wire()  # body_len before the request id
    w.sock.sendall(frame(0x03, 0, b"", body_len=4097))
    e = w.error()
    assert (e.code, e.request_id, closed(w)) == (ErrorCode.TOO_LARGE, 0, True)


# ---------------------------------------------------------------- 1.11: SEAL, ready, FENCE


def _call(w: Wire, event):
    w.send(event)
    return w.reply()


def test_seal_checks_its_epoch_first_also_on_a_sealed_object(wire, server):
    w = wire()
    w.login(wire.key, NS)
    # this test's own objects: the module's namespace may be fenced by another test
    fence = _call(w, ev.Fence(w.rid(), 0)).length
    e = fence + 1
    assert isinstance(_call(w, ev.Fence(w.rid(), e)), ev.FenceOk)
    data = b"sealed data"
    assert _call(w, ev.Append(w.rid(), "s/obj", 0, e, crc32c(data), data)).length == len(data)
    assert _call(w, ev.Seal(w.rid(), "s/obj", e)) == ev.SealOk(w.next_id, len(data))
    assert _call(w, ev.Seal(w.rid(), "s/obj", e)) == ev.SealOk(w.next_id, len(data))  # idempotent
    assert isinstance(_call(w, ev.Fence(w.rid(), e + 1)), ev.FenceOk)
    for name in ("s/obj", "s/missing"):  # stale epoch: FENCED before SEAL_OK, before NOT_FOUND
        r = _call(w, ev.Seal(w.rid(), name, e))
        assert (r.code, r.length) == (ErrorCode.FENCED, e + 1), r
    r = _call(w, ev.Seal(w.rid(), "s/missing", e + 1))
    assert r.code is ErrorCode.NOT_FOUND, r
    r = _call(w, ev.Seal(w.rid(), "s/../x", e))  # the name before the epoch
    assert r.code is ErrorCode.BAD_NAME, r
    reader = wire()
    reader.login(server.keygen(NS, "read"), NS)
    r = _call(reader, ev.Seal(reader.rid(), "s/obj", e))  # the role before everything
    assert r.code is ErrorCode.FORBIDDEN, r


def test_data_for_ready_is_checked_after_crc_and_epoch_and_before_the_object(sos_server):
    srv = sos_server
    key = srv.keygen("ready", "append")
    ready = layout.ready_name(1)
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, "ready"), ev.AuthOk)
        assert c.call(ev.Fence(c.rid(), 1)).epoch == 1
        r = c.append(ready, 0, b"x", epoch=1, crc=crc32c(b"x") ^ 1)
        assert r.code is ErrorCode.CHECKSUM_MISMATCH, r
        r = c.append(ready, 0, b"x", epoch=0)
        assert (r.code, r.length) == (ErrorCode.FENCED, 1), r
        r = c.append(ready, 0, b"x", epoch=1)  # no such object yet: still BAD_REQUEST
        assert r.code is ErrorCode.BAD_REQUEST, r
        assert c.append(ready, 0, b"", epoch=1).length == 0  # empty: created
        assert c.call(ev.Seal(c.rid(), ready, 1)).length == 0
        r = c.append(ready, 0, b"x", epoch=1)  # sealed: BAD_REQUEST, not SEALED
        assert r.code is ErrorCode.BAD_REQUEST, r
        r = c.append(ready, 0, b"", epoch=1)  # an empty append goes on to the other rules
        assert r.code is ErrorCode.SEALED, r


def test_fence_at_the_top_of_the_epoch_range(sos_server):
    srv = sos_server
    key = srv.keygen("top", "append")
    srv.stop()
    out = server_cli("reset-fence", "--data", srv.data_dir, "top", "--epoch", str(MAX_EPOCH - 5), timeout=WAIT)
    assert out.returncode == 0, out.stderr
    srv.start()
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, "top"), ev.AuthOk)
        r = c.call(ev.Fence(c.rid(), MAX_EPOCH + 1))  # below the top: the highest it can set
        assert (r.code, r.length) == (ErrorCode.TOO_LARGE, MAX_EPOCH), r
        assert c.call(ev.Fence(c.rid(), MAX_EPOCH)).epoch == MAX_EPOCH
        for epoch in (MAX_EPOCH - 1, MAX_EPOCH):
            r = c.call(ev.Fence(c.rid(), epoch))
            assert (r.code, r.length) == (ErrorCode.FENCED, MAX_EPOCH), r
        for epoch in (MAX_EPOCH + 1, U64_MAX):
            r = c.call(ev.Fence(c.rid(), epoch))
            assert (r.code, r.length) == (ErrorCode.TOO_LARGE, MAX_EPOCH), r
            assert "reset-fence" in r.message


def test_a_restarted_server_drops_a_cut_append_and_takes_its_resend(sos_server):
    from sos_server.storage import FRAME, object_file_name

    srv = sos_server
    key = srv.keygen("cut", "append")
    with RawClient(srv.address) as c:
        c.login(key, "cut")
        assert c.append("obj", 0, b"A" * 500).length == 500
    srv.kill()
    h2, h = object_file_name("obj")
    path = os.path.join(srv.data_dir, "ns", "cut", "objects", h2, h)
    cut = b"B" * 4000  # the append that was being written when the server died
    with open(path, "ab") as f:
        f.write(FRAME.pack(len(cut), crc32c(cut)) + cut[:1234])
    srv.start()
    with RawClient(srv.address) as c:
        c.login(key, "cut")
        assert c.call(ev.Stat(c.rid(), "obj")).length == 500  # the cut bytes are not counted
        assert c.append("obj", 500, cut).length == 4500  # the writer's re-send lands whole
        assert c.read("obj") == b"A" * 500 + cut


# ---------------------------------------------------------------- Part 2: the sos command


T0 = 1_763_900_000_000_000_000


def _records(*ops_from_seq: tuple[int, object]) -> bytes:
    return b"".join(encode(op, seq, T0 + seq * 1000) for seq, op in ops_from_seq)


def _complete(c: Client, generation: int) -> None:
    c.append(layout.ready_name(generation), 0, b"")
    c.seal(layout.ready_name(generation))


def test_the_one_before_is_the_previous_generation_with_segments(server, tmp_path):
    ns = f"chain-{os.getpid()}"
    key = server.keygen(ns, "append")
    with Client(server.address, key, ns) as c:
        c.append(layout.segment_name(1, 1, 0), 0, _records((1, SnapshotEnd(1)), (2, Create("a"))))
        _complete(c, 1)
        c.append("gen/0000000002/notes", 0, b"not a journal object")  # generation 2: no segment
        # generation 3 starts with the record after generation 1's last one
        c.append(layout.segment_name(3, 3, 0), 0, _records((3, Create("a")), (4, SnapshotEnd(3))))
        _complete(c, 3)
    v = run_sos_as(server, key, "verify", "-q", ns)
    assert v.returncode == 3, (v.stdout, v.stderr)
    assert "generation 3 does not continue generation 1" in v.stdout
    r = run_sos_as(server, key, "restore", "-q", ns, str(tmp_path / "t"))
    assert r.returncode == 3 and "generation 3 does not continue generation 1" in r.stderr, r.stderr
    assert not (tmp_path / "t").exists()


def test_an_incomplete_generation_restore_names_its_first_record_verify_exits_0(server, tmp_path):
    ns = f"incomplete-{os.getpid()}"
    key = server.keygen(ns, "append")
    with Client(server.address, key, ns) as c:
        c.append(layout.segment_name(1, 1, 0), 0, _records((1, SnapshotEnd(1)), (2, Create("a"))))
        _complete(c, 1)
        # generation 2: snapshot (record 3), SNAPSHOT_END (4), then a journal record (5); no ready
        c.append(layout.segment_name(2, 3, 0), 0, _records((3, Create("a")), (4, SnapshotEnd(2)), (5, Create("b"))))
    r = run_sos_as(server, key, "restore", "-q", ns, str(tmp_path / "t"))
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path / "t")) == ["a"]
    warning = next(line for line in r.stderr.splitlines() if line.startswith("sos: warning:"))
    assert "generation 2 is not complete" in warning and "from record 3 on" in warning, warning
    v = run_sos_as(server, key, "verify", "-q", ns)
    assert v.returncode == 0, (v.stdout, v.stderr)
    assert "OK, 1 WARNING" in v.stdout
    assert "generation 2 is not complete but holds records 5..5 after its SNAPSHOT_END" in v.stdout
    assert "A generation that is not complete is\n      no problem" in jcli.VERIFY_EXIT_CODES


def test_the_root_checkpoint_is_written_empty_and_dot_is_the_same(server, tmp_path, capsys):
    from sos_client import cli

    ns = f"root-{os.getpid()}"
    key = server.keygen(ns, "append")
    with Client(server.address, key, ns) as c:
        c.append(
            layout.segment_name(1, 1, 0),
            0,
            _records((1, SnapshotEnd(1)), (2, Mkdir("commits")), (3, Create("commits/0")), (4, Create("later"))),
        )
        _complete(c, 1)
    for i, querydir in enumerate(("", ".")):
        target = tmp_path / f"t{i}"
        r = run_sos_as(server, key, "restore", "-q", "--batch", f"{querydir}:0", ns, str(target))
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(target)) == ["commits"], querydir
    assert cli.main(["restore", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "'' for the root itself: --batch :N, the same as --batch .:N" in out


# ---------------------------------------------------------------- Part 3: the gateway


@pytest.mark.slow
def test_the_first_step_of_a_write_to_a_leased_path_is_refused(sos_server, tmp_path):
    from tests.gateway.support import Gw, chunked_create, remote, send_chunk

    g = Gw(sos_server, tmp_path)
    try:
        s = g.session
        slow = chunked_create(g, "/l/f")  # a CREATE body streaming: /l/f holds the lease
        send_chunk(slow, b"first;")
        deadline = time.monotonic() + WAIT
        while s.get(g.u("/l/f", op="GETFILESTATUS")).status_code != 200:  # the lease is taken first
            assert time.monotonic() < deadline
            time.sleep(0.05)
        steps = [
            s.put(g.u("/l/f", op="CREATE", overwrite="true"), allow_redirects=False),
            s.put(g.u("/l/f", op="CREATE", overwrite="true", noredirect="true"), allow_redirects=False),
            s.post(g.u("/l/f", op="APPEND"), allow_redirects=False),
        ]
        for r in steps:
            assert r.status_code == 403 and remote(r)["exception"] == "AlreadyBeingCreatedException", r.text
        # reading is no writing: OPEN's first step is redirected
        assert s.get(g.u("/l/f", op="OPEN"), allow_redirects=False).status_code == 307
        send_chunk(slow, b"second")
        slow.send(b"0\r\n\r\n")
        assert slow.getresponse().status == 201
        slow.close()
        assert g.read("/l/f") == b"first;second"
        # the lease ended with the body: the first step is redirected again
        assert s.post(g.u("/l/f", op="APPEND"), allow_redirects=False).status_code == 307
    finally:
        assert g.stop() == 0


# ---------------------------------------------------------------- the text itself


def test_protocol_md_states_each_rule_once_without_the_old_contradictions():
    with open(DOC, encoding="utf-8") as f:
        text = " ".join(f.read().split())
    gone = [
        "A second HELLO or a second AUTH on the same connection is answered BAD_REQUEST",  # vs HELLO_OK
        "UNSUPPORTED_VERSION and the client should close",
        "After a crash the server MAY remove",
        "Sealing is idempotent: sealing a sealed object answers SEAL_OK again",  # vs epoch checked
        "naming the generation and the first record it leaves out",
        "unless a generation with segments is newer",
    ]
    for phrase in gone:
        assert phrase not in text, phrase
    said = [
        "This holds at any time, before HELLO and before AUTH too",
        "Only AUTHs answered AUTH_FAILED count as failed",
        "their next request, a PING too, is answered AUTH_FAILED",
        "A HELLO answered UNSUPPORTED_VERSION (1.7) leaves the connection as it was",
        "until HELLO_OK the negotiated version is 1",
        "also when `min_version > max_version`",
        "This holds for an object already sealed too",
        "At the top of the range (fence = 9,999,999,999) no FENCE passes",
        "After a crash the server MUST remove",
        "the generation *with segments* of the next lower number",
        "naming the generation and its first record",
        "its exit status stays 0",
        "`sos restore --batch :N` names the root's batch N",
        "a path being written answers 403 AlreadyBeingCreatedException at this step",
    ]
    for phrase in said:
        assert phrase in text, phrase
