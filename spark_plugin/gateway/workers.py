"""``sos gateway --workers N``: one namespace served by N processes (docs/DEPLOY.md, Sizing).

The process ``sos gateway`` starts is the namespace's one journal writer, as with one process:
fencing, epochs, barriers, leases of files being written and the memory of RENAMEs stay in it.
It makes the listening socket(s) and starts N-1 workers (``python -m
spark_plugin.gateway.workers``) that inherit them and take every client connection (the
kernel hands each new one to whichever worker accepts it first); the writer accepts none,
so its time goes to the changes, which are what one process runs out of first. A worker

- answers every GET (GETFILESTATUS, GETFILELINKSTATUS, LISTSTATUS, OPEN, GETSERVERDEFAULTS,
  ...) itself from the writer's cache tree on disk, which every change has reached before its
  reply is sent (the writer changes the tree, then answers): a read on any process after a
  write's reply sees the write;
- answers token requests itself (the same key secret: a token of one process is good at all),
  and checks bearer tokens of the reads it serves;
- hands every other request (CREATE, APPEND, RENAME, MKDIRS, DELETE, markers, ...), body
  included, to the writer over a private Unix socket, as HTTP/1.1, and relays the writer's
  reply: the writer checks the token and answers exactly as it would have on its own socket.

The writer publishes in a small shared page (a memfd) whether a newer writer fenced it and,
with ``--lease``, until when its lease holds: a worker checks it before every request, so a
fenced or lapsed gateway stops serving reads in every process at once. The writer supervises
the workers: a worker that dies is started again; SIGTERM drains them all (each closes its
copy of the listening socket, finishes its requests, then the writer flushes); a fenced
writer makes them all refuse and exit with code 3; a writer that dies takes its workers with
it (PR_SET_PDEATHSIG, and the end of their stdin).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import json
import logging
import mmap
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, cast

import h11
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from sos_client.serving import serve_until_signal
from sos_journal.faces.facade import FenceWatch
from sos_journal.tree.open import OpenNamespace
from sos_wire.auth import Key
from sos_wire.logs import setup_logging
from spark_plugin.gateway.http.auth import TOKEN_PATH, TokenAuthority, TokenInfo, key_verifier
from spark_plugin.gateway.http.connection import CURRENT_CONN, IDLE_TIMEOUT, Conn, Drop, Head, Reply, remote_error
from spark_plugin.gateway.http.server import EXIT_FENCED, Gateway, standby_reply
from spark_plugin.gateway.options import GatewayOptions
from spark_plugin.gateway.pair.lease import LeaseHolder
from spark_plugin.gateway.process import READY_MARKER
from spark_plugin.gateway.serving import Serving, watch_fence
from spark_plugin.gateway.webhdfs.namespace import WebHdfsNamespace

__all__ = [
    "SharedState",
    "WorkerGateway",
    "WorkerRequests",
    "WorkerSpec",
    "Workers",
    "WriterGateway",
    "listen_sockets",
    "run_worker",
    "serve_with_workers",
]

log = logging.getLogger(__name__)

#: a worker not ready this long after its start fails the gateway's start (or is started again)
WORKER_START_TIMEOUT = 120.0
#: a worker that dies is started again after this long, doubling while it keeps dying young
RESTART_DELAY = (0.5, 10.0)
#: a worker that lived this long had started well: its next restart is quick again
HEALTHY_AFTER = 10.0
#: how often a worker looks at the shared page between requests, and the writer publishes
#: its lease there
STATE_POLL = 0.1
#: a pooled connection to the writer idle this long is closed by the worker (the writer
#: closes one idle IDLE_TIMEOUT: never reused when the writer may be closing it)
UPSTREAM_IDLE = IDLE_TIMEOUT / 2
#: how often a worker writes its requests' figures for the writer's metrics endpoint
STATS_EVERY = 2.0
STATS_FILE = "requests.json"
#: the largest reply of the writer a worker relays (its replies to changes are small JSON)
MAX_RELAYED_REPLY = 1 << 20
#: request headers a worker never passes on (hop by hop; its own, which the writer trusts)
_NOT_FORWARDED = frozenset({b"connection", b"keep-alive", b"expect", b"te", b"trailer", b"upgrade"})
_FORWARD_PREFIX = b"x-sos-"
#: what a worker tells the writer of the client (the writer trusts them on its Unix socket only)
PEER_HEADER = b"x-sos-peer"
LOCAL_HEADER = b"x-sos-local"
_PR_SET_PDEATHSIG = 1

#: the request head being served by this task (the worker forwards it as it came)
_CURRENT_REQUEST: contextvars.ContextVar[h11.Request | Head | None] = contextvars.ContextVar(
    "sos_gateway_request", default=None
)


# ---------------------------------------------------------------------------------- shared page


class SharedState:
    """A page the writer writes and its workers read (a memfd every process maps): fenced,
    lease lost, and the CLOCK_MONOTONIC time until which the writer's lease holds (+inf
    without a lease). One aligned 8-byte store per field: a reader never sees a torn value."""

    _FIELDS = struct.Struct("=qqd")  # fenced, lease lost, lease valid until

    def __init__(self, fd: int, *, writable: bool) -> None:
        self.fd = fd
        self.map = mmap.mmap(fd, mmap.PAGESIZE, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))

    @classmethod
    def create(cls) -> SharedState:
        fd = os.memfd_create("sos-gateway-state")
        os.ftruncate(fd, mmap.PAGESIZE)
        state = cls(fd, writable=True)
        state.set_lease(float("inf"), lost=False)
        return state

    def read(self) -> tuple[bool, bool, float]:
        fenced, lost, until = self._FIELDS.unpack_from(self.map, 0)
        return bool(fenced), bool(lost), until

    def set_fenced(self) -> None:
        struct.pack_into("=q", self.map, 0, 1)

    def set_lease(self, valid_until: float, *, lost: bool) -> None:
        struct.pack_into("=d", self.map, 16, valid_until)
        struct.pack_into("=q", self.map, 8, int(lost))

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


# ---------------------------------------------------------------------------------- the worker


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with (JSON on its stdin, the key included: never on a command
    line nor in the environment of its children)."""

    index: int
    parent: int
    namespace: str
    key: str
    server: str
    timeout: float
    server_tls: bool
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    token_ttl: int
    key_recheck: float
    threads: int
    max_connections: int
    max_per_address: int
    head_timeout: float
    send_timeout: float
    open_memory: int
    advertise: tuple[str, int | None] | None
    listen_host: str
    insecure_no_auth: bool
    tree_dir: str
    upstream: str
    scratch: str
    listen_fds: list[int]
    state_fd: int
    lease: float | None
    drain_timeout: float
    log_level: str


class WorkerNamespace(WebHdfsNamespace):
    """The read side of the writer's namespace: its cache tree, no journal. Only reads are
    asked of it (the changes go to the writer); the memory of RENAMEs it is built with lives
    in the worker's scratch directory, never in the writer's cache."""

    def __init__(self, tree_dir: str, namespace: str, scratch: str, owner: str) -> None:
        view = OpenNamespace(
            namespace=namespace,
            cache_dir=scratch,
            tree_dir=os.path.join(scratch, "tree"),
            spool_dir=scratch,
            tree=cast("Any", None),
            read_only=True,
        )
        os.makedirs(view.tree_dir, exist_ok=True)  # an empty stand-in, until the root is the writer's
        super().__init__(view, sync=False, owner=owner, group=owner)
        self.set_root(tree_dir)


class _Upstream:
    """One connection of a worker to the writer's Unix socket (HTTP/1.1, h11 as the client)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = time.monotonic()

    async def send(self, event: h11.Event) -> None:
        data = self.h11.send(event)
        if data:
            await self.stream.send_all(data)

    async def reply(self) -> tuple[h11.Response, bytes]:
        """The writer's reply, whole (bounded by MAX_RELAYED_REPLY)."""
        response: h11.Response | None = None
        body: list[bytes] = []
        size = 0
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(bytes(await self.stream.receive_some(1 << 16)))
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > MAX_RELAYED_REPLY:
                    raise Drop("the writer's reply is too large to relay")
                body.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage) and response is not None:
                return response, b"".join(body)
            elif isinstance(event, h11.ConnectionClosed):
                raise Drop("the writer process closed its connection")

    def reusable(self) -> bool:
        if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
            return False
        try:
            self.h11.start_next_cycle()
        except h11.LocalProtocolError:
            return False
        return True


class WorkerGateway(Gateway):
    """A worker's HTTP server: GETs and token requests served here, everything else relayed
    to the writer (module docstring)."""

    def __init__(self, *args: Any, shared: SharedState, upstream: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared = shared
        self.upstream = upstream
        self._pool: list[_Upstream] = []

    async def _request(self, conn: Conn, req: h11.Request | Head) -> None:
        _CURRENT_REQUEST.set(req)
        await super()._request(conn, req)

    def check_shared(self) -> None:
        """Fence this worker (refuse, drain, exit 3) once the writer says it was fenced."""
        if self.fenced is None and self.shared.read()[0]:
            self.fence("a newer writer fenced this gateway's journal writer (its writer process)")

    async def _dispatch(
        self, conn: Conn, method: str, path: str, params: dict[str, str], headers: dict[str, str], op: str
    ) -> int:
        self.check_shared()
        if self.fenced is not None or (method == "GET" and not _ends_refusal(op, path)) or path == TOKEN_PATH:
            return await super()._dispatch(conn, method, path, params, headers, op)
        req = _CURRENT_REQUEST.get()
        assert req is not None
        await self.oauth.bearer(headers)  # a request without a valid token is refused here (401)
        self._granted(conn)  # (its body streams at its pace, as in the writer)
        conn.granted = False  # counted by the writer, which serves it
        return await self._forward(conn, req)

    def _may_serve_fast(self, conn: Conn) -> bool:
        self.check_shared()  # (as _dispatch does first)
        return super()._may_serve_fast(conn)

    async def lease_gate(self, conn: Conn, method: str, path: str, grant: TokenInfo) -> int | None:
        """The writer's lease gate (:meth:`LeaseHolder.gate`), from the shared page."""
        _fenced, lost, until = self.shared.read()
        if lost:
            raise standby_reply("this sos gateway is no longer the namespace's writer: a newer writer fenced it")
        if time.monotonic() >= until:
            raise standby_reply("this sos gateway could not renew its lease (paused, or the SOS server is unreachable)")
        return None

    async def _connect(self) -> _Upstream:
        now = time.monotonic()
        while self._pool:
            up = self._pool.pop()
            if now - up.idle_since < UPSTREAM_IDLE:
                return up
            await trio.aclose_forcefully(up.stream)
        try:
            return _Upstream(await trio.open_unix_socket(self.upstream))
        except OSError as exc:
            raise Reply(
                503,
                remote_error("IOException", f"this gateway's writer process is not reachable ({exc.strerror}): retry"),
                [("retry-after", "1"), ("connection", "close")],
            ) from None

    async def _forward(self, conn: Conn, req: h11.Request | Head) -> int:
        """``req`` (its body streamed as it comes) to the writer, and its reply to ``conn``."""
        headers = [
            (name, value)
            for name, value in req.headers
            if name.lower() not in _NOT_FORWARDED and not name.lower().startswith(_FORWARD_PREFIX)
        ]
        if not any(name.lower() == b"host" for name, _ in headers):  # an HTTP/1.0 client's
            headers.append((b"host", b"sos-gateway"))
        headers += [(PEER_HEADER, conn.peer.encode()), (LOCAL_HEADER, conn.local.encode())]
        up = await self._connect()
        ok = False
        try:
            await up.send(h11.Request(method=req.method, target=req.target, headers=headers))
            if conn.fast and not conn.fast_body:  # no body (Hadoop's plain heads): the reply at once
                await up.send(h11.EndOfMessage())
                response, body = await up.reply()
            else:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump_body, conn, up)
                    response, body = await up.reply()
                    nursery.cancel_scope.cancel()  # an early reply (a refusal): the rest is not sent
            ok = True
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, h11.ProtocolError) as exc:
            # the writer went away mid-request (it is stopping, or died: this worker follows)
            raise Drop(f"the writer process's connection failed: {exc!r}") from exc
        finally:
            if ok and up.reusable():
                up.idle_since = time.monotonic()
                self._pool.append(up)
            else:
                await trio.aclose_forcefully(up.stream)
        relayed = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in response.headers
            if name not in (b"content-length", b"connection", b"keep-alive")
        ]
        if (b"connection", b"close") in response.headers or not _body_read(conn):
            relayed.append(("connection", "close"))
        await conn.respond(response.status_code, body, relayed, response.reason.decode("latin-1"))
        return response.status_code

    @staticmethod
    async def _pump_body(conn: Conn, up: _Upstream) -> None:
        while True:
            event = await conn.next_event()
            if isinstance(event, h11.Data):
                await up.send(h11.Data(data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                await up.send(h11.EndOfMessage())
                return
            elif isinstance(event, h11.ConnectionClosed):
                raise Drop("closed in the middle of a request body")


def _body_read(conn: Conn) -> bool:
    return conn.fast or conn.h11.their_state is h11.DONE


def _ends_refusal(op: str, path: str) -> bool:
    """An OPEN of a checkpoint's ``offsets/N``: the writer serves it, as a restarted driver's
    read of it ends the refusal of batch N's commit there (webhdfs/inflight.py, protocol.md
    3.4); the workers cannot see the writer's notes of batches in flight."""
    if op.upper() != "OPEN":
        return False
    parent, _, name = path.rstrip("/").rpartition("/")
    return name.isdigit() and parent.rpartition("/")[2] == "offsets"


def _server_trust(spec: WorkerSpec) -> ssl.SSLContext | None:
    if not spec.server_tls:
        return None
    return ssl.create_default_context(cafile=spec.tls_ca) if spec.tls_ca else ssl.create_default_context()


def worker_gateway(spec: WorkerSpec, shared: SharedState) -> WorkerGateway:
    """A worker's :class:`WorkerGateway`, with the writer's options."""
    tls = None
    if spec.tls_cert and spec.tls_key:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(spec.tls_cert, spec.tls_key)
    owner = os.environ.get("USER") or "sos"
    with contextlib.suppress(KeyError, OSError):
        import getpass  # noqa: PLC0415 - as serving.webhdfs_view

        owner = getpass.getuser()
    gateway = WorkerGateway(
        WorkerNamespace(spec.tree_dir, spec.namespace, os.path.join(spec.scratch, f"worker-{spec.index}"), owner),
        TokenAuthority(spec.namespace, Key.parse(spec.key).secret, ttl=spec.token_ttl),
        key_verifier(spec.server, spec.namespace, timeout=spec.timeout, tls=_server_trust(spec)),
        insecure=spec.insecure_no_auth,
        tls=tls,
        threads=spec.threads,
        max_connections=spec.max_connections,
        max_per_address=spec.max_per_address,
        head_timeout=spec.head_timeout,
        send_timeout=spec.send_timeout,
        open_memory=spec.open_memory,
        advertise=tuple(spec.advertise) if spec.advertise else None,
        key_recheck=spec.key_recheck,
        shared=shared,
        upstream=spec.upstream,
    )
    if spec.lease is not None:
        gateway.gate = gateway.lease_gate
    return gateway


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent (the writer) dies; at once if it is gone already."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


async def serve_worker(spec: WorkerSpec, gateway: WorkerGateway) -> None:
    """Serve on the inherited sockets until SIGTERM (a drain) or the writer's fence; stdout
    says ``ready`` once serving; the end of stdin (the writer gone) stops it at once."""
    sockets = [trio.socket.from_stdlib_socket(socket.socket(fileno=fd)) for fd in spec.listen_fds]

    async def watch(scope: trio.CancelScope) -> None:
        while not gateway.draining:
            gateway.check_shared()
            await trio.sleep(STATE_POLL)
        if gateway.fenced is not None:
            scope.deadline = min(scope.deadline, trio.current_time() + spec.drain_timeout)

    async def publish_stats() -> None:
        while True:
            await trio.sleep(STATS_EVERY)
            write_stats(gateway, spec.scratch, spec.index)

    async def orphaned() -> None:
        stdin = trio.lowlevel.FdStream(os.dup(0))
        while await stdin.receive_some(4096):
            pass
        log.error("worker %d: the gateway's writer process is gone: stopping now", spec.index)
        os._exit(1)

    async def serve(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:

            async def serve_then_stop(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
                await gateway.serve(spec.listen_host, 0, sockets=sockets, task_status=task_status)
                nursery.cancel_scope.cancel()

            started = await nursery.start(serve_then_stop)
            nursery.start_soon(watch, nursery.cancel_scope)
            nursery.start_soon(orphaned)
            nursery.start_soon(publish_stats)
            os.write(1, b"ready\n")
            task_status.started(started)

    def drain(name: str) -> None:
        gateway.check_shared()  # a fenced writer's SIGTERM: fenced here too (exit code 3)
        busy = gateway.drain()
        log.info("worker %d: %s: stopping: %d requests in progress", spec.index, name, busy)

    await serve_until_signal(
        serve,
        lambda _address: f"sos gateway worker {spec.index}: serving {gateway.url} (pid {os.getpid()})",
        stop=drain,
        grace=spec.drain_timeout,
    )


def run_worker() -> int:
    """``python -m spark_plugin.gateway.workers``: a read worker (its spec on stdin)."""
    spec = WorkerSpec(**json.loads(sys.stdin.readline()))
    die_with_parent(spec.parent)
    setup_logging(spec.log_level)
    shared = SharedState(spec.state_fd, writable=False)
    os.makedirs(os.path.join(spec.scratch, f"worker-{spec.index}"), mode=0o700, exist_ok=True)
    gateway = worker_gateway(spec, shared)
    trio.run(serve_worker, spec, gateway)
    write_stats(gateway, spec.scratch, spec.index)
    log.info("worker %d stopped; requests served:\n%s", spec.index, gateway.summary() or "(none)")
    return EXIT_FENCED if gateway.fenced is not None else 0


def write_stats(gateway: Gateway, scratch: str, index: int) -> None:
    """The worker's requests by operation (count, seconds) in ``scratch``, where the writer's
    metrics endpoint reads them (:class:`WorkerRequests`)."""
    doc = {op: [s.count, s.seconds] for op, s in list(gateway.stats.items())}
    path = os.path.join(scratch, f"worker-{index}", STATS_FILE)
    with contextlib.suppress(OSError):
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(path + ".tmp", path)


class WorkerRequests(Collector):
    """``sos_gateway_worker_requests{worker,op}`` and ``..._request_seconds``: the requests
    each read worker served (``sos_gateway_requests`` counts the writer's, every change
    included); a restarted worker's counters start again from 0 (a counter reset)."""

    def __init__(self, scratch: str) -> None:
        self.scratch = scratch

    def collect(self) -> Iterable[Metric]:
        reqs = CounterMetricFamily(
            "sos_gateway_worker_requests", "Requests with a valid token a read worker served", labels=["worker", "op"]
        )
        secs = CounterMetricFamily(
            "sos_gateway_worker_request_seconds", "Time a read worker spent serving them", labels=["worker", "op"]
        )
        with contextlib.suppress(FileNotFoundError):
            for name in sorted(os.listdir(self.scratch)):
                try:
                    with open(os.path.join(self.scratch, name, STATS_FILE)) as f:
                        doc = json.load(f)
                except (OSError, ValueError):
                    continue
                for op, (count, seconds) in sorted(doc.items()):
                    reqs.add_metric([name.removeprefix("worker-"), op], float(count))
                    secs.add_metric([name.removeprefix("worker-"), op], float(seconds))
        yield reqs
        yield secs


# ---------------------------------------------------------------------------------- the writer


class _Internal(Conn):
    """A connection from a worker, on the writer's Unix socket."""


class WriterGateway(Gateway):
    """The writer's HTTP server with workers: as :class:`Gateway`, plus the Unix socket its
    workers relay changes on (:meth:`serve_internal`) and the fence told to the shared page."""

    shared: SharedState | None = None

    def fence(self, reason: str) -> None:
        if self.shared is not None:
            self.shared.set_fenced()  # first: no worker serves one more request
        super().fence(reason)

    def drain(self) -> int:
        """With workers: stop serving (:meth:`serve` returns, and :func:`serve_writer` then
        drains the workers) but go on serving what they hand it until they are all gone: a
        request a worker took before its own drain is answered, as with one process."""
        if self.shared is None:
            return super().drain()
        if self._accepting is not None:
            self._accepting.cancel()
        return 0

    def _may_serve_fast(self, conn: Conn) -> bool:
        return not isinstance(conn, _Internal) and super()._may_serve_fast(conn)

    async def _request(self, conn: Conn, req: h11.Request | Head) -> None:
        if isinstance(conn, _Internal):  # the client the worker serves: its redirects' address
            fields = dict(req.headers)
            conn.local = fields.get(LOCAL_HEADER, b"").decode("latin-1")
            conn.peer = fields.get(PEER_HEADER, b"").decode("latin-1")
        await super()._request(conn, req)

    async def serve(
        self,
        host: str,
        port: int,
        *,
        sockets: list[trio.socket.SocketType] | None = None,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """With ``sockets`` (its workers'): accept nothing on them, the workers take every
        client connection and hand the changes here, so this process's time goes to the
        journal; until :meth:`drain`. Without: as :meth:`Gateway.serve`."""
        if sockets is None:
            await super().serve(host, port, task_status=task_status)
            return
        bound = sockets[0].getsockname()
        self.address = (bound[0], bound[1])
        self._listen_host = host  # the redirects name the address the clients reached
        for sock in sockets:
            sock.close()  # (copies: the workers' stay open)
        with trio.CancelScope() as self._accepting:
            task_status.started(self.address)
            await trio.sleep_forever()

    async def serve_internal(self, path: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the workers' connections on the Unix socket ``path`` until cancelled."""
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(1024)
        listener = trio.SocketListener(sock)
        async with listener, trio.open_nursery() as nursery:
            task_status.started()
            while True:
                stream = await listener.accept()
                nursery.start_soon(self._internal_connection, stream)

    async def _internal_connection(self, stream: trio.SocketStream) -> None:
        conn = _Internal(stream, send_timeout=self.send_timeout)
        CURRENT_CONN.set(conn)
        try:
            with conn.scope:
                await self._serve_connection(conn)
        except (Drop, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("a worker's connection ended: %r", exc)
        except Exception:
            log.exception("a worker's connection failed")
        finally:
            await trio.aclose_forcefully(stream)


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets on ``host:port`` as trio.open_tcp_listeners makes them (every
    address of ``host``; port 0: one free port for all), for the writer and its workers."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    made: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _name, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            made.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(made) > 1:
                address = (address[0], made[0].getsockname()[1], *address[2:])
            sock.bind(address)
            sock.listen(0xFFFF)
    except BaseException:
        for sock in made:
            sock.close()
        raise
    return made


@dataclass
class _Child:
    index: int
    process: subprocess.Popen[bytes]
    started: float


class Workers:
    """The writer's N-1 read workers: started, watched (one that dies is started again),
    stopped. ``spec``: the :class:`WorkerSpec` fields all share (index and parent are set
    here); ``sockets``: the listening sockets they inherit, closed in this process by
    :meth:`stop` (so that, once every process closed its copy, connections are refused)."""

    def __init__(self, count: int, spec: dict[str, Any], sockets: list[socket.socket], shared: SharedState) -> None:
        self.count = count
        self.spec = spec
        self.sockets = sockets
        self.shared = shared
        self.children: dict[int, _Child] = {}
        self.stopping = False
        self._stopped = trio.Event()

    def _spawn(self, index: int) -> _Child:
        fds = [sock.fileno() for sock in self.sockets]
        spec = WorkerSpec(**self.spec, index=index, parent=os.getpid(), listen_fds=fds, state_fd=self.shared.fd)
        process = subprocess.Popen(
            [sys.executable, "-m", "spark_plugin.gateway.workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=[*fds, self.shared.fd],
        )
        assert process.stdin is not None
        process.stdin.write(json.dumps(asdict(spec)).encode() + b"\n")
        process.stdin.flush()  # stdin stays open: its end tells the worker the writer is gone
        child = _Child(index, process, time.monotonic())
        self.children[index] = child
        return child

    async def _ready(self, child: _Child) -> bool:
        """Whether ``child`` said it serves within WORKER_START_TIMEOUT."""
        assert child.process.stdout is not None
        out = trio.lowlevel.FdStream(os.dup(child.process.stdout.fileno()))
        got = b""
        with trio.move_on_after(WORKER_START_TIMEOUT):
            async with out:
                while b"\n" not in got:
                    data = await out.receive_some(64)
                    if not data:
                        break
                    got += data
        return got.startswith(b"ready")

    async def start(self) -> None:
        """Start every worker and wait until each serves (RuntimeError if one does not)."""
        children = [self._spawn(i) for i in range(1, self.count)]
        for child in children:
            if not await self._ready(child):
                raise RuntimeError(f"gateway worker {child.index} (pid {child.process.pid}) did not start")
        log.info("%d read workers serve beside the writer: %s", len(children), self.pids())

    def pids(self) -> str:
        return ", ".join(
            f"{c.index}: pid {c.process.pid}" for c in sorted(self.children.values(), key=lambda c: c.index)
        )

    async def supervise(self) -> None:
        """Watch every worker; start again one that exits while serving (with a delay that
        grows while it keeps dying young); set :meth:`wait_stopped` once all exited when
        stopping."""
        async with trio.open_nursery() as nursery:
            for child in list(self.children.values()):
                nursery.start_soon(self._watch, child)
        self._stopped.set()

    async def _watch(self, child: _Child) -> None:
        delay = RESTART_DELAY[0]
        while True:
            code = await _exited(child.process)
            if self.stopping:
                log.info("gateway worker %d (pid %d) exited with %s", child.index, child.process.pid, _how(code))
                return
            lived = time.monotonic() - child.started
            delay = RESTART_DELAY[0] if lived >= HEALTHY_AFTER else min(delay * 2, RESTART_DELAY[1])
            log.warning(
                "gateway worker %d (pid %d) exited with %s while serving: starting it again in %.1f s",
                child.index,
                child.process.pid,
                _how(code),
                delay,
            )
            await trio.sleep(delay)
            if self.stopping:
                return
            child = self._spawn(child.index)
            if await self._ready(child):
                log.info("gateway worker %d serves again (pid %d)", child.index, child.process.pid)

    def stop(self) -> None:
        """Drain every worker (SIGTERM) and close this process's copy of the listening sockets."""
        if self.stopping:
            return
        self.stopping = True
        for sock in self.sockets:
            sock.close()
        self.signal(signal.SIGTERM)

    def signal(self, signum: int) -> None:
        for child in self.children.values():
            if child.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.send_signal(signum)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    def kill(self) -> None:
        """SIGKILL whatever still runs, and reap it."""
        self.stopping = True
        self.signal(signal.SIGKILL)
        for child in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=5)
            for stream in (child.process.stdin, child.process.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


async def _exited(process: subprocess.Popen[bytes]) -> int:
    """``process``'s exit status, awaited without a thread (a pidfd)."""
    fd = os.pidfd_open(process.pid)
    try:
        while process.poll() is None:
            await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
    return process.returncode


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"


@dataclass
class WriterSide:
    """What the writer adds to serve with workers, made before serving and removed after."""

    sockets: list[socket.socket]
    shared: SharedState
    scratch: str
    workers: Workers

    @property
    def upstream(self) -> str:
        return os.path.join(self.scratch, "writer.sock")

    def close(self) -> None:
        self.workers.kill()
        for sock in self.sockets:
            sock.close()
        self.shared.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def writer_side(count: int, host: str, port: int, spec: dict[str, Any]) -> WriterSide:
    """The listening sockets, the shared page and the private directory of the Unix socket;
    ``spec``: the :class:`WorkerSpec` fields but index, parent, the descriptors, upstream and
    scratch."""
    sockets = listen_sockets(host, port)
    shared = SharedState.create()
    scratch = tempfile.mkdtemp(prefix="sos-gateway-")  # 0700: only this user reaches the socket
    spec = dict(spec, upstream=os.path.join(scratch, "writer.sock"), scratch=scratch)
    return WriterSide(sockets, shared, scratch, Workers(count, spec, sockets, shared))


def worker_spec(options: GatewayOptions, serving: Serving, tree_dir: str) -> dict[str, Any]:
    """The :class:`WorkerSpec` fields of ``options`` (:func:`writer_side` adds the rest)."""
    return {
        "namespace": options.namespace,
        "key": options.key,
        "server": options.server,
        "timeout": options.timeout,
        "server_tls": options.tls_client is not None,
        "tls_ca": options.tls_ca,
        "tls_cert": options.tls_cert,
        "tls_key": options.tls_key,
        "token_ttl": options.token_ttl,
        "key_recheck": options.key_recheck,
        "threads": options.threads,
        "max_connections": serving.max_connections,
        "max_per_address": options.max_per_address,
        "head_timeout": options.head_timeout,
        "send_timeout": options.send_timeout,
        "open_memory": options.open_memory,
        "advertise": serving.advertised,
        "listen_host": serving.host,
        "insecure_no_auth": options.insecure_no_auth,
        "tree_dir": tree_dir,
        "lease": options.lease,
        "drain_timeout": options.drain_timeout,
        "log_level": logging.getLevelName(log.getEffectiveLevel()).lower(),
    }


def serve_with_workers(
    options: GatewayOptions,
    serving: Serving,
    gateway: WriterGateway,
    tree_dir: str,
    about: str,
    watch: FenceWatch | None,
    holder: LeaseHolder | None,
    registry: CollectorRegistry | None,
) -> None:
    """What :func:`~.run.serve_active` runs with ``--workers N``: the writer's side made,
    the workers started, everything served until SIGTERM or a fence, the workers gone after;
    ``registry``: the metrics endpoint's (the workers' requests join it)."""
    about = f"{about[:-1]}, {options.workers} processes)"
    side = writer_side(options.workers, serving.host, serving.port, worker_spec(options, serving, tree_dir))
    gateway.shared = side.shared
    if registry is not None:
        registry.register(WorkerRequests(side.scratch))
    try:
        trio.run(serve_writer, gateway, side, serving.host, about, options.drain_timeout, watch, holder)
    finally:
        side.close()


async def serve_writer(
    gateway: WriterGateway,
    side: WriterSide,
    host: str,
    about: str,
    drain_timeout: float,
    watch: FenceWatch | None,
    holder: LeaseHolder | None,
) -> None:
    """:func:`~.serving.serve_gateway` with workers: the Unix socket served, the workers
    started (each serving before the ready line), the writer's own accepts on the shared
    sockets; SIGTERM drains the writer and every worker, which the writer outlives."""

    async def serve(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(gateway.serve_internal, side.upstream)
            await side.workers.start()
            nursery.start_soon(side.workers.supervise)

            async def serve_then_stop(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
                sockets = [trio.socket.from_stdlib_socket(sock.dup()) for sock in side.sockets]
                await gateway.serve(host, 0, sockets=sockets, task_status=task_status)
                side.workers.stop()  # (fenced: they refuse already)
                await side.workers.wait_stopped()  # their changes still come here meanwhile
                gateway.draining = True
                nursery.cancel_scope.cancel()

            started = await nursery.start(serve_then_stop)
            if watch is not None:
                nursery.start_soon(watch_fence, gateway, watch, drain_timeout, nursery.cancel_scope)
            if holder is not None:
                nursery.start_soon(publish_lease, holder, side.shared)
            task_status.started(started)

    def drain(name: str) -> None:
        gateway.drain()
        side.workers.stop()
        log.info(
            "%s: stopping: no new connections; the requests in progress in the writer and its %d "
            "workers get %.0f s to finish",
            name,
            len(side.workers.children),
            drain_timeout,
        )

    await serve_until_signal(
        serve, lambda _address: f"{READY_MARKER} {gateway.url} {about}", stop=drain, grace=drain_timeout
    )


async def publish_lease(holder: LeaseHolder, shared: SharedState) -> None:
    """Show the workers the writer's lease every STATE_POLL s (a renewal shows a little late:
    they stop early, never late)."""
    while True:
        shared.set_lease(holder.valid_until, lost=holder.lost is not None)
        await trio.sleep(STATE_POLL)


if __name__ == "__main__":  # the module's own copy runs the worker (its logger's name, its classes)
    from spark_plugin.gateway import workers

    sys.exit(workers.run_worker())
