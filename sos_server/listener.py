"""Listener: TCP (optionally TLS) accept loop, connection caps, one Session per connection.

A connection is refused with ERROR BUSY (request id 0) when
``max_unauthenticated_per_address`` connections from the peer's address (an IPv6 address
counts by its /64) have not authenticated yet, or when ``max_connections`` are open and
all of them authenticated. When ``max_unauthenticated`` connections have not
authenticated yet (or ``max_connections`` are open), the newcomer is not refused: the
*oldest* unauthenticated connection is evicted to make room (ERROR BUSY, request id 0,
then the close; one still in its TLS handshake is just closed). Oldest first, not "least
progress first": a newcomer has made the least progress of all, and a crowd that sends
HELLO on every connection would otherwise have each real client evicted by the next
connection the crowd opens. So silent connections from many addresses cannot lock real
clients out: a client that completes HELLO and AUTH before ``max_unauthenticated`` newer
connections arrive always gets in. Failed AUTHs are answered at a bounded rate per
address (``AuthFailures``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ctypes
import ctypes.util
import logging
import math
import re
import resource
import ssl

import trio

from sos_wire import events as ev
from sos_wire.addresses import address_key
from sos_wire.auth import tls_server_end_point
from sos_wire.connection import Connection, Role
from sos_wire.errors import ErrorCode

from .engine import Engine
from .session import Session

__all__ = [
    "AuthFailures",
    "ListenError",
    "Listener",
    "certificate_binding",
    "make_tls_context",
    "raise_nofile_limit",
    "tune_malloc",
]

log = logging.getLogger(__name__)

#: what the accept loop hands a connection's handler: TCP, or TLS over TCP
AcceptedStream = trio.SocketStream | trio.SSLStream[trio.SocketStream]


def raise_nofile_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise RLIMIT_NOFILE: %s", exc)
    return soft


def tune_malloc() -> bool:
    """Keep freed frame buffers in the heap instead of giving them back to the kernel.

    Every 1 MiB append allocates MiB-sized buffers (socket reads, the frame, its data);
    with glibc's defaults each comes from a fresh mmap and is paid for in page faults,
    ~1.5 ms of CPU per MiB on these VMs (measured: 1.77 ms -> 0.17 ms per 1 MiB frame
    through the codec). No-op where glibc's mallopt is not available."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    ok: bool = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1
    trimmed: bool = mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1
    return trimmed and ok


def make_tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    return ctx


_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----\s+(.+?)-----END CERTIFICATE-----", re.DOTALL)


def certificate_binding(cert: str) -> bytes:
    """The AUTH channel binding (protocol.md 1.6) of a server using the PEM file *cert*:
    tls-server-end-point of its first certificate, the one the server presents (as
    OpenSSL's load_cert_chain takes it). ValueError if the file holds no certificate."""
    with open(cert, "rb") as f:
        m = _PEM_CERT.search(f.read())
    if m is None:
        raise ValueError(f"{cert}: no PEM certificate in it")
    try:
        der = base64.b64decode(b"".join(m.group(1).split()), validate=True)
    except binascii.Error:
        raise ValueError(f"{cert}: the first certificate is not valid base64") from None
    return tls_server_end_point(der)


class ListenError(Exception):
    """The listening address cannot be bound (in use, bad host, no permission)."""


class AuthFailures:
    """Failed AUTHs per address, as a token bucket: *burst* of them are answered at once,
    then at most *rate* a second; the answer to one over the rate waits until it fits
    (at most *cap* seconds). Successful AUTHs are never delayed."""

    def __init__(self, *, rate: float = 2.0, burst: int = 10, cap: float = 5.0, max_addresses: int = 10_000):
        self.rate, self.burst, self.cap, self.max_addresses = rate, burst, cap, max_addresses
        self._seen: dict[str, tuple[float, float]] = {}  # address -> (tokens, when), oldest first

    def failed(self, address: str, now: float) -> float:
        """Record a failed AUTH from *address* at *now*; returns the seconds to wait before answering."""
        tokens, when = self._seen.pop(address, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - when) * self.rate) - 1
        tokens = max(tokens, -self.cap * self.rate)  # the debt of waiting answers is bounded too
        self._seen[address] = (tokens, now)
        while len(self._seen) > self.max_addresses:
            del self._seen[next(iter(self._seen))]
        return 0.0 if tokens >= 0 else min(-tokens / self.rate, self.cap)


class _Waiting:
    """A connection that has not authenticated yet, as the eviction queue holds it."""

    __slots__ = ("evicted", "scope", "session")

    def __init__(self) -> None:
        self.scope = trio.CancelScope()  # the connection's whole handling, TLS handshake included
        self.session: Session | None = None  # once the TLS handshake (if any) is done
        self.evicted = False

    def evict(self, why: str) -> None:
        self.evicted = True
        if self.session is None:
            self.scope.cancel()  # in its TLS handshake: no channel to say BUSY on yet
        else:
            self.session.evict(why)  # ERROR BUSY, then the close


class Listener:
    def __init__(
        self,
        engine: Engine,
        *,
        host: str = "127.0.0.1",
        port: int = 7070,
        tls: ssl.SSLContext | None = None,
        channel_binding: bytes | None = None,
        max_connections: int = 1024,
        max_unauthenticated: int = 128,
        max_unauthenticated_per_address: int = 8,
        idle_timeout: float | None = None,
        handshake_timeout: float | None = None,
        send_timeout: float | None = None,
    ) -> None:
        self.engine = engine
        self.host, self.port = host, port
        self.tls = tls
        if tls is not None and not channel_binding:
            raise ValueError("a TLS listener needs the channel binding of its certificate (certificate_binding)")
        # what every session of a TLS listener binds AUTH proofs to (protocol.md 1.6)
        self.channel_binding: bytes = (channel_binding or b"") if tls is not None else b""
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.max_unauthenticated_per_address = max_unauthenticated_per_address
        self.idle_timeout = idle_timeout
        self.handshake_timeout = handshake_timeout
        self.send_timeout = send_timeout
        self.open = 0
        self.unauthenticated = 0
        self._unauthenticated_by: dict[str, int] = {}  # address_key -> unauthenticated connections
        #: connections not authenticated (nor evicted) yet, oldest first: the eviction queue
        self._waiting: dict[int, _Waiting] = {}
        self._evicting = 0  # connections evicted that have not closed yet (not counted as open)
        self.auth_failures = AuthFailures()
        self.address: tuple[str, int] | None = None

    async def serve(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, report the bound (host, port) through task_status, serve until cancelled.

        Raises ListenError (before task_status.started) if the address cannot be bound."""
        listeners: list[trio.abc.Listener[AcceptedStream]]
        try:
            if self.tls is not None:
                ssl_listeners = await trio.open_ssl_over_tcp_listeners(self.port, self.tls, host=self.host)
                first = ssl_listeners[0].transport_listener
                listeners = list(ssl_listeners)
            else:
                tcp_listeners = await trio.open_tcp_listeners(self.port, host=self.host)
                first = tcp_listeners[0]
                listeners = list(tcp_listeners)
        except OSError as exc:
            raise ListenError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from None
        if not isinstance(first, trio.SocketListener):  # pragma: no cover - trio's TLS runs over TCP listeners
            raise ListenError(f"cannot tell the address of {type(first).__name__}")
        self.address = first.socket.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._handle, listeners)
            task_status.started(self.address)

    def _refusal(self, addr: str) -> str | None:
        """Why a new connection from *addr* is refused, or None (then :meth:`_make_room`)."""
        if self._unauthenticated_by.get(addr, 0) >= self.max_unauthenticated_per_address:
            return f"{self.max_unauthenticated_per_address} connections from {addr} not authenticated yet"
        if self.open - self._evicting >= self.max_connections and not self._waiting:
            return f"{self.max_connections} connections open, all authenticated"
        return None

    def _make_room(self) -> None:
        """Evict the oldest unauthenticated connections the newcomer needs the slot of."""
        if len(self._waiting) >= self.max_unauthenticated:
            self._evict_oldest(f"{self.max_unauthenticated} connections not authenticated yet")
        if self.open - self._evicting >= self.max_connections and self._waiting:
            self._evict_oldest(f"{self.max_connections} connections open")

    def _evict_oldest(self, why: str) -> None:
        key = next(iter(self._waiting))
        victim = self._waiting.pop(key)
        self._evicting += 1
        log.info("evicting the oldest unauthenticated connection", extra={"reason": why})
        victim.evict(
            f"{why}: the oldest connection that has not authenticated makes room for a newer one"
            " (send HELLO and AUTH at once after connecting)"
        )

    def _unauthenticated_delta(self, addr: str, n: int) -> None:
        self.unauthenticated += n
        self.engine.metrics.unauthenticated.inc(n)
        left = self._unauthenticated_by.get(addr, 0) + n
        if left:
            self._unauthenticated_by[addr] = left
        else:
            del self._unauthenticated_by[addr]

    async def _handle(self, stream: AcceptedStream) -> None:
        try:
            sock = stream.transport_stream.socket if isinstance(stream, trio.SSLStream) else stream.socket
            host, port = sock.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            host = peer = "?"
        addr = address_key(host)
        metrics = self.engine.metrics
        metrics.connections_total.inc()
        why = self._refusal(addr)
        if why is not None:
            await self._refuse(stream, peer, why)
            return
        self._make_room()
        self.open += 1
        metrics.connections.inc()
        self._unauthenticated_delta(addr, 1)
        authenticated = False
        waiting = _Waiting()
        self._waiting[id(waiting)] = waiting

        def on_authenticated() -> None:
            nonlocal authenticated
            authenticated = True
            self._waiting.pop(id(waiting), None)
            self._unauthenticated_delta(addr, -1)

        def on_auth_failed() -> float:
            return self.auth_failures.failed(addr, trio.current_time())

        # HELLO/AUTH (and TLS) must be done by then: a connection slot is not free
        now = trio.current_time()
        deadline = now + self.handshake_timeout if self.handshake_timeout else math.inf
        try:
            with waiting.scope:
                if isinstance(stream, trio.SSLStream):  # a TLS listener's
                    try:
                        with trio.fail_at(min(deadline, now + 30)):
                            await stream.do_handshake()
                    except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError) as exc:
                        cause = exc.__cause__ or exc  # trio's BrokenResourceError wraps the SSLError
                        reason = f"{type(cause).__name__}: {cause}".rstrip(": ")
                        log.warning("TLS handshake failed", extra={"peer": peer, "error": reason})
                        await trio.aclose_forcefully(stream)
                        return
                session = waiting.session = Session(
                    self.engine,
                    stream,
                    peer=peer,
                    idle_timeout=self.idle_timeout,
                    handshake_deadline=deadline,
                    channel_binding=self.channel_binding,
                    send_timeout=self.send_timeout,
                    on_authenticated=on_authenticated,
                    on_auth_failed=on_auth_failed,
                )
                await session.run()
            if waiting.scope.cancelled_caught:  # evicted in its TLS handshake
                metrics.evicted.inc()
                await trio.aclose_forcefully(stream)
        finally:
            self.open -= 1
            metrics.connections.dec()
            self._waiting.pop(id(waiting), None)
            if waiting.evicted:
                self._evicting -= 1
            if not authenticated:
                self._unauthenticated_delta(addr, -1)

    async def _refuse(self, stream: AcceptedStream, peer: str, why: str) -> None:
        log.warning("too many connections, refusing", extra={"peer": peer, "reason": why})
        self.engine.metrics.error(ErrorCode.BUSY.name)
        conn = Connection(Role.SERVER)
        data = conn.send(ev.Error(0, ErrorCode.BUSY, 0, f"server busy: {why}"))
        with trio.move_on_after(5):
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError):
                await stream.send_all(data)
        await trio.aclose_forcefully(stream)
