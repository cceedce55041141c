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

import ipaddress
import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
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

__all__ = ["READY_MARKER", "Gateway", "GatewayProcess", "parse_listen", "run_gateway"]

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
READ_CHUNK = 1 << 20
#: a keep-alive connection idle this long between requests is closed
IDLE_TIMEOUT = 120.0
#: a request whose head or body makes no progress for this long is dropped
STALL_TIMEOUT = 120.0
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
    count: int = 0
    seconds: float = 0.0
    worst: float = 0.0
    latencies: list[float] = field(default_factory=list)


class _Conn:
    """One HTTP connection: h11 state plus the stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        #: set when the gateway stops: the next reply tells the client to close
        self.closing = False

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
            try:
                with trio.move_on_after(timeout):
                    chunk = await self.stream.receive_some(RECV_SIZE)
                    self.h11.receive_data(bytes(chunk))  # b"": the client closed
                    return True
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _Drop(f"receive failed: {exc!r}") from exc
            finally:
                idle.discard(scope)
        return False

    async def next_event(self, timeout: float = STALL_TIMEOUT) -> Any:
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
            with trio.move_on_after(timeout) as scope:
                try:
                    data = await self.stream.receive_some(RECV_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    raise _Drop(f"receive failed: {exc!r}") from exc
            if scope.cancelled_caught:
                raise _Drop("the client stalled")
            self.h11.receive_data(bytes(data))

    async def send(self, event: Any) -> None:
        if isinstance(event, h11.Response) and self.closing:
            event = h11.Response(status_code=event.status_code, reason=event.reason,
                                 headers=[*event.headers, (b"connection", b"close")])
        data = self.h11.send(event)
        if data:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _Drop(f"send failed: {exc!r}") from exc

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

    async def drain(self) -> None:
        """Read and discard the rest of the request body (memory stays bounded)."""
        while self.h11.their_state is h11.SEND_BODY:
            event = await self.next_event()
            if isinstance(event, h11.ConnectionClosed):
                raise _Drop("closed in the middle of a request body")


class Gateway:
    """The HTTP server of one namespace (see the module docstring).

    ``ns``: the WebHDFS view of the opened namespace. ``authority``: issues and checks
    tokens; ``verify_key(key_text) -> (role, key_id)`` authenticates a client secret at
    the SOS server (PermissionError if refused, ConnectionError if unreachable).
    ``insecure``: serve every request as the append role without a token (only for a
    loopback listener; the CLI enforces it). ``threads``: most worker threads at once.
    ``key_recheck``: seconds after which a bearer token's key is asked again at the server.
    """

    def __init__(self, ns: WebHdfsNamespace, authority: TokenAuthority,
                 verify_key: Callable[[str], tuple[str, str]], *, insecure: bool = False,
                 tls: ssl.SSLContext | None = None, threads: int = 32,
                 max_connections: int = 1024, key_recheck: float = DEFAULT_KEY_RECHECK) -> None:
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
        self.connections = trio.CapacityLimiter(max_connections)
        self.stats: dict[str, _OpStats] = {}
        self.address: tuple[str, int] | None = None
        #: True once :meth:`drain` was called (the gateway is stopping)
        self.draining = False
        self._accepting: trio.CancelScope | None = None
        self._idle: set[trio.CancelScope] = set()
        self._conns: set[_Conn] = set()

    # ------------------------------------------------------------------ serving
    async def serve(self, host: str, port: int, *,
                    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        tcp = await trio.open_tcp_listeners(port, host=host or None)
        addr = tcp[0].socket.getsockname()
        self.address = (addr[0], addr[1])
        listeners: list[trio.abc.Listener[Any]] = list(tcp)
        if self.tls is not None:
            listeners = [trio.SSLListener(lis, self.tls, https_compatible=True) for lis in tcp]
        # connections live in their own nursery: stopping the accept loop (drain) leaves
        # the requests in progress running; serve returns once they are all done
        async with trio.open_nursery() as handlers:
            with trio.CancelScope() as self._accepting:
                task_status.started(self.address)
                await trio.serve_listeners(self._connection, listeners,
                                           handler_nursery=handlers)

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
        conn = _Conn(stream)
        try:
            self.connections.acquire_nowait()
        except trio.WouldBlock:
            try:
                await conn.respond(503, _json(_remote("IOException", "too many connections")),
                                   [("connection", "close")])
            except _Drop:
                pass
            await trio.aclose_forcefully(stream)
            return
        self._conns.add(conn)
        conn.closing = self.draining
        try:
            await self._serve_connection(conn)
        except _Drop as exc:
            log.debug("connection dropped: %s", exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as exc:
            log.debug("connection broken: %r", exc)
        except Exception:
            log.exception("connection failed")
        finally:
            self._conns.discard(conn)
            self.connections.release()
            await trio.aclose_forcefully(stream)

    async def _serve_connection(self, conn: _Conn) -> None:
        while True:
            if self.draining or not await conn.wait_for_request(IDLE_TIMEOUT, self._idle):
                return  # stopping, or idle too long
            try:
                event = await conn.next_event(IDLE_TIMEOUT)
            except _Reply as reply:  # a malformed request head
                await self._send_reply(conn, reply)
                return
            if isinstance(event, h11.ConnectionClosed):
                return
            if not isinstance(event, h11.Request):
                raise _Drop(f"unexpected {type(event).__name__}")
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
        if conn.h11.their_state is h11.SEND_BODY and ("connection", "close") not in headers:
            headers.append(("connection", "close"))  # the unread body makes reuse impossible
        if conn.h11.our_state is h11.SEND_RESPONSE:
            await conn.respond(reply.status, body, headers, reply.reason)

    # ------------------------------------------------------------------ requests
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
        label = op or path
        status = 500
        try:
            try:
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
            if params.get("data") == "true":
                label += " data"
            stats = self.stats.setdefault(f"{method} {label}", _OpStats())
            stats.count += 1
            stats.seconds += elapsed
            stats.worst = max(stats.worst, elapsed)
            if len(stats.latencies) < 100_000:
                stats.latencies.append(elapsed)
            log.debug("%s %s %s%s -> %d (%.1f ms) %s", method, op or "-", path,
                      " [data]" if params.get("data") == "true" else "", status, elapsed * 1e3,
                      query)

    async def _dispatch(self, conn: _Conn, method: str, path: str, params: dict[str, str],
                        headers: dict[str, str], op: str) -> int:
        if path == TOKEN_PATH:
            return await self._token(conn, method, headers)
        grant = await self._authenticate(headers)
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
        host = headers.get("host") or "{}:{}".format(*(self.address or ("127.0.0.1", 0)))
        query = {k: v for k, v in params.items() if k not in ("noredirect", "data")}
        query["data"] = "true"
        return (f"{self.scheme}://{host}{urllib.parse.quote(path, errors='surrogateescape')}"
                f"?{urllib.parse.urlencode(query)}")

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
        offset = _int_param(params, "offset", 0) or 0
        length = _int_param(params, "length", None)
        fd, start, count = await self._run(self.ns.open_for_read, rel, offset, length)
        try:
            await conn.send(h11.Response(status_code=200,
                                         headers=[(b"content-length", str(count).encode())]))
            pos, end = start, start + count
            while pos < end:
                chunk = await self._run(os.pread, fd, min(READ_CHUNK, end - pos), pos)
                if not chunk:  # cannot happen on a snapshot, unless truncated meanwhile
                    raise _Drop(f"/{rel} shrank while being read")
                await conn.send(h11.Data(data=chunk))
                pos += len(chunk)
            await conn.send(h11.EndOfMessage())
        finally:
            os.close(fd)
        return 200

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
        """One line per operation: count, mean, p50, p99 and worst latency (ms)."""
        lines = []
        for name, s in sorted(self.stats.items()):
            lat = sorted(s.latencies)
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
                key_recheck: float = DEFAULT_KEY_RECHECK) -> int:
    """Serve ``namespace`` on ``listen`` until SIGTERM/SIGINT; returns the exit code
    (0 after a clean stop with the journal flushed, 1 if the final flush failed). On the
    signal it stops accepting connections and gives the requests in progress
    ``drain_timeout`` seconds to finish (a second signal stops at once).

    ``client_factory`` (optional) returns a connected client for the namespace (TLS and
    timeouts of the CLI's connection options); ``tls_client`` is the SSL context that
    checks client keys at the server (the same trust as the factory's). ``tls_cert`` +
    ``tls_key`` serve HTTPS (``swebhdfs://``).
    """
    from sos_client.journal.open import default_cache_dir, open_namespace
    from sos_wire.auth import Key

    host, port = parse_listen(listen)
    if insecure_no_auth and not is_loopback(host):
        raise ValueError(f"--insecure-no-auth is only accepted on a loopback address, not {host}")
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
                      insecure=insecure_no_auth, tls=tls, threads=threads, key_recheck=key_recheck)
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
