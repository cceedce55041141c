"""The sans-IO connection (h11 style): bytes in, events out; events in, bytes out.

    conn = Connection(Role.SERVER)
    conn.receive_data(chunk)            # b"" means the peer closed (EOF)
    while (ev := conn.next_event()) is not NEED_DATA:
        ...
        sock.send(conn.send(reply))

Framing rules enforced here:

* the 16-byte header is parsed only once complete; its magic, CRC32C, version
  and ``body_len`` (against ``max_body``) are checked before a single byte of
  the body is waited for, so a lying length never makes us buffer more than
  ``max_body`` bytes;
* a server connection accepts only requests and a client connection only
  replies; request id 0 is reserved (connection-level ERROR), a client never
  reuses an id still in flight, and every reply must answer a request in flight
  with the matching reply type (or ERROR);
* every violation raises ``RemoteProtocolError`` (never ``struct.error``,
  construct errors or ``UnicodeDecodeError``).  After a *fatal* one the
  connection is dead; a non-fatal one (unknown opcode, oversized PING payload,
  server side only) skipped exactly one well-framed request.

The hot frames (header, APPEND, APPEND_OK, READ_DATA) use precompiled
``struct.Struct`` fast paths equivalent to the construct definitions in
``frames.py`` (tests/wire/test_fastpath.py proves it); payloads are copied out
of the receive buffer exactly once. The body of a large APPEND or READ_DATA (at least
``DIRECT_BODY_MIN`` bytes) may get a buffer of its own once its header is parsed: the I/O
layer asks for it (``receive_buffer``, which allocates it: the I/O layer owns the memory
policy) and receives straight into it (``recv_into`` + ``received``); the event's ``data``
is then a memoryview of that buffer, never copied again.
"""

from __future__ import annotations

import dataclasses
import struct
from enum import Enum
from typing import Final

from . import events as ev
from .crc import crc32c
from .errors import ErrorCode, LocalProtocolError, RemoteProtocolError, error_code
from .frames import (
    BODIES,
    DEFAULT_MAX_BODY,
    HEADER_LEN,
    MAGIC,
    MAX_PING_PAYLOAD,
    REPLIES,
    REPLY_TO,
    REQUESTS,
    SUPPORTED_VERSIONS,
    VERSION,
    Op,
)

__all__ = [
    "DIRECT_BODY_MIN",
    "EVENT_OF",
    "NEED_DATA",
    "OP_OF",
    "Connection",
    "Role",
    "decode_body",
    "encode_event",
]

#: bodies of APPEND and READ_DATA frames at least this big are received into a buffer of
#: their own (no copy out of the shared receive buffer; ``receive_buffer`` for recv_into)
DIRECT_BODY_MIN = 64 * 1024


class _Sentinel(Enum):
    """The type of NEED_DATA: an enum of one member, so that a type checker narrows
    ``next_event()``'s result to an event once it is not NEED_DATA (``is`` tells them apart)."""

    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return self.value

    __str__ = __repr__


#: returned by ``next_event`` when a whole frame is not buffered yet
NEED_DATA: Final = _Sentinel.NEED_DATA


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"


EVENT_OF: dict[Op, type] = {
    Op.HELLO: ev.Hello,
    Op.HELLO_OK: ev.HelloOk,
    Op.AUTH: ev.Auth,
    Op.AUTH_OK: ev.AuthOk,
    Op.PING: ev.Ping,
    Op.PONG: ev.Pong,
    Op.LIST: ev.List,
    Op.LIST_OK: ev.ListOk,
    Op.STAT: ev.Stat,
    Op.STAT_OK: ev.StatOk,
    Op.APPEND: ev.Append,
    Op.APPEND_OK: ev.AppendOk,
    Op.READ: ev.Read,
    Op.READ_DATA: ev.ReadData,
    Op.SEAL: ev.Seal,
    Op.SEAL_OK: ev.SealOk,
    Op.FENCE: ev.Fence,
    Op.FENCE_OK: ev.FenceOk,
    Op.TIER_WAIT: ev.TierWait,
    Op.TIER_WAIT_OK: ev.TierWaitOk,
    Op.ERROR: ev.Error,
}
OP_OF: dict[type, Op] = {cls: op for op, cls in EVENT_OF.items()}
_FIELDS = {cls: [f.name for f in dataclasses.fields(cls) if f.name != "request_id"] for cls in OP_OF}

# -- fast paths (checked against frames.py by tests/wire/test_fastpath.py) ----------
_HEADER = struct.Struct(">2sBBIII")  # magic, version, opcode, request_id, body_len, header_crc
_HEADER12 = struct.Struct(">2sBBII")
_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")
_APPEND_TAIL = struct.Struct(">QQII")  # offset, epoch, crc, data_len (after the name)
_READ_DATA_HEAD = struct.Struct(">QBI")  # offset, last, data_len


def _header(opcode: int, request_id: int, body_len: int) -> bytes:
    h12 = _HEADER12.pack(MAGIC, VERSION, opcode, request_id, body_len)
    return h12 + crc32c(h12).to_bytes(4, "big")


def _encode_body_parts(op: Op, event: ev.Event) -> list[ev.Payload]:
    """The body of *event* (whose opcode is *op*: ``OP_OF[type(event)]``, so the event's
    class is exactly the one of its opcode) as a list of bytes-like parts (no copy of big
    payloads)."""
    if isinstance(event, ev.Append):
        name = event.name.encode("utf-8")
        data = event.data
        return [_U16.pack(len(name)), name, _APPEND_TAIL.pack(event.offset, event.epoch, event.crc, len(data)), data]
    if isinstance(event, ev.ReadData):
        if event.last not in (0, 1):
            raise ValueError(f"last must be a bool, got {event.last!r}")
        data = event.data
        return [_READ_DATA_HEAD.pack(event.offset, event.last, len(data)), data]
    if isinstance(event, ev.AppendOk):
        return [_U64.pack(event.length)]
    if isinstance(event, ev.Ping | ev.Pong) and len(event.payload) > MAX_PING_PAYLOAD:
        raise ValueError(f"{op.name} payload is {len(event.payload)} bytes, the limit is {MAX_PING_PAYLOAD}")
    fields = {f: getattr(event, f) for f in _FIELDS[type(event)]}
    if isinstance(event, ev.ListOk):
        fields["entries"] = [{"name": e.name, "length": e.length, "sealed": e.sealed} for e in event.entries]
    return [BODIES[op].build(fields)]


def encode_event(event: ev.Event) -> bytes:
    """Header + body of *event*, with no connection state checks (for tests and docs)."""
    op = OP_OF[type(event)]
    parts = _encode_body_parts(op, event)
    size = sum(len(p) for p in parts)
    return b"".join([_header(op, event.request_id, size), *parts])


def decode_body(op: Op, request_id: int, body: bytes) -> ev.Event:
    """Parse *body* with the construct definition of *op* into an event.

    Raises RemoteProtocolError on anything malformed (reference decoder; the
    connection uses fast paths for the hot frames)."""
    try:
        c = BODIES[op].parse(body)
    except Exception as exc:  # noqa: BLE001 - construct's errors, UnicodeDecodeError, ...: all a malformed body
        raise RemoteProtocolError(f"malformed {op.name} body: {_short(exc)}", request_id=request_id) from None
    cls = EVENT_OF[op]
    if op is Op.LIST_OK:
        entries = tuple(ev.ListEntry(e.name, e.length, bool(e.sealed)) for e in c.entries)
        return ev.ListOk(request_id, entries, bool(c.more))
    kw = {f: c[f] for f in _FIELDS[cls]}
    if op is Op.AUTH_OK:
        kw["role"] = ev.KeyRole(kw["role"])
    elif op is Op.ERROR:
        kw["code"] = error_code(kw["code"])
    elif op is Op.STAT_OK:
        kw["sealed"] = bool(kw["sealed"])
    elif op is Op.READ_DATA:
        kw["last"] = bool(kw["last"])
    elif op in (Op.PING, Op.PONG) and len(kw["payload"]) > MAX_PING_PAYLOAD:
        raise RemoteProtocolError(
            f"{op.name} payload is {len(kw['payload'])} bytes, the limit is {MAX_PING_PAYLOAD}",
            code=ErrorCode.BAD_REQUEST,
            request_id=request_id,
            fatal=op is Op.PONG,
        )
    event: ev.Event = cls(request_id, **kw)
    return event


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] or type(exc).__name__


Event = ev.Event | _Sentinel


class Connection:
    """One end of one SOS connection; owns no socket.

    *max_body* caps the body of frames we accept.  ``peer_max_body`` caps the
    frames we send; a client learns it from HELLO_OK.
    """

    def __init__(self, role: Role, *, max_body: int = DEFAULT_MAX_BODY) -> None:
        if not isinstance(role, Role):
            raise LocalProtocolError(f"role must be a Role, not {role!r}")
        if not 0 < max_body <= 0xFFFFFFFF:
            raise LocalProtocolError(f"max_body must be in 1..2**32-1, not {max_body!r}")
        self.role = role
        self.max_body = max_body
        self.peer_max_body = DEFAULT_MAX_BODY
        self._buf = bytearray()
        self._hdr: tuple[int, int, int] | None = None  # (opcode, request_id, body_len) of the frame being received
        self._body: bytearray | None = None  # the frame's own body buffer (direct_body_min)
        #: bodies of APPEND/READ_DATA at least this big may get their own buffer
        #: (receive_buffer; None: never)
        self.direct_body_min: int | None = DIRECT_BODY_MIN
        self._filled = 0  # bytes of _body received
        self._eof = False
        self._error: RemoteProtocolError | None = None
        #: request ids in flight -> opcode of the request
        # request id -> the request's Op (None: a frame of an unknown opcode, server side)
        self._pending: dict[int, Op | None] = {}
        self._next_id = 0

    # -- state ------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """How many requests have not had their final reply yet."""
        return len(self._pending)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet turned into events."""
        return len(self._buf) + self._filled

    @property
    def eof(self) -> bool:
        return self._eof

    def next_request_id(self) -> int:
        """A fresh request id (1..2**32-1, never 0, never one still in flight)."""
        while True:
            self._next_id = self._next_id % 0xFFFFFFFF + 1
            if self._next_id not in self._pending:
                return self._next_id

    # -- receiving --------------------------------------------------------------------
    def receive_data(self, data: ev.Payload) -> None:
        """Buffer bytes from the peer; ``b""`` means the peer closed its side."""
        if not data:
            self._eof = True
            return
        if self._eof:
            raise LocalProtocolError("receive_data after EOF")
        if self._error is not None:
            return  # a dead connection buffers nothing more
        body = self._body
        if body is not None and self._filled < len(body):
            n = min(len(body) - self._filled, len(data))
            body[self._filled : self._filled + n] = data[:n] if n < len(data) else data
            self._filled += n
            if n == len(data):
                return
            data = memoryview(data)[n:]
        self._buf += data

    @property
    def awaiting_body(self) -> int:
        """The size of a large APPEND/READ_DATA body whose header has arrived and that has no
        buffer of its own yet (what :meth:`receive_buffer` would allocate); else 0."""
        hdr = self._hdr
        direct = self.direct_body_min
        if hdr is None or self._body is not None or direct is None or self._error is not None or self._eof:
            return 0
        opcode, _rid, body_len = hdr
        if body_len < direct or not (opcode == Op.APPEND or opcode == Op.READ_DATA):
            return 0
        if len(self._buf) >= HEADER_LEN + body_len:
            return 0  # all there already
        return body_len

    def receive_buffer(self, *, allocate: bool = True) -> memoryview | None:
        """Where the next bytes of the peer may go directly (``sock.recv_into(view)``, then
        :meth:`received`): the rest of a large frame's body, or None (use receive_data).

        The body's buffer is allocated here, at its full size, when a large body is
        :attr:`awaiting_body` and ``allocate`` is true: the caller decides whether a peer's
        announced length may cost that memory before the bytes arrive (a server keeps a
        budget; ``allocate=False`` only returns a buffer already handed out)."""
        body = self._body
        if body is None:
            body_len = self.awaiting_body if allocate else 0
            if not body_len:
                return None
            body = bytearray(body_len)
            buf = self._buf
            have = len(buf) - HEADER_LEN
            body[:have] = memoryview(buf)[HEADER_LEN:]
            buf.clear()
            self._body, self._filled = body, have
        if self._filled >= len(body) or self._error is not None:
            return None
        return memoryview(body)[self._filled :]

    def received(self, n: int) -> None:
        """``n`` bytes were written into the view :meth:`receive_buffer` returned; 0 means
        the peer closed its side."""
        if not n:
            self._eof = True
            return
        body = self._body
        if body is None or not 0 < n <= len(body) - self._filled:
            raise LocalProtocolError(f"received({n}) does not fit the buffer handed out")
        self._filled += n

    def _fail(self, message: str, *, code: ErrorCode = ErrorCode.BAD_FRAME, request_id: int = 0) -> RemoteProtocolError:
        self._error = RemoteProtocolError(message, code=code, request_id=request_id, fatal=True)
        self._buf.clear()
        self._hdr = None
        self._body, self._filled = None, 0
        return self._error

    def next_event(self) -> Event:
        """The next complete event, or NEED_DATA. Raises RemoteProtocolError on garbage."""
        if self._error is not None:
            raise RemoteProtocolError(
                f"connection already failed: {self._error.message}",
                code=self._error.code,
                request_id=self._error.request_id,
            )
        buf = self._buf
        hdr = self._hdr
        if hdr is None:
            if len(buf) < HEADER_LEN:
                if self._eof and buf:
                    raise self._fail(f"peer closed the connection inside a frame header ({len(buf)} of 16 bytes)")
                return NEED_DATA
            hdr = self._hdr = self._parse_header()
        opcode, request_id, body_len = hdr
        end = HEADER_LEN + body_len
        body = self._body
        if body is not None:  # a large body in its own buffer
            if self._filled < body_len:
                if self._eof:
                    raise self._fail(
                        f"peer closed the connection inside a frame body ({self._filled} of {body_len} bytes)",
                        request_id=request_id,
                    )
                return NEED_DATA
            self._body, self._filled = None, 0
            src, start, end, done = body, 0, body_len, 0
        elif len(buf) < end:
            if self._eof:
                raise self._fail(
                    f"peer closed the connection inside a frame body ({len(buf) - HEADER_LEN} of {body_len} bytes)",
                    request_id=request_id,
                )
            return NEED_DATA
        else:
            src, start, done = buf, HEADER_LEN, end
        self._hdr = None
        if opcode not in Op._value2member_map_:
            # server side only (the header check made it fatal for clients): skip the frame
            del buf[:done]
            self._pending[request_id] = None
            raise RemoteProtocolError(
                f"unknown opcode 0x{opcode:02x}", code=ErrorCode.UNKNOWN_OP, request_id=request_id, fatal=False
            )
        op = Op(opcode)
        event: ev.Event
        try:
            if op is Op.APPEND:
                event = self._fast_append(request_id, src, start, end)
            elif op is Op.READ_DATA:
                event = self._fast_read_data(request_id, src, start, end)
            elif op is Op.APPEND_OK:
                if body_len != 8:
                    raise RemoteProtocolError(
                        f"malformed APPEND_OK body: {body_len} bytes, expected 8", request_id=request_id
                    )
                event = ev.AppendOk(request_id, _U64.unpack_from(buf, HEADER_LEN)[0])
            else:
                with memoryview(buf) as mv:
                    body_bytes = mv[HEADER_LEN:end].tobytes()
                event = decode_body(op, request_id, body_bytes)
        except RemoteProtocolError as exc:
            if exc.fatal:
                raise self._fail(exc.message, code=exc.code, request_id=exc.request_id) from None
            del buf[:done]
            self._pending[request_id] = op
            raise
        del buf[:done]
        self._after_receive(op, event)
        return event

    def _parse_header(self) -> tuple[int, int, int]:
        buf = self._buf
        magic, version, opcode, request_id, body_len, header_crc = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise self._fail(f"bad magic {bytes(magic)!r}, expected {MAGIC!r} (is the peer an SOS endpoint?)")
        if crc32c(buf[:12]) != header_crc:
            raise self._fail("header checksum mismatch")
        if version not in SUPPORTED_VERSIONS:
            raise self._fail(
                f"unsupported protocol version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))})",
                code=ErrorCode.UNSUPPORTED_VERSION,
                request_id=request_id,
            )
        if body_len > self.max_body:
            raise self._fail(
                f"frame body of {body_len} bytes exceeds the limit of {self.max_body}",
                code=ErrorCode.TOO_LARGE,
                request_id=request_id,
            )
        known = opcode in Op._value2member_map_
        if self.role is Role.SERVER:
            if request_id == 0:
                raise self._fail("request id 0 is reserved")
            if request_id in self._pending:
                # answered with id 0: an ERROR with this id would look like the in-flight request's reply
                raise self._fail(f"request id {request_id} reused while still in flight")
            if known and opcode not in REQUESTS:
                raise self._fail(f"a server accepts only requests, got {Op(opcode).name}", request_id=request_id)
        else:
            if not known or opcode not in REPLIES:
                name = Op(opcode).name if known else f"unknown opcode 0x{opcode:02x}"
                raise self._fail(f"a client accepts only replies, got {name}", request_id=request_id)
            if not (request_id == 0 and opcode == Op.ERROR):
                want = self._pending.get(request_id)
                if want is None:
                    raise self._fail(f"reply {Op(opcode).name} for request id {request_id}, which is not in flight")
                if opcode != Op.ERROR and opcode != REPLY_TO[want]:
                    raise self._fail(
                        f"reply {Op(opcode).name} does not answer {want.name} (request id {request_id})",
                        request_id=request_id,
                    )
        return (opcode, request_id, body_len)

    def _payload(self, buf: bytearray, pos: int, end: int) -> bytes | memoryview:
        """The payload: a copy out of the shared receive buffer (reused for the next frames),
        or a view of a body's own buffer (nobody else writes it: no copy)."""
        if buf is self._buf:
            with memoryview(buf) as mv:
                return mv[pos:end].tobytes()
        return memoryview(buf)[pos:end]

    def _fast_append(self, request_id: int, buf: bytearray, start: int, end: int) -> ev.Append:
        pos = start
        if pos + 2 > end:
            raise RemoteProtocolError("malformed APPEND body: truncated name length", request_id=request_id)
        (name_len,) = _U16.unpack_from(buf, pos)
        pos += 2
        if pos + name_len + _APPEND_TAIL.size > end:
            raise RemoteProtocolError("malformed APPEND body: truncated", request_id=request_id)
        try:
            name = buf[pos : pos + name_len].decode("utf-8")
        except UnicodeDecodeError:
            raise RemoteProtocolError("malformed APPEND body: name is not valid UTF-8", request_id=request_id) from None
        pos += name_len
        offset, epoch, crc, data_len = _APPEND_TAIL.unpack_from(buf, pos)
        pos += _APPEND_TAIL.size
        if pos + data_len != end:
            raise RemoteProtocolError(
                f"malformed APPEND body: data length {data_len} does not fill the frame", request_id=request_id
            )
        return ev.Append(request_id, name, offset, epoch, crc, self._payload(buf, pos, end))

    def _fast_read_data(self, request_id: int, buf: bytearray, start: int, end: int) -> ev.ReadData:
        pos = start
        if pos + _READ_DATA_HEAD.size > end:
            raise RemoteProtocolError("malformed READ_DATA body: truncated", request_id=request_id)
        offset, last, data_len = _READ_DATA_HEAD.unpack_from(buf, pos)
        if last > 1:
            raise RemoteProtocolError(
                f"malformed READ_DATA body: last must be 0 or 1, got {last}", request_id=request_id
            )
        pos += _READ_DATA_HEAD.size
        if pos + data_len != end:
            raise RemoteProtocolError(
                f"malformed READ_DATA body: data length {data_len} does not fill the frame", request_id=request_id
            )
        return ev.ReadData(request_id, offset, bool(last), self._payload(buf, pos, end))

    def _after_receive(self, op: Op, event: ev.Event) -> None:
        if self.role is Role.SERVER:
            self._pending[event.request_id] = op
            return
        if isinstance(event, ev.ReadData) and not event.last:
            return
        self._pending.pop(event.request_id, None)
        if isinstance(event, ev.HelloOk):
            self.peer_max_body = event.max_body

    # -- sending ----------------------------------------------------------------------
    def send(self, event: ev.Event) -> bytes:
        """The bytes of the frame for *event*. Raises LocalProtocolError on misuse."""
        return b"".join(self.send_parts(event))

    def send_parts(self, event: ev.Event) -> list[ev.Payload]:
        """The frame for *event* as a list of bytes-like parts (header, fields, payload),
        the payload not copied: for ``sendmsg``/``writev``. Same checks as :meth:`send`."""
        op = OP_OF.get(type(event))
        if op is None:
            raise LocalProtocolError(f"not an SOS event: {event!r}")
        rid = event.request_id
        if not isinstance(rid, int) or not 0 <= rid <= 0xFFFFFFFF:
            raise LocalProtocolError(f"request_id must be a u32, not {rid!r}")
        if self.role is Role.CLIENT:
            if op not in REQUESTS:
                raise LocalProtocolError(f"a client sends only requests, not {op.name}")
            if rid == 0:
                raise LocalProtocolError("request id 0 is reserved")
            if rid in self._pending:
                raise LocalProtocolError(f"request id {rid} is still in flight")
        else:
            if op not in REPLIES:
                raise LocalProtocolError(f"a server sends only replies, not {op.name}")
            if op is not Op.ERROR:
                if rid not in self._pending:
                    raise LocalProtocolError(f"{op.name} answers request id {rid}, which is not in flight")
                want = self._pending[rid]
                if want is None or REPLY_TO[want] != op:
                    asked = want.name if want is not None else "an unknown opcode"
                    raise LocalProtocolError(f"{op.name} does not answer {asked} (request id {rid})")
        try:
            parts = _encode_body_parts(op, event)
            size = sum(memoryview(p).nbytes for p in parts)  # TypeError for anything not bytes-like
        except Exception as exc:  # noqa: BLE001 - whatever a field the codec cannot encode raises: the caller's misuse
            raise LocalProtocolError(f"cannot encode {event!r:.200}: {_short(exc)}") from None
        if size > self.peer_max_body:
            raise LocalProtocolError(f"{op.name} body of {size} bytes exceeds the peer's limit of {self.peer_max_body}")
        try:
            frame = [_header(op, rid, size), *parts]
        except Exception as exc:  # noqa: BLE001 - as above (struct.error for a field out of range)
            raise LocalProtocolError(f"cannot encode {event!r:.200}: {_short(exc)}") from None
        if self.role is Role.CLIENT:
            self._pending[rid] = op
        elif not (isinstance(event, ev.ReadData) and not event.last):
            self._pending.pop(rid, None)
        return frame
