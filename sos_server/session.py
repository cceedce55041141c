"""Session: one per connection. Frames in (sos_wire.Connection), engine calls, frames out.

- Before AUTH only HELLO and PING are answered; any other request gets NOT_AUTHENTICATED
  (an unknown opcode: UNKNOWN_OP, decided by the codec before any of this). An AUTH before
  HELLO is NOT_AUTHENTICATED and is no failed AUTH (it tests no key); a HELLO answered
  UNSUPPORTED_VERSION leaves the connection as before HELLO (another HELLO may follow).
  Frames before AUTH may carry at most ``PRE_AUTH_MAX_BODY`` (4 KiB) of body (TOO_LARGE,
  fatal): HELLO, AUTH and PING need about 100 bytes, and an unauthenticated peer must
  not make the server buffer megabytes. ``max_body`` applies once AUTH succeeded.
- HELLO_OK carries a fresh 32-byte nonce; AUTH proves the key against it. The
  ``MAX_AUTH_FAILURES``-th failed AUTH on a connection is answered and the connection
  closed; the listener may delay each failed AUTH's answer (per-address back-off).
- Revocation: before each request (PING too, once authenticated) the key's file is compared with what it was at AUTH
  (one stat); if it was removed or changed, the proof is checked again against it, and a
  key that no longer proves (or changed role) gets AUTH_FAILED and the connection closes.
- Requests are pipelined: each runs in its own task and its reply carries its request id.
  Appends and seals to one object keep their arrival order (each waits for the previous
  one's *write*, not its sync, so pipelined appends share a group commit).
- TIER_WAIT waits in its own task like every request (at most ``MAX_TIER_WAITS`` per
  connection, BUSY beyond): a wait for the object-store tier holds up nothing else.
- READ is streamed as READ_DATA frames of at most 1 MiB; the last has last=1.
- Replies are bounded per connection: a READ reserves each chunk in a reply budget of
  ``MAX_REPLY_BYTES`` before reading it from storage, LIST its largest possible size;
  at most ``MAX_READ_STREAMS`` READs stream at once; while the budget is full no further
  requests are read from the socket. A send that makes no progress for ``send_timeout``
  (a peer that does not read its replies) closes the connection.
- Every non-fatal error is answered with an ERROR frame and the connection lives on;
  a broken frame is answered (BAD_FRAME or the codec's code) and the connection closes
  (protocol.md 1.8 has the table of which ERRORs close).
- Handshake deadline: a connection not authenticated by ``handshake_deadline`` (trio
  time; the listener sets it ``--handshake-timeout`` after accepting) is closed, whatever
  it sends meanwhile (PINGs, a trickled frame, replies it never reads). Without it a
  crowd of silent connections fills ``--max-connections`` and everyone else gets BUSY.
- Eviction: the listener may evict a connection that has not authenticated yet to make room
  for a newcomer (:meth:`Session.evict`); it gets ERROR BUSY (request id 0) and the close.
- A token-role key (protocol.md 1.6) authenticates, then every request but PING is
  answered FORBIDDEN: it is a gateway client's credential, useless at the server itself.
- Idle timeout: no complete request for ``idle_timeout`` seconds (and nothing in flight)
  closes the connection. Clients reconnect on their next request.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from collections.abc import Callable, Iterable

import trio

from sos_wire import events as ev
from sos_wire.connection import NEED_DATA, Connection, Role
from sos_wire.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from sos_wire.events import KeyRole
from sos_wire.frames import DEFAULT_MAX_BODY, HEADER_LEN, MAX_PING_PAYLOAD, SUPPORTED_VERSIONS, VERSION

from .engine import THREAD_READ_MIN, Engine, ServerError
from .storage import ROLE_APPEND, ROLE_READ, ROLE_TOKEN

__all__ = ["MAX_AUTH_FAILURES", "PRE_AUTH_MAX_BODY", "READ_CHUNK", "SERVER_NAME", "TOKEN_FORBIDDEN", "Session"]

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20  # data bytes per READ_DATA frame
RECV_SIZE = 256 << 10
PRE_AUTH_RECV_SIZE = 16 << 10  # before AUTH: bytes asked of the socket at a time
#: bytes of large-body buffers that all connections together may hold before those bodies
#: have arrived (sos_wire's receive_buffer); beyond it bodies go through the shared buffer
DIRECT_BUDGET = 32 << 20
PRE_AUTH_MAX_BODY = 4096  # frame body limit before AUTH (HELLO, AUTH, PING need ~100 bytes)
MAX_AUTH_FAILURES = 3  # failed AUTHs on one connection; the last is answered, then the close
MAX_IN_FLIGHT = 256  # requests per connection being handled at once
MAX_IN_FLIGHT_BYTES = 64 << 20  # append data per connection being handled at once
MAX_REPLY_BYTES = 8 << 20  # READ/LIST reply bytes per connection produced and not yet sent
MAX_TIER_WAITS = 64  # TIER_WAITs per connection waiting at once (BUSY beyond, protocol.md 1.11)
MAX_READ_STREAMS = 2  # READs per connection streaming at once (each holds a storage buffer)
SEND_SEPARATELY_MIN = 64 << 10  # a payload this big is sent after its header, not joined to it
SEND_STEP = 256 << 10  # a send must make this much progress within send_timeout
_LIST_ENTRY_MAX = 2 + 1024 + 8 + 1  # name str (1.10: at most 1024 bytes), length, sealed
SERVER_NAME = "sos-server/0.1"

_ROLE_WIRE = {ROLE_APPEND: KeyRole.APPEND, ROLE_READ: KeyRole.READ, ROLE_TOKEN: KeyRole.TOKEN}
#: what a token-role key gets for every request but PING (protocol.md 1.6)
TOKEN_FORBIDDEN = (
    "a token key can only prove itself to a gateway: `sos gateway` (POST /oauth2/token) takes it and issues"
    " an append bearer token; requests to sos-server need an append or read key"
)


class _ByteBudget:
    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0
        self._changed = trio.Event()

    async def acquire(self, n: int) -> None:
        while self.used and self.used + n > self.cap:
            await self._changed.wait()
        self.used += n

    async def wait_room(self) -> None:
        """Until less than the cap is used."""
        while self.used >= self.cap:
            await self._changed.wait()

    def release(self, n: int) -> None:
        self.used -= n
        self._changed.set()
        self._changed = trio.Event()


class _DirectBudget:
    """Bytes of body buffers allocated ahead of their data, for the whole process."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.cap:
            return False
        self.used += n
        return True

    def release(self, n: int) -> None:
        self.used -= n


_direct = _DirectBudget(DIRECT_BUDGET)


class _Closing(Exception):
    """The connection must close (after a fatal error or the idle timeout)."""


class Session:
    def __init__(
        self,
        engine: Engine,
        stream: trio.abc.Stream,
        *,
        peer: str = "?",
        idle_timeout: float | None = None,
        handshake_deadline: float = math.inf,
        max_body: int = DEFAULT_MAX_BODY,
        channel_binding: bytes = b"",
        send_timeout: float | None = None,
        on_authenticated: Callable[[], None] | None = None,
        on_auth_failed: Callable[[], float] | None = None,
    ) -> None:
        """*send_timeout*: close when a send makes no progress for that long (None: never).
        *on_authenticated* is called once AUTH succeeded; *on_auth_failed* at each failed
        AUTH, returning how many seconds to wait before answering it."""
        self.engine = engine
        # b"" on plain TCP; inside TLS the binding of the server's certificate (AUTH proof)
        self.channel_binding = channel_binding
        self.metrics = engine.metrics
        self.stream = stream
        #: the plain socket under the stream (None with TLS): large bodies are received into
        #: their own buffer with recv_into (sos_wire.connection, DIRECT_BODY_MIN)
        self._sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._direct_held = 0  # bytes of DIRECT_BUDGET this connection's body buffer holds
        self.peer = peer
        self.idle_timeout = idle_timeout
        self.send_timeout = send_timeout
        self._on_authenticated = on_authenticated
        self._on_auth_failed = on_auth_failed
        self._handshake = trio.CancelScope(deadline=handshake_deadline)
        self.conn = Connection(Role.SERVER, max_body=min(max_body, PRE_AUTH_MAX_BODY))
        self.max_body = max_body
        self.nonce: bytes | None = None
        self.namespace: str | None = None
        self.role: str | None = None
        self._send_lock = trio.Lock()
        self._in_flight = 0
        self._slots = trio.Semaphore(MAX_IN_FLIGHT)
        self._budget = _ByteBudget(MAX_IN_FLIGHT_BYTES)
        self._replies = _ByteBudget(MAX_REPLY_BYTES)
        self._read_streams = trio.Semaphore(MAX_READ_STREAMS)
        self._tier_waits = 0  # TIER_WAITs in flight (at most MAX_TIER_WAITS)
        self._chains: dict[str, trio.Event] = {}  # object name -> write of the latest request
        self._broken = False
        self._closing = False  # after a fatal ERROR: nothing more is sent
        self._auth_failures = 0
        self._auth_ok: ev.Auth | None = None  # the AUTH that succeeded (re-checked for revocation)
        self._key_state: tuple[int, ...] | None = None
        self._scope: trio.CancelScope | None = None  # the whole session's
        self._evicted: str | None = None  # why the listener evicted this connection before AUTH

    # -- output ----------------------------------------------------------------------
    async def _send(self, event: ev.Event) -> None:
        if self._broken or self._closing:
            return
        async with self._send_lock:
            if self._broken or self._closing:
                return
            parts = self.conn.send_parts(event)
            try:
                if len(parts[-1]) < SEND_SEPARATELY_MIN:
                    await self._send_bytes(b"".join(parts))
                else:  # a large payload (READ_DATA) goes out as it is, not joined to its header
                    await self._send_bytes(b"".join(parts[:-1]))
                    await self._send_bytes(parts[-1])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._broken = True
            except trio.Cancelled:  # maybe half a frame went out: nothing may follow it
                self._broken = True
                raise

    async def _send_bytes(self, data: ev.Payload) -> None:
        timeout = self.send_timeout
        if timeout is None:
            await self.stream.send_all(data)
            return
        view = memoryview(data)
        for start in range(0, len(view), SEND_STEP):
            with trio.move_on_after(timeout) as scope:
                await self.stream.send_all(view[start : start + SEND_STEP])
            if scope.cancelled_caught:
                # the peer does not read its replies: without this, the session (and what
                # its requests hold) would live for as long as the peer keeps the socket open
                log.warning("replies not read, closing", extra={"peer": self.peer, "seconds": timeout})
                self.metrics.send_timeouts.inc()
                self._broken = True
                if self._scope is not None:
                    self._scope.cancel()
                return

    async def _send_error(self, request_id: int, code: ErrorCode, message: str, length: int = 0) -> None:
        self.metrics.error(ErrorCode(code).name)
        await self._send(ev.Error(request_id, ErrorCode(code), length, message[:4000]))

    # -- main loop -------------------------------------------------------------------
    async def run(self) -> None:
        log.info("connection opened", extra={"peer": self.peer})
        try:
            async with trio.open_nursery() as nursery:
                self._scope = nursery.cancel_scope
                with self._handshake:  # no requests run before AUTH: nothing else to cancel
                    try:
                        await self._read_loop(nursery)
                    except _Closing:
                        self._closing = True
                        nursery.cancel_scope.cancel()
                if self._handshake.cancelled_caught and self._evicted is not None:
                    log.info("evicted before AUTH, closing", extra={"peer": self.peer, "reason": self._evicted})
                    self.metrics.evicted.inc()
                    with trio.move_on_after(2):  # a few dozen bytes: the socket buffer takes them
                        await self._send_error(0, ErrorCode.BUSY, f"server busy: {self._evicted}")
                    self._closing = True
                    nursery.cancel_scope.cancel()
                elif self._handshake.cancelled_caught:
                    log.info("not authenticated in time, closing", extra={"peer": self.peer})
                    self.metrics.handshake_timeouts.inc()
                    nursery.cancel_scope.cancel()
        finally:
            if self._direct_held:
                _direct.release(self._direct_held)
                self._direct_held = 0
            log.info("connection closed", extra={"peer": self.peer, "namespace": self.namespace})
            with trio.CancelScope(shield=True):
                if self._broken:  # maybe a half-sent frame: no graceful close (TLS close_notify)
                    await trio.aclose_forcefully(self.stream)
                else:
                    with trio.move_on_after(5):
                        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                            await self.stream.aclose()

    def evict(self, why: str) -> bool:
        """Close this connection to make room for a newcomer (the listener's pre-AUTH pool is
        full): ERROR BUSY *why* (request id 0), then the close. False if it authenticated
        already (then it is not touched)."""
        if self.namespace is not None:
            return False
        self._evicted = why
        self._handshake.cancel()
        return True

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        idle = self.idle_timeout or 0.0  # 0: no idle timeout
        deadline = trio.current_time() + idle if idle else float("inf")
        while True:
            # hand out every complete event first
            while True:
                try:
                    event = self.conn.next_event()
                except RemoteProtocolError as exc:
                    if exc.fatal:
                        log.warning("bad frame, closing", extra={"peer": self.peer, "error": exc.message})
                        await self._send_error(exc.request_id, exc.code, exc.message)
                        raise _Closing from None
                    await self._send_error(exc.request_id, exc.code, exc.message)
                    continue
                if event is NEED_DATA:
                    break
                if idle:
                    deadline = trio.current_time() + idle
                await self._dispatch(event, nursery)
            if self.conn.eof or self._broken:
                return
            # replies waiting over their budget: read no further requests until they drain
            # (a peer that never reads them is closed by the send timeout)
            await self._replies.wait_room()
            size = RECV_SIZE if self.namespace is not None else PRE_AUTH_RECV_SIZE
            view = self._direct_view() if self._sock is not None else None
            with trio.move_on_at(deadline) as scope:
                try:
                    if view is not None:  # the rest of a large body, straight into its buffer
                        with view:
                            got = await self._sock.recv_into(view)  # type: ignore[union-attr]
                        data = None
                    else:
                        data = await self.stream.receive_some(size)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return
            if scope.cancelled_caught:
                if self._in_flight:
                    deadline = trio.current_time() + idle
                    continue
                log.info("idle timeout, closing", extra={"peer": self.peer, "seconds": idle})
                raise _Closing
            if data is None:
                self.conn.received(got)
            else:
                self.conn.receive_data(data)

    def _direct_view(self) -> memoryview | None:
        """The rest of a large body to recv_into, if it has (or may now get) its own buffer.
        Buffers allocated before their bytes arrive are bounded server-wide (DIRECT_BUDGET):
        announced lengths alone cannot make the server allocate more than that."""
        view = self.conn.receive_buffer(allocate=False)
        if view is not None:
            return view
        if self._direct_held:  # the body this connection held budget for is complete
            _direct.release(self._direct_held)
            self._direct_held = 0
        want = self.conn.awaiting_body
        if want and _direct.take(want):
            self._direct_held = want
            return self.conn.receive_buffer()
        return None

    async def _dispatch(self, event: ev.Event, nursery: trio.Nursery) -> None:
        rid = event.request_id
        self.metrics.request(type(event).__name__)
        if isinstance(event, ev.Ping):
            if self._auth_ok is not None:  # PINGs must not keep a revoked key's connection open
                await self._close_if_revoked(rid, self._auth_ok)
            if len(event.payload) > MAX_PING_PAYLOAD:
                await self._send_error(rid, ErrorCode.BAD_REQUEST, f"PING payload over {MAX_PING_PAYLOAD} bytes")
            else:
                await self._send(ev.Pong(rid, event.payload))
            return
        if isinstance(event, ev.Hello):
            await self._hello(event)
            return
        if isinstance(event, ev.Auth):
            await self._auth(event)
            return
        auth = self._auth_ok
        if self.namespace is None or auth is None:
            await self._send_error(rid, ErrorCode.NOT_AUTHENTICATED, f"{type(event).__name__.upper()} before AUTH")
            return
        await self._close_if_revoked(rid, auth)
        if self.role == ROLE_TOKEN:
            await self._send_error(rid, ErrorCode.FORBIDDEN, f"{type(event).__name__.upper()}: {TOKEN_FORBIDDEN}")
            return
        size = len(event.data) if isinstance(event, ev.Append) else 0
        await self._slots.acquire()
        await self._budget.acquire(size)
        self._in_flight += 1
        if isinstance(event, (ev.Append, ev.Seal)):
            prev = self._chains.get(event.name)
            mine = self._chains[event.name] = trio.Event()
            nursery.start_soon(self._handle_write, event, prev, mine, size)
        else:
            nursery.start_soon(self._handle, event, size)

    async def _close_if_revoked(self, rid: int, auth: ev.Auth) -> None:
        """Answer request *rid* AUTH_FAILED and close if the session's key was revoked.
        Every request after AUTH is checked, PING too: otherwise PINGs alone would keep a
        revoked key's connection (and its authenticated slot) open for good."""
        if not self._key_revoked(auth):
            return
        log.warning(
            "key revoked, closing",
            extra={"peer": self.peer, "namespace": self.namespace, "key_id": auth.key_id.hex()},
        )
        await self._send_error(
            rid,
            ErrorCode.AUTH_FAILED,
            f"key {auth.key_id.hex()} of namespace {self.namespace!r} was removed or changed"
            " since AUTH: closing the connection",
        )
        raise _Closing

    # -- handshake -------------------------------------------------------------------
    async def _hello(self, event: ev.Hello) -> None:
        rid = event.request_id
        if self.nonce is not None:
            await self._send_error(rid, ErrorCode.BAD_REQUEST, "HELLO was already sent on this connection")
            return
        if not (event.min_version <= VERSION <= event.max_version) or event.min_version > event.max_version:
            await self._send_error(
                rid,
                ErrorCode.UNSUPPORTED_VERSION,
                f"client speaks versions {event.min_version}..{event.max_version}, "
                f"server speaks {', '.join(map(str, SUPPORTED_VERSIONS))}",
            )
            return
        self.nonce = secrets.token_bytes(32)
        await self._send(ev.HelloOk(rid, VERSION, self.nonce, self.max_body, SERVER_NAME))

    async def _auth(self, event: ev.Auth) -> None:
        rid = event.request_id
        if self.nonce is None:
            await self._send_error(rid, ErrorCode.NOT_AUTHENTICATED, "send HELLO before AUTH")
            return
        if self.namespace is not None:
            await self._send_error(rid, ErrorCode.BAD_REQUEST, f"already authenticated to {self.namespace!r}")
            return
        key_state = self.engine.storage.key_state(event.namespace, event.key_id)  # before the key is read
        try:
            role = self._check_key(event, self.nonce)
        except ServerError as exc:
            log.warning(
                "auth failed", extra={"peer": self.peer, "namespace": event.namespace, "key_id": event.key_id.hex()}
            )
            self._auth_failures += 1
            delay = self._on_auth_failed() if self._on_auth_failed is not None else 0.0
            if delay > 0:
                await trio.sleep(delay)
            last = self._auth_failures >= MAX_AUTH_FAILURES
            message = exc.message + (f"; {MAX_AUTH_FAILURES} failed AUTHs: closing the connection" if last else "")
            await self._send_error(rid, exc.code, message, exc.length)
            if last:
                raise _Closing from None
            return
        self.namespace, self.role = event.namespace, role
        self._auth_ok, self._key_state = event, key_state
        self.conn.max_body = self.max_body
        self._handshake.deadline = math.inf
        if self._on_authenticated is not None:
            self._on_authenticated()
        log.info(
            "authenticated",
            extra={"peer": self.peer, "namespace": self.namespace, "role": role, "key_id": event.key_id.hex()},
        )
        await self._send(ev.AuthOk(rid, _ROLE_WIRE[role]))

    def _check_key(self, event: ev.Auth, nonce: bytes) -> str:
        """The role of the key *event* proves itself with over *nonce* (ServerError AUTH_FAILED
        if it does not)."""
        return self.engine.authenticate(event.namespace, event.key_id, nonce, event.proof, self.channel_binding)

    def _key_revoked(self, auth: ev.Auth) -> bool:
        """True if the key this session authenticated with (*auth*) was removed, or changed so
        that the AUTH no longer proves it or its role differs. One stat when nothing changed."""
        state = self.engine.storage.key_state(auth.namespace, auth.key_id)
        if state is not None and state == self._key_state:
            return False
        if self.nonce is None:  # not reached: AUTH succeeded after HELLO
            return True
        try:
            role = self._check_key(auth, self.nonce)
        except ServerError:
            return True
        if role != self.role:
            return True
        self._key_state = state
        return False

    # -- requests --------------------------------------------------------------------
    def _session_key(self) -> tuple[str, str]:
        """(namespace, role) of the session: requests are dispatched only after AUTH."""
        if self.namespace is None or self.role is None:
            raise ServerError(ErrorCode.NOT_AUTHENTICATED, "request before AUTH")
        return self.namespace, self.role

    async def _handle_write(
        self, event: ev.Append | ev.Seal, prev: trio.Event | None, mine: trio.Event, size: int
    ) -> None:
        rid = event.request_id
        try:
            try:
                namespace, role = self._session_key()
                if prev is not None:
                    await prev.wait()
                if isinstance(event, ev.Append):
                    pending = await self.engine.append_begin(
                        namespace, role, event.name, event.offset, event.epoch, event.crc, event.data
                    )
                else:
                    pending = await self.engine.seal_begin(namespace, role, event.name, event.epoch)
            finally:
                mine.set()
                if self._chains.get(event.name) is mine:
                    del self._chains[event.name]
            length = await self.engine.finish(pending)
            if isinstance(event, ev.Append):
                await self._send(ev.AppendOk(rid, length))
            else:
                await self._send(ev.SealOk(rid, length))
        except ServerError as exc:
            await self._send_error(rid, exc.code, exc.message, exc.length)
        except Exception as exc:  # a bug or an I/O surprise: answer it, keep serving
            log.exception("internal error handling %s", type(event).__name__, extra={"peer": self.peer})
            await self._send_error(rid, ErrorCode.INTERNAL, f"internal server error: {type(exc).__name__}")
        finally:
            self._done(size)

    async def _handle(self, event: ev.Event, size: int) -> None:
        rid = event.request_id
        try:
            namespace, role = self._session_key()
            if isinstance(event, ev.Stat):
                length, sealed = self.engine.stat(namespace, event.name)
                await self._send(ev.StatOk(rid, length, sealed))
            elif isinstance(event, ev.List):
                await self._list(event)
            elif isinstance(event, ev.Read):
                await self._read(event)
            elif isinstance(event, ev.Fence):
                epoch = await self.engine.fence(namespace, role, event.epoch)
                await self._send(ev.FenceOk(rid, epoch))
            elif isinstance(event, ev.TierWait):
                await self._tier_wait(event, namespace)
            else:
                await self._send_error(rid, ErrorCode.BAD_REQUEST, f"{type(event).__name__} is not a request")
        except ServerError as exc:
            await self._send_error(rid, exc.code, exc.message, exc.length)
        except LocalProtocolError as exc:
            log.error("could not encode a reply: %s", exc.message, extra={"peer": self.peer})
            await self._send_error(rid, ErrorCode.INTERNAL, f"reply could not be encoded: {exc.message}")
        except Exception as exc:
            log.exception("internal error handling %s", type(event).__name__, extra={"peer": self.peer})
            await self._send_error(rid, ErrorCode.INTERNAL, f"internal server error: {type(exc).__name__}")
        finally:
            self._done(size)

    async def _tier_wait(self, event: ev.TierWait, namespace: str) -> None:
        if self._tier_waits >= MAX_TIER_WAITS:
            raise ServerError(ErrorCode.BUSY, f"{MAX_TIER_WAITS} TIER_WAITs in flight on this connection already")
        self._tier_waits += 1
        try:
            tiered = await self.engine.tier_wait(namespace, event.name, event.offset, event.timeout_ms)
        finally:
            self._tier_waits -= 1
        await self._send(ev.TierWaitOk(event.request_id, tiered))

    def _done(self, size: int) -> None:
        self._in_flight -= 1
        self._budget.release(size)
        self._slots.release()

    async def _list(self, event: ev.List) -> None:
        # reserve the largest reply this LIST can have before the engine builds it
        limits = self.engine.limits
        count = min(max(event.limit, 0), limits.max_list) or limits.max_list
        bound = HEADER_LEN + 5 + count * _LIST_ENTRY_MAX
        await self._replies.acquire(bound)
        try:
            entries, more = self.engine.list(self._session_key()[0], event.prefix, event.after, event.limit)
            await self._send(ev.ListOk(event.request_id, tuple(ev.ListEntry(*e) for e in entries), more))
        finally:
            self._replies.release(bound)

    async def _read(self, event: ev.Read) -> None:
        async with self._read_streams:
            await self._stream_read(event)

    async def _stream_read(self, event: ev.Read) -> None:
        rid = event.request_id
        want, pieces = self.engine.open_read(self._session_key()[0], event.name, event.offset, event.length)
        offset = event.offset
        sent = 0
        threaded = want >= THREAD_READ_MIN
        chunker = _Chunker(pieces)
        while True:
            reserved = min(READ_CHUNK, want - sent)
            await self._replies.acquire(reserved)  # before the chunk exists
            try:
                if threaded:
                    chunk = await trio.to_thread.run_sync(chunker.take, READ_CHUNK)
                else:
                    chunk = chunker.take(READ_CHUNK)
                sent += len(chunk)
                last = sent >= want
                if not chunk and not last:  # object shorter than promised (cannot happen)
                    raise ServerError(ErrorCode.INTERNAL, "read ended early")
                await self._send(ev.ReadData(rid, offset, last, chunk))
            finally:
                self._replies.release(reserved)
            self.metrics.read_bytes.inc(len(chunk))
            offset += len(chunk)
            if last:
                return


class _Chunker:
    """Cuts the storage's verified pieces (one per stored frame, up to 8 MiB) into chunks."""

    def __init__(self, pieces: Iterable[memoryview]) -> None:
        self.pieces = iter(pieces)
        self.rest: memoryview | None = None

    def take(self, limit: int) -> bytes | memoryview:
        """Up to ``limit`` bytes: a view of one piece when it covers them (no copy), else
        the pieces joined."""
        first = self.rest if self.rest is not None and len(self.rest) else next(self.pieces, None)
        if first is None:
            self.rest = None
            return b""
        if len(first) >= limit:
            self.rest = first[limit:]
            return first[:limit]
        out = [first]
        size = len(first)
        self.rest = None
        while size < limit:
            piece = next(self.pieces, None)
            if piece is None:
                break
            room = limit - size
            if len(piece) > room:
                piece, self.rest = piece[:room], piece[room:]
            out.append(piece)
            size += len(piece)
        return b"".join(out)
