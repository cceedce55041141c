"""`GatewayOptions`: everything ``sos gateway`` is run with, built once by the command
(:mod:`.cli`) and read by both :func:`~.run.run_gateway` and :func:`~.standby.run_standby`;
the library defaults are here and nowhere else."""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from sos_client.aio import AsyncClient
from sos_journal.faces.facade import FENCE_CHECK
from sos_journal.format.records import Record
from sos_journal.tree.open import ClientFactory, OpenNamespace, open_namespace
from sos_journal.tree.tree import RebuildCache
from spark_plugin.gateway.http.auth import DEFAULT_KEY_RECHECK, DEFAULT_TOKEN_TTL
from spark_plugin.gateway.http.connection import (
    HEAD_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    SEND_TIMEOUT,
)
from spark_plugin.gateway.http.operations import OPEN_MEMORY

__all__ = ["DRAIN_TIMEOUT", "SHIP_LINGER", "SHIP_LINGER_TIER", "GatewayOptions"]

#: on SIGTERM/SIGINT, the requests in progress get this long to finish (Kubernetes gives
#: a pod 30 s by default between SIGTERM and SIGKILL)
DRAIN_TIMEOUT = 25.0
#: the gateway's writer holds back records no barrier waits for (a checkpoint's state files
#: under --barrier commit, acknowledged from the spool) this long, so that the changes of
#: that moment ship in one APPEND round (JournalWriter.linger); a barrier ships at once, and
#: with it every record held back. 50 ms: under load a barrier comes sooner, so the records
#: ride in the barriers' rounds (shipped from the event loop) and the replicator thread
#: rarely wakes; how long a record no barrier waits for sits in the spool changes no
#: guarantee (protocol.md 3.4: a commit that follows it waits for it)
SHIP_LINGER = 0.05
#: ... and with ``--durability tier``: records held back 50 ms reach the bucket's flushes that
#: much later, and the batch's barriers wait for them there (the small query's batch p50 at 6
#: queries: 577-580 ms held 50 ms, 464-467 held 5 ms; docs/BENCHMARKS.md, "Fifth round"); its
#: writer's thread is woken by appends rather than looking every 5 ms (an idle gateway would
#: spend 2.4 % of a core on it)
SHIP_LINGER_TIER = 0.005


@dataclass(frozen=True, kw_only=True)
class GatewayOptions:
    """What a gateway (active or standby) serves, and how.

    ``client_factory`` (optional) returns a connected client for the namespace (TLS and
    timeouts of the CLI's connection options); ``tls_client`` is the SSL context that checks
    client keys at the server (the same trust as the factory's). ``tls_cert`` + ``tls_key``
    serve HTTPS (``swebhdfs://``); without them a listen address that is not loopback is
    refused unless ``insecure_plaintext`` (:func:`~.run.plaintext_refusal`). ``advertise``:
    ``HOST[:PORT]`` the redirects name. ``max_connections`` is lowered to what the descriptor
    limit (raised to its hard limit first) holds. ``durability`` and ``tier_patience`` go to
    :func:`~sos_journal.tree.open.open_namespace`: with "tier" every barrier (protocol.md
    3.4) also waits for the server's bucket, and a server without a tier is refused before
    anything is served (JournalTierUnavailable). A fenced gateway is seen by its writer or by
    a fence check every ``fence_check`` s. On SIGTERM/SIGINT the requests in progress get
    ``drain_timeout`` s, then the journal ``flush_timeout`` s to reach the server.

    ``metrics``, ``HOST:PORT`` of the Prometheus endpoint (:mod:`.metrics`; ``:PORT`` is
    127.0.0.1; a standby's adds :mod:`.standby_metrics`). The active gateway's own:
    ``restore_batch``, ``CHECKPOINT:N``: before
    serving, roll the whole namespace back to right after batch N of that checkpoint
    committed (:mod:`sos_journal.rebuild.rollback`), refused (RollbackRefused) if records
    follow it unless ``restore_yes``. ``lease``: seconds; the active renews a lease a standby
    watches (lease.py, protocol.md 3.6) and serves only while holding it (None: no lease);
    a standby takes over after that long of silence (None: lease.DEFAULT_LEASE).
    ``barrier``: "commit" or "every" (protocol.md 3.4); None: :attr:`barrier_rule`'s default.

    ``workers``: processes serving the namespace (:mod:`.workers`: the writer and
    ``workers - 1`` read workers; 1: one process). ``tls_ca``: the CA file of
    ``tls_client`` (None: the system's), for the workers' own key checks.
    """

    namespace: str
    listen: str
    server: str
    key: str
    cache_dir: str | None = None
    client_factory: ClientFactory | None = None
    timeout: float = 30.0
    tls_client: ssl.SSLContext | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    sync: bool = True
    max_lag_bytes: int = 64 << 20
    generation_bytes: int | None = None
    insecure_no_auth: bool = False
    token_ttl: int = DEFAULT_TOKEN_TTL
    threads: int = 32
    flush_timeout: float = 120.0
    drain_timeout: float = DRAIN_TIMEOUT
    insecure_plaintext: bool = False
    advertise: str | None = None
    max_connections: int = MAX_CONNECTIONS
    max_per_address: int = MAX_CONNECTIONS_PER_ADDRESS
    head_timeout: float = HEAD_TIMEOUT
    send_timeout: float = SEND_TIMEOUT
    open_memory: int = OPEN_MEMORY
    key_recheck: float = DEFAULT_KEY_RECHECK
    durability: str = "server"
    tier_patience: float | None = None
    fence_check: float = FENCE_CHECK
    metrics: str | None = None
    restore_batch: str | None = None
    restore_yes: bool = False
    lease: float | None = None
    barrier: str | None = None
    workers: int = 1
    tls_ca: str | None = None

    @property
    def barrier_rule(self) -> str:
        """``--barrier`` as served: given, else "every" for a gateway of a pair (``--lease``;
        a standby is always "every": it never holds its active's spool) and "commit" alone."""
        if self.barrier is not None:
            return self.barrier
        return "every" if self.lease else "commit"

    def open_journal(
        self,
        cache_dir: str,
        *,
        client_factory: ClientFactory | None = None,
        rebuild: RebuildCache | None = None,
        replayed_to: int | None = None,
        observe_rebuild: Callable[[Record], None] | None = None,
    ) -> OpenNamespace:
        """The namespace opened on ``cache_dir`` as every gateway opens it
        (:func:`~sos_journal.tree.open.open_namespace`; ``client_factory``: None, this
        one's): its writer never waits, the gateway's barriers do; ``rebuild``,
        ``replayed_to`` and ``observe_rebuild`` as there."""
        opened = open_namespace(
            self.namespace,
            cache_dir,
            server=self.server,
            key=self.key,
            timeout=self.timeout,
            tls=self.tls_client,
            client_factory=client_factory or self.client_factory,
            sync=False,
            max_lag_bytes=self.max_lag_bytes,
            generation_bytes=self.generation_bytes,
            durability=self.durability,
            tier_patience=self.tier_patience,
            rebuild=rebuild,
            replayed_to=replayed_to,
            observe_rebuild=observe_rebuild,
        )
        if opened.writer is not None:  # records no barrier waits for go in shared rounds
            opened.writer.linger = SHIP_LINGER if self.durability == "server" else SHIP_LINGER_TIER
            opened.writer.poll_records = self.durability == "server"
            # a barrier in the event loop ships its round there (loop_ship.py): a trio client
            # with the connection options of the thread's (the CLI's factory: the same server,
            # key, timeout and TLS trust); a lost connection is the thread's to retry
            opened.writer.loop_client_factory = functools.partial(
                AsyncClient,
                self.server,
                self.key,
                self.namespace,
                timeout=self.timeout,
                tls=self.tls_client,
                reconnect_timeout=0.0,
            )
        return opened
