"""Listener: TCP (optionally TLS) accept loop, connection cap, one Session per connection."""

from __future__ import annotations

import logging
import math
import re
import resource
import ssl

import trio

from sos_wire.connection import Connection, Role
from sos_wire.errors import ErrorCode
from sos_wire import events as ev

from .engine import Engine
from .session import Session

__all__ = ["Listener", "ListenError", "raise_nofile_limit", "make_tls_context", "certificate_binding", "tune_malloc"]

log = logging.getLogger("sos_server.listener")


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
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    ok = mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1
    return mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1 and ok


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
    import base64
    import binascii

    from sos_wire.auth import tls_server_end_point

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
        idle_timeout: float | None = None,
        handshake_timeout: float | None = None,
    ) -> None:
        self.engine = engine
        self.host, self.port = host, port
        self.tls = tls
        if tls is not None and not channel_binding:
            raise ValueError("a TLS listener needs the channel binding of its certificate (certificate_binding)")
        # what every session of a TLS listener binds AUTH proofs to (protocol.md 1.6)
        self.channel_binding: bytes = (channel_binding or b"") if tls is not None else b""
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.handshake_timeout = handshake_timeout
        self.open = 0
        self.address: tuple[str, int] | None = None

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen, report the bound (host, port) through task_status, serve until cancelled.

        Raises ListenError (before task_status.started) if the address cannot be bound."""
        try:
            if self.tls is not None:
                listeners = await trio.open_ssl_over_tcp_listeners(self.port, self.tls, host=self.host)
                sock = listeners[0].transport_listener.socket
            else:
                listeners = await trio.open_tcp_listeners(self.port, host=self.host)
                sock = listeners[0].socket
        except OSError as exc:
            raise ListenError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from None
        self.address = sock.getsockname()[:2]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._handle, listeners)
            task_status.started(self.address)

    async def _handle(self, stream) -> None:
        try:
            sock = stream.transport_stream.socket if self.tls else stream.socket
            peer = "%s:%d" % sock.getpeername()[:2]
        except OSError:
            peer = "?"
        metrics = self.engine.metrics
        metrics.connections_total.inc()
        if self.open >= self.max_connections:
            await self._refuse(stream, peer)
            return
        self.open += 1
        metrics.connections.inc()
        # HELLO/AUTH (and TLS) must be done by then: a connection slot is not free
        now = trio.current_time()
        deadline = now + self.handshake_timeout if self.handshake_timeout else math.inf
        try:
            if self.tls is not None:
                try:
                    with trio.fail_at(min(deadline, now + 30)):
                        await stream.do_handshake()
                except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError) as exc:
                    log.warning("TLS handshake failed", extra={"peer": peer, "error": str(exc)})
                    await trio.aclose_forcefully(stream)
                    return
            session = Session(
                self.engine, stream, peer=peer, idle_timeout=self.idle_timeout, handshake_deadline=deadline,
                channel_binding=self.channel_binding,
            )
            await session.run()
        finally:
            self.open -= 1
            metrics.connections.dec()

    async def _refuse(self, stream, peer: str) -> None:
        log.warning("too many connections, refusing", extra={"peer": peer, "max": self.max_connections})
        self.engine.metrics.error(ErrorCode.BUSY.name)
        conn = Connection(Role.SERVER)
        data = conn.send(ev.Error(0, ErrorCode.BUSY, 0, f"server busy: {self.max_connections} connections open"))
        with trio.move_on_after(5):
            try:
                await stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError):
                pass
        await trio.aclose_forcefully(stream)
