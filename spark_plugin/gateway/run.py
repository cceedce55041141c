"""`run_gateway`: what ``sos gateway`` runs: the namespace opened (server connection,
writer, tree), the HTTP server (:class:`~spark_plugin.gateway.server.Gateway`) served until
SIGTERM/SIGINT (a graceful drain), the final flush. Also the checks of its addresses
(``--listen``, ``--advertise``: :mod:`sos_wire.addresses`), the refusal of plain HTTP off
loopback and the connection cap that fits the descriptor limit."""

from __future__ import annotations

import getpass
import logging
import resource
import ssl
from typing import Any

import trio

from sos_client.journal.open import ClientFactory, default_cache_dir, open_namespace
from sos_client.serving import serve_until_signal
from sos_wire.addresses import is_loopback, is_wildcard, parse_address, split_address
from sos_wire.auth import Key

from .auth import DEFAULT_KEY_RECHECK, DEFAULT_TOKEN_TTL, TOKEN_PATH, TokenAuthority, key_verifier
from .http import HEAD_TIMEOUT, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_ADDRESS, SEND_TIMEOUT
from .lease import hold_lease, lease_url
from .operations import OPEN_MEMORY
from .process import READY_MARKER
from .server import Gateway
from .webhdfs import WebHdfsNamespace

__all__ = ["fit_connections", "parse_advertise", "parse_listen", "plaintext_refusal", "raise_nofile_limit",
           "run_gateway"]

log = logging.getLogger("sos.gateway")

#: descriptors kept for everything but client connections (the journal's spool and cache,
#: the SOS server's connections, the listeners, logs); each worker thread may hold one more
FD_RESERVE = 128
#: on SIGTERM/SIGINT, the requests in progress get this long to finish (Kubernetes gives
#: a pod 30 s by default between SIGTERM and SIGKILL)
DRAIN_TIMEOUT = 25.0


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
        raise ValueError(f"--advertise {text!r}: {exc}: expected HOST or HOST:PORT, the name "
                         f"clients reach the gateway at (e.g. sos-gateway:9870)") from None
    return host, port


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


def run_gateway(namespace: str, listen: str, *, server: str, key: str, cache_dir: str | None = None,
                client_factory: ClientFactory | None = None, timeout: float = 30.0,
                tls_client: ssl.SSLContext | None = None, tls_cert: str | None = None,
                tls_key: str | None = None, sync: bool = True, max_lag_bytes: int = 64 << 20,
                generation_bytes: int | None = None, insecure_no_auth: bool = False,
                token_ttl: int = DEFAULT_TOKEN_TTL, threads: int = 32,
                flush_timeout: float = 120.0, drain_timeout: float = DRAIN_TIMEOUT,
                insecure_plaintext: bool = False, advertise: str | None = None,
                max_connections: int = MAX_CONNECTIONS,
                max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
                head_timeout: float = HEAD_TIMEOUT, send_timeout: float = SEND_TIMEOUT,
                open_memory: int = OPEN_MEMORY, key_recheck: float = DEFAULT_KEY_RECHECK,
                durability: str = "server", tier_patience: float | None = None,
                lease: float | None = None) -> int:
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
    what the descriptor limit (raised to its hard limit first) holds. ``durability`` and
    ``tier_patience`` go to :func:`~sos_client.journal.open.open_namespace`: with "tier" every
    barrier (protocol.md 3.4) also waits for the server's bucket, and a server without a tier
    is refused here (JournalTierUnavailable) before anything is served. ``lease``: seconds;
    renew a lease a standby gateway watches (lease.py, protocol.md 3.6) and serve only while
    holding it.
    """
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
                            max_lag_bytes=max_lag_bytes, generation_bytes=generation_bytes,
                            durability=durability, tier_patience=tier_patience)
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
    if advertised is None and tls is not None and is_wildcard(host):
        log.warning("--listen %s with TLS and no --advertise: the redirects of CREATE, APPEND "
                    "and OPEN name the IP address each client reached, which the certificate "
                    "must then hold; give --advertise NAME:PORT (a name of the certificate)",
                    listen)
    holder = None
    code = 0
    try:
        holder = hold_lease(gateway, opened, lease, lease_url(advertise, listen)) if lease else None
        mode = ("sync" if sync else "async") + (", durability tier" if durability == "tier" else "")
        trio.run(_serve, gateway, host, port, f"(namespace {namespace}, {mode}"
                 f"{', no auth' if insecure_no_auth else ''})", drain_timeout)
        log.info("stopped; requests served:\n%s", gateway.summary() or "(none)")
        try:
            if opened.writer is not None:  # None only for a read-only namespace (nothing to flush)
                opened.writer.barrier(timeout=flush_timeout)
        except Exception as exc:  # noqa: BLE001 - reported, exit code says it
            log.error("final flush failed (the spool in %s keeps the journal; the next gateway "
                      "on this cache ships it): %r", opened.spool_dir, exc)
            code = 1
    finally:
        if holder is not None:
            holder.stop()
        try:
            opened.close(timeout=0)
        except Exception as exc:  # noqa: BLE001
            log.error("closing the journal failed: %r", exc)
            code = 1
    return code


async def _serve(gateway: Gateway, host: str, port: int, about: str, drain_timeout: float) -> None:
    """Serve until SIGTERM/SIGINT, then drain: no new connection, the requests in
    progress finish (at most ``drain_timeout`` s); a second signal stops at once."""

    async def serve(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await gateway.serve(host, port, task_status=task_status)

    def drain(name: str) -> None:
        busy = gateway.drain()
        log.info("%s: stopping: no new connections; %d in progress get %.0f s to finish", name,
                 busy, drain_timeout)

    await serve_until_signal(serve, lambda _address: f"{READY_MARKER} {gateway.url} {about}",
                             stop=drain, grace=drain_timeout)
