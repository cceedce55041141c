"""Session: one per connection. Frames in (sos_wire.Connection), engine calls, frames out.

- Before AUTH only HELLO and PING are answered; anything else gets NOT_AUTHENTICATED.
- HELLO_OK carries a fresh 32-byte nonce; AUTH proves the key against it.
- Requests are pipelined: each runs in its own task and its reply carries its request id.
  Appends and seals to one object keep their arrival order (each waits for the previous
  one's *write*, not its sync, so pipelined appends share a group commit).
- READ is streamed as READ_DATA frames of at most 1 MiB; the last has last=1.
- Every non-fatal error is answered with an ERROR frame and the connection lives on;
  a broken frame is answered (BAD_FRAME or the codec's code) and the connection closes.
- Handshake deadline: a connection not authenticated by ``handshake_deadline`` (trio
  time; the listener sets it ``--handshake-timeout`` after accepting) is closed, whatever
  it sends meanwhile (PINGs, a trickled frame, replies it never reads). Without it a
  crowd of silent connections fills ``--max-connections`` and everyone else gets BUSY.
- Idle timeout: no complete request for ``idle_timeout`` seconds (and nothing in flight)
  closes the connection. Clients reconnect on their next request.
"""

from __future__ import annotations

import logging
import math
import secrets

import trio

from sos_wire import events as ev
from sos_wire.connection import NEED_DATA, Connection, Role
from sos_wire.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from sos_wire.events import KeyRole
from sos_wire.frames import DEFAULT_MAX_BODY, MAX_PING_PAYLOAD, SUPPORTED_VERSIONS, VERSION

from .engine import Engine, ServerError, THREAD_READ_MIN
from .storage import ROLE_APPEND

__all__ = ["Session", "READ_CHUNK", "SERVER_NAME"]

log = logging.getLogger("sos_server.session")

READ_CHUNK = 1 << 20  # data bytes per READ_DATA frame
RECV_SIZE = 256 << 10
MAX_IN_FLIGHT = 256  # requests per connection being handled at once
MAX_IN_FLIGHT_BYTES = 64 << 20  # append data per connection being handled at once
SERVER_NAME = "sos-server/0.1"

_ROLE_WIRE = {ROLE_APPEND: KeyRole.APPEND, "read": KeyRole.READ}


class _ByteBudget:
    def __init__(self, cap: int) -> None:
        self.cap, self.used = cap, 0
        self._changed = trio.Event()

    async def acquire(self, n: int) -> None:
        while self.used and self.used + n > self.cap:
            await self._changed.wait()
        self.used += n

    def release(self, n: int) -> None:
        self.used -= n
        self._changed.set()
        self._changed = trio.Event()


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
    ) -> None:
        self.engine = engine
        # b"" on plain TCP; inside TLS the binding of the server's certificate (AUTH proof)
        self.channel_binding = channel_binding
        self.metrics = engine.metrics
        self.stream = stream
        self.peer = peer
        self.idle_timeout = idle_timeout
        self._handshake = trio.CancelScope(deadline=handshake_deadline)
        self.conn = Connection(Role.SERVER, max_body=max_body)
        self.max_body = max_body
        self.nonce: bytes | None = None
        self.namespace: str | None = None
        self.role: str | None = None
        self._send_lock = trio.Lock()
        self._in_flight = 0
        self._slots = trio.Semaphore(MAX_IN_FLIGHT)
        self._budget = _ByteBudget(MAX_IN_FLIGHT_BYTES)
        self._chains: dict[str, trio.Event] = {}  # object name -> write of the latest request
        self._broken = False

    # -- output ----------------------------------------------------------------------
    async def _send(self, event) -> None:
        if self._broken:
            return
        async with self._send_lock:
            data = self.conn.send(event)
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._broken = True

    async def _send_error(self, request_id: int, code: ErrorCode, message: str, length: int = 0) -> None:
        self.metrics.error(ErrorCode(code).name)
        await self._send(ev.Error(request_id, ErrorCode(code), length, message[:4000]))

    # -- main loop -------------------------------------------------------------------
    async def run(self) -> None:
        log.info("connection opened", extra={"peer": self.peer})
        try:
            async with trio.open_nursery() as nursery:
                with self._handshake:  # no requests run before AUTH: nothing else to cancel
                    try:
                        await self._read_loop(nursery)
                    except _Closing:
                        nursery.cancel_scope.cancel()
                if self._handshake.cancelled_caught:
                    log.info("not authenticated in time, closing", extra={"peer": self.peer})
                    self.metrics.handshake_timeouts.inc()
                    nursery.cancel_scope.cancel()
        finally:
            log.info("connection closed", extra={"peer": self.peer, "namespace": self.namespace})
            with trio.CancelScope(shield=True):
                with trio.move_on_after(5):
                    try:
                        await self.stream.aclose()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass

    async def _read_loop(self, nursery: trio.Nursery) -> None:
        idle = self.idle_timeout
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
            with trio.move_on_at(deadline) as scope:
                try:
                    data = await self.stream.receive_some(RECV_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
            if scope.cancelled_caught:
                if self._in_flight:
                    deadline = trio.current_time() + idle
                    continue
                log.info("idle timeout, closing", extra={"peer": self.peer, "seconds": idle})
                raise _Closing
            self.conn.receive_data(data)

    async def _dispatch(self, event, nursery: trio.Nursery) -> None:
        rid = event.request_id
        self.metrics.request(type(event).__name__)
        if isinstance(event, ev.Ping):
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
        if self.namespace is None:
            await self._send_error(rid, ErrorCode.NOT_AUTHENTICATED, f"{type(event).__name__.upper()} before AUTH")
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

    # -- handshake -------------------------------------------------------------------
    async def _hello(self, event: ev.Hello) -> None:
        rid = event.request_id
        if self.nonce is not None:
            await self._send_error(rid, ErrorCode.BAD_REQUEST, "HELLO was already sent on this connection")
            return
        if not (event.min_version <= VERSION <= event.max_version) or event.min_version > event.max_version:
            await self._send_error(
                rid, ErrorCode.UNSUPPORTED_VERSION,
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
        try:
            role = self.engine.authenticate(
                event.namespace, event.key_id, self.nonce, event.proof, self.channel_binding
            )
        except ServerError as exc:
            log.warning(
                "auth failed", extra={"peer": self.peer, "namespace": event.namespace, "key_id": event.key_id.hex()}
            )
            await self._send_error(rid, exc.code, exc.message, exc.length)
            return
        self.namespace, self.role = event.namespace, role
        self._handshake.deadline = math.inf
        log.info("authenticated", extra={"peer": self.peer, "namespace": self.namespace, "role": role})
        await self._send(ev.AuthOk(rid, _ROLE_WIRE[role]))

    # -- requests --------------------------------------------------------------------
    async def _handle_write(self, event, prev: trio.Event | None, mine: trio.Event, size: int) -> None:
        rid = event.request_id
        try:
            try:
                if prev is not None:
                    await prev.wait()
                if isinstance(event, ev.Append):
                    pending = await self.engine.append_begin(
                        self.namespace, self.role, event.name, event.offset, event.epoch, event.crc, event.data
                    )
                else:
                    pending = await self.engine.seal_begin(self.namespace, self.role, event.name, event.epoch)
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

    async def _handle(self, event, size: int) -> None:
        rid = event.request_id
        try:
            if isinstance(event, ev.Stat):
                length, sealed = self.engine.stat(self.namespace, event.name)
                await self._send(ev.StatOk(rid, length, sealed))
            elif isinstance(event, ev.List):
                entries, more = self.engine.list(self.namespace, event.prefix, event.after, event.limit)
                await self._send(ev.ListOk(rid, tuple(ev.ListEntry(*e) for e in entries), more))
            elif isinstance(event, ev.Read):
                await self._read(event)
            elif isinstance(event, ev.Fence):
                epoch = await self.engine.fence(self.namespace, self.role, event.epoch)
                await self._send(ev.FenceOk(rid, epoch))
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

    def _done(self, size: int) -> None:
        self._in_flight -= 1
        self._budget.release(size)
        self._slots.release()

    async def _read(self, event: ev.Read) -> None:
        rid = event.request_id
        want, pieces = self.engine.open_read(self.namespace, event.name, event.offset, event.length)
        offset = event.offset
        sent = 0
        threaded = want >= THREAD_READ_MIN
        chunker = _Chunker(pieces)
        while True:
            if threaded:
                chunk = await trio.to_thread.run_sync(chunker.take, READ_CHUNK)
            else:
                chunk = chunker.take(READ_CHUNK)
            sent += len(chunk)
            last = sent >= want
            if not chunk and not last:  # object shorter than promised (cannot happen)
                raise ServerError(ErrorCode.INTERNAL, "read ended early")
            await self._send(ev.ReadData(rid, offset, last, chunk))
            self.metrics.read_bytes.inc(len(chunk))
            offset += len(chunk)
            if last:
                return


class _Chunker:
    """Cuts the storage's verified pieces (one per stored frame, up to 8 MiB) into chunks."""

    def __init__(self, pieces) -> None:
        self.pieces = iter(pieces)
        self.rest: memoryview | None = None

    def take(self, limit: int) -> bytes:
        out = []
        size = 0
        while size < limit:
            if self.rest is not None and len(self.rest):
                piece, self.rest = self.rest, None
            else:
                piece = next(self.pieces, None)
                if piece is None:
                    break
            room = limit - size
            if len(piece) > room:
                piece, self.rest = piece[:room], piece[room:]
            out.append(piece)
            size += len(piece)
        return b"".join(out)
