"""`sos gateway`: the WebHDFS REST API for one namespace, as its single journal writer.

A Spark cluster of any size checkpoints to ``webhdfs://HOST:PORT/path`` (Hadoop's stock
WebHdfsFileSystem, no extra jar): every node talks HTTP to the gateway, the gateway
applies each operation to its cache through the same journal core as the mount and the
fsspec filesystem (:func:`sos_client.journal.open.open_namespace`, JournaledTree), so
the journal, its format and ``sos restore`` are the same. The WebHDFS semantics live in
:mod:`spark_plugin.webhdfs`; this module is the HTTP side:

* HTTP/1.1 by h11 under trio (keep-alive, bounded header size, bounded bodies for
  everything but file contents, which stream chunk by chunk into the journal);
* blocking tree calls run in worker threads with a bounded limiter; no lock is held
  while a request body streams (Hadoop's client reads other files meanwhile);
* replies carry no Content-Type header (Hadoop's shaded client cannot parse one);
* authentication: ``POST /oauth2/token`` (client credentials; see
  :mod:`spark_plugin.gateway_auth`), then ``Authorization: Bearer`` on every request;
* ``POST /sos/v1/marker?label=L`` (body: the payload) appends a MARKER record, durable
  when the reply comes (sync mode): the Spark batch listener's way in.

:func:`run_gateway` runs it until SIGTERM/SIGINT (``sos gateway`` calls it);
:class:`GatewayProcess` runs ``sos gateway`` in a child process (tests, Spark helpers).
"""

from __future__ import annotations

import contextvars
import errno
import ipaddress
import json
import logging
import os
import random
import resource
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

import h11
import trio

from .gateway_auth import (
    DEFAULT_KEY_RECHECK,
    DEFAULT_TOKEN_TTL,
    KeyChecks,
    KeyRevoked,
    Throttled,
    TokenAuthority,
    TokenInfo,
    address_key,
)
from .webhdfs import (
    WRITE_PIECE,
    WebHdfsError,
    WebHdfsNamespace,
    parse_permission,
    rel_path,
)

__all__ = ["READY_MARKER", "Gateway", "GatewayProcess", "parse_advertise", "parse_listen",
           "plaintext_refusal", "run_gateway"]

log = logging.getLogger("sos.gateway")

#: The gateway prints this, then " URL (namespace NS, sync|async)", on stderr once it serves.
READY_MARKER = "sos gateway: ready on"
WEBHDFS_PREFIX = "/webhdfs/v1"
TOKEN_PATH = "/oauth2/token"
MARKER_PATH = "/sos/v1/marker"

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
#: an OPEN reply is read from the cache and sent in pieces of this size ...
OPEN_PIECE = 128 << 10
#: ... and the pieces waiting for slow readers hold at most this much, gateway-wide
OPEN_MEMORY = 64 << 20
#: a new OPEN data step waits this long for room in OPEN_MEMORY, then answers 503
OPEN_MEMORY_WAIT = 10.0
#: connection caps: all at once, per client address (IPv4 address, IPv6 /64)
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_ADDRESS = 64
#: descriptors kept for everything but client connections (the journal's spool and cache,
#: the SOS server's connections, the listeners, logs); each worker thread may hold one more
FD_RESERVE = 128
#: accept() failing for lack of descriptors or memory: retry after 0.1 s, doubling to 2 s,
#: and say so at most once per ACCEPT_LOG_INTERVAL (never a traceback per retry)
ACCEPT_RETRY = (0.1, 2.0)
ACCEPT_LOG_INTERVAL = 10.0
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: after a refusal that closes the connection: read and discard what the client still
#: sends for at most this long and this many bytes (seconds, bytes) before closing
LINGER = (2.0, 1 << 20)
#: latencies kept per operation for its percentiles (a uniform sample of all of them)
LATENCY_SAMPLES = 2048
#: on SIGTERM/SIGINT, the requests in progress get this long to finish (Kubernetes gives
#: a pod 30 s by default between SIGTERM and SIGKILL)
DRAIN_TIMEOUT = 25.0

_GET_OPS = {"OPEN", "GETFILESTATUS", "GETFILELINKSTATUS", "LISTSTATUS", "LISTSTATUS_BATCH",
            "GETCONTENTSUMMARY", "GETHOMEDIRECTORY", "GETSERVERDEFAULTS", "CHECKACCESS"}
_PUT_OPS = {"CREATE", "MKDIRS", "RENAME", "SETPERMISSION", "SETTIMES", "SETREPLICATION"}
_POST_OPS = {"APPEND", "TRUNCATE"}
_DELETE_OPS = {"DELETE"}
#: operations Hadoop's WebHdfsFileSystem knows that the gateway refuses
#: (UnsupportedOperationException, 400), with why
_UNSUPPORTED: dict[str, dict[str, str]] = {
    "GET": dict.fromkeys(
        ["GETFILECHECKSUM", "GETDELEGATIONTOKEN", "GETACLSTATUS", "GETXATTRS", "LISTXATTRS",
         "GETTRASHROOT", "GETTRASHROOTS", "GETALLSTORAGEPOLICY", "GETSTORAGEPOLICY",
         "GETFILEBLOCKLOCATIONS", "GET_BLOCK_LOCATIONS", "GETSNAPSHOTDIFF",
         "GETSNAPSHOTDIFFLISTING", "GETSNAPSHOTTABLEDIRECTORYLIST", "GETSNAPSHOTLIST",
         "GETECPOLICY", "GETECPOLICIES", "GETECCODECS", "GETLINKTARGET", "GETQUOTAUSAGE",
         "GETSTATUS"],
        "the gateway serves files and directories only (no checksums, delegation tokens, "
        "ACLs, xattrs, trash, storage or erasure-coding policies, snapshots, quotas, links)"),
    "PUT": {
        **dict.fromkeys(
            ["CREATESYMLINK", "RENEWDELEGATIONTOKEN", "CANCELDELEGATIONTOKEN",
             "MODIFYACLENTRIES", "REMOVEACLENTRIES", "REMOVEDEFAULTACL", "REMOVEACL", "SETACL",
             "SETXATTR", "REMOVEXATTR", "ENABLEECPOLICY", "DISABLEECPOLICY", "SETECPOLICY",
             "ALLOWSNAPSHOT", "DISALLOWSNAPSHOT", "CREATESNAPSHOT", "RENAMESNAPSHOT",
             "SETSTORAGEPOLICY", "SETQUOTA", "SETQUOTABYSTORAGETYPE", "SATISFYSTORAGEPOLICY"],
            "the journal has no record for links, ACLs, xattrs, policies, snapshots or quotas"),
        "SETOWNER": "the journal records no owners",
    },
    "POST": {"CONCAT": "the journal has no concat record",
             "UNSETSTORAGEPOLICY": "the gateway has no storage policies",
             "UNSETECPOLICY": "the gateway has no erasure-coding policies"},
    "DELETE": {"DELETESNAPSHOT": "the gateway has no snapshots"},
}
_MUTATING_METHODS = {"PUT", "POST", "DELETE"}
_KNOWN_OPS = frozenset(_GET_OPS | _PUT_OPS | _POST_OPS | _DELETE_OPS).union(
    *(ops.keys() for ops in _UNSUPPORTED.values()))

SERVER_DEFAULTS = {"FsServerDefaults": {
    "blockSize": 128 << 20, "bytesPerChecksum": 512, "writePacketSize": 64 << 10,
    "replication": 1, "fileBufferSize": 4096, "encryptDataTransfer": False,
    "trashInterval": 0, "checksumType": 2, "keyProviderUri": "", "defaultStoragePolicyId": 7,
}}


class _Reply(Exception):
    """Raised inside a handler to answer at once (status, JSON document, extra headers)."""

    def __init__(self, status: int, doc: dict | None, headers: list[tuple[str, str]] | None = None,
                 reason: str = "") -> None:
        super().__init__(status)
        self.status = status
        self.doc = doc
        self.headers = headers or []
        self.reason = reason


class _Drop(Exception):
    """The connection cannot go on (broken, stalled, or a protocol error): close it."""


def _json(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _remote(exception: str, message: str) -> dict:
    return WebHdfsError(exception, message).body()


def _bool_param(params: dict[str, str], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None or value == "":
        return default
    low = value.lower()
    if low not in ("true", "false"):
        raise WebHdfsError("IllegalArgumentException",
                           f'Invalid value for webhdfs parameter "{name}": {value!r} is not '
                           f"true or false")
    return low == "true"


def _int_param(params: dict[str, str], name: str, default: int | None) -> int | None:
    value = params.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise WebHdfsError("IllegalArgumentException",
                           f'Invalid value for webhdfs parameter "{name}": {value!r} is not '
                           f"an integer") from None


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


def _socket_addresses(stream: trio.abc.Stream) -> tuple[str, str]:
    """(client IP, the gateway's own IP this connection reached); "" if unknown."""
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    sock = getattr(inner, "socket", None)
    if sock is None:
        return "", ""
    try:
        peer, local = sock.getpeername()[0], sock.getsockname()[0]
    except OSError:  # the client is already gone: its first receive fails
        return "", ""
    return str(peer), str(local)


class _Conn:
    """One HTTP connection: h11 state plus the stream, and what the slots need to know
    (:class:`_Slots`)."""

    def __init__(self, stream: trio.abc.Stream, *, send_timeout: float = SEND_TIMEOUT) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        #: set when the gateway stops: the next reply tells the client to close
        self.closing = False
        peer, self.local = _socket_addresses(stream)
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
        #: cancelled to close the connection from outside (:meth:`_Slots.make_room`)
        self.scope = trio.CancelScope()

    async def wait_for_request(self, timeout: float, idle: set[trio.CancelScope]) -> bool:
        """Wait for the first bytes of the next request: True once some are here, False
        after ``timeout`` or when a stopping gateway cancels the wait. While it waits the
        connection is idle: its scope is in ``idle`` (no byte of a request is lost by
        cancelling it)."""
        data, closed = self.h11.trailing_data
        if data or closed:
            return True
        with trio.CancelScope() as scope:
            idle.add(scope)
            self.waiting = True
            try:
                with trio.move_on_after(timeout):
                    chunk = await self.stream.receive_some(RECV_SIZE)
                    self.h11.receive_data(bytes(chunk))  # b"": the client closed
                    return True
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _Drop(f"receive failed: {exc!r}") from exc
            finally:
                self.waiting = False
                idle.discard(scope)
        return False

    async def next_event(self, timeout: float = STALL_TIMEOUT) -> Any:
        """The next h11 event; a receive waits at most ``timeout`` (then the connection is
        dropped) and never past :attr:`deadline` (then 408, and the connection closes)."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise _Reply(exc.error_status_hint,
                             _remote("IllegalArgumentException", f"bad HTTP request: {exc}"),
                             [("connection", "close")]) from exc
            if event is not h11.NEED_DATA:
                return event
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
                raise _Drop(f"receive failed: {exc!r}") from exc
            finally:
                self.waiting = False
            if scope.cancelled_caught:
                if self.deadline is not None and trio.current_time() >= self.deadline:
                    raise _Reply(408, _remote("IllegalArgumentException",
                                              "the request head did not arrive whole in time"),
                                 [("connection", "close")], reason="Request Timeout")
                raise _Drop("the client stalled")
            self.h11.receive_data(bytes(data))

    async def send(self, event: Any) -> None:
        if isinstance(event, h11.Response) and self.closing:
            event = h11.Response(status_code=event.status_code, reason=event.reason,
                                 headers=[*event.headers, (b"connection", b"close")])
        data = self.h11.send(event)
        if data:
            await self.send_bytes(data)

    async def send_bytes(self, data: bytes) -> None:
        """Send ``data`` in steps of SEND_STEP; a step that does not go out within the send
        timeout drops the connection (a client that stops reading must not keep its slot,
        nor the reply's memory, for as long as it keeps the socket open)."""
        view = memoryview(data)
        for start in range(0, len(view), SEND_STEP):
            self.waiting = True
            try:
                with trio.move_on_after(self.send_timeout) as scope:
                    await self.stream.send_all(view[start:start + SEND_STEP])
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _Drop(f"send failed: {exc!r}") from exc
            finally:
                self.waiting = False
            if scope.cancelled_caught:
                log.info("closing a connection from %s: it read nothing of its reply for %.0f s",
                         self.peer or "?", self.send_timeout)
                raise _Drop("the client does not read its reply")

    async def respond(self, status: int, body: bytes = b"",
                      headers: list[tuple[str, str]] | None = None, reason: str = "") -> None:
        hdrs = [(b"content-length", str(len(body)).encode())]
        hdrs += [(k.encode(), v.encode()) for k, v in (headers or [])]
        kwargs: dict[str, Any] = {"status_code": status, "headers": hdrs}
        if reason:
            kwargs["reason"] = reason.encode("ascii", "replace")
        await self.send(h11.Response(**kwargs))
        if body:
            await self.send(h11.Data(data=body))
        await self.send(h11.EndOfMessage())

    async def read_small_body(self, limit: int = MAX_SMALL_BODY) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limit:
                    raise _Reply(413, _remote("IllegalArgumentException",
                                              f"request body larger than {limit} bytes"),
                                 [("connection", "close")])
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise _Drop("closed in the middle of a request body")

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
        while self.h11.their_state is h11.SEND_BODY:
            try:
                if self.h11.next_event() is h11.NEED_DATA:
                    return
            except h11.RemoteProtocolError:
                return

    async def drain(self) -> None:
        """Read and discard the rest of the request body (memory stays bounded)."""
        while self.h11.their_state is h11.SEND_BODY:
            event = await self.next_event()
            if isinstance(event, h11.ConnectionClosed):
                raise _Drop("closed in the middle of a request body")


#: the connection the current task serves (each connection is one trio task)
_CURRENT_CONN: contextvars.ContextVar[_Conn | None] = contextvars.ContextVar(
    "sos_gateway_conn", default=None)


class _Slots:
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
        self.open: set[_Conn] = set()
        #: the unauthenticated ones, oldest first
        self.pending: dict[_Conn, None] = {}
        self.by_address: Counter[str] = Counter()

    def admit(self, conn: _Conn) -> str | None:
        """Take a slot for ``conn``, making room if needed; None, or why it was refused."""
        if (self.by_address[conn.peer] >= self.per_address
                and not self.make_room(lambda c: c.peer == conn.peer)):
            return f"too many connections from {conn.peer or 'this address'}"
        if len(self.open) >= self.total and not self.make_room():
            return "too many connections"
        if len(self.pending) >= self.unauthenticated and not self.make_room():
            return "too many connections without a valid token"
        self.open.add(conn)
        self.pending[conn] = None
        self.by_address[conn.peer] += 1
        return None

    def authenticated(self, conn: _Conn) -> None:
        conn.authenticated = True
        self.pending.pop(conn, None)

    def release(self, conn: _Conn) -> None:
        if conn in self.open:
            self.open.discard(conn)
            self.pending.pop(conn, None)
            self.by_address[conn.peer] -= 1
            if self.by_address[conn.peer] <= 0:
                del self.by_address[conn.peer]

    def make_room(self, match: Callable[[_Conn], bool] = lambda c: True) -> bool:
        """Close the oldest unauthenticated connection (that ``match``) waiting for its
        client; False if there is none."""
        for conn in self.pending:
            if conn.waiting and match(conn):
                log.debug("closing an unauthenticated connection from %s (open %.0f s) to "
                          "make room", conn.peer or "?", trio.current_time() - conn.accepted)
                self.release(conn)
                conn.scope.cancel()
                return True
        return False


class Gateway:
    """The HTTP server of one namespace (see the module docstring).

    ``ns``: the WebHDFS view of the opened namespace. ``authority``: issues and checks
    tokens; ``verify_key(key_text) -> (role, key_id)`` authenticates a client secret at
    the SOS server (PermissionError if refused, ConnectionError if unreachable).
    ``insecure``: serve every request as the append role without a token (only for a
    loopback listener; the CLI enforces it). ``threads``: most worker threads at once.
    ``max_connections``, ``max_per_address``: connection caps (a quarter of the first, at
    least 4, for connections that have not authenticated yet: :class:`_Slots`);
    ``head_timeout``, ``send_timeout``: see HEAD_TIMEOUT, SEND_TIMEOUT; ``open_memory``: most
    bytes of OPEN replies held at once; ``advertise``: (host, port) the redirects of the
    two-step operations name (default: the listen address, or for a wildcard one the
    address each client reached; never the client's Host header).
    ``key_recheck``: seconds after which a bearer token's key is asked again at the server.
    """

    def __init__(self, ns: WebHdfsNamespace, authority: TokenAuthority,
                 verify_key: Callable[[str], tuple[str, str]], *, insecure: bool = False,
                 tls: ssl.SSLContext | None = None, threads: int = 32,
                 max_connections: int = MAX_CONNECTIONS,
                 max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
                 head_timeout: float = HEAD_TIMEOUT, send_timeout: float = SEND_TIMEOUT,
                 open_memory: int = OPEN_MEMORY,
                 advertise: tuple[str, int | None] | None = None,
                 key_recheck: float = DEFAULT_KEY_RECHECK) -> None:
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
        self.slots = _Slots(max_connections, max(4, max_connections // 4),
                            min(max_per_address, max_connections))
        self.head_timeout = head_timeout
        self.send_timeout = send_timeout
        #: one token per OPEN_PIECE of OPEN reply held in memory
        self.open_memory = trio.CapacityLimiter(max(1, open_memory // OPEN_PIECE))
        self.advertise = advertise
        self.stats: dict[str, _OpStats] = {}
        self.address: tuple[str, int] | None = None
        #: True once :meth:`drain` was called (the gateway is stopping)
        self.draining = False
        self._accepting: trio.CancelScope | None = None
        self._idle: set[trio.CancelScope] = set()
        self._conns: set[_Conn] = set()
        self._listen_host = ""
        self._accept_delay = ACCEPT_RETRY[0]
        self._accept_failures = 0
        self._accept_logged = -ACCEPT_LOG_INTERVAL

    # ------------------------------------------------------------------ serving
    async def serve(self, host: str, port: int, *,
                    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        tcp = await trio.open_tcp_listeners(port, host=host or None)
        addr = tcp[0].socket.getsockname()
        self.address = (addr[0], addr[1])
        self._listen_host = host
        listeners: list[trio.abc.Listener[Any]] = list(tcp)
        if self.tls is not None:
            listeners = [trio.SSLListener(lis, self.tls, https_compatible=True) for lis in tcp]
        # connections live in their own nursery: stopping the accept loops (drain) leaves
        # the requests in progress running; serve returns once they are all done
        async with trio.open_nursery() as handlers:
            with trio.CancelScope() as self._accepting:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(self._accept_loop, listener, handlers)
                    task_status.started(self.address)

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
            log.warning("cannot accept connections: %s (%d times since the last report; %d "
                        "connections open, descriptor limit %d): retrying in up to %.1f s",
                        os.strerror(exc.errno or 0), self._accept_failures, len(self._conns),
                        soft, ACCEPT_RETRY[1])
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

    @property
    def url(self) -> str:
        host, port = self.address or ("127.0.0.1", 0)
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{port}"

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def _connection(self, stream: trio.abc.Stream) -> None:
        conn = _Conn(stream, send_timeout=self.send_timeout)
        refused = self.slots.admit(conn)
        if refused is not None:
            log.debug("connection from %s refused: %s", conn.peer or "?", refused)
            conn.send_timeout = min(self.send_timeout, 5.0)
            try:
                await conn.respond(503, _json(_remote("IOException", refused)),
                                   [("connection", "close"), ("retry-after", "1")])
            except _Drop:
                pass
            await trio.aclose_forcefully(stream)
            return
        self._conns.add(conn)
        conn.closing = self.draining
        _CURRENT_CONN.set(conn)  # this task's: the redirects' address (_location)
        try:
            with conn.scope:
                await self._serve_connection(conn)
                if (conn.h11.our_state is h11.MUST_CLOSE
                        and conn.h11.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)):
                    await conn.linger()  # a refusal (400, 408, 413, 431...) must reach it
        except _Drop as exc:
            log.debug("connection dropped: %s", exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as exc:
            log.debug("connection broken: %r", exc)
        except Exception:
            log.exception("connection failed")
        finally:
            self._conns.discard(conn)
            self.slots.release(conn)
            await trio.aclose_forcefully(stream)

    async def _serve_connection(self, conn: _Conn) -> None:
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
            try:
                event = await conn.next_event(IDLE_TIMEOUT)
            except _Reply as reply:  # a malformed request head, or one too slow
                await self._send_reply(conn, reply)
                return
            if isinstance(event, h11.ConnectionClosed):
                return
            if not isinstance(event, h11.Request):
                raise _Drop(f"unexpected {type(event).__name__}")
            if conn.authenticated:
                conn.deadline = None  # its body streams at its pace (STALL_TIMEOUT per read)
            await self._request(conn, event)
            if conn.h11.our_state is h11.MUST_CLOSE or conn.h11.their_state is not h11.DONE:
                return
            try:
                conn.h11.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _send_reply(self, conn: _Conn, reply: _Reply) -> None:
        body = _json(reply.doc) if reply.doc is not None else b""
        headers = list(reply.headers)
        conn.consume_buffered_body()
        if conn.h11.their_state is not h11.DONE and ("connection", "close") not in headers:
            headers.append(("connection", "close"))  # an unread body makes reuse impossible
        # IDLE: the head was malformed or too slow (h11 lets a server answer it)
        if conn.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            await conn.respond(reply.status, body, headers, reply.reason)

    def _granted(self, conn: _Conn) -> None:
        """The request being served carried a valid token, or got one."""
        conn.granted = True
        if not conn.authenticated:
            self.slots.authenticated(conn)
            conn.deadline = None

    # ------------------------------------------------------------------ requests
    @staticmethod
    def _check_head(req: h11.Request) -> None:
        """What h11 lets through and RFC 9112 or the spec refuses (400/431, then close)."""
        close = [("connection", "close")]
        size = len(req.method) + len(req.target) + 12 + sum(len(k) + len(v) + 4
                                                            for k, v in req.headers)
        if size > MAX_HEAD:  # it came in one read: h11 bounds only incomplete heads
            raise _Reply(431, _remote("IllegalArgumentException",
                                      f"request head larger than {MAX_HEAD} bytes"),
                         close, reason="Request Header Fields Too Large")
        names = [name for name, _ in req.headers]  # h11 gives them in lower case
        if b"transfer-encoding" in names and b"content-length" in names:
            # RFC 9112 6.1: a request smuggling attempt, or a broken client: never reuse
            raise _Reply(400, _remote("IllegalArgumentException", "bad HTTP request: both "
                                      "Content-Length and Transfer-Encoding"), close)
        if names.count(b"authorization") > 1:
            raise _Reply(400, _remote("IllegalArgumentException",
                                      "bad HTTP request: more than one Authorization header"),
                         close)

    async def _request(self, conn: _Conn, req: h11.Request) -> None:
        started = time.perf_counter()
        method = req.method.decode("ascii", "replace").upper()
        target = req.target.decode("utf-8", "surrogateescape")
        raw_path, _, query = target.partition("?")
        path = urllib.parse.unquote(raw_path, errors="surrogateescape")
        params = {k.lower(): v for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True)}
        headers = {k.decode("ascii", "replace").lower(): v.decode("latin-1")
                   for k, v in req.headers}
        op = params.get("op", "").upper()
        conn.granted = False
        status = 500
        try:
            try:
                self._check_head(req)
                status = await self._dispatch(conn, method, path, params, headers, op)
            except WebHdfsError as exc:
                raise _Reply(exc.status, exc.body()) from exc
        except _Reply as reply:
            status = reply.status
            if reply.status >= 500:
                log.warning("%s %s %s -> %d %s", method, op, path, reply.status,
                            (reply.doc or {}).get("RemoteException", {}).get("message", ""))
            await self._send_reply(conn, reply)
        except _Drop:
            raise
        except Exception as exc:
            log.exception("%s %s %s failed", method, op, path)
            status = 500
            await self._send_reply(conn, _Reply(500, _remote("IOException",
                                                              f"internal error: {exc!r}")))
        finally:
            elapsed = time.perf_counter() - started
            if conn.granted:  # a bounded set of names: what clients without a token send,
                # and paths, never make new entries
                label = _stats_label(path, op, params)
                self.stats.setdefault(label, _OpStats()).add(elapsed)
            log.debug("%s %s %s%s -> %d (%.1f ms) %s", method, op or "-", path,
                      " [data]" if params.get("data") == "true" else "", status, elapsed * 1e3,
                      query)

    async def _dispatch(self, conn: _Conn, method: str, path: str, params: dict[str, str],
                        headers: dict[str, str], op: str) -> int:
        if path == TOKEN_PATH:
            status = await self._token(conn, method, headers)
            if status == 200:
                self._granted(conn)
            return status
        grant = await self._authenticate(headers)
        self._granted(conn)
        if path == MARKER_PATH:
            return await self._marker(conn, method, params, grant)
        if path != WEBHDFS_PREFIX and not path.startswith(WEBHDFS_PREFIX + "/"):
            raise _Reply(404, _remote("FileNotFoundException",
                                      f"no such endpoint: {path} (WebHDFS is served under "
                                      f"{WEBHDFS_PREFIX}/, tokens at {TOKEN_PATH})"))
        rel = rel_path(path[len(WEBHDFS_PREFIX):] or "/")
        if not op:
            raise WebHdfsError("IllegalArgumentException",
                               'Invalid value for webhdfs parameter "op": no op given')
        supported = {"GET": _GET_OPS, "PUT": _PUT_OPS, "POST": _POST_OPS,
                     "DELETE": _DELETE_OPS}.get(method, set())
        if op not in supported:
            why = _UNSUPPORTED.get(method, {}).get(op)
            if why is not None:
                raise WebHdfsError("UnsupportedOperationException",
                                   f"{op} is not supported by sos gateway: {why}")
            raise WebHdfsError("IllegalArgumentException",
                               f'Invalid value for webhdfs parameter "op": {op} is not a valid '
                               f"{method} operation.")
        if method in _MUTATING_METHODS and not grant.can_write:
            raise WebHdfsError("AccessControlException",
                               f"Permission denied: {op} needs a token of a key with the "
                               f"append role; this token is read-only")
        if op in ("CREATE", "APPEND", "OPEN"):
            return await self._two_step(conn, method, op, rel, params, headers)
        await conn.read_small_body()
        doc = await self._simple(op, rel, params, grant)
        body = _json(doc) if doc is not None else b""
        await conn.respond(200, body)
        return 200

    async def _authenticate(self, headers: dict[str, str]) -> TokenInfo:
        if self.insecure:
            return TokenInfo(self.ns.namespace, "append", 0, "")
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            grant = self.authority.check(token.strip())
            if grant is not None:
                await self._key_stands(grant)
                return grant
            raise _Reply(401, _remote("AccessControlException",
                                      "the bearer token is invalid or expired: get a new one "
                                      f"at {TOKEN_PATH}"),
                         [("www-authenticate", 'Bearer realm="sos", error="invalid_token"')],
                         reason="Unauthorized: invalid or expired bearer token")
        raise _Reply(401, _remote("AccessControlException",
                                  f"authentication required: send Authorization: Bearer <token> "
                                  f"(POST client credentials to {TOKEN_PATH} for one)"),
                     [("www-authenticate", 'Bearer realm="sos"')],
                     reason="Unauthorized: no bearer token")

    async def _key_stands(self, grant: TokenInfo) -> None:
        """401 once the SOS server refuses the token's key (revoked: asked again every
        key_recheck seconds, no server round trip in between); 503 if it cannot be asked."""
        try:
            await self.key_checks.for_bearer(grant)
        except KeyRevoked as exc:
            log.info("token of key %s refused: %s", grant.key_id or "?", exc)
            raise _Reply(401, _remote("AccessControlException",
                                      f"the bearer token's key was revoked: {exc}"),
                         [("www-authenticate", 'Bearer realm="sos", error="invalid_token"')],
                         reason="Unauthorized: the token's key was revoked") from None
        except ConnectionError as exc:
            raise _Reply(503, _remote("IOException", f"cannot check the token's key: {exc}"),
                         [("retry-after", "5")]) from None

    async def _simple(self, op: str, rel: str, params: dict[str, str],
                      grant: TokenInfo) -> dict | None:
        ns = self.ns
        if op in ("GETFILESTATUS", "GETFILELINKSTATUS"):
            return await self._run(ns.get_file_status, rel)
        if op == "LISTSTATUS":
            return await self._run(ns.list_status, rel)
        if op == "LISTSTATUS_BATCH":
            return await self._run(ns.list_status_batch, rel, params.get("startafter", ""))
        if op == "GETCONTENTSUMMARY":
            return await self._run(ns.content_summary, rel)
        if op == "GETHOMEDIRECTORY":
            return {"Path": f"/user/{params.get('user.name') or ns.owner}"}
        if op == "GETSERVERDEFAULTS":
            return SERVER_DEFAULTS
        if op == "CHECKACCESS":
            await self._run(ns.check_access, rel, params.get("fsaction", ""), grant.can_write)
            return None
        if op == "MKDIRS":
            mode = parse_permission(params.get("permission"), 0o755)
            return await self._run(ns.mkdirs, rel, mode)
        if op == "RENAME":
            dst = params.get("destination")
            if not dst:
                raise WebHdfsError("IllegalArgumentException",
                                   'Invalid value for webhdfs parameter "destination": missing')
            options = None
            if "renameoptions" in params:
                options = {o.strip().upper() for o in params["renameoptions"].split(",")
                           if o.strip()}
                unknown = options - {"NONE", "OVERWRITE", "TO_TRASH"}
                if unknown:
                    raise WebHdfsError("IllegalArgumentException",
                                       f'Invalid value for webhdfs parameter "renameoptions": '
                                       f"{sorted(unknown)}")
            return await self._run(ns.rename, rel, dst, options)
        if op == "DELETE":
            return await self._run(ns.delete, rel, _bool_param(params, "recursive", False))
        if op == "SETPERMISSION":
            await self._run(ns.set_permission, rel, parse_permission(params.get("permission"),
                                                                     0o755))
            return None
        if op == "SETTIMES":
            await self._run(ns.set_times, rel, _int_param(params, "modificationtime", -1),
                            _int_param(params, "accesstime", -1))
            return None
        if op == "SETREPLICATION":
            return await self._run(ns.set_replication, rel)
        if op == "TRUNCATE":
            new_length = _int_param(params, "newlength", None)
            if new_length is None:
                raise WebHdfsError("IllegalArgumentException",
                                   'Invalid value for webhdfs parameter "newlength": missing')
            return await self._run(ns.truncate, rel, new_length)
        raise AssertionError(op)  # pragma: no cover - _dispatch checked the op

    # ------------------------------------------------------------------ CREATE / APPEND / OPEN
    def _location(self, headers: dict[str, str], path: str, params: dict[str, str]) -> str:
        """The data step's URL. Its host is the gateway's own (``advertise``, else the
        listen address, else, for a wildcard listener, the address this client reached),
        never the client's Host header: a client could name any host there."""
        query = {k: v for k, v in params.items() if k not in ("noredirect", "data")}
        query["data"] = "true"
        return (f"{self._advertised_base()}{urllib.parse.quote(path, errors='surrogateescape')}"
                f"?{urllib.parse.urlencode(query)}")

    def _advertised_base(self) -> str:
        """``scheme://host:port`` of the redirects (see :meth:`_location`)."""
        bound_host, port = self.address or ("127.0.0.1", 0)
        host = self._listen_host or bound_host
        if self.advertise is not None:
            host, port = self.advertise[0], self.advertise[1] or port
        elif _is_wildcard(host):
            conn = _CURRENT_CONN.get()
            local = conn.local if conn is not None else ""
            host = local if local and not _is_wildcard(local) else "127.0.0.1"
            if host.startswith("::ffff:") and "." in host:  # dual-stack socket, IPv4 client
                host = host[len("::ffff:"):]
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{port}"

    async def _two_step(self, conn: _Conn, method: str, op: str, rel: str,
                        params: dict[str, str], headers: dict[str, str]) -> int:
        """Step 1 (no ``data=true``): check, then 307 to this same URL with ``data=true``
        (``noredirect=true``: 200 + ``{"Location": ...}``). Step 2: the data."""
        ns = self.ns
        if params.get("data") != "true":
            await conn.read_small_body()
            if op == "CREATE":
                await self._run(lambda: ns.check_create(
                    rel, overwrite=_bool_param(params, "overwrite", False),
                    create_parent=_bool_param(params, "createparent", True)))
            elif op == "APPEND":
                await self._run(ns.check_append, rel)
            else:
                await self._run(ns.check_append, rel)  # OPEN: an existing file
            if op != "OPEN":
                await self._run(ns.check_lease, rel)
            location = self._location(headers, WEBHDFS_PREFIX + "/" + rel, params)
            if _bool_param(params, "noredirect", False):
                await conn.respond(200, _json({"Location": location}))
                return 200
            await conn.respond(307, b"", [("location", location)])
            return 307
        if op == "OPEN":
            await conn.read_small_body()
            return await self._open(conn, rel, params)
        return await self._receive_file(conn, op, rel, params)

    async def _receive_file(self, conn: _Conn, op: str, rel: str, params: dict[str, str]) -> int:
        ns = self.ns
        try:
            if op == "CREATE":
                mode = parse_permission(params.get("permission"), 0o644)
                overwrite = _bool_param(params, "overwrite", False)
                create_parent = _bool_param(params, "createparent", True)
                await self._run(lambda: ns.begin_create(rel, mode, overwrite=overwrite,
                                                        create_parent=create_parent))
                offset = 0
            else:
                offset = await self._run(ns.begin_append, rel)
        except WebHdfsError:
            if not conn.h11.they_are_waiting_for_100_continue:
                await conn.drain()  # Hadoop's client sends the whole body before it reads a reply
            raise
        failure: WebHdfsError | None = None
        try:
            pending: list[bytes] = []
            size = 0
            while True:
                event = await conn.next_event()
                if isinstance(event, h11.Data):
                    if failure is not None:
                        continue  # drain the rest, then answer
                    pending.append(bytes(event.data))
                    size += len(event.data)
                    if size < WRITE_PIECE:
                        continue
                elif isinstance(event, h11.ConnectionClosed):
                    raise _Drop("closed in the middle of a file body")
                elif not isinstance(event, h11.EndOfMessage):
                    continue
                if pending and failure is None:
                    data = b"".join(pending)
                    pending, size = [], 0
                    try:
                        await self._run(ns.write, rel, offset, data)
                        offset += len(data)
                    except WebHdfsError as exc:
                        failure = exc
                if isinstance(event, h11.EndOfMessage):
                    break
        finally:
            await self._run(ns.release, rel)
        if failure is not None:
            raise failure
        # sync mode: the file's contents are durable before the writer is told so (the
        # RENAME that follows may reach a replacement gateway that never saw them)
        await self._run(ns.barrier)
        if op == "CREATE":
            await conn.respond(201)
            return 201
        await conn.respond(200)
        return 200

    async def _open(self, conn: _Conn, rel: str, params: dict[str, str]) -> int:
        """The data step of OPEN, in pieces of OPEN_PIECE read as the client takes them; each
        piece is counted in the gateway-wide :attr:`open_memory` while it waits to be sent.
        A new reply that finds no room in OPEN_MEMORY_WAIT seconds answers 503 (readers
        that do not read are dropped by the send timeout, which gives their room back)."""
        offset = _int_param(params, "offset", 0) or 0
        length = _int_param(params, "length", None)
        fd, start, count = await self._run(self.ns.open_for_read, rel, offset, length)
        held = False
        try:
            if count:
                held = await self._open_room(OPEN_MEMORY_WAIT)
                if not held:
                    raise _Reply(503, _remote("IOException", "the gateway holds too many replies "
                                              "that are not read yet: try again"),
                                 [("retry-after", "1")])
            await conn.send(h11.Response(status_code=200,
                                         headers=[(b"content-length", str(count).encode())]))
            pos, end = start, start + count
            while pos < end:
                if not held:
                    held = await self._open_room(self.send_timeout)
                    if not held:
                        raise _Drop("no room to send an OPEN reply")
                chunk = await self._run(os.pread, fd, min(OPEN_PIECE, end - pos), pos)
                if not chunk:  # cannot happen on a snapshot, unless truncated meanwhile
                    raise _Drop(f"/{rel} shrank while being read")
                await conn.send(h11.Data(data=chunk))
                pos += len(chunk)
                self.open_memory.release()
                held = False
            await conn.send(h11.EndOfMessage())
        finally:
            if held:
                self.open_memory.release()
            os.close(fd)
        return 200

    async def _open_room(self, timeout: float) -> bool:
        """Take room for one OPEN piece; False after ``timeout`` seconds without any."""
        with trio.move_on_after(timeout):
            await self.open_memory.acquire()
            return True
        return False

    # ------------------------------------------------------------------ token, marker
    async def _verified_key(self, secret: str, conn: _Conn) -> tuple[str, str]:
        """(role, key_id) of a client secret the SOS server accepts now (asked every time:
        a removed key gets no new token), throttled per client address (KeyChecks)."""
        return await self.key_checks.for_token(secret, _peer_address(conn.stream))

    async def _token(self, conn: _Conn, method: str, headers: dict[str, str]) -> int:
        if method != "POST":
            raise _Reply(405, {"error": "invalid_request",
                               "error_description": f"{TOKEN_PATH} takes POST"},
                         [("allow", "POST")])
        body = await conn.read_small_body()
        form = dict(urllib.parse.parse_qsl(body.decode("utf-8", "replace"),
                                           keep_blank_values=True))
        auth = headers.get("authorization", "")
        if auth.lower().startswith("basic "):  # RFC 6749 2.3.1: credentials in the header
            import base64
            import binascii

            try:
                user, _, secret = base64.b64decode(auth[6:].strip()).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                raise _Reply(400, {"error": "invalid_request",
                                   "error_description": "malformed Basic credentials"}) from None
            form.setdefault("client_id", urllib.parse.unquote_plus(user))
            form.setdefault("client_secret", urllib.parse.unquote_plus(secret))
        no_store = [("cache-control", "no-store"), ("pragma", "no-cache")]
        if form.get("grant_type") != "client_credentials":
            raise _Reply(400, {"error": "unsupported_grant_type",
                               "error_description": "only grant_type=client_credentials"},
                         no_store)
        if form.get("client_id") != self.ns.namespace:
            raise _Reply(401, {"error": "invalid_client",
                               "error_description": "client_id must be the gateway's namespace"},
                         no_store)
        secret = form.get("client_secret", "")
        if not secret:
            raise _Reply(400, {"error": "invalid_request",
                               "error_description": "client_secret (a key of the namespace) "
                                                   "is missing"}, no_store)
        try:
            role, key_id = await self._verified_key(secret, conn)
        except Throttled as exc:
            log.info("token request throttled: %s", exc.message)
            raise _Reply(exc.status, {"error": "temporarily_unavailable",
                                      "error_description": exc.message},
                         [*no_store, ("retry-after", str(exc.retry_after))]) from None
        except (PermissionError, ValueError) as exc:
            log.info("token refused: %s", exc)
            raise _Reply(401, {"error": "invalid_client",
                               "error_description": "the SOS server refused this key for the "
                                                   "namespace"}, no_store) from None
        except ConnectionError as exc:
            log.warning("cannot check a client key: %s", exc)
            raise _Reply(503, {"error": "temporarily_unavailable",
                               "error_description": "the SOS server cannot be reached"},
                         [*no_store, ("retry-after", "5")]) from None
        token, expires_in = self.authority.issue(role, key_id, _key_secret(secret))
        log.info("issued a %s token for key %s (%d s)", role, key_id or "?", expires_in)
        await conn.respond(200, _json({"access_token": token, "token_type": "Bearer",
                                       "expires_in": expires_in}), no_store)
        return 200

    async def _marker(self, conn: _Conn, method: str, params: dict[str, str],
                      grant: TokenInfo) -> int:
        if method != "POST":
            raise _Reply(405, _remote("UnsupportedOperationException",
                                      f"{MARKER_PATH} takes POST"), [("allow", "POST")])
        if not grant.can_write:
            raise WebHdfsError("AccessControlException",
                               "Permission denied: a marker needs a token of a key with the "
                               "append role")
        label = params.get("label", "")
        if not label:
            raise WebHdfsError("IllegalArgumentException", "marker: label= is missing")
        payload = await conn.read_small_body()
        try:
            seq = await self._run(self.ns.marker, label, payload)
        except ValueError as exc:  # a label the journal refuses
            raise WebHdfsError("IllegalArgumentException", f"marker: {exc}") from None
        await conn.respond(200, _json({"seq": seq}))
        return 200

    def summary(self) -> str:
        """One line per operation (of requests with a valid token): count, mean, p50, p99
        (of a uniform sample) and worst latency (ms)."""
        lines = []
        for name, s in sorted(self.stats.items()):
            lat = sorted(s.samples)
            p50 = lat[len(lat) // 2] if lat else 0.0
            p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
            lines.append(f"{name}: {s.count} requests, mean {s.seconds / max(s.count, 1) * 1e3:.2f}"
                         f" ms, p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, "
                         f"max {s.worst * 1e3:.2f} ms")
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Running a gateway: server connection -> opener -> HTTP
# ---------------------------------------------------------------------------

def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); port 0 picks a free one."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if sep and rest.startswith(":") else ""
    else:
        host, _, port_text = text.rpartition(":")
    if not host or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ValueError(f"--listen {text!r}: expected HOST:PORT (e.g. 0.0.0.0:9870)")
    return host, int(port_text)


def _peer_address(stream: trio.abc.Stream) -> str:
    """The client's address as the token endpoint's throttles count it (address_key)."""
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    try:
        sock = inner.socket  # type: ignore[union-attr]  # SocketStream (TCP) only
        return address_key(str(sock.getpeername()[0]))
    except (AttributeError, OSError, IndexError, TypeError):
        return "?"


def _key_secret(key_text: str) -> bytes:
    """The secret of a key the server just accepted (sealed into its tokens)."""
    from sos_wire.auth import Key

    return Key.parse(key_text).secret


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    """A listen host that means every interface (no address of its own to advertise)."""
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_unspecified
    except ValueError:
        return False


def parse_advertise(text: str) -> tuple[str, int | None]:
    """``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT`` -> (host, port or None: the
    listen port)."""
    text = text.strip()
    host, port_text = text, ""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            host = ""
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    if not host or _is_wildcard(host) or (port_text and not (
            port_text.isdigit() and 0 < int(port_text) < 65536)) or text.endswith(":"):
        raise ValueError(f"--advertise {text!r}: expected HOST or HOST:PORT, the name clients "
                         f"reach the gateway at (e.g. sos-gateway:9870)")
    return host, int(port_text) if port_text else None


def plaintext_refusal(listen: str, *, tls: bool, insecure_plaintext: bool) -> str:
    """Why serving plain HTTP on ``listen`` is refused ("" if it is not): off a loopback
    address a token request carries a key of the namespace in clear, and every request
    a bearer token."""
    host, _ = parse_listen(listen)
    if tls or insecure_plaintext or is_loopback(host):
        return ""
    return (f"--listen {listen} is not a loopback address and there is no --tls-cert: clients "
            f"would send their keys (at {TOKEN_PATH}) and bearer tokens in clear. Serve HTTPS "
            f"with --tls-cert/--tls-key, or pass --insecure-plaintext if the network between "
            f"the clients and the gateway is trusted (e.g. an encrypted overlay)")


def _stats_label(path: str, op: str, params: dict[str, str]) -> str:
    """The statistics' key of a request: its operation, from a fixed set of names."""
    if path == TOKEN_PATH:
        return "token"
    if path == MARKER_PATH:
        return "marker"
    if op not in _KNOWN_OPS or not (path == WEBHDFS_PREFIX or
                                    path.startswith(WEBHDFS_PREFIX + "/")):
        return "other"
    if op in ("CREATE", "APPEND", "OPEN") and params.get("data") == "true":
        return f"{op} data"
    return op


def raise_nofile_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard one (at the common soft limit of 1,024
    the gateway ran out of descriptors before its own connection cap); (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and soft != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft, hard


def fit_connections(wanted: int, soft_limit: int, threads: int) -> int:
    """The connection cap that fits ``soft_limit`` descriptors: each connection may hold two
    (its socket, and the file an OPEN sends), FD_RESERVE plus one per worker thread stay for
    the rest (the journal, the cache, the SOS server's connections)."""
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        return wanted
    return max(8, min(wanted, (soft_limit - FD_RESERVE - threads) // 2))


def key_verifier(server: str, namespace: str, *, timeout: float = 30.0,
                 tls: ssl.SSLContext | None = None) -> Callable[[str], tuple[str, str]]:
    """``verify(key_text) -> (role, key_id)``: authenticates with the key at the SOS server."""

    def verify(key_text: str) -> tuple[str, str]:
        from sos_client import Client
        from sos_wire.auth import Key
        from sos_wire.events import KeyRole

        key = Key.parse(key_text)  # BadKey (a ValueError) for a malformed secret
        client = Client(server, key, namespace, timeout=timeout, tls=tls)
        try:
            # APPEND and TOKEN (the gateway clients' key role, protocol.md 1.6) get an append token
            role = "read" if client.role == KeyRole.READ else "append"
        finally:
            client.close()
        return role, key.key_id_hex

    return verify


def run_gateway(namespace: str, listen: str, *, server: str, key: str, cache_dir: str | None = None,
                client_factory: Callable[[], Any] | None = None, timeout: float = 30.0,
                tls_client: ssl.SSLContext | None = None, tls_cert: str | None = None,
                tls_key: str | None = None, sync: bool = True, max_lag_bytes: int = 64 << 20,
                generation_bytes: int | None = None, insecure_no_auth: bool = False,
                token_ttl: int = DEFAULT_TOKEN_TTL, threads: int = 32,
                flush_timeout: float = 120.0, drain_timeout: float = DRAIN_TIMEOUT,
                insecure_plaintext: bool = False, advertise: str | None = None,
                max_connections: int = MAX_CONNECTIONS,
                max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
                head_timeout: float = HEAD_TIMEOUT, send_timeout: float = SEND_TIMEOUT,
                open_memory: int = OPEN_MEMORY, key_recheck: float = DEFAULT_KEY_RECHECK) -> int:
    """Serve ``namespace`` on ``listen`` until SIGTERM/SIGINT; returns the exit code
    (0 after a clean stop with the journal flushed, 1 if the final flush failed). On the
    signal it stops accepting connections and gives the requests in progress
    ``drain_timeout`` seconds to finish (a second signal stops at once).

    ``client_factory`` (optional) returns a connected client for the namespace (TLS and
    timeouts of the CLI's connection options); ``tls_client`` is the SSL context that
    checks client keys at the server (the same trust as the factory's). ``tls_cert`` +
    ``tls_key`` serve HTTPS (``swebhdfs://``); without them a listen address that is not
    loopback is refused unless ``insecure_plaintext`` (:func:`plaintext_refusal`).
    ``advertise``: ``HOST[:PORT]`` the redirects name. The connection cap is lowered to
    what the descriptor limit (raised to its hard limit first) holds.
    """
    from sos_client.journal.open import default_cache_dir, open_namespace
    from sos_wire.auth import Key

    host, port = parse_listen(listen)
    if insecure_no_auth and not is_loopback(host):
        raise ValueError(f"--insecure-no-auth is only accepted on a loopback address, not {host}")
    refusal = plaintext_refusal(listen, tls=bool(tls_cert or tls_key),
                                insecure_plaintext=insecure_plaintext)
    if refusal:
        raise ValueError(refusal)
    advertised = parse_advertise(advertise) if advertise else None
    soft, hard = raise_nofile_limit()
    cap = fit_connections(max_connections, soft, threads)
    log.info("descriptor limit %d (hard %d): at most %d connections (%d without a valid token, "
             "%d per client address)", soft, hard, cap, max(4, cap // 4),
             min(max_per_address, cap))
    if cap < max_connections:
        log.warning("the descriptor limit (%d) holds only %d connections, not %d: raise its hard "
                    "limit (ulimit -Hn, LimitNOFILE=) for more", soft, cap, max_connections)
    tls = None
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(tls_cert, tls_key)
    secret = Key.parse(key).secret
    opened = open_namespace(namespace, cache_dir or default_cache_dir(namespace), server=server,
                            key=key, timeout=timeout, tls=tls_client,
                            client_factory=client_factory, sync=False,
                            max_lag_bytes=max_lag_bytes, generation_bytes=generation_bytes)
    import getpass

    try:
        owner = getpass.getuser()
    except (KeyError, OSError):
        owner = "sos"
    ns = WebHdfsNamespace(opened, sync=sync, owner=owner, group=owner)
    gateway = Gateway(ns, TokenAuthority(namespace, secret, ttl=token_ttl),
                      key_verifier(server, namespace, timeout=timeout, tls=tls_client),
                      insecure=insecure_no_auth, tls=tls, threads=threads,
                      max_connections=cap, max_per_address=max_per_address,
                      head_timeout=head_timeout, send_timeout=send_timeout,
                      open_memory=open_memory, advertise=advertised, key_recheck=key_recheck)
    if advertised is None and tls is not None and _is_wildcard(host):
        log.warning("--listen %s with TLS and no --advertise: the redirects of CREATE, APPEND "
                    "and OPEN name the IP address each client reached, which the certificate "
                    "must then hold; give --advertise NAME:PORT (a name of the certificate)",
                    listen)
    code = 0
    try:
        trio.run(_serve_until_signal, gateway, host, port, namespace, sync, drain_timeout)
        log.info("stopped; requests served:\n%s", gateway.summary() or "(none)")
        try:
            if opened.writer is not None:  # None only for a read-only namespace (nothing to flush)
                opened.writer.barrier(timeout=flush_timeout)
        except Exception as exc:  # noqa: BLE001 - reported, exit code says it
            log.error("final flush failed (the spool in %s keeps the journal; the next gateway "
                      "on this cache ships it): %r", opened.spool_dir, exc)
            code = 1
    finally:
        try:
            opened.close(timeout=0)
        except Exception as exc:  # noqa: BLE001
            log.error("closing the journal failed: %r", exc)
            code = 1
    return code


async def _serve_until_signal(gateway: Gateway, host: str, port: int, namespace: str,
                              sync: bool, drain_timeout: float = DRAIN_TIMEOUT) -> None:
    """Serve until SIGTERM/SIGINT, then drain: no new connection, the requests in
    progress finish (at most ``drain_timeout`` s); a second signal stops at once."""
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            with trio.CancelScope() as watching:

                async def serve(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
                                ) -> None:
                    await gateway.serve(host, port, task_status=task_status)
                    watching.cancel()  # drained: nothing left to wait for

                await nursery.start(serve)
                print(f"{READY_MARKER} {gateway.url} (namespace {namespace}, "
                      f"{'sync' if sync else 'async'}{', no auth' if gateway.insecure else ''})",
                      file=sys.stderr, flush=True)
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if gateway.draining:
                        log.info("%s again: stopping now", name)
                        nursery.cancel_scope.cancel()
                        break
                    busy = gateway.drain()
                    log.info("%s: stopping: no new connections; %d in progress get %.0f s to "
                             "finish", name, busy, drain_timeout)
                    nursery.cancel_scope.deadline = trio.current_time() + drain_timeout


# ---------------------------------------------------------------------------
# GatewayProcess: `sos gateway` in a child process (tests, Spark helpers)
# ---------------------------------------------------------------------------

class GatewayProcess:
    """Runs ``sos gateway NAMESPACE --listen LISTEN --cache CACHE`` in a child process.

    ``.url`` (``http://host:port``) is known once :meth:`start` returns; ``.stop()``
    (SIGTERM, flushes), ``.kill()`` (SIGKILL, a crash). The key goes by environment.
    """

    def __init__(self, namespace: str, cache_dir: str, server: str, key: str, *,
                 listen: str = "127.0.0.1:0", sync: bool = True, log_path: str | None = None,
                 extra_args: tuple[str, ...] | list[str] = (), start_timeout: float = 120.0,
                 debug: bool = False) -> None:
        self.namespace = namespace
        self.cache_dir = cache_dir
        self.server = server
        self.key = key
        self.listen = listen
        self.sync = sync
        self.extra_args = list(extra_args)
        self.start_timeout = start_timeout
        self.debug = debug
        self.log_path = log_path or os.path.join(tempfile.mkdtemp(prefix="sos-gateway-log-"),
                                                 "gateway.log")
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    @property
    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "spark_plugin.cli_gateway", self.namespace,
               "--listen", self.listen, "--cache", self.cache_dir, "--server", self.server]
        if not self.sync:
            cmd.append("--async")
        if self.debug:
            cmd.append("--debug")
        return cmd + self.extra_args

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def start(self) -> Self:
        env = dict(os.environ, SOS_KEY=str(self.key))
        with open(self.log_path, "ab") as logf:
            offset = logf.tell()
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=logf, env=env)
        deadline = time.monotonic() + self.start_timeout
        while True:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
            for line in text.splitlines():
                if line.startswith(READY_MARKER):
                    self.url = line[len(READY_MARKER):].split()[0]
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"sos gateway exited with {self.proc.returncode}:\n"
                                   f"{text[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"sos gateway did not start in {self.start_timeout}s:\n"
                                   f"{text[-4000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(60)

    def stop(self, timeout: float = 120.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(60)
        return self.proc.returncode

    def __enter__(self) -> Self:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
