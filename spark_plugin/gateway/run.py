"""`run_gateway`: what ``sos gateway`` runs: the namespace opened (server connection,
writer, tree), the HTTP server (:class:`~spark_plugin.gateway.http.server.Gateway`) served until
SIGTERM/SIGINT (a graceful drain), the final flush. Also the checks of its addresses
(``--listen``, ``--advertise``: :mod:`sos_wire.addresses`), the refusal of plain HTTP off
loopback and the connection cap that fits the descriptor limit. ``--workers N`` (N > 1) alone
imports :mod:`~spark_plugin.gateway.workers` (~20 ms of CPU at every gateway's start otherwise).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from typing import TYPE_CHECKING

import trio

from sos_client.errors import SOSError
from sos_journal.beneath import clear_directory
from sos_journal.faces.facade import FenceWatch
from sos_journal.read.points import parse_batch
from sos_journal.rebuild.rollback import RollbackPoint, rollback_rebuild
from sos_journal.tree.open import ClientFactory, OpenNamespace, default_cache_dir
from sos_journal.tree.tree import RebuildCache
from sos_journal.writer.spool import private_file
from sos_journal.writer.writer import server_last_record
from spark_plugin.gateway.http.metrics import GatewayMetrics, serve_metrics
from spark_plugin.gateway.http.server import Gateway
from spark_plugin.gateway.options import DRAIN_TIMEOUT, GatewayOptions
from spark_plugin.gateway.pair.lease import hold_lease, last_renewals, lease_url
from spark_plugin.gateway.pair.metrics import RoleCollector
from spark_plugin.gateway.serving import (
    Serving,
    build_gateway,
    check_serving,
    close_journal,
    connection_cap,
    final_flush,
    fit_connections,
    parse_advertise,
    parse_listen,
    parse_metrics_listen,
    plaintext_refusal,
    raise_nofile_limit,
    serve_gateway,
    webhdfs_view,
)
from spark_plugin.gateway.webhdfs.inflight import previous_writer_segment
from spark_plugin.gateway.webhdfs.renames import JournalRenames

if TYPE_CHECKING:
    from spark_plugin.gateway.workers import WriterGateway

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

#: a previous writer whose last record is younger than this was probably still running
#: when this gateway fenced it (logged as a warning, else as information)
LIVE_WRITER_WINDOW = 300.0
#: a previous writer's lease not renewed for this long (and four of its renewal intervals) is
#: gone: the writer had stopped (clocks of two machines may differ by a few seconds)
LEASE_GONE_MIN = 15.0
#: in the cache directory while a --restore-batch is under way (prepare_rollback)
ROLLBACK_PENDING = "rollback-pending"


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
    ns = webhdfs_view(opened, options.sync, options.barrier_rule)
    gateway = build_gateway(options, serving, ns, _writer_class() if options.workers > 1 else Gateway)
    try:
        exported = serve_metrics(gateway, ns, options.metrics, parse_metrics_listen) if options.metrics else None
    except OSError as exc:
        opened.close(timeout=0)
        raise OSError(exc.errno, f"cannot listen for metrics on {options.metrics}: {exc.strerror or exc}") from None
    if exported is not None:
        exported.registry.register(RoleCollector(lambda: "active"))
    return serve_active(options, serving, gateway, opened, exported)


def _writer_class() -> type[WriterGateway]:
    """The gateway of ``--workers N``: the writer of N processes (see the module's docstring)."""
    from spark_plugin.gateway.workers import WriterGateway  # noqa: PLC0415

    return WriterGateway


def open_active(options: GatewayOptions) -> OpenNamespace:
    """The namespace opened as its writer on the gateway's cache: rolled back first with
    ``restore_batch`` (:func:`prepare_rollback`), or rebuilt after a rollback that did not
    finish (:func:`finish_interrupted_rollback`); whom it fenced logged."""
    cache_dir = options.cache_dir or default_cache_dir(options.namespace)
    point = options.restore_batch
    rebuild = prepare_rollback(cache_dir, point, options.restore_yes) if point else None
    interrupted = not point and finish_interrupted_rollback(cache_dir)
    renames = JournalRenames()  # a cache rebuilt from the server: its RENAMEs, for resends
    opened = options.open_journal(cache_dir, rebuild=rebuild, observe_rebuild=renames)
    if opened.rebuilt and rebuild is None:
        renames.save(os.path.dirname(opened.tree_dir), opened.tree_dir)
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
        if options.workers > 1 and isinstance(gateway, _writer_class()):  # --workers N (N > 1)
            from spark_plugin.gateway.workers import serve_with_workers  # noqa: PLC0415 - as _writer_class

            registry = exported.registry if exported is not None else None
            serve_with_workers(options, serving, gateway, opened.tree_dir, about, watch, holder, registry)
        else:
            trio.run(serve_gateway, gateway, serving.host, serving.port, about, options.drain_timeout, watch)
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
            last = previous_writer_segment(client, writer.epoch)
            if last is None:
                return
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
