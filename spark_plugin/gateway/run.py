"""`run_gateway`: what ``sos gateway`` runs: the namespace opened (server connection,
writer, tree), the HTTP server (:class:`~spark_plugin.gateway.server.Gateway`) served until
SIGTERM/SIGINT (a graceful drain), the final flush. Also the checks of its addresses
(``--listen``, ``--advertise``: :mod:`sos_wire.addresses`), the refusal of plain HTTP off
loopback and the connection cap that fits the descriptor limit."""

from __future__ import annotations

import contextlib
import getpass
import itertools
import logging
import os
import resource
import ssl
import time
from dataclasses import dataclass
from typing import Any

import trio

from sos_client.errors import SOSError
from sos_client.journal import layout
from sos_client.journal.beneath import clear_directory
from sos_client.journal.facade import FenceWatch
from sos_client.journal.open import ClientFactory, OpenNamespace, default_cache_dir
from sos_client.journal.points import parse_batch
from sos_client.journal.rollback import RollbackPoint, rollback_rebuild
from sos_client.journal.spool import private_file
from sos_client.journal.tree import RebuildCache
from sos_client.journal.writer import server_last_record
from sos_client.serving import serve_until_signal
from sos_wire.addresses import is_loopback, is_wildcard, parse_address, split_address
from sos_wire.auth import Key

from .auth import TOKEN_PATH, TokenAuthority, key_verifier
from .lease import hold_lease, last_renewals, lease_url
from .metrics import GatewayMetrics, serve_metrics
from .options import DRAIN_TIMEOUT, GatewayOptions
from .process import READY_MARKER
from .server import EXIT_FENCED, Gateway
from .standby_metrics import RoleCollector
from .webhdfs import WebHdfsNamespace

__all__ = [
    "DRAIN_TIMEOUT",
    "GatewayOptions",
    "Serving",
    "build_gateway",
    "check_serving",
    "close_journal",
    "connection_cap",
    "final_flush",
    "fit_connections",
    "parse_advertise",
    "parse_listen",
    "parse_metrics_listen",
    "plaintext_refusal",
    "prepare_rollback",
    "raise_nofile_limit",
    "run_gateway",
    "webhdfs_view",
]

log = logging.getLogger(__name__)

#: descriptors kept for everything but client connections (the journal's spool and cache,
#: the SOS server's connections, the listeners, logs); each worker thread may hold one more
FD_RESERVE = 128
#: a previous writer whose last record is younger than this was probably still running
#: when this gateway fenced it (logged as a warning, else as information)
LIVE_WRITER_WINDOW = 300.0
#: a previous writer's lease not renewed for this long (and four of its renewal intervals) is
#: gone: the writer had stopped (clocks of two machines may differ by a few seconds)
LEASE_GONE_MIN = 15.0
#: in the cache directory while a --restore-batch is under way (prepare_rollback)
ROLLBACK_PENDING = "rollback-pending"


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port); port 0 picks a free one."""
    try:
        return parse_address(text, any_port=True)
    except ValueError as exc:
        raise ValueError(f"--listen {text!r}: {exc}: expected HOST:PORT (e.g. 0.0.0.0:9870)") from None


def parse_advertise(text: str) -> tuple[str, int | None]:
    """``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT`` -> (host, port or None: the
    listen port)."""
    try:
        host, port = split_address(text)
        if is_wildcard(host):
            raise ValueError(f"{host} is no address of its own")
        if port == 0:
            raise ValueError("port must be 1..65535")
    except ValueError as exc:
        raise ValueError(
            f"--advertise {text!r}: {exc}: expected HOST or HOST:PORT, the name "
            f"clients reach the gateway at (e.g. sos-gateway:9870)"
        ) from None
    return host, port


def plaintext_refusal(listen: str, *, tls: bool, insecure_plaintext: bool) -> str:
    """Why serving plain HTTP on ``listen`` is refused ("" if it is not): off a loopback
    address a token request carries a key of the namespace in clear, and every request
    a bearer token."""
    host, _ = parse_listen(listen)
    if tls or insecure_plaintext or is_loopback(host):
        return ""
    return (
        f"--listen {listen} is not a loopback address and there is no --tls-cert: clients "
        f"would send their keys (at {TOKEN_PATH}) and bearer tokens in clear. Serve HTTPS "
        f"with --tls-cert/--tls-key, or pass --insecure-plaintext if the network between "
        f"the clients and the gateway is trusted (e.g. an encrypted overlay)"
    )


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


@dataclass(frozen=True)
class Serving:
    """Where and how a gateway serves, checked (:func:`check_serving`) before anything is
    opened: the listen address, the redirects' address, the connection cap that fits the
    descriptor limit, the HTTPS context (None: plain HTTP) and the secret its tokens are
    sealed with."""

    host: str
    port: int
    advertised: tuple[str, int | None] | None
    max_connections: int
    tls: ssl.SSLContext | None
    secret: bytes


def check_serving(options: GatewayOptions) -> Serving:
    """``options``' addresses, TLS files and key checked (ValueError: refused; an
    ``insecure_no_auth`` gateway only on loopback, plain HTTP as :func:`plaintext_refusal`
    says), the descriptor limit raised and the connection cap fitted to it."""
    host, port = parse_listen(options.listen)
    if options.insecure_no_auth and not is_loopback(host):
        raise ValueError(f"--insecure-no-auth is only accepted on a loopback address, not {host}")
    refusal = plaintext_refusal(
        options.listen, tls=bool(options.tls_cert or options.tls_key), insecure_plaintext=options.insecure_plaintext
    )
    if refusal:
        raise ValueError(refusal)
    advertised = parse_advertise(options.advertise) if options.advertise else None
    cap = connection_cap(options.max_connections, options.max_per_address, options.threads)
    tls = None
    if options.tls_cert or options.tls_key:
        if not (options.tls_cert and options.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(options.tls_cert, options.tls_key)
    return Serving(host, port, advertised, cap, tls, Key.parse(options.key).secret)


def connection_cap(wanted: int, per_address: int, threads: int) -> int:
    """The descriptor limit raised to its hard limit, and the connection cap it holds
    (:func:`fit_connections`), logged (a warning when it is below ``wanted``)."""
    soft, hard = raise_nofile_limit()
    cap = fit_connections(wanted, soft, threads)
    log.info(
        "descriptor limit %d (hard %d): at most %d connections (%d without a valid token, %d per client address)",
        soft,
        hard,
        cap,
        max(4, cap // 4),
        min(per_address, cap),
    )
    if cap < wanted:
        log.warning(
            "the descriptor limit (%d) holds only %d connections, not %d: raise its hard "
            "limit (ulimit -Hn, LimitNOFILE=) for more",
            soft,
            cap,
            wanted,
        )
    return cap


def webhdfs_view(opened: OpenNamespace, sync: bool) -> WebHdfsNamespace:
    """WebHDFS over ``opened``, its files owned by the user the gateway runs as."""
    try:
        owner = getpass.getuser()
    except (KeyError, OSError):
        owner = "sos"
    return WebHdfsNamespace(opened, sync=sync, owner=owner, group=owner)


def build_gateway(options: GatewayOptions, serving: Serving, ns: WebHdfsNamespace) -> Gateway:
    """The HTTP server of ``ns`` (not serving yet): tokens, key checks, caps and timeouts."""
    gateway = Gateway(
        ns,
        TokenAuthority(options.namespace, serving.secret, ttl=options.token_ttl),
        key_verifier(options.server, options.namespace, timeout=options.timeout, tls=options.tls_client),
        insecure=options.insecure_no_auth,
        tls=serving.tls,
        threads=options.threads,
        max_connections=serving.max_connections,
        max_per_address=options.max_per_address,
        head_timeout=options.head_timeout,
        send_timeout=options.send_timeout,
        open_memory=options.open_memory,
        advertise=serving.advertised,
        key_recheck=options.key_recheck,
    )
    if serving.advertised is None and serving.tls is not None and is_wildcard(serving.host):
        log.warning(
            "--listen %s with TLS and no --advertise: the redirects of CREATE, APPEND "
            "and OPEN name the IP address each client reached, which the certificate "
            "must then hold; give --advertise NAME:PORT (a name of the certificate)",
            options.listen,
        )
    return gateway


def final_flush(gateway: Gateway, opened: OpenNamespace | None, flush_timeout: float) -> int:
    """After serving: EXIT_FENCED when a newer writer fenced ``gateway`` (nothing to flush:
    the server refuses this writer), else 0 once the journal reached the server (or there is
    no writer), 1 (logged) if it did not within ``flush_timeout`` s."""
    if gateway.fenced is not None:
        return EXIT_FENCED
    if opened is None or opened.writer is None:  # None: a read-only namespace, an unpromoted standby
        return 0
    try:
        opened.writer.barrier(timeout=flush_timeout)
    except Exception as exc:  # noqa: BLE001 - reported, exit code says it
        log.error(
            "final flush failed (the spool in %s keeps the journal; the next gateway on this cache ships it): %r",
            opened.spool_dir,
            exc,
        )
        return 1
    return 0


def close_journal(gateway: Gateway, opened: OpenNamespace) -> int:
    """``opened`` closed: 0, or 1 (logged) if that failed and ``gateway`` was not fenced."""
    try:
        opened.close(timeout=0)
    except Exception as exc:  # noqa: BLE001
        if gateway.fenced is None:
            log.error("closing the journal failed: %r", exc)
            return 1
    return 0


def run_gateway(options: GatewayOptions) -> int:
    """Serve ``options.namespace`` on ``options.listen`` until SIGTERM/SIGINT; returns the
    exit code (0 after a clean stop with the journal flushed, 1 if the final flush failed,
    EXIT_FENCED (3) when a newer writer fenced it: it then refuses every request and stops
    at once, seen by its writer or by a fence check every ``fence_check`` s). On the signal
    it stops accepting connections and gives the requests in progress ``drain_timeout``
    seconds to finish (a second signal stops at once). The options: :class:`GatewayOptions`.
    """
    serving = check_serving(options)
    if options.metrics is not None:
        parse_metrics_listen(options.metrics)  # a bad address: refused before anything is opened
    opened = open_active(options)
    ns = webhdfs_view(opened, options.sync)
    gateway = build_gateway(options, serving, ns)
    try:
        exported = serve_metrics(gateway, ns, options.metrics, parse_metrics_listen) if options.metrics else None
    except OSError as exc:
        opened.close(timeout=0)
        raise OSError(exc.errno, f"cannot listen for metrics on {options.metrics}: {exc.strerror or exc}") from None
    if exported is not None:
        exported.registry.register(RoleCollector(lambda: "active"))
    return serve_active(options, serving, gateway, opened, exported)


def open_active(options: GatewayOptions) -> OpenNamespace:
    """The namespace opened as its writer on the gateway's cache: rolled back first with
    ``restore_batch`` (:func:`prepare_rollback`), or rebuilt after a rollback that did not
    finish (:func:`finish_interrupted_rollback`); whom it fenced logged."""
    cache_dir = options.cache_dir or default_cache_dir(options.namespace)
    point = options.restore_batch
    rebuild = prepare_rollback(cache_dir, point, options.restore_yes) if point else None
    interrupted = not point and finish_interrupted_rollback(cache_dir)
    opened = options.open_journal(cache_dir, rebuild=rebuild)
    if point and not opened.rebuilt:  # e.g. a new namespace: no batch to go back to
        opened.close(timeout=0)
        raise ValueError(f"--restore-batch {point}: namespace {options.namespace!r} has no journal to roll back")
    if point or interrupted:  # the cache and the journal agree again
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(os.path.abspath(cache_dir), ROLLBACK_PENDING))
    if opened.writer is not None:
        report_previous_writer(opened, options.client_factory or opened.client_factory)
    return opened


def serve_active(
    options: GatewayOptions, serving: Serving, gateway: Gateway, opened: OpenNamespace, exported: GatewayMetrics | None
) -> int:
    """Serve ``gateway`` (holding the lease with ``options.lease``, watching the fence) until
    it stops, flush the journal, close everything; returns the exit code."""
    factory = options.client_factory or opened.client_factory
    watch = (
        FenceWatch(options.namespace, opened.writer, factory, options.fence_check, who="this gateway")
        if opened.writer is not None
        else None
    )
    holder = None
    code = 0
    try:
        if options.lease:
            url = lease_url(options.advertise, options.listen)
            holder = hold_lease(gateway, opened, options.lease, url, durability=options.durability)
        mode = ("sync" if options.sync else "async") + (", durability tier" if options.durability == "tier" else "")
        about = f"(namespace {options.namespace}, {mode}{', no auth' if options.insecure_no_auth else ''})"
        trio.run(_serve, gateway, serving.host, serving.port, about, options.drain_timeout, watch)
        log.info("stopped; requests served:\n%s", gateway.summary() or "(none)")
        code = final_flush(gateway, opened, options.flush_timeout)  # still holding the lease
    finally:
        if holder is not None:
            holder.stop()
        if watch is not None:
            watch.close()
        if exported is not None:
            exported.close()
        if close_journal(gateway, opened):
            code = 1
    return code


def parse_metrics_listen(text: str) -> tuple[str, int]:
    """``--metrics``: ``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` (127.0.0.1), as ``sos-server serve
    --metrics``; port 0 picks a free one."""
    stripped = text.strip()
    try:
        return parse_address("127.0.0.1" + stripped if stripped.startswith(":") else stripped, any_port=True)
    except ValueError as exc:
        raise ValueError(f"--metrics {text!r}: {exc}: expected HOST:PORT (e.g. 127.0.0.1:9871)") from None


def prepare_rollback(cache_dir: str, point: str, discard: bool) -> RebuildCache:
    """``--restore-batch CHECKPOINT:N``: empty the cache's tree (so that the opener rebuilds
    it, after shipping the spool) and return the rebuild that restores it at the batch.
    ROLLBACK_PENDING, written first and removed once the new generation started, makes a
    start after a crash in between rebuild the tree from the journal's end
    (:func:`finish_interrupted_rollback`): a half-restored or rolled-back tree that the
    journal does not hold yet is never taken for the namespace's state."""
    parse_batch(point)  # a malformed point: refused before the cache is touched
    cache_dir = os.path.abspath(cache_dir)
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    private_file(os.path.join(cache_dir, ROLLBACK_PENDING), f"--restore-batch {point} in progress\n")
    tree_dir = os.path.join(cache_dir, "tree")
    if os.path.isdir(tree_dir) and not os.path.islink(tree_dir):
        clear_directory(tree_dir)

    def found(at: RollbackPoint) -> None:
        log.info(
            "--restore-batch: batch %d of checkpoint %r committed at journal record %d; the journal ends at %d",
            at.batch,
            at.checkpoint or ".",
            at.position,
            at.end,
        )

    return rollback_rebuild(point, discard=discard, on_point=found)


def finish_interrupted_rollback(cache_dir: str) -> bool:
    """A --restore-batch stopped before its new generation started (ROLLBACK_PENDING left):
    empty the tree so that it is rebuilt from the journal (its end: the rollback did not
    happen, or the new generation if it was complete); True if so."""
    cache_dir = os.path.abspath(cache_dir)
    if not os.path.exists(os.path.join(cache_dir, ROLLBACK_PENDING)):
        return False
    log.warning(
        "a --restore-batch on this cache did not finish: the cache is rebuilt from the server "
        "(the journal's end); run --restore-batch again to roll back"
    )
    tree_dir = os.path.join(cache_dir, "tree")
    if os.path.isdir(tree_dir) and not os.path.islink(tree_dir):
        clear_directory(tree_dir)
    return True


def report_previous_writer(opened: OpenNamespace, client_factory: ClientFactory | None) -> None:
    """Log whom this gateway fenced at open: the writer of the newest journal segment of an
    older epoch, and how long ago it wrote its last record (the record's own time). Within
    LIVE_WRITER_WINDOW that writer was probably still running (a warning: it is fenced now,
    its changes fail, and a gateway or mount stops), unless it held a lease (a gateway of a
    pair) whose renewals stopped well before now (:func:`lease_gone`); otherwise an ordinary
    takeover (info)."""
    writer = opened.writer
    if writer is None or client_factory is None:
        return
    try:
        client = client_factory()
        try:
            segs = [
                seg
                for g in layout.scan_listing(client.list(layout.GEN_PREFIX)).values()
                for seg in g.segments
                if seg.epoch < writer.epoch and seg.length > 0
            ]
            if not segs:
                return
            last = max(segs, key=lambda seg: (seg.generation, seg.first_seq))
            found = server_last_record(client, last.name)
            renewals = last_renewals(client, last.epoch)
        finally:
            client.close()
    except (SOSError, OSError) as exc:
        log.info(
            "took over namespace %r at epoch %d (the previous writer could not be read: %s)",
            opened.namespace,
            writer.epoch,
            exc,
        )
        return
    if found is None:
        return
    age = max(0.0, time.time() - found[1] / 1e9)
    gone = lease_gone(renewals)
    if age < LIVE_WRITER_WINDOW and gone is None:
        log.warning(
            "FENCED A LIVE WRITER? this gateway took namespace %r over at epoch %d from the "
            "writer of epoch %d, whose last record (seq %d, segment %s) is %.0f s old: it was "
            "probably still running (another gateway or mount on this namespace); it can no "
            "longer change the namespace and stops. Expected after a loss: the first writer "
            "after the previous one died (its node, its cache, or the server restored from its "
            "bucket) finds a record this recent and no heartbeat to tell it is gone",
            opened.namespace,
            writer.epoch,
            last.epoch,
            found[0],
            last.name,
            age,
        )
    else:
        log.info(
            "took over namespace %r at epoch %d from the writer of epoch %d (its last record, seq %d, is %.0f s old%s)",
            opened.namespace,
            writer.epoch,
            last.epoch,
            found[0],
            age,
            "" if gone is None else f"; its lease was last renewed {gone:.0f} s ago: it had stopped",
        )


def lease_gone(renewals: list[float], now: float | None = None) -> float | None:
    """Seconds since the last of a previous writer's lease ``renewals`` (Unix times, oldest
    first) when they stopped: longer than four of its renewal intervals (its lease: four
    intervals) and LEASE_GONE_MIN, which absorbs clock skew between machines; None if it
    held no lease or renewed it lately."""
    if not renewals:
        return None
    silent = (time.time() if now is None else now) - renewals[-1]
    steps = [b - a for a, b in itertools.pairwise(renewals) if b > a]
    interval = max(steps) if steps else LEASE_GONE_MIN / 4
    return silent if silent > max(4 * interval, LEASE_GONE_MIN) else None


async def _serve(
    gateway: Gateway, host: str, port: int, about: str, drain_timeout: float, watch: FenceWatch | None = None
) -> None:
    """Serve until SIGTERM/SIGINT, then drain: no new connection, the requests in
    progress finish (at most ``drain_timeout`` s); a second signal stops at once. With
    ``watch``, a fenced gateway refuses every request and stops the same way."""

    async def serve(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:

            async def serve_then_stop(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
                await gateway.serve(host, port, task_status=task_status)
                nursery.cancel_scope.cancel()  # served: the fence watch ends too

            task_status.started(await nursery.start(serve_then_stop))
            if watch is not None:
                nursery.start_soon(_watch_fence, gateway, watch, drain_timeout, nursery.cancel_scope)

    def drain(name: str) -> None:
        busy = gateway.drain()
        log.info("%s: stopping: no new connections; %d in progress get %.0f s to finish", name, busy, drain_timeout)

    await serve_until_signal(
        serve, lambda _address: f"{READY_MARKER} {gateway.url} {about}", stop=drain, grace=drain_timeout
    )


async def _watch_fence(gateway: Gateway, watch: FenceWatch, drain_timeout: float, scope: trio.CancelScope) -> None:
    """Check every 0.5 s; once fenced, refuse and drain (at most ``drain_timeout`` s)."""
    while not gateway.draining:
        reason = await trio.to_thread.run_sync(watch.check, abandon_on_cancel=True)
        if reason is not None:
            gateway.fence(reason)
            scope.deadline = min(scope.deadline, trio.current_time() + drain_timeout)
            return
        await trio.sleep(0.5)
