"""`sos gateway`: the WebHDFS REST API for one namespace, as its single journal writer.

A Spark cluster of any size checkpoints to ``webhdfs://HOST:PORT/path`` (Hadoop's stock
WebHdfsFileSystem, no extra jar): every node talks HTTP to the gateway, the gateway
applies each operation to its cache through the same journal core as the mount and the
fsspec filesystem (:func:`sos_journal.tree.open.open_namespace`, JournaledTree), so
the journal, its format and ``sos restore`` are the same. The package, by layer:

* :mod:`.http`: HTTP/1.1 by h11 under trio, Hadoop's plain bodiless heads by a stricter
  fast path (keep-alive, bounded heads and small bodies, head
  deadline, send timeout, connection slots);
* this module, :class:`Gateway`: the accept loop, each connection's request loop, and the
  routing of a request: ``POST /oauth2/token`` and the bearer check of every other request
  (:mod:`.auth`), ``POST /sos/v1/marker?label=L`` (a MARKER record, durable when the reply
  comes in sync mode: the Spark batch listener's way in), and the WebHDFS operations under
  ``/webhdfs/v1`` through the table of :mod:`.operations`; per-operation statistics;
* :mod:`.webhdfs`: the WebHDFS semantics over the opened namespace (no HTTP);
* :mod:`.run` (``run_gateway``: what ``sos gateway`` runs), :mod:`.cli` (the command),
  :mod:`.process` (``GatewayProcess``: the command in a child process), :mod:`.client`
  (``GatewayClient``, standard library only: what the Spark helpers use).

Tree calls that are microseconds of system calls run in the event loop (:meth:`Gateway._quick`:
reads of the cache; small changes while the namespace lock is free and the writer has room,
so none waits), the others in worker threads with a bounded limiter; concurrent barriers
share one wait (:class:`.operations.SharedBarrier`). No lock is held while a request body
streams (Hadoop's client reads other files meanwhile); replies carry no Content-Type header
(Hadoop's shaded client cannot parse one).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import resource
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

from sos_wire.addresses import is_wildcard
from spark_plugin.gateway.http.auth import DEFAULT_KEY_RECHECK, TOKEN_PATH, KeyChecks, OAuth2, TokenAuthority, TokenInfo
from spark_plugin.gateway.http.connection import (
    CURRENT_CONN,
    HEAD_TIMEOUT,
    IDLE_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    MAX_HEAD,
    SEND_TIMEOUT,
    Conn,
    Drop,
    Head,
    Reply,
    Slots,
    json_body,
    remote_error,
)
from spark_plugin.gateway.http.operations import (
    KNOWN_OPS,
    OPEN_MEMORY,
    OPERATIONS,
    SERVER_DEFAULTS_BODY,
    WEBHDFS_PREFIX,
    Call,
    Operations,
    check_operation,
)
from spark_plugin.gateway.webhdfs.hdfs import WebHdfsError, redact_query, rel_path, remote_exception
from spark_plugin.gateway.webhdfs.namespace import WebHdfsNamespace

__all__ = ["EXIT_FENCED", "MARKER_PATH", "Gate", "Gateway"]

log = logging.getLogger(__name__)

MARKER_PATH = "/sos/v1/marker"
#: accept() failing for lack of descriptors or memory: retry after 0.1 s, doubling to 2 s,
#: and say so at most once per ACCEPT_LOG_INTERVAL (never a traceback per retry)
ACCEPT_RETRY = (0.1, 2.0)
ACCEPT_LOG_INTERVAL = 10.0
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: (conn, method, path, grant) -> None (serve it), a status (answered), or raises Reply
Gate = Callable[[Conn, str, str, TokenInfo], Awaitable[int | None]]
#: latencies kept per operation for its percentiles (a uniform sample of all of them)
LATENCY_SAMPLES = 2048
#: exit code of a gateway that stopped because a newer writer fenced it
EXIT_FENCED = 3
#: a change journaling more than this many bytes (a large piece of a file body) always runs
#: in a worker thread (Gateway._quick)
QUICK_LIMIT = 256 << 10


#: the operations :meth:`Gateway._fast_read` serves (op as sent, upper case -> its statistics' label)
_FAST_READS = {
    b"GETFILESTATUS": "GETFILESTATUS",
    b"GETFILELINKSTATUS": "GETFILELINKSTATUS",
    b"GETSERVERDEFAULTS": "GETSERVERDEFAULTS",
}
_FAST_PREFIX = (WEBHDFS_PREFIX + "/").encode()

STANDBY_CLASS = "org.apache.hadoop.ipc.StandbyException"


def standby_reply(why: str) -> Reply:
    """The refusal of a standby NameNode: 403 with StandbyException, as HDFS's ExceptionHandler
    sends it. The message ends with the class's simple name on purpose: Hadoop's
    WebHdfsFileSystem.validateResponse then raises it as an IOException, which its failover
    policy retries on the next NameNode after an exponential, jittered sleep
    (``dfs.http.client.failover.sleep.base.millis``), not at once: a client whose active
    gateway just died does not spend its retries before the standby has taken over."""
    return Reply(
        403,
        remote_exception(
            "StandbyException",
            f"Operation category WRITE is not supported in state standby: {why}: StandbyException",
            STANDBY_CLASS,
        ),
    )


@dataclass
class _OpStats:
    """One operation's count, total and worst latency, and a uniform sample of at most
    LATENCY_SAMPLES of its latencies for the percentiles (reservoir sampling: the memory
    stays the same however many requests come)."""

    count: int = 0
    seconds: float = 0.0
    worst: float = 0.0
    samples: list[float] = field(default_factory=list)

    def add(self, elapsed: float) -> None:
        self.count += 1
        self.seconds += elapsed
        self.worst = max(self.worst, elapsed)
        if len(self.samples) < LATENCY_SAMPLES:
            self.samples.append(elapsed)
        else:
            i = random.randrange(self.count)
            if i < LATENCY_SAMPLES:
                self.samples[i] = elapsed


class Gateway:
    """The HTTP server of one namespace (see the module docstring).

    ``ns``: the WebHDFS view of the opened namespace. ``authority``: issues and checks
    tokens; ``verify_key(key_text) -> (role, key_id)`` authenticates a client secret at
    the SOS server (PermissionError if refused, ConnectionError if unreachable).
    ``insecure``: serve every request as the append role without a token (only for a
    loopback listener; the CLI enforces it). ``threads``: most worker threads at once.
    ``max_connections``, ``max_per_address``: connection caps (a quarter of the first, at
    least 4, for connections that have not authenticated yet: :class:`.http.Slots`);
    ``head_timeout``, ``send_timeout``: see HEAD_TIMEOUT, SEND_TIMEOUT; ``open_memory``: most
    bytes of OPEN replies held at once; ``advertise``: (host, port) the redirects of the
    two-step operations name (default: the listen address, or for a wildcard one the
    address each client reached; never the client's Host header).
    ``key_recheck``: seconds after which a bearer token's key is asked again at the server.
    """

    def __init__(
        self,
        ns: WebHdfsNamespace,
        authority: TokenAuthority,
        verify_key: Callable[[str], tuple[str, str]],
        *,
        insecure: bool = False,
        tls: ssl.SSLContext | None = None,
        threads: int = 32,
        max_connections: int = MAX_CONNECTIONS,
        max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
        head_timeout: float = HEAD_TIMEOUT,
        send_timeout: float = SEND_TIMEOUT,
        open_memory: int = OPEN_MEMORY,
        advertise: tuple[str, int | None] | None = None,
        key_recheck: float = DEFAULT_KEY_RECHECK,
    ) -> None:
        self.ns = ns
        self.authority = authority
        self.verify_key = verify_key
        self.insecure = insecure
        self.tls = tls
        self.scheme = "https" if tls is not None else "http"
        self.limiter = trio.CapacityLimiter(threads)
        #: every token request asks the server (no cache issues a token); throttled per
        #: client address; bearer tokens' keys asked again every key_recheck seconds
        self.key_checks = KeyChecks(verify_key, recheck=key_recheck)
        self.oauth = OAuth2(authority.namespace, authority, self.key_checks, insecure=insecure)
        self.slots = Slots(max_connections, max(4, max_connections // 4), min(max_per_address, max_connections))
        self.head_timeout = head_timeout
        self.send_timeout = send_timeout
        self.operations = Operations(
            ns, self._run, self._advertised_base, open_memory=open_memory, send_timeout=send_timeout, quick=self._quick
        )
        self.advertise = advertise
        self.stats: dict[str, _OpStats] = {}
        self.address: tuple[str, int] | None = None
        #: True once :meth:`drain` was called (the gateway is stopping)
        self.draining = False
        #: why this gateway is no longer its namespace's writer (a newer one fenced it), or
        #: None: once set, every request is refused (503) and the gateway stops
        self.fenced: str | None = None
        self._accepting: trio.CancelScope | None = None
        self._idle: set[trio.CancelScope] = set()
        self._conns: set[Conn] = set()
        self._listen_host = ""
        self._accept_delay = ACCEPT_RETRY[0]
        self._accept_failures = 0
        self._accept_logged = -ACCEPT_LOG_INTERVAL
        self._open_memory = open_memory
        #: a standby's or a lease holder's say before every request but a token request
        #: (standby.py, lease.py): None lets it through, a status means it answered, a Reply
        #: refuses it (StandbyException); None: no gateway pair
        self.gate: Gate | None = None

    # ------------------------------------------------------------------ serving
    async def serve(
        self,
        host: str,
        port: int,
        *,
        sockets: list[trio.socket.SocketType] | None = None,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on ``host:port`` (or on ``sockets``, listening already: ``sos gateway
        --workers``, whose processes share them) until :meth:`drain`; returns once every
        connection is done."""
        if sockets is not None:
            tcp = [trio.SocketListener(sock) for sock in sockets]
        else:
            tcp = await trio.open_tcp_listeners(port, host=host or None)
        addr = tcp[0].socket.getsockname()
        self.address = (addr[0], addr[1])
        self._listen_host = host
        listeners: list[trio.abc.Listener[Any]] = list(tcp)
        if self.tls is not None:
            listeners = [trio.SSLListener(lis, self.tls, https_compatible=True) for lis in tcp]
        # connections live in their own nursery: stopping the accept loops (drain) leaves
        # the requests in progress running; serve returns once they are all done
        try:
            async with trio.open_nursery() as handlers:
                with trio.CancelScope() as self._accepting:
                    async with trio.open_nursery() as accepting:
                        for listener in listeners:
                            accepting.start_soon(self._accept_loop, listener, handlers)
                        task_status.started(self.address)
        finally:
            await self.operations.barriers.aclose()  # (the thread ships what is left)

    async def _accept_loop(self, listener: trio.abc.Listener[Any], handlers: trio.Nursery) -> None:
        """trio.serve_listeners, but out of descriptors (EMFILE) or memory it backs off and
        says so once per ACCEPT_LOG_INTERVAL instead of a traceback every 0.1 s."""
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                        raise
                    await self._accept_failed(exc)
                    continue
                self._accept_delay = ACCEPT_RETRY[0]
                handlers.start_soon(self._connection, stream)

    async def _accept_failed(self, exc: OSError) -> None:
        self._accept_failures += 1
        now = trio.current_time()
        if now - self._accept_logged >= ACCEPT_LOG_INTERVAL:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            log.warning(
                "cannot accept connections: %s (%d times since the last report; %d "
                "connections open, descriptor limit %d): retrying in up to %.1f s",
                os.strerror(exc.errno or 0),
                self._accept_failures,
                len(self._conns),
                soft,
                ACCEPT_RETRY[1],
            )
            self._accept_logged = now
            self._accept_failures = 0
        self.slots.make_room()  # an idle connection without a token gives its descriptor back
        await trio.sleep(self._accept_delay)
        self._accept_delay = min(self._accept_delay * 2, ACCEPT_RETRY[1])

    def drain(self) -> int:
        """Begin a graceful stop: close the listening sockets (new connections are
        refused, so Hadoop's retry policy waits for the next gateway), close the idle
        keep-alive connections, and let the requests in progress finish, each reply
        closing its connection. :meth:`serve` returns once none is left. Returns how many
        connections were busy."""
        self.draining = True
        if self._accepting is not None:
            self._accepting.cancel()
        for conn in self._conns:
            conn.closing = True
        for scope in list(self._idle):
            scope.cancel()
        return len(self._conns) - len(self._idle)

    def fence(self, reason: str) -> None:
        """A newer writer took the namespace over: refuse every request from now on (the
        mutating ones first of all; the health check's too, so it fails) and stop."""
        if self.fenced is not None:
            return
        self.fenced = reason
        log.error(
            "FENCED: %s; this gateway refuses every request and stops now (exit code %d): "
            "the newer writer serves the namespace",
            reason,
            EXIT_FENCED,
        )
        self.drain()

    @property
    def url(self) -> str:
        host, port = self.address or ("127.0.0.1", 0)
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{port}"

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def _quick(self, fn: Callable[..., Any], *args: Any, change: int | None = None) -> Any:
        """``fn(*args)`` at once, in the event loop, when it is microseconds of system calls
        that cannot wait: a read of the cache (``change`` None), or a change journaling about
        ``change`` bytes (at most QUICK_LIMIT) while the namespace lock is free and the
        writer has room (no wait for the lag bound, no new generation). Otherwise in a
        worker thread (:meth:`_run`): handing a call to a thread and back costs more than
        most of these calls themselves."""
        if change is None:
            return fn(*args)
        ns = self.ns
        if change > QUICK_LIMIT or not ns.has_room(change) or not ns.lock.acquire(blocking=False):
            return await self._run(fn, *args)
        try:
            return fn(*args)
        finally:
            ns.lock.release()

    async def _connection(self, stream: trio.abc.Stream) -> None:
        conn = Conn(stream, send_timeout=self.send_timeout)
        refused = self.slots.admit(conn)
        if refused is not None:
            log.debug("connection from %s refused: %s", conn.peer or "?", refused)
            conn.send_timeout = min(self.send_timeout, 5.0)
            with contextlib.suppress(Drop):
                await conn.respond(
                    503,
                    json_body(remote_error("IOException", refused)),
                    [("connection", "close"), ("retry-after", "1")],
                )
            await trio.aclose_forcefully(stream)
            return
        self._conns.add(conn)
        conn.closing = self.draining
        CURRENT_CONN.set(conn)  # this task's: the redirects' address (_location)
        try:
            with conn.scope:
                await self._serve_connection(conn)
                if conn.h11.our_state is h11.MUST_CLOSE and conn.h11.their_state not in (
                    h11.DONE,
                    h11.MUST_CLOSE,
                    h11.CLOSED,
                ):
                    await conn.linger()  # a refusal (400, 408, 413, 431...) must reach it
        except Drop as exc:
            log.debug("connection dropped: %s", exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as exc:
            log.debug("connection broken: %r", exc)
        except Exception:
            log.exception("connection failed")
        finally:
            self._conns.discard(conn)
            self.slots.release(conn)
            await trio.aclose_forcefully(stream)

    async def _serve_connection(self, conn: Conn) -> None:
        first = True
        while True:
            # the first request's head is due HEAD_TIMEOUT after the accept (a TLS handshake
            # included); a later one's HEAD_TIMEOUT after its first byte
            now = trio.current_time()
            wait = max(conn.accepted + self.head_timeout - now, 0.0) if first else IDLE_TIMEOUT
            if self.draining or not await conn.wait_for_request(wait, self._idle):
                return  # stopping, or idle too long
            conn.deadline = (conn.accepted if first else trio.current_time()) + self.head_timeout
            first = False
            # Hadoop's plain requests are read without h11 (http.parse_fast_head)
            head = conn.fast_request()
            if head is not None and head.auth is not None and await self._fast_read(conn, head):
                if not conn.reusable():
                    return
                continue
            event: h11.Event | type[h11.PAUSED] | Head | None = head
            if event is None:
                try:
                    event = await conn.next_event(IDLE_TIMEOUT)
                except Reply as reply:  # a malformed request head, or one too slow
                    await self._send_reply(conn, reply)
                    return
            if isinstance(event, h11.ConnectionClosed):
                return
            if not isinstance(event, h11.Request | Head):
                raise Drop(f"unexpected {type(event).__name__}")
            if conn.authenticated:
                conn.deadline = None  # its body streams at its pace (STALL_TIMEOUT per read)
            await self._request(conn, event)
            if not conn.reusable():
                return

    def _may_serve_fast(self, conn: Conn) -> bool:
        """Whether :meth:`_fast_read` may serve a request of ``conn``: not fenced, not one of
        a pair (whose gate has its say before every request), no debug line to write."""
        return self.fenced is None and self.gate is None and not log.isEnabledFor(logging.DEBUG)

    async def _fast_read(self, conn: Conn, head: Head) -> bool:
        """The lane of the reads most of a streaming query's requests are (GETFILESTATUS,
        GETFILELINKSTATUS, GETSERVERDEFAULTS: 36 of the small query's 54): a plain GET read
        by the fast path, with one Authorization field holding a token the gateway verified
        whose key the server accepted within the last key_recheck seconds, a target under
        WEBHDFS_PREFIX with nothing percent-encoded. Served here with the answer
        :meth:`_request` gives it (its FileStatus, or its 404), without the layers every
        other operation goes through; False, with nothing done, for any other request (or
        one that fails otherwise than with a WebHDFS refusal below 500): :meth:`_request`
        serves it, reads having no side effect to repeat."""
        if head.method != b"GET" or head.body is not None or not self._may_serve_fast(conn):
            return False
        started = time.perf_counter()
        raw_path, _, query = head.target.partition(b"?")
        if not raw_path.startswith(_FAST_PREFIX) or b"%" in head.target or b"+" in query:
            return False
        op = b""
        for item in query.split(b"&"):  # (as query_pairs and _request's params: the last op)
            name, _, value = item.partition(b"=")
            if name.lower() == b"op":
                op = value
        label = _FAST_READS.get(op.upper())
        if label is None:
            return False
        auth = head.auth
        grant = self.oauth.bearer_now(auth.decode("latin-1")) if auth is not None else None
        if grant is None:
            return False
        try:
            rel = rel_path(raw_path[len(_FAST_PREFIX) - 1 :].decode("ascii"))
            body = SERVER_DEFAULTS_BODY if label == "GETSERVERDEFAULTS" else None
            status = 200
            if body is None:
                try:
                    body = self.ns.file_status_body(rel)
                except WebHdfsError as exc:
                    if exc.status >= 500:
                        return False
                    status, body = exc.status, json_body(exc.body())
        except Exception:  # noqa: BLE001 - :meth:`_request` serves it and says what it was
            return False
        self._granted(conn)
        try:
            await conn.respond(status, body)
        finally:
            self.stats.setdefault(label, _OpStats()).add(time.perf_counter() - started)
        return True

    async def _send_reply(self, conn: Conn, reply: Reply) -> None:
        body = json_body(reply.doc) if reply.doc is not None else b""
        headers = list(reply.headers)
        conn.consume_buffered_body()
        if not conn.fast and conn.h11.their_state is not h11.DONE and ("connection", "close") not in headers:
            headers.append(("connection", "close"))  # an unread body makes reuse impossible
        # IDLE: the head was malformed or too slow (h11 lets a server answer it)
        if conn.reply_due():
            await conn.respond(reply.status, body, headers, reply.reason)

    def _granted(self, conn: Conn) -> None:
        """The request being served carried a valid token, or got one."""
        conn.granted = True
        if not conn.authenticated:
            self.slots.authenticated(conn)
            conn.deadline = None

    # ------------------------------------------------------------------ requests
    @staticmethod
    def _check_head(req: h11.Request | Head) -> None:
        """What h11 lets through and RFC 9112 or the spec refuses (400/431, then close)."""
        close = [("connection", "close")]
        size = len(req.method) + len(req.target) + 12 + sum(len(k) + len(v) + 4 for k, v in req.headers)
        if size > MAX_HEAD:  # it came in one read: h11 bounds only incomplete heads
            raise Reply(
                431,
                remote_error("IllegalArgumentException", f"request head larger than {MAX_HEAD} bytes"),
                close,
                reason="Request Header Fields Too Large",
            )
        names = [name for name, _ in req.headers]  # h11 gives them in lower case
        if b"transfer-encoding" in names and b"content-length" in names:
            # RFC 9112 6.1: a request smuggling attempt, or a broken client: never reuse
            raise Reply(
                400,
                remote_error("IllegalArgumentException", "bad HTTP request: both Content-Length and Transfer-Encoding"),
                close,
            )
        if names.count(b"authorization") > 1:
            raise Reply(
                400,
                remote_error("IllegalArgumentException", "bad HTTP request: more than one Authorization header"),
                close,
            )

    async def _request(self, conn: Conn, req: h11.Request | Head) -> None:
        started = time.perf_counter()
        method = req.method.decode("ascii", "replace").upper()
        target = req.target.decode("utf-8", "surrogateescape")
        raw_path, _, query = target.partition("?")
        path = urllib.parse.unquote(raw_path, errors="surrogateescape")
        params = {k.lower(): v for k, v in query_pairs(query)}
        headers = {k.decode("ascii", "replace").lower(): v.decode("latin-1") for k, v in req.headers}
        op = params.get("op", "").upper()
        conn.granted = False
        status = 500
        try:
            try:
                self._check_head(req)
                status = await self._dispatch(conn, method, path, params, headers, op)
            except WebHdfsError as exc:
                if self.gate is not None and self._writer_fenced():
                    # one of a pair whose write a newer writer's fence refused: its client
                    # goes to the other gateway (the server kept nothing of it)
                    raise standby_reply(f"this gateway's writer was fenced: {exc.message}") from exc
                raise Reply(exc.status, exc.body()) from exc
        except Reply as reply:
            status = reply.status
            if reply.status >= 500:
                log.warning(
                    "%s %s %s -> %d %s",
                    method,
                    op,
                    path,
                    reply.status,
                    (reply.doc or {}).get("RemoteException", {}).get("message", ""),
                )
            await self._send_reply(conn, reply)
        except Drop:
            raise
        except Exception as exc:
            log.exception("%s %s %s failed", method, op, path)
            status = 500
            await self._send_reply(conn, Reply(500, remote_error("IOException", f"internal error: {exc!r}")))
        finally:
            elapsed = time.perf_counter() - started
            if conn.granted:  # a bounded set of names: what clients without a token send,
                # and paths, never make new entries
                label = stats_label(path, op, params)
                self.stats.setdefault(label, _OpStats()).add(elapsed)
            if log.isEnabledFor(logging.DEBUG):  # (its redaction costs a regular expression)
                log.debug(
                    "%s %s %s%s -> %d (%.1f ms) %s",
                    method,
                    op or "-",
                    path,
                    " [data]" if params.get("data") == "true" else "",
                    status,
                    elapsed * 1e3,
                    redact_query(query),  # a key a client put in the URL is never logged
                )

    async def _dispatch(
        self, conn: Conn, method: str, path: str, params: dict[str, str], headers: dict[str, str], op: str
    ) -> int:
        if self.fenced is not None:  # before anything, even the token and its check
            if self.gate is not None:  # one of a pair (lease.py): its clients go to the other
                raise standby_reply(f"this gateway no longer serves the namespace: {self.fenced}")
            raise Reply(
                503,
                remote_error("IOException", f"this gateway no longer serves the namespace: {self.fenced}"),
                [("connection", "close")],
            )
        if path == TOKEN_PATH:
            status = await self.oauth.token(conn, method, headers)
            if status == 200:
                self._granted(conn)
            return status
        grant = await self.oauth.bearer(headers)
        self._granted(conn)
        if self.gate is not None:
            answered = await self.gate(conn, method, path, grant)
            if answered is not None:
                return answered
        if path == MARKER_PATH:
            return await self._marker(conn, method, params, grant)
        if path != WEBHDFS_PREFIX and not path.startswith(WEBHDFS_PREFIX + "/"):
            raise Reply(
                404,
                remote_error(
                    "FileNotFoundException",
                    f"no such endpoint: {path} (WebHDFS is served under {WEBHDFS_PREFIX}/, tokens at {TOKEN_PATH})",
                ),
            )
        rel = rel_path(path[len(WEBHDFS_PREFIX) :] or "/")
        check_operation(method, op, grant)
        handler = OPERATIONS[(method, op)]
        return await handler(self.operations, Call(conn, method, op, rel, params, headers, grant))

    def _writer_fenced(self) -> bool:
        """Did the server refuse this gateway's writer as fenced (or its segment as sealed)?"""
        writer = self.ns.writer
        if writer is None:
            return False
        status = writer.status()
        return status["state"] == "failed" and str(status.get("error") or "").startswith(("Fenced:", "SealedError:"))

    def become_active(self, ns: WebHdfsNamespace) -> None:
        """A promoted standby (standby.py): serve ``ns``, its namespace opened as the writer,
        from the next request on."""
        self.ns = ns
        self.operations = Operations(
            ns,
            self._run,
            self._advertised_base,
            open_memory=self._open_memory,
            send_timeout=self.send_timeout,
            quick=self._quick,
        )

    def _advertised_base(self) -> str:
        """``scheme://host:port`` of the redirects of the two-step operations: the gateway's
        own address (``advertise``, else the listen address, else, for a wildcard listener,
        the address this client reached), never the client's Host header."""
        bound_host, port = self.address or ("127.0.0.1", 0)
        host = self._listen_host or bound_host
        if self.advertise is not None:
            host, port = self.advertise[0], self.advertise[1] or port
        elif is_wildcard(host):
            conn = CURRENT_CONN.get()
            local = conn.local if conn is not None else ""
            host = local if local and not is_wildcard(local) else "127.0.0.1"
            if host.startswith("::ffff:") and "." in host:  # dual-stack socket, IPv4 client
                host = host[len("::ffff:") :]
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{port}"

    # ------------------------------------------------------------------ marker, statistics
    async def _marker(self, conn: Conn, method: str, params: dict[str, str], grant: TokenInfo) -> int:
        if method != "POST":
            raise Reply(
                405, remote_error("UnsupportedOperationException", f"{MARKER_PATH} takes POST"), [("allow", "POST")]
            )
        if not grant.can_write:
            raise WebHdfsError(
                "AccessControlException", "Permission denied: a marker needs a token of a key with the append role"
            )
        label = params.get("label", "")
        if not label:
            raise WebHdfsError("IllegalArgumentException", "marker: label= is missing")
        payload = await conn.read_small_body()
        try:
            seq = await self._quick(self.ns.marker_now, label, payload, change=len(payload) + len(label))
        except ValueError as exc:  # a label the journal refuses
            raise WebHdfsError("IllegalArgumentException", f"marker: {exc}") from None
        await self.operations.barriers.wait(seq)
        await conn.respond(200, json_body({"seq": seq}))
        return 200

    def summary(self) -> str:
        """One line per operation (of requests with a valid token): count, mean, p50, p99
        (of a uniform sample) and worst latency (ms)."""
        lines = []
        for name, s in sorted(self.stats.items()):
            lat = sorted(s.samples)
            p50 = lat[len(lat) // 2] if lat else 0.0
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
            lines.append(
                f"{name}: {s.count} requests, mean {s.seconds / max(s.count, 1) * 1e3:.2f}"
                f" ms, p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, "
                f"max {s.worst * 1e3:.2f} ms"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Running a gateway: server connection -> opener -> HTTP


def query_pairs(query: str) -> list[tuple[str, str]]:
    """``urllib.parse.parse_qsl(query, keep_blank_values=True)``, without its per-field
    decoding when nothing in ``query`` needs it (no ``%``, no ``+``: Hadoop's usual query)."""
    if "%" in query or "+" in query:
        return urllib.parse.parse_qsl(query, keep_blank_values=True)
    pairs = []
    for item in query.split("&"):
        if item:
            name, _, value = item.partition("=")
            pairs.append((name, value))
    return pairs


def stats_label(path: str, op: str, params: dict[str, str]) -> str:
    """The statistics' key of a request: its operation, from a fixed set of names."""
    if path == TOKEN_PATH:
        return "token"
    if path == MARKER_PATH:
        return "marker"
    if op not in KNOWN_OPS or not (path == WEBHDFS_PREFIX or path.startswith(WEBHDFS_PREFIX + "/")):
        return "other"
    if op in ("CREATE", "APPEND", "OPEN") and params.get("data") == "true":
        return f"{op} data"
    return op
