"""Fuzzing a real ``sos-server`` process over real sockets (hypothesis).

Each example opens a connection -- unauthenticated, authenticated with an append key or
a read key, or after a failed AUTH -- and sends a random mix of well-formed requests with
hostile field values, mutated frames, frames with random opcodes and bodies, and plain
garbage, cut into random pieces; then half-closes and reads every reply until the server
closes. Afterwards:

- the server never crashed: the process runs and a fresh connection gets PONG (checked
  after every example);
- no acknowledged byte changed: objects written before the fuzzing read back identical,
  and so does every APPEND the fuzzer itself got an APPEND_OK for (what the server saw
  is decoded from the sent bytes by the same codec, so a mutated frame that happened to
  be a valid append is accounted for);
- memory stays bounded: the server's RSS grows by less than 100 MB; and a client that
  announces huge bodies and never sends them does not make the server allocate them.

``derandomize=True``: the same examples on every run (CI must be deterministic).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections import defaultdict, deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sos_client import Client
from sos_server.session import PRE_AUTH_MAX_BODY
from sos_wire import events as ev
from sos_wire.auth import Key
from sos_wire.connection import NEED_DATA, Connection, Role, encode_event
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode, RemoteProtocolError
from sos_wire.frames import DEFAULT_MAX_BODY
from tests.server.support import rss

pytestmark = [pytest.mark.hostile]

NS = "fuzz"
OTHER_NS = "fuzz-other"
TIMEOUT = 60
RSS_SLACK = 100 << 20
EXAMPLES = 150

U32 = st.integers(0, 0xFFFFFFFF)
U64 = st.one_of(st.sampled_from([0, 1, 2, 5, 1 << 32, (1 << 64) - 1]), st.integers(0, (1 << 64) - 1))
NAMES = st.one_of(
    st.sampled_from(
        [
            "keep/a",
            "keep/sealed",
            "f/1",
            "f/2",
            "f/3",
            "../keep/a",
            "../" + OTHER_NS + "/iso",
            "/keep/a",
            "keep//a",
            "keep/./a",
            "",
            ".",
            "a" * 1025,
            "b/" * 600,
            "\x00",
            "é/ü",
        ]
    ),
    st.from_regex(r"[a-z]{1,3}/[A-Za-z0-9._=+-]{1,12}", fullmatch=True),
    st.text(max_size=40),
)
DATA = st.binary(max_size=2048)


FENCE_EPOCH = 4  # the fixture fences the namespace at this epoch


def _answered(shadow, request_id: int) -> None:
    """The real server answers every request; the shadow parser is told so through its
    public send (an ERROR reply ends a request), so a reused id is never flagged here."""
    shadow.send(ev.Error(request_id, ErrorCode.INTERNAL, 0, ""))


@st.composite
def appends(draw):
    name, data = draw(NAMES), draw(DATA)
    offset = draw(st.one_of(st.sampled_from([0, 0, 0, 100, 1 << 63]), U64))
    crc = crc32c(data) if draw(st.booleans()) or draw(st.booleans()) else draw(U32)
    epoch = draw(st.one_of(st.sampled_from([4, 5, (1 << 64) - 1]), st.sampled_from([4, 9]), st.integers(0, 4), U64))
    return ev.Append(0, name, offset, epoch, crc, data)


@st.composite
def good_appends(draw):
    """Appends that can land (fresh valid name, offset 0, right CRC, the fence's epoch 4)."""
    name = draw(st.from_regex(r"g/[A-Za-z0-9._=+-]{1,16}", fullmatch=True))
    data = draw(st.binary(min_size=1, max_size=4096))
    return ev.Append(0, name, 0, 4, crc32c(data), data)


REQUESTS = st.one_of(
    good_appends(),
    st.builds(ev.Hello, st.just(0), st.text(max_size=20), st.integers(0, 255), st.integers(0, 255)),
    st.builds(
        ev.Auth,
        st.just(0),
        st.binary(min_size=8, max_size=8),
        st.sampled_from([NS, OTHER_NS, "", "X"]),
        st.binary(min_size=32, max_size=32),
    ),
    st.builds(ev.Ping, st.just(0), st.binary(max_size=80)),
    st.builds(
        ev.List,
        st.just(0),
        st.one_of(st.sampled_from(["", "keep/", "../", "f"]), st.text(max_size=10)),
        st.text(max_size=10),
        U32,
    ),
    st.builds(ev.Stat, st.just(0), NAMES),
    appends(),
    appends(),
    st.builds(ev.Read, st.just(0), NAMES, U64, U64),
    st.builds(ev.Seal, st.just(0), NAMES, U64),
    # the fixture fences at 4: these FENCEs are all refused, so appends with epoch 4 land
    st.builds(ev.Fence, st.just(0), st.integers(0, 4)),
)


def _frame(opcode: int, rid: int, body: bytes, body_len: int | None = None) -> bytes:
    h = b"SO" + bytes([1, opcode]) + struct.pack(">II", rid, len(body) if body_len is None else body_len)
    return h + struct.pack(">I", crc32c(h)) + body


@st.composite
def actions(draw):
    kind = draw(st.sampled_from(["event"] * 8 + ["mutated", "frame", "garbage", "header"]))
    if kind in ("event", "mutated"):
        e = draw(REQUESTS)
        rid = draw(st.one_of(st.just(None), st.just(None), U32))  # None: a fresh id
        return (
            kind,
            e,
            rid,
            (
                draw(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4))
                if kind == "mutated"
                else None
            ),
        )
    if kind == "frame":
        return kind, draw(st.integers(0, 255)), draw(U32), draw(st.binary(max_size=300))
    if kind == "header":  # a valid header whose length lies about the body that follows
        return (
            kind,
            draw(st.sampled_from([0x03, 0x05, 0x06, 0x07])),
            draw(U32),
            (
                draw(st.one_of(st.integers(0, 64), st.integers(0, DEFAULT_MAX_BODY + 10), U32)),
                draw(st.binary(max_size=100)),
            ),
        )
    return kind, draw(st.binary(min_size=1, max_size=200)), None, None


class Fuzzee:
    """The server under fuzz and what it acknowledged."""

    def __init__(self, srv) -> None:
        self.srv = srv
        self.host, port = srv.address.rsplit(":", 1)
        self.port = int(port)
        self.key = Key.parse(srv.keygen(NS, "append"))
        self.read_key = Key.parse(srv.keygen(NS, "read"))
        self.other_key = srv.keygen(OTHER_NS, "append")
        self.acked: list[tuple[str, int, bytes]] = []  # appends the fuzzer got APPEND_OK for
        self.stats = defaultdict(int)
        self.anchors = 0  # known-good appends that open each run in append mode

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=TIMEOUT)

    def ping_fresh(self) -> None:
        assert self.srv.running(), "sos-server died"
        with self.connect() as s:
            conn = Connection(Role.CLIENT)
            s.sendall(conn.send(ev.Ping(conn.next_request_id(), b"alive?")))
            while (e := conn.next_event()) is NEED_DATA:
                data = s.recv(4096)
                assert data, "server closed a fresh connection instead of answering PING"
                conn.receive_data(data)
            assert e.payload == b"alive?"

    def login(self, s: socket.socket, mode: str) -> int:
        """HELLO (+ AUTH) on *s*; returns the next free request id."""
        conn = Connection(Role.CLIENT)
        s.sendall(conn.send(ev.Hello(1, "fuzz", 1, 1)))
        while (hello := conn.next_event()) is NEED_DATA:
            conn.receive_data(s.recv(4096))
        key = {"append": self.key, "read": self.read_key}.get(mode) or Key.generate()
        s.sendall(conn.send(ev.Auth(2, key.key_id, NS, key.proof(hello.nonce, NS))))
        while (auth := conn.next_event()) is NEED_DATA:
            conn.receive_data(s.recv(4096))
        assert isinstance(auth, ev.AuthOk) == (mode in ("append", "read")), auth
        return 3

    def run(self, mode: str, steps, piece: int) -> None:
        s = self.connect()
        try:
            rid = self.login(s, mode) if mode != "none" else 1
            stream = bytearray()
            if mode == "append":
                # one append that must land opens every authenticated run, so that "appends got
                # through the fuzz" does not hang on what a hypothesis version happens to draw
                self.anchors += 1
                data = b"anchor %d" % self.anchors
                stream += encode_event(ev.Append(rid, f"anchor/{self.anchors}", 0, FENCE_EPOCH, crc32c(data), data))
                rid += 1
            for kind, a, b, c in steps:
                if kind in ("event", "mutated"):
                    e = type(a)(
                        b if b is not None else rid,
                        *(getattr(a, f) for f in a.__dataclass_fields__ if f != "request_id"),
                    )
                    rid += 1
                    try:
                        raw = bytearray(encode_event(e))
                    except Exception:  # a value the codec cannot encode (e.g. a 70 KiB name)
                        continue
                    for pos, val in c or ():
                        raw[pos % len(raw)] = val
                    stream += raw
                elif kind == "frame":
                    stream += _frame(a, b, c)
                elif kind == "header":
                    stream += _frame(a, b, c[1], body_len=c[0])
                else:
                    stream += a
            self.stats[mode] += 1
            piece = max(piece, len(stream) // 300)  # byte-by-byte only for short streams
            try:
                for i in range(0, len(stream), piece):
                    s.sendall(stream[i : i + piece])
                s.shutdown(socket.SHUT_WR)
            except OSError:  # EPIPE, ECONNRESET, ENOTCONN: the server closed on a broken frame
                pass
            replies = bytearray()
            try:
                while data := s.recv(1 << 20):
                    replies += data
            except ConnectionResetError:
                pass
        finally:
            s.close()
        self._account(bytes(stream), bytes(replies), rid_base=3 if mode != "none" else 1)

    def _account(self, sent: bytes, replies: bytes, rid_base: int) -> None:
        """Decode what the server saw (same codec) and record every acknowledged append."""
        shadow = Connection(Role.SERVER)
        # the login frames were already consumed by the real server: mirror only the fuzz bytes
        shadow.receive_data(sent)
        shadow.receive_data(b"")
        # every request the server saw, by request id, in order (placeholders for skipped frames)
        by_rid: dict[int, deque] = defaultdict(deque)
        while True:
            try:
                e = shadow.next_event()
            except RemoteProtocolError as exc:
                if exc.fatal:
                    break
                by_rid[exc.request_id].append(None)
                _answered(shadow, exc.request_id)
                continue
            if e is NEED_DATA:
                break
            by_rid[e.request_id].append(e)
            _answered(shadow, e.request_id)
        pos = 0
        while pos + 16 <= len(replies):
            op = replies[pos + 3]
            rid, n = struct.unpack_from(">II", replies, pos + 4)
            body = replies[pos + 16 : pos + 16 + n]
            pos += 16 + n
            self.stats[f"reply_{op:#x}"] += 1
            if op == 0x87 and len(body) > 8 and body[8] == 0:
                continue  # a READ_DATA that is not the last one
            if not by_rid.get(rid):
                continue  # a connection-level error (id 0) or the answer to a fatal frame
            req = by_rid[rid].popleft()
            if op == 0x86:
                assert isinstance(req, ev.Append), (req, rid)
                (length,) = struct.unpack(">Q", body)
                assert length == req.offset + len(req.data), (req, length)
                self.acked.append((req.name, req.offset, req.data))


@pytest.fixture
def fuzzee(sos_server):
    f = Fuzzee(sos_server)
    with Client(sos_server.address, str(f.key), NS, timeout=TIMEOUT) as c:
        f.keep = {"keep/a": os.urandom(100_000), "keep/sealed": os.urandom(5000)}
        assert c.fence(FENCE_EPOCH) == FENCE_EPOCH  # APPEND and SEAL must carry the fence's epoch
        for name, data in f.keep.items():
            c.append_many(name, 0, [data], epoch=4)
        c.seal("keep/sealed", epoch=4)
    with Client(sos_server.address, f.other_key, OTHER_NS, timeout=TIMEOUT) as c:
        c.append("iso", 0, b"the other tenant")
    f.ping_fresh()
    return f


def test_fuzzed_frames_never_crash_the_server_or_change_acked_bytes(fuzzee):
    f = fuzzee
    rss_before = rss(f.srv.pid)

    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(
        mode=st.sampled_from(["none", "append", "append", "read", "wrong"]),
        steps=st.lists(actions(), min_size=1, max_size=12),
        piece=st.sampled_from([1, 7, 100, 4096, 1 << 20]),
    )
    def fuzz(mode, steps, piece):
        f.run(mode, steps, piece)
        f.ping_fresh()

    fuzz()

    # the fuzzing reached the server in every mode and got appends through
    assert all(f.stats[m] > 10 for m in ("none", "append", "read", "wrong")), dict(f.stats)
    assert len(f.acked) >= 10, f"too few fuzzed appends were acknowledged: {len(f.acked)} {dict(f.stats)}"
    with Client(f.srv.address, str(f.read_key), NS, timeout=TIMEOUT) as c:
        for name, data in f.keep.items():
            assert c.read(name, 0, len(data)) == data, name
        assert c.stat("keep/sealed") == (5000, True)
        for name, offset, data in f.acked:
            if data:
                assert c.read(name, offset, len(data)) == data, (name, offset)
            else:  # an empty append acknowledges that the object exists and reaches offset
                assert c.stat(name)[0] >= offset, (name, offset)
    with Client(f.srv.address, f.other_key, OTHER_NS, timeout=TIMEOUT) as c:
        assert [(e.name, e.length) for e in c.list()] == [("iso", 16)]
        assert c.read("iso") == b"the other tenant"
    assert rss(f.srv.pid) < rss_before + RSS_SLACK, (rss_before, rss(f.srv.pid))
    # everything fuzzed was closed by the server; the log shows no crash of a session
    assert "Traceback" not in f.srv.log_text()


def _server_rx_drained(port: int, expect: int) -> bool:
    """True when *expect* or more server-side sockets of *port* have nothing left unread."""
    n = 0
    with open("/proc/net/tcp") as fh:
        for line in list(fh)[1:]:
            parts = line.split()
            local, state, queues = parts[1], parts[3], parts[4]
            if int(local.split(":")[1], 16) != port or state != "01":
                continue
            if int(queues.split(":")[1], 16):
                return False
            n += 1
    return n >= expect


def test_announced_huge_bodies_are_not_allocated(fuzzee):
    f = fuzzee
    rss_before = rss(f.srv.pid)
    held = []
    try:
        for i in range(96):
            if i % 2:
                s = f.connect()
                held.append(s)
                f.login(s, "append")
                cap = DEFAULT_MAX_BODY
            else:  # unauthenticated: each from its own address (one address may hold only a few)
                s = socket.create_connection((f.host, f.port), timeout=TIMEOUT, source_address=(f"127.0.1.{i}", 0))
                held.append(s)
                cap = PRE_AUTH_MAX_BODY  # the cap before AUTH
            # the largest body the cap allows, announced; only a sliver of it ever sent
            s.sendall(_frame(0x06 if i % 2 else 0x03, 1000 + i, b"\x00\x04keep" + b"x" * 100, body_len=cap))
        deadline = time.monotonic() + TIMEOUT
        while not _server_rx_drained(f.port, len(held)):  # the server has read every byte we sent
            assert time.monotonic() < deadline, "the server never read what was sent"
            time.sleep(0.05)
        grown = rss(f.srv.pid) - rss_before
        # 96 x 8 MiB would be 800 MB if the announced lengths were allocated
        assert grown < RSS_SLACK, f"server RSS grew by {grown / 1e6:.0f} MB"
        f.ping_fresh()
        # over the cap: refused on the header, connection closed
        with f.connect() as s:
            s.sendall(_frame(0x06, 7, b"", body_len=0xFFFFFFFF))
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            assert data[3] == 0xFF and struct.unpack(">H", data[16:18])[0] == 13  # TOO_LARGE
    finally:
        for s in held:
            s.close()
    f.ping_fresh()
    with Client(f.srv.address, str(f.key), NS, timeout=TIMEOUT) as c:
        assert c.read("keep/a") == f.keep["keep/a"]
