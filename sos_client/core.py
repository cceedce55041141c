"""What the blocking and the trio client share: the protocol logic, written once.

Every operation is a generator over one ``sos_wire.Connection`` that yields
*commands* to its driver and gets results back:

* ``bytes``       -> the driver sends them; result None
* ``RECV``        -> the driver returns the next event received
* ``NEXT_CHUNK``  -> the driver returns the next chunk of the caller's data, or None at the end
* ``PROBE_TLS``   -> the driver returns whether the server completes a TLS handshake on a
  second connection (:func:`answers_tls`; only :meth:`Core.tls_refusal` asks)

The blocking client drives them with a socket, the trio client with a stream.
An operation raises only after it received every reply it asked for, so a
raised SOSError leaves the connection usable; if anything interrupts an
operation midway (``conn.in_flight != 0``) the driver drops the connection.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
from collections import deque
from collections.abc import Generator
from typing import Any, TypeVar, cast

from sos_client.errors import BadKey, BadNameError, ConnectionLost, Corrupt, SOSError, TooLarge, error_from_reply
from sos_wire import events as ev
from sos_wire.addresses import format_address, parse_address
from sos_wire.auth import Key, tls_server_end_point
from sos_wire.connection import Connection, Role
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.frames import DEFAULT_MAX_BODY, MAX_LIST_LIMIT, MAX_TIER_WAIT_MS, SUPPORTED_VERSIONS, VERSION
from sos_wire.names import BadName, validate_name, validate_namespace

__all__ = [
    "CLIENT_NAME",
    "DEFAULT_PORT",
    "DEFAULT_SERVER",
    "DEFAULT_WINDOW_BYTES",
    "DEFAULT_WINDOW_FRAMES",
    "NEXT_CHUNK",
    "PROBE_TLS",
    "READ_STEP",
    "RECV",
    "AppendJob",
    "ClientSettings",
    "Core",
    "Op",
    "answers_tls",
    "channel_binding_of",
    "parse_server",
    "readable_now",
    "resolve_tls",
    "settings_from_env",
    "tier_wait_ms",
]

DEFAULT_PORT = 7070
DEFAULT_SERVER = f"127.0.0.1:{DEFAULT_PORT}"
CLIENT_NAME = "sos-py/0.1"
#: bytes asked for per READ request by read_iter: bounds what a client holds at once
READ_STEP = 4 << 20
#: append_many keeps at most this many bytes / frames in flight
DEFAULT_WINDOW_BYTES = 8 << 20
DEFAULT_WINDOW_FRAMES = 256
#: small chunks are coalesced into appends of about this size
PIECE_TARGET = 1 << 20


class _Command:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


RECV = _Command("RECV")
NEXT_CHUNK = _Command("NEXT_CHUNK")
PROBE_TLS = _Command("PROBE_TLS")

T = TypeVar("T")
_Reply = TypeVar("_Reply", bound=ev.Event)
#: an operation of :class:`Core` returning a T: it yields commands to its driver (a frame's
#: parts, RECV, NEXT_CHUNK) and is sent back what each asks for (None, an event, a chunk)
Op = Generator[Any, Any, T]


def parse_server(server: str | None) -> tuple[str, int]:
    """``"host:port"``, ``"host"``, ``"[v6]:port"`` -> (host, port) (:func:`sos_wire.addresses.parse_address`,
    default port 7070). None/"" -> $SOS_SERVER or the default."""
    if not server:
        server = os.environ.get("SOS_SERVER") or DEFAULT_SERVER
    try:
        return parse_address(server, default_port=DEFAULT_PORT)
    except ValueError as exc:
        raise ValueError(f"bad server address {server!r}: {exc}") from None


def resolve_server(server: str | None) -> str:
    """The one reading of a server address for every entry point (clients, commands,
    fsspec, mount, gateway): the argument, else $SOS_SERVER, else 127.0.0.1:7070; a bare host
    gets the default port. Returns the canonical ``host:port`` (``[v6]:port``); ValueError
    for a bad one."""
    return format_address(*parse_server(server))


def resolve_key(key: str | Key | None) -> Key:
    """The one reading of a key: the argument, else $SOS_KEY. :class:`BadKey` (a
    PermissionError and a ValueError) if there is none or it is malformed; the message
    never holds the key."""
    if isinstance(key, Key):
        return key
    if key is None or key == "":
        key = os.environ.get("SOS_KEY")
        if not key:
            raise BadKey("no key given: pass key=... or set SOS_KEY (what `sos-server keygen` prints)")
    try:
        return Key.parse(key)
    except ValueError as exc:
        raise BadKey(f"bad key (expected <key_id>.<secret>): {exc}") from None


#: environment variable naming the CA file that verifies the server's TLS certificate (as
#: ``--tls-ca FILE``; like AWS_CA_BUNDLE): read wherever a client is made without a TLS setting
TLS_CA_ENV = "SOS_TLS_CA"


def resolve_tls(tls: ssl.SSLContext | bool | None) -> ssl.SSLContext | None:
    """The one reading of a client's TLS setting: an SSLContext as it is; True: the system
    CAs; False: plain TCP; None: ``$SOS_TLS_CA`` (a CA file) if set, else plain TCP."""
    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls is True:
        return ssl.create_default_context()
    if tls is None:
        cafile = os.environ.get(TLS_CA_ENV)
        if cafile:
            try:
                return ssl.create_default_context(cafile=cafile)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"${TLS_CA_ENV}={cafile}: cannot load it as a CA file: {exc}") from None
    return None


#: the first bytes of a TLS record a server sends: an alert (0x15) or a handshake (0x16),
#: then the major version 3
TLS_RECORD_PREFIXES = (b"\x15\x03", b"\x16\x03")
#: seconds a TLS probe may take at most: a TLS server answers a ClientHello at once; a server
#: that does not (a broken or hostile one) must not cost a failing client seconds per attempt
TLS_PROBE_TIMEOUT = 0.5


def answers_tls(host: str, port: int, timeout: float) -> bool:
    """Does the server at host:port complete a TLS handshake (certificate not checked: the
    question is only whether it speaks TLS)? One short extra connection, of at most
    :data:`TLS_PROBE_TIMEOUT` seconds (blocking: the trio client runs it in a thread)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    timeout = min(timeout, TLS_PROBE_TIMEOUT)
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            raw.settimeout(timeout)
            with ctx.wrap_socket(raw, server_hostname=host):
                return True
    except (OSError, ssl.SSLError):
        return False


def settings_from_env(server: str | None, key: str | Key | None, namespace: str) -> tuple[str, int, Key, str]:
    """Resolve (host, port, Key, namespace), defaulting server/key from SOS_SERVER/SOS_KEY."""
    host, port = parse_server(server)
    resolved = resolve_key(key)
    try:
        validate_namespace(namespace)
    except BadName as exc:
        raise BadNameError(str(exc), ErrorCode.BAD_NAME) from None
    return host, port, resolved, namespace


class ReadCursor:
    """Where a streamed read stands (both clients' ``read_iter``): the offset and size of
    the next READ, and whether the read is over after one returned ``got`` bytes."""

    __slots__ = ("length", "offset", "remaining", "step")

    def __init__(self, offset: int, length: int, step: int) -> None:
        self.offset, self.length, self.remaining, self.step = offset, length, length, step

    def ask(self) -> int:
        return self.step if self.length == 0 else min(self.step, self.remaining)

    def advance(self, got: int, asked: int) -> bool:
        """Count ``got`` bytes read for a READ of ``asked``; True when the read is over."""
        self.offset += got
        if self.length:
            self.remaining -= got
            if self.remaining <= 0:
                return True
        return got < asked


class ClientSettings:
    """What both clients resolve the same way before connecting: server, key and namespace
    (defaults from $SOS_SERVER/$SOS_KEY), timeouts, TLS context, client name; and the
    :class:`Core` of each connection they open. A driver sets up its own state in
    :meth:`_start`, called last."""

    #: how errors name the client ("Client() needs a namespace")
    _who = "a client"

    def __init__(
        self,
        server: str | None = None,
        key: str | Key | None = None,
        namespace: str | None = None,
        *,
        timeout: float = 30,
        tls: ssl.SSLContext | bool | None = None,
        reconnect_timeout: float | None = None,
        client_name: str = CLIENT_NAME,
    ) -> None:
        if namespace is None:
            raise TypeError(f"{self._who} needs a namespace")
        self.host, self.port, self._key, self.namespace = settings_from_env(server, key, namespace)
        self.server = f"{self.host}:{self.port}"
        self.timeout = timeout
        self.reconnect_timeout = timeout if reconnect_timeout is None else reconnect_timeout
        self._tls = resolve_tls(tls)  # None: $SOS_TLS_CA, else plain TCP
        self._client_name = client_name
        self._core: Core | None = None
        self._closed = False
        self._start()

    def _start(self) -> None:
        """The driver's own set-up (its lock, its first connection), after the settings."""

    def _new_core(self, transport: Any) -> Core:
        """The :class:`Core` of a connection just opened (*transport*: its TLS socket or
        stream, whose certificate the AUTH proof is bound to; unused on plain TCP)."""
        binding = channel_binding_of(transport) if self._tls is not None else b""
        self._core = Core(self._key, self.namespace, client_name=self._client_name, channel_binding=binding)
        return self._core

    @property
    def role(self) -> ev.KeyRole | None:
        """KeyRole granted by the server (APPEND, READ, or TOKEN: a gateway-only key the server
        answers every request but PING with FORBIDDEN); None before connecting."""
        return self._core.role if self._core else None


def channel_binding_of(tls: Any) -> bytes:
    """The AUTH channel binding of an established TLS connection (protocol.md 1.6).

    *tls*: an ``ssl.SSLSocket``/``ssl.SSLObject`` or a ``trio.SSLStream`` after its
    handshake.  The server's certificate is taken as it arrived, whether or not the
    context verified it: a relay with another certificate then gets a proof the real
    server refuses."""
    der = tls.getpeercert(binary_form=True)
    if not der:
        raise ConnectionLost(
            "the TLS server presented no certificate: the AUTH proof cannot be bound to it", retryable=False
        )
    return tls_server_end_point(der)


def readable_now(fileno: int) -> bool:
    """True if the socket *fileno* has something to read (data, EOF, an error) right now.

    poll, not select: select fails for descriptors above FD_SETSIZE (1024)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fileno, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    return bool(select.select([fileno], [], [], 0)[0])  # pragma: no cover - no poll (Windows)


def check_name(name: str) -> str:
    try:
        return validate_name(name)
    except BadName as exc:
        raise BadNameError(str(exc), ErrorCode.BAD_NAME, name=name if isinstance(name, str) else None) from None


def _u64(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise ValueError(f"{what} must be an integer in 0..2**64-1, not {value!r}")
    return value


def tier_wait_ms(timeout: float) -> int:
    """TIER_WAIT's ``timeout_ms`` for a wait of *timeout* seconds: capped at 60 s, as the
    server caps it (protocol.md 1.9); 0 answers at once."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ValueError(f"tier_wait timeout must be a number of seconds >= 0, not {timeout!r}")
    return min(MAX_TIER_WAIT_MS, round(timeout * 1000))


class Core:
    """Protocol logic over one authenticated connection (no I/O)."""

    def __init__(
        self, key: Key, namespace: str, *, client_name: str = CLIENT_NAME, channel_binding: bytes = b""
    ) -> None:
        """*channel_binding*: ``b""`` on plain TCP, :func:`channel_binding_of` the TLS
        connection otherwise (it goes into the AUTH proof)."""
        self.conn = Connection(Role.CLIENT)
        self.key = key
        self.namespace = namespace
        self.client_name = client_name
        self.channel_binding = bytes(channel_binding)
        self.role: ev.KeyRole | None = None
        self.server_name = ""
        self.max_body = DEFAULT_MAX_BODY
        #: the first bytes the server sent (as many as tell a TLS record): tls_refusal reads them
        self.first_bytes = b""

    # -- what the driver received ---------------------------------------------------------
    def receive_data(self, data: ev.Payload) -> None:
        """Bytes the driver received (the zero-copy path of a large body goes to
        ``conn.received`` directly: that is never a connection's first bytes)."""
        if len(self.first_bytes) < 2:
            self.first_bytes += bytes(data[: 2 - len(self.first_bytes)])
        self.conn.receive_data(data)

    # -- plumbing ---------------------------------------------------------------------
    def _send(self, event: ev.Event) -> list:
        """The frame's parts (header, fields, payload uncopied): what a driver sends."""
        return self.conn.send_parts(event)

    def _recv(self) -> Op[ev.Event]:
        """Generator: the next event; raises for connection-level errors (request id 0)."""
        event = yield RECV
        if isinstance(event, ev.Error) and event.request_id == 0:
            raise ConnectionLost(f"the server closed the connection: {event.message}", event.code)
        return event

    def _request(
        self, event: ev.Request, what: str, reply_type: type[_Reply], *, name: str | None = None
    ) -> Op[_Reply]:
        """Generator: send one request, return its reply or raise the mapped error."""
        yield self._send(event)
        reply = yield from self._recv()
        if isinstance(reply, reply_type):
            return reply
        if isinstance(reply, ev.Error):
            raise error_from_reply(reply, what, name=name)
        raise ConnectionLost(f"{what}: unexpected reply {type(reply).__name__}")  # pragma: no cover

    def _rid(self) -> int:
        return self.conn.next_request_id()

    def _where(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    # -- operations -------------------------------------------------------------------
    def handshake(self) -> Op[ev.KeyRole]:
        hello = yield from self._request(
            ev.Hello(self._rid(), self.client_name, min(SUPPORTED_VERSIONS), max(SUPPORTED_VERSIONS)),
            "hello",
            ev.HelloOk,
        )
        if hello.version != VERSION:
            raise ConnectionLost(f"the server chose protocol version {hello.version}, this client speaks {VERSION}")
        self.server_name = hello.server
        self.max_body = hello.max_body
        proof = self.key.proof(hello.nonce, self.namespace, self.channel_binding)
        ok = yield from self._request(
            ev.Auth(self._rid(), self.key.key_id, self.namespace, proof),
            f"authenticate key {self.key.key_id.hex()} to namespace {self.namespace!r}",
            ev.AuthOk,
        )
        self.role = ok.role
        return ok.role

    def tls_refusal(self, server: str) -> Op[ConnectionLost | None]:
        """Run after this connection's handshake failed (the server closed it, or sent bytes
        that are no frame): the error that says the server requires TLS, not retryable
        (retrying without TLS cannot work; the driver raises it from the handshake's error),
        or None (the handshake's error stands).

        Over TLS already: None. Otherwise the bytes received decide: a TLS record (a TLS
        server's alert to a plaintext HELLO) says TLS; any other byte, a server that speaks
        something else. Nothing received is not enough: OpenSSL (the sos-server's TLS) closes
        without an alert when the first record is not TLS, and so does any server that just
        went away; then a second connection probes (``PROBE_TLS``)."""
        if self.channel_binding:
            return None
        if self.first_bytes:
            wants_tls = self.first_bytes in TLS_RECORD_PREFIXES
        else:
            wants_tls = yield PROBE_TLS
        if not wants_tls:
            return None
        return ConnectionLost(
            f"{server}: the server requires TLS: pass --tls-ca FILE (or set "
            f"{TLS_CA_ENV}=FILE; --tls for a certificate of a public CA)",
            retryable=False,
        )

    def ping(self, payload: bytes = b"") -> Op[bytes]:
        reply = yield from self._request(ev.Ping(self._rid(), bytes(payload)), "ping", ev.Pong)
        return reply.payload

    def stat(self, name: str) -> Op[tuple[int, bool]]:
        check_name(name)
        reply = yield from self._request(ev.Stat(self._rid(), name), f"stat {self._where(name)}", ev.StatOk, name=name)
        return reply.length, reply.sealed

    def list_page(
        self, prefix: str, after: str, limit: int = MAX_LIST_LIMIT
    ) -> Op[tuple[tuple[ev.ListEntry, ...], bool]]:
        reply = yield from self._request(
            ev.List(self._rid(), prefix, after, limit), f"list {self.namespace}/{prefix}", ev.ListOk
        )
        # A page must move the cursor forward: a server that repeats or reorders pages
        # would otherwise make the paging loop run forever.
        last = after
        for entry in reply.entries:
            if (last and entry.name <= last) or not entry.name.startswith(prefix):
                raise SOSError(
                    f"list {self.namespace}/{prefix}: the server sent {entry.name!r} after {last!r}"
                    " (names must be in increasing order, after the cursor and under the prefix)"
                )
            last = entry.name
        return reply.entries, reply.more

    def append(self, name: str, offset: int, data: ev.Payload, epoch: int) -> Op[int]:
        check_name(name)
        _u64(offset, "offset")
        _u64(epoch, "epoch")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"append data must be bytes-like, not {type(data).__name__}")
        if not isinstance(data, bytes):
            data = bytes(data)  # the frame must not change under us (and len() must count bytes)
        self._check_piece(name, len(data))
        reply = yield from self._request(
            ev.Append(self._rid(), name, offset, epoch, crc32c(data), data),
            f"append {len(data)} bytes to {self._where(name)} at offset {offset}",
            ev.AppendOk,
            name=name,
        )
        return reply.length

    def max_piece(self, name: str) -> int:
        """The largest data an APPEND for *name* can carry on this connection."""
        return self.max_body - (2 + len(name.encode("utf-8")) + 24)

    def _check_piece(self, name: str, size: int) -> None:
        limit = self.max_piece(name)
        if size > limit:
            raise TooLarge(
                f"append of {size} bytes to {self._where(name)}: the server takes at most {limit} per append "
                "(use append_many, which splits)",
                ErrorCode.TOO_LARGE,
                name=name,
            )

    def read_step(self, name: str, offset: int, length: int) -> Op[list[ev.Payload]]:
        """Generator: READ one range; returns the list of data chunks (at most *length* bytes)."""
        check_name(name)
        _u64(offset, "offset")
        _u64(length, "length")
        what = f"read {self._where(name)} at offset {offset}"
        yield self._send(ev.Read(self._rid(), name, offset, length))
        chunks: list[ev.Payload] = []
        while True:
            event = yield from self._recv()
            if isinstance(event, ev.Error):
                raise error_from_reply(event, what, name=name)
            reply = cast(ev.ReadData, event)  # the connection checks a reply answers its request
            chunks.append(reply.data)
            if reply.last:
                return chunks

    def seal(self, name: str, epoch: int) -> Op[int]:
        check_name(name)
        _u64(epoch, "epoch")
        reply = yield from self._request(
            ev.Seal(self._rid(), name, epoch), f"seal {self._where(name)}", ev.SealOk, name=name
        )
        return reply.length

    def tier_wait(self, name: str, offset: int, timeout_ms: int) -> Op[int]:
        """Generator: TIER_WAIT (protocol.md 1.11); returns ``tiered`` (>= offset), raises
        TierUnavailable (the bucket did not reach *offset* in time, no tier, the tier stopped)."""
        check_name(name)
        _u64(offset, "offset")
        if not isinstance(timeout_ms, int) or not 0 <= timeout_ms < 1 << 32:
            raise ValueError(f"timeout_ms must be an integer in 0..2**32-1, not {timeout_ms!r}")
        reply = yield from self._request(
            ev.TierWait(self._rid(), name, offset, timeout_ms),
            f"wait for the tier to hold {self._where(name)} up to offset {offset}",
            ev.TierWaitOk,
            name=name,
        )
        if reply.tiered < offset:
            raise SOSError(
                f"tier_wait {self._where(name)}: the server answered tiered={reply.tiered}, "
                f"below the offset {offset} waited for (protocol.md 1.11: at least offset)"
            )
        return reply.tiered

    def fence(self, epoch: int) -> Op[int]:
        _u64(epoch, "epoch")
        reply = yield from self._request(
            ev.Fence(self._rid(), epoch), f"fence namespace {self.namespace!r} at epoch {epoch}", ev.FenceOk
        )
        return reply.epoch


class _Piece:
    __slots__ = ("acked", "data", "offset", "rid")

    def __init__(self, offset: int, data: memoryview) -> None:
        self.offset = offset
        self.data = data
        self.rid = 0  # request id on the current connection; 0 = not sent on it yet
        self.acked = False


class AppendJob:
    """State of one ``append_many``: survives reconnects, so it can resume.

    ``queue`` holds every piece made from the caller's chunks and not yet
    acknowledged, in offset order: the ones in flight (at most ``window_bytes`` /
    ``window_frames``) and the rest of the chunk being sent.  After a reconnect
    :meth:`resume_check` compares the server's length with what was acknowledged and
    :meth:`run` sends the whole queue again at the original offsets: pieces that had
    landed are acknowledged again by the server's idempotent-retry rule (which
    compares the bytes), the others are appended.  Nothing is missing or doubled.
    """

    def __init__(
        self,
        name: str,
        offset: int,
        epoch: int,
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        window_frames: int = DEFAULT_WINDOW_FRAMES,
    ) -> None:
        check_name(name)
        self.name = name
        self.epoch = _u64(epoch, "epoch")
        self.acked = _u64(offset, "offset")  # everything below is acknowledged
        self.next_offset = offset  # where the next new piece goes
        self.queue: deque[_Piece] = deque()
        self.window_bytes = max(1, window_bytes)
        self.window_frames = max(1, window_frames)
        self.exhausted = False
        self._pending = bytearray()  # small chunks being coalesced

    def resume_check(self, core: Core) -> Op[int]:
        """Generator (after a reconnect): STAT, and make sure nothing acknowledged is gone."""
        try:
            length, _sealed = yield from core.stat(self.name)
        except SOSError as exc:
            if exc.code == ErrorCode.NOT_FOUND and self.acked == 0:
                length = 0
            else:
                raise
        if length < self.acked:
            raise Corrupt(
                f"append to {core._where(self.name)}: the server reports length {length} but acknowledged "
                f"{self.acked} bytes before the connection was lost",
                ErrorCode.CORRUPT,
                name=self.name,
                length=length,
            )
        return length

    def _enqueue(self, data: memoryview) -> None:
        self.queue.append(_Piece(self.next_offset, data))
        self.next_offset += len(data)

    def run(self, core: Core) -> Op[int]:
        """Generator: send everything, keeping the window full; returns the final length."""
        limit = core.max_piece(self.name)
        target = min(PIECE_TARGET, limit, max(1, self.window_bytes // 4))  # several pieces fit the window
        for piece in self.queue:  # (a resume) nothing is in flight on this new connection
            piece.rid = 0
        sent = 0  # queue[:sent] are in flight on this connection
        by_rid: dict[int, _Piece] = {}
        in_flight_bytes = 0
        first_error: tuple[int, SOSError] | None = None
        while True:
            while first_error is None:
                if sent == len(self.queue):  # everything queued is in flight: get more
                    if self.exhausted or in_flight_bytes >= self.window_bytes or len(by_rid) >= self.window_frames:
                        break
                    chunk = yield NEXT_CHUNK
                    if chunk is None:
                        self.exhausted = True
                        if self._pending:
                            data, self._pending = bytes(self._pending), bytearray()
                            for start in range(0, len(data), limit):
                                self._enqueue(memoryview(data)[start : start + limit])
                    else:
                        for view in self._pieces(chunk, target, limit):
                            self._enqueue(view)
                    continue
                piece = self.queue[sent]
                if by_rid and (
                    in_flight_bytes + len(piece.data) > self.window_bytes or len(by_rid) >= self.window_frames
                ):
                    break
                piece.rid = core._rid()
                piece.acked = False
                by_rid[piece.rid] = piece
                in_flight_bytes += len(piece.data)
                sent += 1
                yield core._send(
                    ev.Append(piece.rid, self.name, piece.offset, self.epoch, crc32c(piece.data), piece.data)
                )
            if not by_rid:
                break
            event = yield from core._recv()
            piece = by_rid.pop(event.request_id)
            in_flight_bytes -= len(piece.data)
            if isinstance(event, ev.Error):
                exc = error_from_reply(
                    event,
                    f"append {len(piece.data)} bytes to {core._where(self.name)} at offset {piece.offset}",
                    name=self.name,
                )
                if first_error is None or piece.offset < first_error[0]:
                    first_error = (piece.offset, exc)
                continue
            reply = cast(ev.AppendOk, event)  # the connection checks a reply answers its request
            if reply.length != piece.offset + len(piece.data):
                raise Corrupt(
                    f"append to {core._where(self.name)} at {piece.offset}: server acknowledged length "
                    f"{reply.length}, expected {piece.offset + len(piece.data)}",
                    ErrorCode.CORRUPT,
                    name=self.name,
                )
            piece.acked = True
            while self.queue and self.queue[0].acked:
                done = self.queue.popleft()
                sent -= 1
                self.acked = done.offset + len(done.data)
        if first_error is not None:
            raise first_error[1]
        return self.acked

    def _pieces(self, chunk: ev.Payload, target: int, limit: int) -> list[memoryview]:
        """Turn a caller chunk into pieces: coalesce small ones, split huge ones (no copy)."""
        if not isinstance(chunk, (bytes, bytearray, memoryview)):
            raise TypeError(f"append_many chunks must be bytes-like, not {type(chunk).__name__}")
        n = len(chunk)
        if not n:
            return []
        if self._pending or n < target:
            self._pending += chunk
            if len(self._pending) < target:
                return []
            data, self._pending = bytes(self._pending), bytearray()
            mv = memoryview(data)
        elif isinstance(chunk, bytes):
            mv = memoryview(chunk)
        else:  # the caller may reuse a mutable buffer: keep our own copy until acknowledged
            mv = memoryview(bytes(chunk))
        return [mv[start : start + limit] for start in range(0, len(mv), limit)]
