"""The gateway's HTTP connection layer: h11 under trio, no WebHDFS in it.

* the fast path (:func:`parse_fast_head`, :meth:`Conn.fast_request`): the plain, bodiless
  request heads Hadoop's client sends (most of a streaming query's requests) are read here
  and their replies written here, without h11's per-event machinery; any other head (a
  body, chunked, obs-text, HTTP/1.0, a head split over reads, ...) goes to h11 unchanged;

* :class:`Conn`: one connection (h11 state and the stream): bounded heads (MAX_HEAD) and small
  bodies (MAX_SMALL_BODY), a head deadline, a stall timeout per receive, a send timeout per
  SEND_STEP (a client that stops reading its reply loses its connection), the linger after a
  refusal that closes;
* :class:`Slots`: who may hold a connection (in all, per client address, and without a valid
  token; those make room for newcomers);
* :class:`Reply` (answer at once) and :class:`Drop` (close the connection), what the layers
  above raise.

The operations (:mod:`.operations`), the OAuth2 side (:mod:`.auth`) and the server
(:mod:`.server`) use it; it knows nothing of them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import h11
import trio

from sos_client.aio import receive_when_readable
from sos_wire.addresses import address_key
from spark_plugin.gateway.webhdfs.hdfs import WebHdfsError

__all__ = [
    "CURRENT_CONN",
    "Conn",
    "Drop",
    "Head",
    "Reply",
    "Slots",
    "json_body",
    "parse_fast_head",
    "peer_address",
    "remote_error",
]

log = logging.getLogger(__name__)

#: largest request head (request line + headers)
MAX_HEAD = 64 << 10
#: largest body of any request but CREATE/APPEND data (token form, marker payload, ...)
MAX_SMALL_BODY = 64 << 10
RECV_SIZE = 256 << 10
#: a keep-alive connection idle this long between requests is closed
IDLE_TIMEOUT = 120.0
#: a request body that makes no progress for this long is dropped
STALL_TIMEOUT = 120.0
#: a request head must arrive whole within this long of its first byte (of the accept, for
#: a connection's first request): a client dripping one byte a minute cannot keep a slot
HEAD_TIMEOUT = 20.0
#: a reply whose client reads nothing of it for this long is dropped (its slot and the
#: memory it holds are freed); a step of SEND_STEP bytes must go out within it
SEND_TIMEOUT = 60.0
SEND_STEP = 64 << 10
#: sent with every reply: Java's HttpURLConnection (Hadoop's WebHDFS client) then drops a
#: pooled connection idle longer than this instead of reusing it. After a gateway restart
#: its pool holds connections to the dead process; a reused one fails a request that
#: streams a body (CREATE, APPEND data) with "Unexpected end of file from server", never
#: retried. A restart takes longer than this, so no connection of the old process is reused.
#: (Java reads Keep-Alive only beside "Connection: keep-alive")
KEEP_ALIVE_HINT = [(b"connection", b"keep-alive"), (b"keep-alive", b"timeout=1")]
#: connection caps: all at once, per client address (IPv4 address, IPv6 /64)
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_ADDRESS = 64
#: after a refusal that closes the connection: read and discard what the client still
#: sends for at most this long and this many bytes (seconds, bytes) before closing
LINGER = (2.0, 1 << 20)


#: the fast path (:func:`parse_fast_head`) takes a request head only if it is whole within
#: this many bytes of the first read; anything larger goes to h11 (and MAX_HEAD)
FAST_HEAD = 8 << 10
_FAST_LINE = re.compile(rb"(GET|PUT|POST|DELETE) (/[\x21-\x7e]*) HTTP/1\.1")
#: a header field: a token, a colon, optional whitespace, a value of visible ASCII with
#: inner spaces or tabs (no obs-text, no control byte), optional whitespace
_FAST_FIELD = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*((?:[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?)?)[ \t]*")
#: header fields that put a request off the fast path (h11 handles them)
_SLOW_FIELDS = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"te", b"trailer"})


#: the head of a reply with no header of its own and no reason phrase to a keep-alive request
#: of the fast path: what :meth:`Conn._reply_head` (and h11) write for it, byte for byte
_PLAIN_REPLY = b"HTTP/1.1 %d \r\ncontent-length: %d\r\nconnection: keep-alive\r\nkeep-alive: timeout=1\r\n\r\n"


#: (``chunked=True``) a chunked body is read on the fast path only if it is whole, with
#: its head, in the bytes of the first read, and at most this large
FAST_BODY = 64 << 10
#: a chunk's size line on the fast path: hexadecimal digits only (no extension)
_FAST_CHUNK = re.compile(rb"[0-9a-fA-F]{1,6}")


class Head:
    """A request head read by the fast path: what the server uses of h11's Request, and the
    request's body when the fast path read it too (``chunked=True``)."""

    __slots__ = ("auth", "body", "headers", "method", "target")

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None = None,
        auth: bytes | None = None,
    ) -> None:
        self.method = method
        self.target = target
        #: (lower-case name, value without surrounding whitespace), in order
        self.headers = headers
        #: the whole body of a chunked request (None: the request has no body)
        self.body = body
        #: the value of its Authorization field if it has exactly one (None: none, or more
        #: than one: the server's full path answers those)
        self.auth = auth


def _fast_chunked_body(data: bytes, pos: int) -> tuple[bytes, int] | None:
    """The chunked body starting at ``data[pos]`` and where it ends, if it is whole there,
    within FAST_BODY bytes, in the plain form (hexadecimal sizes without extensions, CRLF
    line ends, the last chunk ``0`` with no trailer); None otherwise (h11 reads it)."""
    parts: list[bytes] = []
    size = 0
    while True:
        eol = data.find(b"\r\n", pos, pos + 8)
        if eol < 0 or _FAST_CHUNK.fullmatch(data, pos, eol) is None:
            return None
        n = int(data[pos:eol], 16)
        pos = eol + 2
        if n == 0:
            if data[pos : pos + 2] != b"\r\n":
                return None  # a trailer (or not whole yet)
            return b"".join(parts), pos + 2
        size += n
        if size > FAST_BODY or data[pos + n : pos + n + 2] != b"\r\n":
            return None
        parts.append(data[pos : pos + n])
        pos += n + 2


def parse_fast_head(data: bytes, *, chunked: bool = False) -> tuple[Head, int] | None:
    """The request head at the start of ``data`` and its length, if it is one of the plain
    shapes Hadoop's client and the Spark helpers send; None for anything else (h11 then
    reads it and refuses it or not, exactly as without this path).

    Taken: a whole head within FAST_HEAD bytes; ``GET|PUT|POST|DELETE``, a target of
    visible ASCII starting with ``/``, ``HTTP/1.1``; CRLF line ends; fields of a token name
    and a visible-ASCII value; exactly one Host; no body (Content-Length absent or ``0``,
    no Transfer-Encoding); no Expect, Upgrade, TE, Trailer; Connection absent or
    ``keep-alive``. Stricter than h11 in every point, so it accepts nothing h11 refuses.

    With ``chunked``, also a request whose only framing field is ``Transfer-Encoding:
    chunked`` (Hadoop's CREATE and APPEND data steps) when its whole body follows in
    ``data`` in the plain form (:func:`_fast_chunked_body`): ``Head.body`` is that body and
    the length returned includes it."""
    end = data.find(b"\r\n\r\n", 0, FAST_HEAD)
    if end < 0:
        return None
    eol = data.find(b"\r\n", 0, end + 2)
    line = _FAST_LINE.fullmatch(data, 0, eol)
    if line is None:
        return None
    block = data[eol + 2 : end]
    key = (block, chunked)
    try:
        fields = _FIELD_BLOCKS[key]
    except KeyError:
        fields = _fast_fields(block, chunked)
        if len(block) <= FIELD_BLOCK_MAX:
            if len(_FIELD_BLOCKS) >= FIELD_BLOCKS:
                _FIELD_BLOCKS.clear()
            _FIELD_BLOCKS[key] = fields
    if fields is None:
        return None
    headers, has_body, auth = fields
    used = end + 4
    body = None
    if has_body:
        whole = _fast_chunked_body(data, used)
        if whole is None:
            return None
        body, used = whole
    return Head(line.group(1), line.group(2), list(headers), body, auth), used


#: the header fields of recent heads (their bytes between the request line and the blank
#: line, and ``chunked``) -> what :func:`_fast_fields` made of them: a client sends the same
#: fields with every request (its token, its agent, the host), so most heads are read by one
#: comparison of those bytes. At most FIELD_BLOCKS entries of at most FIELD_BLOCK_MAX bytes
#: (forgotten all at once when full): the same answer as reading them again, bounded memory.
FIELD_BLOCKS = 1024
FIELD_BLOCK_MAX = 2048
_Fields = tuple[tuple[tuple[bytes, bytes], ...], bool, bytes | None]
_FIELD_BLOCKS: dict[tuple[bytes, bool], _Fields | None] = {}


def _fast_fields(block: bytes, chunked: bool) -> _Fields | None:
    """The header fields of a head of the fast path (:func:`parse_fast_head`): (lower-case
    name, value) in order, whether a chunked body follows, and the value of its one
    Authorization field (None: none or several); None if the fields put the head off the
    fast path."""
    headers = []
    hosts = 0
    framing = 0  # Content-Length and Transfer-Encoding fields
    auths = 0
    auth = None
    has_body = False
    for raw in block.split(b"\r\n") if block else ():
        field = _FAST_FIELD.fullmatch(raw)
        if field is None:
            return None
        name, value = field.group(1).lower(), field.group(2)
        if name == b"transfer-encoding" and chunked and value.lower() == b"chunked":
            has_body, value = True, b"chunked"  # (h11 gives this value in lower case)
        elif name in _SLOW_FIELDS:
            return None
        if name == b"content-length" and value != b"0":
            return None
        if name == b"connection" and value.lower() != b"keep-alive":
            return None
        hosts += name == b"host"
        framing += name in (b"content-length", b"transfer-encoding")
        if name == b"authorization":
            auths += 1
            auth = value
        headers.append((name, value))
    if hosts != 1:
        return None
    if has_body and framing != 1:
        return None  # chunked beside a Content-Length, or twice
    return tuple(headers), has_body, auth if auths == 1 else None


def ascii_request_line(line: bytes) -> bytes:
    """A request line with every byte outside printable ASCII in its target percent-encoded.

    Hadoop's client sends a path's non-ASCII characters as raw UTF-8 bytes in the request
    line (Jetty, HDFS's server, reads them as UTF-8); h11 accepts only printable ASCII
    there. Percent-encoding them gives the same path once the target is decoded (the
    server percent-decodes it as UTF-8). Only bytes >= 0x80 change: a control byte or a
    space stays, so a request line that is malformed in any other way is still refused."""
    if line.isascii():
        return line
    return bytes(b for c in line for b in (f"%{c:02X}".encode() if c >= 0x80 else bytes((c,))))


class Reply(Exception):
    """Raised inside a handler to answer at once (status, JSON document, extra headers)."""

    def __init__(
        self, status: int, doc: dict | None, headers: list[tuple[str, str]] | None = None, reason: str = ""
    ) -> None:
        super().__init__(status)
        self.status = status
        self.doc = doc
        self.headers = headers or []
        self.reason = reason


class Drop(Exception):
    """The connection cannot go on (broken, stalled, or a protocol error): close it."""


_JSON = json.JSONEncoder(separators=(",", ":"))


def json_body(doc: Any) -> bytes:
    return _JSON.encode(doc).encode()


def remote_error(exception: str, message: str) -> dict:
    return WebHdfsError(exception, message).body()


def socket_addresses(stream: trio.abc.Stream) -> tuple[str, str]:
    """(client IP, the gateway's own IP this connection reached); "" if unknown."""
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    sock = getattr(inner, "socket", None)
    if sock is None:
        return "", ""
    try:
        peer, local = sock.getpeername()[0], sock.getsockname()[0]
    except OSError:  # the client is already gone: its first receive fails
        return "", ""
    except IndexError:  # a Unix socket's unnamed peer (a --workers worker's): no IP
        return "", ""
    return str(peer), str(local)


class Conn:
    """One HTTP connection: h11 state plus the stream, and what the slots need to know
    (:class:`Slots`)."""

    def __init__(self, stream: trio.abc.Stream, *, send_timeout: float = SEND_TIMEOUT) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        #: set when the gateway stops: the next reply tells the client to close
        self.closing = False
        peer, self.local = socket_addresses(stream)
        #: the client's address as the per-address cap counts it
        self.peer = address_key(peer)
        self.accepted = trio.current_time()
        self.send_timeout = send_timeout
        #: True once a request of it carried a valid bearer token or got one at TOKEN_PATH:
        #: it then leaves the pool of unauthenticated connections for good
        self.authenticated = False
        #: the request being served carried a valid token (or got one): its latency counts
        self.granted = False
        #: True while it waits for its client (for bytes of a request, or to read a reply):
        #: only then may an unauthenticated connection be closed to make room for another
        self.waiting = False
        #: trio time by which the request head being read must be whole (for a connection
        #: not authenticated yet, its small body too); None: none
        self.deadline: float | None = None
        #: cancelled to close the connection from outside (:meth:`Slots.make_room`)
        self.scope = trio.CancelScope()
        #: the bytes of a request line not yet given to h11 (None: not reading one); see
        #: :func:`ascii_request_line`
        self._line: bytearray | None = None
        #: bytes received between requests and not given to h11 yet: the fast path
        #: (:meth:`fast_request`) reads a head from them, or hands them to h11
        self._pending: bytes | None = None
        #: the request being served was read by the fast path: no body, h11 stays IDLE,
        #: the reply is written here (:meth:`_reply_head`)
        self.fast = False
        #: (fast path) a reply went out / it said the connection closes
        self.replied = False
        self.must_close = False
        #: (fast path) bytes of the reply's body still due (:meth:`send`)
        self._body_left = 0
        #: (fast path) the request's chunked body, read with its head, until it is taken
        self._fast_body: bytes | None = None

    def _receive(self, data: bytes) -> None:
        """Give received bytes to h11; a request line is held back until it is whole (or
        longer than MAX_HEAD, or the client closed) and made ASCII (:func:`ascii_request_line`)."""
        if self._line is None:
            self.h11.receive_data(data)
            return
        self._line += data
        end = self._line.find(b"\n")
        if end < 0 and data and len(self._line) <= MAX_HEAD:
            return
        head = bytes(self._line)
        self._line = None
        if end >= 0:
            head = ascii_request_line(head[:end]) + head[end:]
        self.h11.receive_data(head)
        if not data:
            self.h11.receive_data(b"")

    async def wait_for_request(
        self,
        timeout: float,  # noqa: ASYNC109 - its expiry is an outcome (False), not a cancellation
        idle: set[trio.CancelScope],
    ) -> bool:
        """Wait for the first bytes of the next request: True once some are here, False
        after ``timeout`` or when a stopping gateway cancels the wait. While it waits the
        connection is idle: its scope is in ``idle`` (no byte of a request is lost by
        cancelling it)."""
        if self._pending:  # the next request's bytes came with the last one
            return True
        data, closed = self.h11.trailing_data
        if data or closed:
            return True
        between = self.h11.their_state is h11.IDLE and self.h11.our_state is h11.IDLE
        # one scope for both ends of the wait: its deadline, and a stopping gateway's cancel
        with trio.CancelScope(deadline=trio.current_time() + timeout) as scope:
            idle.add(scope)
            self.waiting = True
            try:
                chunk = await self._receive_next()
                if between:
                    self._pending = chunk  # b"": the client closed
                else:
                    self._receive(chunk)
                return True
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise Drop(f"receive failed: {exc!r}") from exc
            finally:
                self.waiting = False
                idle.discard(scope)
        return False

    async def _receive_next(self) -> bytes:
        """The bytes the client sends next (b"": it closed): :func:`receive_when_readable`."""
        return await receive_when_readable(self.stream, RECV_SIZE)

    def fast_request(self) -> Head | None:
        """The next request's head read without h11 (:func:`parse_fast_head`), if the bytes
        received between requests begin with one of the plain shapes; otherwise None, and
        those bytes go to h11 (:meth:`next_event` reads the request as before)."""
        pending = self._pending
        if pending is None:
            self.fast = False
            return None
        self._pending = None
        parsed = parse_fast_head(pending, chunked=True) if pending else None
        if parsed is None:
            self.fast = False
            self._line = bytearray()  # the request line: made ASCII before h11
            self._receive(pending)
            return None
        head, used = parsed
        if used < len(pending):
            self._pending = pending[used:]  # a pipelined request's first bytes
        self.fast, self.replied, self.must_close = True, False, False
        self._fast_body = head.body
        return head

    @property
    def fast_body(self) -> bool:
        """(fast path) the request came with a body, read with its head and not taken yet."""
        return self.fast and self._fast_body is not None

    def reply_due(self) -> bool:
        """No reply to the request being served has started yet."""
        if self.fast:
            return not self.replied
        return self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    def reusable(self) -> bool:
        """The request and its reply are done and the connection may serve another one."""
        if self.fast:  # (a body nobody read: closed, as h11's state would say)
            return self.replied and not self.must_close and self._fast_body is None
        if self.h11.our_state is h11.MUST_CLOSE or self.h11.their_state is not h11.DONE:
            return False
        try:
            self.h11.start_next_cycle()
        except h11.LocalProtocolError:
            return False
        return True

    async def next_event(self, timeout: float = STALL_TIMEOUT) -> h11.Event | type[h11.PAUSED]:  # noqa: ASYNC109 - a stall is a Drop
        """The next h11 event; a receive waits at most ``timeout`` (then the connection is
        dropped) and never past :attr:`deadline` (then 408, and the connection closes).
        A request of the fast path: its body if it had one (read with its head), then its end."""
        if self.fast:
            body, self._fast_body = self._fast_body, None
            return h11.Data(data=body) if body else h11.EndOfMessage()
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise Reply(
                    exc.error_status_hint,
                    remote_error("IllegalArgumentException", f"bad HTTP request: {exc}"),
                    [("connection", "close")],
                ) from exc
            if event is not h11.NEED_DATA:  # (mypy does not narrow a sentinel class by identity)
                return cast("h11.Event | type[h11.PAUSED]", event)
            if self.h11.they_are_waiting_for_100_continue:
                await self.send(h11.InformationalResponse(status_code=100, headers=[]))
            limit = timeout
            if self.deadline is not None:
                limit = min(limit, self.deadline - trio.current_time())
            self.waiting = True
            try:
                with trio.move_on_after(max(limit, 0.0)) as scope:
                    data = await self.stream.receive_some(RECV_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise Drop(f"receive failed: {exc!r}") from exc
            finally:
                self.waiting = False
            if scope.cancelled_caught:
                if self.deadline is not None and trio.current_time() >= self.deadline:
                    raise Reply(
                        408,
                        remote_error("IllegalArgumentException", "the request head did not arrive whole in time"),
                        [("connection", "close")],
                        reason="Request Timeout",
                    )
                raise Drop("the client stalled")
            self._receive(bytes(data))

    def _encode(self, event: h11.Event) -> bytes:
        """``event`` as bytes for the wire (h11's state moves on); a response says whether the
        connection stays (KEEP_ALIVE_HINT) or closes (the gateway is stopping)."""
        if isinstance(event, h11.Response) and self.closing:
            event = h11.Response(
                status_code=event.status_code, reason=event.reason, headers=[*event.headers, (b"connection", b"close")]
            )
        elif isinstance(event, h11.Response) and not any(k.lower() == b"connection" for k, _ in event.headers):
            event = h11.Response(
                status_code=event.status_code, reason=event.reason, headers=[*event.headers, *KEEP_ALIVE_HINT]
            )
        return self.h11.send(event) or b""

    def _reply_head(self, status: int, headers: list[tuple[bytes, bytes]], reason: bytes) -> bytes:
        """A reply's head (:meth:`_encode` of its Response) built once: the connection headers
        added here, and h11's regular-expression check of every header replaced by the one
        that matters for headers the gateway writes itself: no CR, LF or NUL (no header or
        reply can be injected through a value, e.g. a Location naming a client's path)."""
        for name, value in headers:
            if b"\r" in value or b"\n" in value or b"\0" in value or not name.replace(b"-", b"").isalnum():
                raise ValueError(f"bad reply header {name!r}: {value!r}")
        if self.closing:
            headers.append((b"connection", b"close"))
        elif not any(k == b"connection" for k, _ in headers):
            headers += KEEP_ALIVE_HINT
        if b"\r" in reason or b"\n" in reason:
            raise ValueError(f"bad reason {reason!r}")
        if self.fast:  # what h11 writes for this response to a keep-alive HTTP/1.1 request
            if self.replied:
                raise ValueError("a second reply to one request")
            self.replied = True
            self.must_close = (b"connection", b"close") in headers
            lines = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
            lines += [b"%s: %s\r\n" % (name, value) for name, value in headers]
            lines.append(b"\r\n")
            return b"".join(lines)
        response = h11.Response(status_code=status, headers=headers, reason=reason, _parsed=True)
        return self.h11.send(response) or b""

    async def send(self, event: h11.Event) -> None:
        if self.fast:  # h11's framing check kept: exactly Content-Length bytes of body
            if isinstance(event, h11.Response):
                headers = [(name.lower(), value) for name, value in event.headers]
                self._body_left = int(dict(headers)[b"content-length"])
                data = self._reply_head(event.status_code, headers, bytes(event.reason))
            elif isinstance(event, h11.Data):
                data = bytes(event.data)
                self._body_left -= len(data)
                if self._body_left < 0:
                    raise Drop("a reply body longer than its Content-Length")
            else:
                if self._body_left:
                    raise Drop("a reply body shorter than its Content-Length")
                data = b""
        else:
            data = self._encode(event)
        if data:
            await self.send_bytes(data)

    async def send_bytes(self, data: bytes) -> None:
        """Send ``data`` in steps of SEND_STEP; a step that does not go out within the send
        timeout drops the connection (a client that stops reading must not keep its slot,
        nor the reply's memory, for as long as it keeps the socket open)."""
        view = memoryview(data)
        if len(view) <= SEND_STEP and isinstance(self.stream, trio.SocketStream):
            # a small reply usually fits the socket's buffer at once: written without the
            # timeout's scope and trio's wait (what does not fit goes the usual way)
            try:
                sent = os.write(self.stream.socket.fileno(), view)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                raise Drop(f"send failed: {exc!r}") from exc
            view = view[sent:]
            if not view:
                return  # (the request loop's next receive is the checkpoint)
        for start in range(0, len(view), SEND_STEP):
            self.waiting = True
            try:
                with trio.move_on_after(self.send_timeout) as scope:
                    await self.stream.send_all(view[start : start + SEND_STEP])
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise Drop(f"send failed: {exc!r}") from exc
            finally:
                self.waiting = False
            if scope.cancelled_caught:
                log.info(
                    "closing a connection from %s: it read nothing of its reply for %.0f s",
                    self.peer or "?",
                    self.send_timeout,
                )
                raise Drop("the client does not read its reply")

    async def respond(
        self, status: int, body: bytes = b"", headers: list[tuple[str, str]] | None = None, reason: str = ""
    ) -> None:
        if self.fast and not headers and not reason and not self.closing:
            # the usual reply of the fast path: its head from a template (_PLAIN_REPLY)
            if self.replied:
                raise ValueError("a second reply to one request")
            self.replied = True
            await self.send_bytes(_PLAIN_REPLY % (status, len(body)) + body)
            return
        hdrs = [(b"content-length", str(len(body)).encode())]
        hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or [])]
        # head, body and end in one send: one system call (and one TCP segment) per reply
        data = self._reply_head(status, hdrs, reason.encode("ascii", "replace"))
        if self.fast:
            await self.send_bytes(data + body)
            return
        if body:
            data += self.h11.send(h11.Data(data=body)) or b""
        data += self.h11.send(h11.EndOfMessage()) or b""
        await self.send_bytes(data)

    async def read_small_body(self, limit: int = MAX_SMALL_BODY) -> bytes:
        if self.fast and not self._fast_body:
            return b""
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limit:
                    raise Reply(
                        413,
                        remote_error("IllegalArgumentException", f"request body larger than {limit} bytes"),
                        [("connection", "close")],
                    )
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise Drop("closed in the middle of a request body")

    async def linger(self) -> None:
        """Half-close, then read and discard what the client still sends, for at most
        LINGER seconds: closing a socket with unread bytes sends a reset, which can destroy
        the reply just sent (a 400 or 408 the client never sees)."""
        self.waiting = True
        with trio.move_on_after(LINGER[0]):
            try:
                if isinstance(self.stream, trio.SocketStream):
                    await self.stream.send_eof()
                got = 0
                while got < LINGER[1]:
                    data = await self.stream.receive_some(RECV_SIZE)
                    if not data:
                        break
                    got += len(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        self.waiting = False

    def consume_buffered_body(self) -> None:
        """Discard what of the request body is already received, without waiting for more:
        a refusal of a request whose body is all here (a GET's empty one) keeps the
        connection."""
        self._fast_body = None  # (read whole with its head: nothing to wait for)
        while not self.fast and self.h11.their_state is h11.SEND_BODY:
            try:
                if self.h11.next_event() is h11.NEED_DATA:
                    return
            except h11.RemoteProtocolError:
                return

    async def drain(self) -> None:
        """Read and discard the rest of the request body (memory stays bounded)."""
        self._fast_body = None
        while not self.fast and self.h11.their_state is h11.SEND_BODY:
            event = await self.next_event()
            if isinstance(event, h11.ConnectionClosed):
                raise Drop("closed in the middle of a request body")


#: the connection the current task serves (each connection is one trio task)
CURRENT_CONN: contextvars.ContextVar[Conn | None] = contextvars.ContextVar("sos_gateway_conn", default=None)


class Slots:
    """Who may hold a connection: at most ``total`` at once, ``per_address`` from one client
    address, and ``unauthenticated`` that have not yet shown a valid token (or got one).

    A new connection counts as unauthenticated. When a cap is reached, the oldest
    unauthenticated connection that is waiting for its client (idle, dripping a head, not
    reading its reply) is closed to make room; only if there is none is the newcomer
    refused. So clients without a token can neither take the slots of those with one, nor
    keep a newcomer (who sends its head at once) out for longer than it takes to connect."""

    def __init__(self, total: int, unauthenticated: int, per_address: int) -> None:
        self.total = total
        self.unauthenticated = unauthenticated
        self.per_address = per_address
        self.open: set[Conn] = set()
        #: the unauthenticated ones, oldest first
        self.pending: dict[Conn, None] = {}
        self.by_address: Counter[str] = Counter()

    def admit(self, conn: Conn) -> str | None:
        """Take a slot for ``conn``, making room if needed; None, or why it was refused."""
        if self.by_address[conn.peer] >= self.per_address and not self.make_room(lambda c: c.peer == conn.peer):
            return f"too many connections from {conn.peer or 'this address'}"
        if len(self.open) >= self.total and not self.make_room():
            return "too many connections"
        if len(self.pending) >= self.unauthenticated and not self.make_room():
            return "too many connections without a valid token"
        self.open.add(conn)
        self.pending[conn] = None
        self.by_address[conn.peer] += 1
        return None

    def authenticated(self, conn: Conn) -> None:
        conn.authenticated = True
        self.pending.pop(conn, None)

    def release(self, conn: Conn) -> None:
        if conn in self.open:
            self.open.discard(conn)
            self.pending.pop(conn, None)
            self.by_address[conn.peer] -= 1
            if self.by_address[conn.peer] <= 0:
                del self.by_address[conn.peer]

    def make_room(self, match: Callable[[Conn], bool] = lambda c: True) -> bool:
        """Close the oldest unauthenticated connection (that ``match``) waiting for its
        client; False if there is none."""
        for conn in self.pending:
            if conn.waiting and match(conn):
                log.debug(
                    "closing an unauthenticated connection from %s (open %.0f s) to make room",
                    conn.peer or "?",
                    trio.current_time() - conn.accepted,
                )
                self.release(conn)
                conn.scope.cancel()
                return True
        return False


def peer_address(stream: trio.abc.Stream) -> str:
    """The client's address as the per-address limits count it (address_key)."""
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    try:
        sock = inner.socket  # type: ignore[union-attr]  # SocketStream (TCP) only
        return address_key(str(sock.getpeername()[0]))
    except (AttributeError, OSError, IndexError, TypeError):
        return "?"
