"""The steps both kinds of gateway share (the active, ``run.py``, and a promoted standby,
``pair/standby.py``): the checks of their addresses (``--listen``, ``--advertise``:
:mod:`sos_wire.addresses`), the refusal of plain HTTP off loopback, the connection cap that
fits the descriptor limit, the HTTP server built over an opened namespace, the run until
SIGTERM/SIGINT (a graceful drain) and the final flush."""

from __future__ import annotations

import getpass
import logging
import resource
import ssl
from dataclasses import dataclass
from typing import Any

import trio

from sos_client.serving import serve_until_signal
from sos_journal.faces.facade import FenceWatch
from sos_journal.tree.open import OpenNamespace
from sos_wire.addresses import is_loopback, is_wildcard, parse_address, split_address
from sos_wire.auth import Key
from spark_plugin.gateway.http.auth import TOKEN_PATH, TokenAuthority, key_verifier
from spark_plugin.gateway.http.server import EXIT_FENCED, Gateway
from spark_plugin.gateway.options import GatewayOptions
from spark_plugin.gateway.process import READY_MARKER
from spark_plugin.gateway.webhdfs.inflight import record_clean_stop
from spark_plugin.gateway.webhdfs.namespace import WebHdfsNamespace

log = logging.getLogger(__name__)


#: descriptors kept for everything but client connections (the journal's spool and cache,
#: the SOS server's connections, the listeners, logs); each worker thread may hold one more
FD_RESERVE = 128


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


def webhdfs_view(opened: OpenNamespace, sync: bool, barrier: str = "every") -> WebHdfsNamespace:
    """WebHDFS over ``opened``, its files owned by the user the gateway runs as; ``barrier``:
    ``--barrier`` (protocol.md 3.4)."""
    try:
        owner = getpass.getuser()
    except (KeyError, OSError):
        owner = "sos"
    return WebHdfsNamespace(opened, sync=sync, owner=owner, group=owner, barrier=barrier)


def build_gateway(
    options: GatewayOptions, serving: Serving, ns: WebHdfsNamespace, kind: type[Gateway] = Gateway
) -> Gateway:
    """The HTTP server of ``ns`` (not serving yet): tokens, key checks, caps and timeouts;
    ``kind``: Gateway, or a subclass (the writer of ``--workers``)."""
    gateway = kind(
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
    record_clean_stop(opened)  # the next gateway on an empty cache knows nothing was lost
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


def parse_metrics_listen(text: str) -> tuple[str, int]:
    """``--metrics``: ``HOST:PORT``, ``[V6]:PORT`` or ``:PORT`` (127.0.0.1), as ``sos-server serve
    --metrics``; port 0 picks a free one."""
    stripped = text.strip()
    try:
        return parse_address("127.0.0.1" + stripped if stripped.startswith(":") else stripped, any_port=True)
    except ValueError as exc:
        raise ValueError(f"--metrics {text!r}: {exc}: expected HOST:PORT (e.g. 127.0.0.1:9871)") from None


async def serve_gateway(
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
                nursery.start_soon(watch_fence, gateway, watch, drain_timeout, nursery.cancel_scope)

    def drain(name: str) -> None:
        busy = gateway.drain()
        log.info("%s: stopping: no new connections; %d in progress get %.0f s to finish", name, busy, drain_timeout)

    await serve_until_signal(
        serve, lambda _address: f"{READY_MARKER} {gateway.url} {about}", stop=drain, grace=drain_timeout
    )


async def watch_fence(gateway: Gateway, watch: FenceWatch, drain_timeout: float, scope: trio.CancelScope) -> None:
    """Check every 0.5 s; once fenced, refuse and drain (at most ``drain_timeout`` s)."""
    while not gateway.draining:
        reason = await trio.to_thread.run_sync(watch.check, abandon_on_cancel=True)
        if reason is not None:
            gateway.fence(reason)
            scope.deadline = min(scope.deadline, trio.current_time() + drain_timeout)
            return
        await trio.sleep(0.5)
