"""The blocking client: one socket, thread-safe, pipelined appends, streamed reads.

with Client("127.0.0.1:7070", key, "ns") as c:
    c.append_many("log", 0, chunks)
    for chunk in c.read_iter("log"):
        ...
"""

from __future__ import annotations

import contextlib
import socket
import ssl as _ssl
import threading
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

from sos_client.core import (
    DEFAULT_WINDOW_BYTES,
    DEFAULT_WINDOW_FRAMES,
    NEXT_CHUNK,
    PROBE_TLS,
    READ_STEP,
    RECV,
    AppendJob,
    ClientSettings,
    Core,
    Op,
    ReadCursor,
    T,
    answers_tls,
    readable_now,
    tier_wait_ms,
)
from sos_client.errors import ConnectionLost
from sos_wire import NEED_DATA, ListEntry, RemoteProtocolError
from sos_wire.events import Payload
from sos_wire.frames import MAX_LIST_LIMIT

__all__ = ["Client"]

RECV_SIZE = 256 * 1024


def _lost(exc: BaseException) -> bool:
    """Reconnecting helps only a lost connection (the server answered nothing else)."""
    return isinstance(exc, ConnectionLost)


def _closed_by_server(sock: socket.socket) -> bool:
    """True if an idle connection (no request in flight) is readable: the server sends
    nothing unasked, so that is its close (EOF, a reset) or a parting ERROR."""
    try:
        if isinstance(sock, _ssl.SSLSocket) and sock.pending():
            return True
        return readable_now(sock.fileno())
    except (OSError, ValueError):
        return True


def _sendmsg_all(sock: socket.socket, parts: list) -> None:
    """sendmsg (writev) every part: a frame's payload goes to the kernel without being
    joined to its header first."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


class Client(ClientSettings):
    """Blocking SOS client for one namespace.

    *server*: ``"host:port"`` (default ``$SOS_SERVER`` or 127.0.0.1:7070); *key*: a
    :class:`sos_wire.Key` or its text (default ``$SOS_KEY``); *timeout*: seconds any
    single wait on the network may take; *tls*: an ``ssl.SSLContext`` (or True for the
    system defaults).  Connects and authenticates immediately.  A lost connection is
    re-established on the next call (one the server closed while idle, before anything is
    sent on it); ``append_many`` and ``read_iter`` resume by themselves.  Safe to share
    between threads (calls are serialized).
    """

    _who = "Client()"

    def _start(self) -> None:
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._connect()

    # -- connection management ----------------------------------------------------------
    def _connect(self) -> Core:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise ConnectionLost(f"cannot connect to {self.server}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        except (OSError, _ssl.SSLError) as exc:
            sock.close()
            raise ConnectionLost(f"TLS handshake with {self.server} failed: {exc}") from exc
        self._sock = sock
        try:
            core = self._new_core(sock)
        except ConnectionLost:
            self._drop()
            raise
        try:
            self._drive(core, core.handshake())
        except ConnectionLost as exc:
            self._drop()
            err = self._drive(core, core.tls_refusal(self.server))
            if err is None:
                raise
            raise err from exc
        except BaseException:
            self._drop()
            raise
        return core

    def _drop(self) -> None:
        sock, self._sock, self._core = self._sock, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def reconnect(self) -> None:
        """Close the current connection (if any) and open a fresh, authenticated one."""
        with self._lock:
            self._check_open()
            self._drop()
            self._connect()

    def _ensure(self) -> Core:
        self._check_open()
        if self._core is not None and self._sock is not None and _closed_by_server(self._sock):
            self._drop()  # e.g. the server's idle timeout: nothing was sent, so just reconnect
        if self._core is None:
            return self._connect()
        return self._core

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionLost("the client is closed")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<sos_client.Client {self.server} namespace={self.namespace!r}>"

    # -- the driver ------------------------------------------------------------------------
    def _drive(self, core: Core, gen: Op[T], chunks: Iterator[Any] | None = None) -> T:
        """Run an operation generator of ``_common`` (made by ``core``) over the socket."""
        try:
            cmd = next(gen)
            while True:
                if cmd is RECV:
                    value = self._recv_event(core)
                elif cmd is NEXT_CHUNK:
                    value = next(chunks, None) if chunks is not None else None
                elif cmd is PROBE_TLS:
                    value = answers_tls(self.host, self.port, self.timeout)
                else:
                    self._send_bytes(cmd)
                    value = None
                cmd = gen.send(value)
        except StopIteration as stop:
            return stop.value
        except BaseException as exc:
            gen.close()
            # an operation that raised with requests in flight leaves the stream out of step
            if self._core is core and (core.conn.in_flight or isinstance(exc, ConnectionLost)):
                self._drop()
            raise

    def _socket(self) -> socket.socket:
        if self._sock is None:
            raise ConnectionLost(f"not connected to {self.server}")
        return self._sock

    def _send_bytes(self, data: bytes | list) -> None:
        try:
            sock = self._socket()
            if not isinstance(data, list):
                sock.sendall(data)
            elif isinstance(sock, _ssl.SSLSocket):  # TLS has no sendmsg
                sock.sendall(b"".join(data))
            else:
                _sendmsg_all(sock, data)
        except OSError as exc:
            self._drop()
            raise ConnectionLost(f"connection to {self.server} lost while sending: {exc}") from exc

    def _recv_event(self, core: Core) -> Any:
        conn = core.conn
        while True:
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                self._drop()
                raise ConnectionLost(f"protocol error from {self.server}: {exc.message}") from None
            if event is not NEED_DATA:
                return event
            view = conn.receive_buffer()  # the rest of a large body: straight into its buffer
            try:
                if view is not None:
                    with view:
                        got = self._socket().recv_into(view)
                    if got:
                        conn.received(got)
                        continue
                    data = b""
                else:
                    data = self._socket().recv(RECV_SIZE)
            except TimeoutError:
                self._drop()
                raise ConnectionLost(f"no reply from {self.server} within {self.timeout} s") from None
            except OSError as exc:
                self._drop()
                raise ConnectionLost(f"connection to {self.server} lost: {exc}") from exc
            if not data:
                self._drop()
                raise ConnectionLost(f"{self.server} closed the connection")
            core.receive_data(data)

    def _call(self, make_gen: Callable[[Core], Op[T]], *, retry: bool = True) -> T:
        """Run one operation; after a lost connection, reconnect and retry once if *retry*."""
        with self._lock:
            core = self._ensure()
            try:
                return self._drive(core, make_gen(core))
            except ConnectionLost:
                if not retry or self._closed:
                    raise
            core = self._reconnect_until_deadline()
            return self._drive(core, make_gen(core))

    def _reconnect_until_deadline(self) -> Core:
        # tenacity (~8 ms of CPU) when a connection is lost, not at every `sos` command's start
        from sos_client.retry import retrying  # noqa: PLC0415

        for attempt in retrying(self.reconnect_timeout, retry_on=_lost):
            with attempt:
                self._drop()
                return self._connect()
        raise AssertionError("unreachable: retrying() raises the last error")

    # -- operations ------------------------------------------------------------------------
    def ping(self, payload: bytes = b"") -> bytes:
        return self._call(lambda core: core.ping(payload))

    def stat(self, name: str) -> tuple[int, bool]:
        """(length, sealed) of *name*; raises SOSNotFound."""
        return self._call(lambda core: core.stat(name))

    def list(self, prefix: str = "") -> Iterator[ListEntry]:
        """Every object whose name starts with *prefix*, in name order (paged internally)."""
        after = ""
        while True:
            entries, more = self._call(partial(Core.list_page, prefix=prefix, after=after, limit=MAX_LIST_LIMIT))
            yield from entries
            if not more or not entries:
                return
            after = entries[-1].name

    def append(self, name: str, offset: int, data: bytes | bytearray | memoryview, *, epoch: int = 0) -> int:
        """Append *data* at *offset* (must be the current length); returns the new length.

        Safe to retry: if it already landed, the server acknowledges it again."""
        return self._call(lambda core: core.append(name, offset, data, epoch))

    def append_many(
        self,
        name: str,
        offset: int,
        chunks: Iterable[bytes | bytearray | memoryview],
        *,
        epoch: int = 0,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        window_frames: int = DEFAULT_WINDOW_FRAMES,
    ) -> int:
        """Append every chunk in order starting at *offset*, pipelined; returns the new length.

        At most *window_bytes* are unacknowledged at once (memory stays bounded however
        large *chunks* is).  If the connection is lost, reconnects, checks the server's
        length and re-sends what was not acknowledged: nothing is missing or doubled."""
        job = AppendJob(name, offset, epoch, window_bytes=window_bytes, window_frames=window_frames)
        it = iter(chunks)
        with self._lock:
            core = self._ensure()
            while True:
                try:
                    return self._drive(core, job.run(core), it)
                except ConnectionLost:
                    if self._closed:
                        raise
                core = self._reconnect_until_deadline()
                self._drive(core, job.resume_check(core))

    def read(self, name: str, offset: int = 0, length: int = 0) -> bytes:
        """Bytes of *name* from *offset*, *length* of them (0 = to the end)."""
        return b"".join(self.read_iter(name, offset, length))

    def read_iter(self, name: str, offset: int = 0, length: int = 0, *, step: int = READ_STEP) -> Iterator[Payload]:
        """Stream *name* in chunks; holds at most *step* bytes at a time; resumes after a lost connection.

        A chunk is ``bytes``, or a ``memoryview`` of a large reply's own buffer (received
        without a copy; nothing else writes it)."""
        cur = ReadCursor(offset, length, step)
        while True:
            ask = cur.ask()
            chunks = self._call(partial(Core.read_step, name=name, offset=cur.offset, length=ask))
            got = 0
            for chunk in chunks:
                if chunk:
                    got += len(chunk)
                    yield chunk
            if cur.advance(got, ask):
                return

    def seal(self, name: str, *, epoch: int = 0) -> int:
        """Seal *name* (no more appends); idempotent; returns its final length."""
        return self._call(lambda core: core.seal(name, epoch))

    def fence(self, epoch: int) -> int:
        """Refuse appends with an epoch below *epoch* in this namespace from now on."""
        return self._call(lambda core: core.fence(epoch), retry=False)

    def tier_wait(self, name: str, offset: int, timeout: float = 30.0) -> int:
        """Wait until the server's object-store tier (the bucket) holds *name*'s bytes
        ``[0, offset)``; returns how many it holds (>= offset). *timeout*: seconds the server
        waits (capped at 60, as the server caps it; 0 answers at once). Raises
        :class:`~sos_client.errors.TierUnavailable` when the bucket did not reach *offset* in
        time (``.tiered``: what it holds), the server has no tier, or its tier stopped copying
        the object; SOSNotFound, or SOSError BAD_REQUEST for an *offset* beyond the durable
        length. Safe to retry (it changes nothing): a lost connection is retried once."""
        ms = tier_wait_ms(timeout)

        def run(core: Core) -> Op[int]:
            # the reply may take the whole wait: the socket's timeout covers it and then ours
            sock = self._socket()
            sock.settimeout(ms / 1000 + self.timeout)
            try:
                return (yield from core.tier_wait(name, offset, ms))
            finally:
                if self._sock is sock:
                    sock.settimeout(self.timeout)

        return self._call(run)
