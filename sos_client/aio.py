"""The trio client: same operations as :class:`sos_client.Client`, async.

async with open_client("127.0.0.1:7070", key, "ns") as c:
    await c.append_many("log", 0, chunks)       # chunks: iterable or async iterable
    async for chunk in c.read_iter("log"):
        ...
"""

from __future__ import annotations

import contextlib
import os
import ssl as _ssl
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from sos_client.core import (
    CLIENT_NAME,
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
from sos_client.retry import async_retrying
from sos_wire import NEED_DATA, Key, ListEntry, RemoteProtocolError
from sos_wire.events import Payload
from sos_wire.frames import MAX_LIST_LIMIT

__all__ = ["AsyncClient", "open_client", "receive_when_readable"]

RECV_SIZE = 256 * 1024


def _lost(exc: BaseException) -> bool:
    """Reconnecting helps only a lost connection (the server answered nothing else)."""
    return isinstance(exc, ConnectionLost)


@asynccontextmanager
async def open_client(
    server: str | None = None,
    key: str | Key | None = None,
    namespace: str | None = None,
    *,
    timeout: float = 30,  # noqa: ASYNC109 - each network wait's limit, not a deadline
    tls: _ssl.SSLContext | bool | None = None,
    reconnect_timeout: float | None = None,
    client_name: str = CLIENT_NAME,
) -> AsyncIterator[AsyncClient]:
    """Connect, authenticate, yield an :class:`AsyncClient`, close on exit."""
    client = AsyncClient(
        server, key, namespace, timeout=timeout, tls=tls, reconnect_timeout=reconnect_timeout, client_name=client_name
    )
    await client.connect()
    try:
        yield client
    finally:
        await client.aclose()


class AsyncClient(ClientSettings):
    _who = "open_client()"

    def _start(self) -> None:
        self._lock = trio.Lock()
        self._stream: trio.abc.Stream | None = None
        self._recv_extra = 0.0  # seconds a reply may take beyond self.timeout (a TIER_WAIT's wait)

    # -- connection management ----------------------------------------------------------
    async def connect(self) -> None:
        async with self._lock:
            await self._connect()

    async def _connect(self) -> Core:
        stream: trio.abc.Stream
        try:
            with trio.fail_after(self.timeout):
                stream = await trio.open_tcp_stream(self.host, self.port)
                if self._tls is not None:
                    tls_stream = trio.SSLStream(stream, self._tls, server_hostname=self.host)
                    await tls_stream.do_handshake()
                    stream = tls_stream
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, _ssl.SSLError) as exc:
            raise ConnectionLost(f"cannot connect to {self.server}: {exc or type(exc).__name__}") from exc
        self._stream = stream
        try:
            core = self._new_core(stream)
        except ConnectionLost:
            await self._drop()
            raise
        try:
            await self._drive(core, core.handshake())
        except ConnectionLost as exc:
            await self._drop()
            err = await self._drive(core, core.tls_refusal(self.server))
            if err is None:
                raise
            raise err from exc
        except BaseException:
            await self._drop()
            raise
        return core

    async def _drop(self) -> None:
        stream, self._stream, self._core = self._stream, None, None
        if stream is not None:
            # a last resort on a stream being dropped: whatever closing it raises changes nothing
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await trio.aclose_forcefully(stream)

    async def reconnect(self) -> None:
        async with self._lock:
            self._check_open()
            await self._drop()
            await self._connect()

    async def _ensure(self) -> Core:
        self._check_open()
        if self._core is not None and _closed_by_server(self._stream):
            await self._drop()  # e.g. the server's idle timeout: nothing was sent, so just reconnect
        if self._core is None:
            return await self._connect()
        return self._core

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionLost("the client is closed")

    async def aclose(self) -> None:
        self._closed = True
        await self._drop()

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the driver ------------------------------------------------------------------------
    async def _drive(self, core: Core, gen: Op[T], chunks: Any = None) -> T:
        """Run an operation generator of ``_common`` (made by ``core``) over the stream;
        ``chunks``: an iterator or an async iterator of the data NEXT_CHUNK asks for."""
        try:
            cmd = next(gen)
            while True:
                if cmd is RECV:
                    value = await self._recv_event(core)
                elif cmd is NEXT_CHUNK:
                    value = await _next_chunk(chunks)
                elif cmd is PROBE_TLS:
                    value = await trio.to_thread.run_sync(answers_tls, self.host, self.port, self.timeout)
                else:
                    await self._send_bytes(cmd)
                    value = None
                cmd = gen.send(value)
        except StopIteration as stop:
            return stop.value
        except BaseException as exc:
            gen.close()
            if self._core is core and (core.conn.in_flight or isinstance(exc, ConnectionLost)):
                await self._drop()
            raise

    def _open_stream(self) -> trio.abc.Stream:
        if self._stream is None:
            raise ConnectionLost(f"not connected to {self.server}")
        return self._stream

    async def _send_bytes(self, parts: bytes | list) -> None:
        # (a list: a frame's parts, Core._send)
        data: bytes | memoryview = b"".join(parts) if isinstance(parts, list) else parts
        stream = self._open_stream()
        if type(stream) is trio.SocketStream:
            # what fits the socket's buffer (a request, usually) is written at once, without
            # the stream's wrappers and its checkpoint (the reply's wait is one); the rest as below
            try:
                sent = os.write(stream.socket.fileno(), data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                await self._drop()
                raise ConnectionLost(f"connection to {self.server} lost while sending: {exc}") from exc
            if sent == len(data):
                return
            data = memoryview(data)[sent:]
        try:
            with trio.fail_after(self.timeout):
                await stream.send_all(data)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError) as exc:
            await self._drop()
            raise ConnectionLost(
                f"connection to {self.server} lost while sending: {exc or type(exc).__name__}"
            ) from exc

    async def _recv_event(self, core: Core) -> Any:
        conn = core.conn
        while True:
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                await self._drop()
                raise ConnectionLost(f"protocol error from {self.server}: {exc.message}") from None
            if event is not NEED_DATA:
                return event
            try:
                with trio.fail_after(self.timeout + self._recv_extra):
                    data = await receive_when_readable(self._open_stream())
            except trio.TooSlowError:
                await self._drop()
                raise ConnectionLost(f"no reply from {self.server} within {self.timeout} s") from None
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                await self._drop()
                raise ConnectionLost(f"connection to {self.server} lost: {exc or type(exc).__name__}") from exc
            if not data:
                await self._drop()
                raise ConnectionLost(f"{self.server} closed the connection")
            core.receive_data(data)

    async def _take_lock(self) -> None:
        """The client's lock, at once when it is free (no checkpoint: the call's own waits
        on the network are its checkpoints), else waited for."""
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def _call(self, make_gen: Callable[[Core], Op[T]], *, retry: bool = True) -> T:
        await self._take_lock()
        try:
            return await self._call_locked(make_gen, retry=retry)
        finally:
            self._lock.release()

    async def _call_locked(self, make_gen: Callable[[Core], Op[T]], *, retry: bool) -> T:
        core = await self._ensure()
        try:
            return await self._drive(core, make_gen(core))
        except ConnectionLost:
            if not retry or self._closed:
                raise
        core = await self._reconnect_until_deadline()
        return await self._drive(core, make_gen(core))

    async def _reconnect_until_deadline(self) -> Core:
        async for attempt in async_retrying(self.reconnect_timeout, retry_on=_lost):
            with attempt:
                await self._drop()
                return await self._connect()
        raise AssertionError("unreachable: async_retrying() raises the last error")

    # -- operations ------------------------------------------------------------------------
    async def ping(self, payload: bytes = b"") -> bytes:
        return await self._call(lambda core: core.ping(payload))

    async def stat(self, name: str) -> tuple[int, bool]:
        return await self._call(lambda core: core.stat(name))

    async def list(self, prefix: str = "") -> AsyncIterator[ListEntry]:
        after = ""
        while True:
            entries, more = await self._call(partial(Core.list_page, prefix=prefix, after=after, limit=MAX_LIST_LIMIT))
            for entry in entries:
                yield entry
            if not more or not entries:
                return
            after = entries[-1].name

    async def append(self, name: str, offset: int, data: bytes | bytearray | memoryview, *, epoch: int = 0) -> int:
        return await self._call(lambda core: core.append(name, offset, data, epoch))

    async def append_many(
        self,
        name: str,
        offset: int,
        chunks: Iterable[bytes | bytearray | memoryview] | AsyncIterable[bytes | bytearray | memoryview],
        *,
        epoch: int = 0,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        window_frames: int = DEFAULT_WINDOW_FRAMES,
    ) -> int:
        """*chunks*: an iterable or an async iterable of bytes-like objects."""
        job = AppendJob(name, offset, epoch, window_bytes=window_bytes, window_frames=window_frames)
        it = chunks.__aiter__() if isinstance(chunks, AsyncIterable) else iter(chunks)
        await self._take_lock()
        try:
            core = await self._ensure()
            while True:
                try:
                    return await self._drive(core, job.run(core), it)
                except ConnectionLost:
                    if self._closed:
                        raise
                core = await self._reconnect_until_deadline()
                await self._drive(core, job.resume_check(core))
        finally:
            self._lock.release()

    async def read(self, name: str, offset: int = 0, length: int = 0) -> bytes:
        return b"".join([chunk async for chunk in self.read_iter(name, offset, length)])

    async def read_iter(
        self, name: str, offset: int = 0, length: int = 0, *, step: int = READ_STEP
    ) -> AsyncIterator[Payload]:
        cur = ReadCursor(offset, length, step)
        while True:
            ask = cur.ask()
            chunks = await self._call(partial(Core.read_step, name=name, offset=cur.offset, length=ask))
            got = 0
            for chunk in chunks:
                if chunk:
                    got += len(chunk)
                    yield chunk
            if cur.advance(got, ask):
                return

    async def seal(self, name: str, *, epoch: int = 0) -> int:
        return await self._call(lambda core: core.seal(name, epoch))

    async def fence(self, epoch: int) -> int:
        return await self._call(lambda core: core.fence(epoch), retry=False)

    async def tier_wait(
        self,
        name: str,
        offset: int,
        timeout: float = 30.0,  # noqa: ASYNC109 - the server's wait, sent in the request
    ) -> int:
        """:meth:`sos_client.Client.tier_wait`: the bucket's length of *name* once >= *offset*."""
        ms = tier_wait_ms(timeout)

        def run(core: Core) -> Op[int]:
            self._recv_extra = ms / 1000  # the reply may take the whole wait (calls are serialized)
            try:
                return (yield from core.tier_wait(name, offset, ms))
            finally:
                self._recv_extra = 0.0

        return await self._call(run)


async def receive_when_readable(stream: trio.abc.Stream, size: int = RECV_SIZE) -> bytes:
    """The next bytes of ``stream``, at most ``size`` (b"": closed). A plain TCP stream: a wait
    until it is readable, then one read, without the stream layer's first read (which seldom
    finds anything: a reply, or a client's next request, is rarely there at once) and its
    wrappers; any other stream (TLS): its own ``receive_some``. The client's replies and the
    gateway's requests are read so."""
    if type(stream) is not trio.SocketStream:
        return bytes(await stream.receive_some(size))
    sock = stream.socket
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            return os.read(sock.fileno(), size)
        except (BlockingIOError, InterruptedError):
            continue  # (readable, then not: another wait)


def _closed_by_server(stream: trio.abc.Stream | None) -> bool:
    """True if an idle connection (no request in flight) is readable: the server sends
    nothing unasked, so that is its close (EOF, a reset) or a parting ERROR."""
    transport = getattr(stream, "transport_stream", stream)  # trio.SSLStream wraps a SocketStream
    sock = getattr(transport, "socket", None)
    if sock is None:
        return False
    try:
        return readable_now(sock.fileno())
    except (OSError, ValueError):
        return True


async def _next_chunk(chunks: Any) -> Any:
    if hasattr(chunks, "__anext__"):
        try:
            return await chunks.__anext__()
        except StopAsyncIteration:
            return None
    return next(chunks, None)
