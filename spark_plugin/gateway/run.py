"""`run_gateway`: what ``sos gateway`` runs: the namespace opened (server connection,
writer, tree), the HTTP server (:class:`~spark_plugin.gateway.server.Gateway`) served until
SIGTERM/SIGINT (a graceful drain), the final flush. Also the checks of its addresses
(``--listen``, ``--advertise``: :mod:`sos_wire.addresses`), the refusal of plain HTTP off
loopback and the connection cap that fits the descriptor limit."""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import resource
import ssl
import time
from typing import Any

import trio

from sos_client.errors import SOSError
from sos_client.journal import layout
from sos_client.journal.beneath import clear_directory
from sos_client.journal.facade import FenceWatch
from sos_client.journal.open import ClientFactory, OpenNamespace, default_cache_dir, open_namespace
from sos_client.journal.points import parse_batch
from sos_client.journal.rollback import RollbackPoint, rollback_rebuild
from sos_client.journal.spool import private_file
from sos_client.journal.tree import RebuildCache
from sos_client.journal.writer import server_last_record
from sos_client.serving import serve_until_signal
from sos_wire.addresses import is_loopback, is_wildcard, parse_address, split_address
from sos_wire.auth import Key

from .auth import DEFAULT_KEY_RECHECK, DEFAULT_TOKEN_TTL, TOKEN_PATH, TokenAuthority, key_verifier
from .http import HEAD_TIMEOUT, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS, SEND_TIMEOUT
from .lease import hold_lease, lease_url
from .metrics import serve_metrics
from .operations import OPEN_MEMORY
from .process import READY_MARKER
from .server import EXIT_FENCED, Gateway
from .webhdfs import WebHdfsNamespace

__all__ = [
    "fit_connections",
    "parse_advertise",
    "parse_listen",
    "parse_metrics_listen",
    "plaintext_refusal",
    "prepare_rollback",
    "raise_nofile_limit",
    "run_gateway",
]

log = logging.getLogger("sos.gateway")

#: descriptors kept for everything but client connections (the journal's spool and cache,
#: the SOS server's connections, the listeners, logs); each worker thread may hold one more
FD_RESERVE = 128
#: on SIGTERM/SIGINT, the requests in progress get this long to finish (Kubernetes gives
#: a pod 30 s by default between SIGTERM and SIGKILL)
DRAIN_TIMEOUT = 25.0
#: how often the gateway asks the SOS server for its namespace's fence epoch (a FENCE(0),
#: which never passes and answers the current fence): a newer writer's takeover is seen
#: within this long even while no request comes; the writer's own failure within 0.5 s
FENCE_CHECK = 5.0
#: a previous writer whose last record is younger than this was probably still running
#: when this gateway fenced it (logged as a warning, else as information)
LIVE_WRITER_WINDOW = 300.0
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


def run_gateway(
    namespace: str,
    listen: str,
    *,
    server: str,
    key: str,
    cache_dir: str | None = None,
    client_factory: ClientFactory | None = None,
    timeout: float = 30.0,
    tls_client: ssl.SSLContext | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    sync: bool = True,
    max_lag_bytes: int = 64 << 20,
    generation_bytes: int | None = None,
    insecure_no_auth: bool = False,
    token_ttl: int = DEFAULT_TOKEN_TTL,
    threads: int = 32,
    flush_timeout: float = 120.0,
    drain_timeout: float = DRAIN_TIMEOUT,
    insecure_plaintext: bool = False,
    advertise: str | None = None,
    max_connections: int = MAX_CONNECTIONS,
    max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
    head_timeout: float = HEAD_TIMEOUT,
    send_timeout: float = SEND_TIMEOUT,
    open_memory: int = OPEN_MEMORY,
    key_recheck: float = DEFAULT_KEY_RECHECK,
    durability: str = "server",
    tier_patience: float | None = None,
    fence_check: float = FENCE_CHECK,
    metrics: str | None = None,
    restore_batch: str | None = None,
    restore_yes: bool = False,
    lease: float | None = None,
) -> int:
    """Serve ``namespace`` on ``listen`` until SIGTERM/SIGINT; returns the exit code
    (0 after a clean stop with the journal flushed, 1 if the final flush failed,
    EXIT_FENCED (3) when a newer writer fenced it: it then refuses every request and stops
    at once, seen by its writer or by a fence check every ``fence_check`` s). On the
    signal it stops accepting connections and gives the requests in progress
    ``drain_timeout`` seconds to finish (a second signal stops at once).

    ``client_factory`` (optional) returns a connected client for the namespace (TLS and
    timeouts of the CLI's connection options); ``tls_client`` is the SSL context that
    checks client keys at the server (the same trust as the factory's). ``tls_cert`` +
    ``tls_key`` serve HTTPS (``swebhdfs://``); without them a listen address that is not
    loopback is refused unless ``insecure_plaintext`` (:func:`plaintext_refusal`).
    ``advertise``: ``HOST[:PORT]`` the redirects name. The connection cap is lowered to
    what the descriptor limit (raised to its hard limit first) holds. ``durability`` and
    ``tier_patience`` go to :func:`~sos_client.journal.open.open_namespace`: with "tier" every
    barrier (protocol.md 3.4) also waits for the server's bucket, and a server without a tier
    is refused here (JournalTierUnavailable) before anything is served.

    ``metrics``: ``HOST:PORT`` of the Prometheus endpoint (:mod:`.metrics`; ``:PORT`` is
    127.0.0.1). ``restore_batch``: ``CHECKPOINT:N``: before serving, roll the whole namespace
    back to right after batch N of that checkpoint committed (:mod:`sos_client.journal.rollback`;
    every other checkpoint goes back to the same journal position); refused
    (RollbackRefused) if records follow it unless ``restore_yes``.

    ``lease``: seconds; renew a lease a standby gateway watches (lease.py, protocol.md 3.6)
    and serve only while holding it.
    """
    host, port = parse_listen(listen)
    if insecure_no_auth and not is_loopback(host):
        raise ValueError(f"--insecure-no-auth is only accepted on a loopback address, not {host}")
    refusal = plaintext_refusal(listen, tls=bool(tls_cert or tls_key), insecure_plaintext=insecure_plaintext)
    if refusal:
        raise ValueError(refusal)
    advertised = parse_advertise(advertise) if advertise else None
    soft, hard = raise_nofile_limit()
    cap = fit_connections(max_connections, soft, threads)
    log.info(
        "descriptor limit %d (hard %d): at most %d connections (%d without a valid token, %d per client address)",
        soft,
        hard,
        cap,
        max(4, cap // 4),
        min(max_per_address, cap),
    )
    if cap < max_connections:
        log.warning(
            "the descriptor limit (%d) holds only %d connections, not %d: raise its hard "
            "limit (ulimit -Hn, LimitNOFILE=) for more",
            soft,
            cap,
            max_connections,
        )
    tls = None
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(tls_cert, tls_key)
    secret = Key.parse(key).secret
    if metrics is not None:
        parse_metrics_listen(metrics)  # a bad address: refused before anything is opened
    cache_dir = cache_dir or default_cache_dir(namespace)
    rebuild = prepare_rollback(cache_dir, restore_batch, restore_yes) if restore_batch else None
    interrupted = not restore_batch and finish_interrupted_rollback(cache_dir)
    opened = open_namespace(
        namespace,
        cache_dir,
        server=server,
        key=key,
        timeout=timeout,
        tls=tls_client,
        client_factory=client_factory,
        sync=False,
        max_lag_bytes=max_lag_bytes,
        generation_bytes=generation_bytes,
        durability=durability,
        tier_patience=tier_patience,
        rebuild=rebuild,
    )
    if restore_batch and not opened.rebuilt:  # e.g. a new namespace: no batch to go back to
        opened.close(timeout=0)
        raise ValueError(f"--restore-batch {restore_batch}: namespace {namespace!r} has no journal to roll back")
    if restore_batch or interrupted:  # the cache and the journal agree again
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(os.path.abspath(cache_dir), ROLLBACK_PENDING))
    if opened.writer is not None:
        report_previous_writer(opened, client_factory or opened.client_factory)
    try:
        owner = getpass.getuser()
    except (KeyError, OSError):
        owner = "sos"
    ns = WebHdfsNamespace(opened, sync=sync, owner=owner, group=owner)
    gateway = Gateway(
        ns,
        TokenAuthority(namespace, secret, ttl=token_ttl),
        key_verifier(server, namespace, timeout=timeout, tls=tls_client),
        insecure=insecure_no_auth,
        tls=tls,
        threads=threads,
        max_connections=cap,
        max_per_address=max_per_address,
        head_timeout=head_timeout,
        send_timeout=send_timeout,
        open_memory=open_memory,
        advertise=advertised,
        key_recheck=key_recheck,
    )
    if advertised is None and tls is not None and is_wildcard(host):
        log.warning(
            "--listen %s with TLS and no --advertise: the redirects of CREATE, APPEND "
            "and OPEN name the IP address each client reached, which the certificate "
            "must then hold; give --advertise NAME:PORT (a name of the certificate)",
            listen,
        )
    holder = None
    exported = None
    try:
        exported = serve_metrics(gateway, ns, metrics, parse_metrics_listen) if metrics else None
    except OSError as exc:
        opened.close(timeout=0)
        raise OSError(exc.errno, f"cannot listen for metrics on {metrics}: {exc.strerror or exc}") from None
    code = 0
    watch = (
        FenceWatch(namespace, opened.writer, client_factory or opened.client_factory, fence_check, who="this gateway")
        if opened.writer is not None
        else None
    )
    try:
        holder = hold_lease(gateway, opened, lease, lease_url(advertise, listen)) if lease else None
        mode = ("sync" if sync else "async") + (", durability tier" if durability == "tier" else "")
        trio.run(
            _serve,
            gateway,
            host,
            port,
            f"(namespace {namespace}, {mode}{', no auth' if insecure_no_auth else ''})",
            drain_timeout,
            watch,
        )
        log.info("stopped; requests served:\n%s", gateway.summary() or "(none)")
        try:
            if gateway.fenced is not None:
                code = EXIT_FENCED  # nothing to flush: the server refuses this writer
            elif opened.writer is not None:  # None only for a read-only namespace
                opened.writer.barrier(timeout=flush_timeout)
        except Exception as exc:  # noqa: BLE001 - reported, exit code says it
            log.error(
                "final flush failed (the spool in %s keeps the journal; the next gateway on this cache ships it): %r",
                opened.spool_dir,
                exc,
            )
            code = 1
    finally:
        if holder is not None:
            holder.stop()
        if watch is not None:
            watch.close()
        if exported is not None:
            exported.close()
        try:
            opened.close(timeout=0)
        except Exception as exc:  # noqa: BLE001
            if gateway.fenced is None:
                log.error("closing the journal failed: %r", exc)
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
    its changes fail, and a gateway or mount stops); older, an ordinary takeover (info)."""
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
    if age < LIVE_WRITER_WINDOW:
        log.warning(
            "FENCED A LIVE WRITER? this gateway took namespace %r over at epoch %d from the "
            "writer of epoch %d, whose last record (seq %d, segment %s) is %.0f s old: it was "
            "probably still running (another gateway or mount on this namespace); it can no "
            "longer change the namespace and stops",
            opened.namespace,
            writer.epoch,
            last.epoch,
            found[0],
            last.name,
            age,
        )
    else:
        log.info(
            "took over namespace %r at epoch %d from the writer of epoch %d (its last record, seq %d, is %.0f s old)",
            opened.namespace,
            writer.epoch,
            last.epoch,
            found[0],
            age,
        )


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
