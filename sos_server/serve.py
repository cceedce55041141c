"""``sos-server serve``, by role: TLS, the tier's store, the data directory (a bootstrap from
the store first when it is empty), the metrics endpoint, the engine with its tier and
listener, and the run until a signal. ``cli.py`` parses the options, calls these in order and
prints what fails; it imports this module for ``serve`` alone, so trio, the engine and the
tier are not loaded for ``keygen``, ``quota``, ``reset-fence`` and ``gc``. The tier's
uploader and bootstrap (``tiering``, ``tier_bootstrap``: sos_tier's layout, log and uploader,
tenacity; ~40 ms of CPU) are imported only by a server started with ``--tier``.

A start-up step that fails raises :class:`StartError`: the one line ``cli.py`` prints and the
exit status; nothing here prints.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import ssl
import sys
import time
from typing import TYPE_CHECKING

import trio

from sos_tier.open import open_store
from sos_tier.store import Store, TierError
from sos_wire.addresses import is_loopback

from .engine import Engine, Limits
from .listener import Listener, ListenError, certificate_binding, make_tls_context, raise_nofile_limit, tune_malloc
from .metrics import Metrics
from .storage import Retention, Storage, StorageError

if TYPE_CHECKING:
    from .tiering import Tier

__all__ = ["Server", "StartError", "load_tls", "namespace_quota", "open_storage", "open_tier_store", "start_metrics"]

log = logging.getLogger(__name__)


class StartError(Exception):
    """A start-up step failed: *message* is the line to print, *status* the exit status
    (1: failed; 2: a usage error)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def load_tls(args: argparse.Namespace) -> tuple[ssl.SSLContext | None, bytes | None]:
    """The TLS context of ``--tls-cert``/``--tls-key`` and the AUTH channel binding of the
    certificate, or (None, None) without TLS: then a warning unless ``--listen`` is loopback."""
    if args.tls_cert:
        try:
            return make_tls_context(args.tls_cert, args.tls_key), certificate_binding(args.tls_cert)
        except (OSError, ValueError) as exc:
            raise StartError(f"cannot load TLS certificate/key: {exc}") from None
    if not is_loopback(args.listen[0]):
        log.warning(
            "listening without TLS on a non-loopback address: anyone on the path can read the data and "
            "take over authenticated connections; pass --tls-cert/--tls-key (docs/DEPLOY.md)",
            extra={"listen": f"{args.listen[0]}:{args.listen[1]}"},
        )
    return None, None


def open_tier_store(args: argparse.Namespace) -> Store | None:
    """The store ``--tier`` names, or None without ``--tier``."""
    if not args.tier:
        return None
    try:
        return open_store(args.tier)
    except ValueError as exc:
        raise StartError(f"--tier: {exc}", 2) from None
    except ImportError as exc:
        raise StartError(f"--tier {args.tier}: {exc} (install the extra: pip install 'sos[tier]')") from None
    except TierError as exc:
        raise StartError(f"--tier {args.tier}: {exc}") from None


def open_storage(args: argparse.Namespace, store: Store | None, metrics: Metrics) -> Storage:
    """The data directory, locked (created if it does not exist), rebuilt from *store* first
    when it holds no namespace yet, opened (the log replayed) and its write-ahead log started;
    the descriptor limit raised and the object descriptors kept open sized from it."""
    nofile = raise_nofile_limit()
    tune_malloc()
    limit = nofile if nofile > 0 else 1 << 20  # RLIM_INFINITY is -1
    max_open = args.max_open_objects or max(16, min(4096, limit // 4))
    storage = Storage(args.data, max_open_files=max_open, wal_checkpoint_bytes=args.wal_size)
    try:
        storage.lock()  # creates the data directory if it does not exist yet
    except StorageError as exc:
        raise StartError(exc.message) from None
    if store is not None:
        _bootstrap_if_empty(args, storage, store)
    t0 = time.monotonic()
    try:
        storage.open()
        storage.start_wal()
    except (StorageError, OSError) as exc:
        storage.close()
        raise StartError(exc.message if isinstance(exc, StorageError) else f"cannot load {args.data}: {exc}") from None
    metrics.repairs.inc(len(storage.repairs))
    metrics.damaged.inc(len(storage.corruptions))
    log.info(
        "storage opened",
        extra={
            "data": storage.root,
            "namespaces": len(storage.namespaces),
            "objects": sum(len(ns.objects) for ns in storage.namespaces.values()),
            "repairs": len(storage.repairs),
            "damaged": len(storage.corruptions),
            "log_records_replayed": storage.replayed.records,
            "seconds": round(time.monotonic() - t0, 3),
            "nofile": nofile,
            "max_open_objects": max_open,
        },
    )
    return storage


def _bootstrap_if_empty(args: argparse.Namespace, storage: Storage, store: Store) -> None:
    """A replacement server on an empty ``--data``: rebuild what the store holds before
    serving it (protocol.md 4.8); an empty store makes an empty data directory."""
    from .tier_bootstrap import BootstrapError, bootstrap, needs_bootstrap  # noqa: PLC0415 - with --tier only

    if not needs_bootstrap(storage.root):
        return
    try:
        report = bootstrap(storage.root, store, lock=False, progress=log.debug)
    except BootstrapError as exc:
        storage.close()
        raise StartError(f"--tier {args.tier}: {exc}") from None
    log.info(
        "tier bootstrap",
        extra={
            "namespaces": len(report.namespaces),
            "objects": len(report.objects),
            "bytes": report.total_bytes,
            "cut": len(report.cut),
            "problems": len(report.problems),
            "seconds": round(report.seconds, 3),
        },
    )


def namespace_quota(args: argparse.Namespace, root: str) -> int | None:
    """``--namespace-quota`` in bytes: a share of the filesystem holding *root* (the data
    directory) is taken of its size now; logged, as every namespace without a quota of its
    own (`sos-server quota`) gets it."""
    setting = args.namespace_quota
    if setting is None:  # a caller's own argparse.Namespace without it
        return None
    if isinstance(setting, int):  # ... or with a size of its own
        return setting
    filesystem = 0
    if setting.percent is not None:
        st = os.statvfs(root)
        filesystem = st.f_blocks * st.f_frsize
        if filesystem <= 0:  # a filesystem that does not say its size
            log.warning("--namespace-quota %s: the data filesystem reports no size: no default quota", setting)
            return None
    quota: int | None = setting.resolve(filesystem)
    log.info(
        "namespace quota",
        extra={"setting": str(setting), "bytes": quota, "filesystem_bytes": filesystem or None},
    )
    return quota


def start_metrics(args: argparse.Namespace, metrics: Metrics) -> None:
    """The Prometheus endpoint of ``--metrics`` (none without), in a daemon thread."""
    if not args.metrics:
        return
    try:
        httpd, _ = metrics.serve(*args.metrics)
    except OSError as exc:
        raise StartError(f"cannot listen for metrics on {args.metrics[0]}:{args.metrics[1]}: {exc}") from None
    print(f"sos-server metrics on {args.metrics[0]}:{httpd.server_port}", file=sys.stderr, flush=True)


class Server:
    """The engine, its tier (with ``--tier``) and the listener over an opened *storage*;
    :meth:`run` serves until SIGTERM or SIGINT."""

    def __init__(
        self,
        args: argparse.Namespace,
        storage: Storage,
        store: Store | None,
        metrics: Metrics,
        tls: ssl.SSLContext | None,
        binding: bytes | None,
    ) -> None:
        self.args = args
        self.storage = storage
        #: the retention settings in force: DATA/retention if it exists, else --keep-generations/--min-age
        self.retention: Retention | None = None
        self._retention_source = ""
        self._gc_lock = trio.Lock()  # one retention round at a time (the timer's, a SIGHUP's)
        limits = Limits(
            max_objects=args.max_objects,
            max_object_size=args.max_object_size,
            max_total_objects=args.max_objects_total,
            namespace_quota=namespace_quota(args, storage.root),
        )
        self.engine = Engine(storage, limits=limits, metrics=metrics)
        self.tier: Tier | None = None
        if store is not None:
            from .tiering import Tier  # noqa: PLC0415 - with --tier only (the module's docstring)

            self.tier = self.engine.tier = Tier(
                store,
                storage,
                metrics,
                interval=args.tier_interval,
                flush=args.tier_flush,
                compact_every=args.tier_compact,
                bytes_trigger=args.tier_bytes,
                lag_warn=args.tier_lag_warn,
                parallel=args.tier_parallel,
                fence_timeout=args.tier_fence_timeout,
                retry_max=args.tier_retry_max,
            )
        self.listener = Listener(
            self.engine,
            host=args.listen[0],
            port=args.listen[1],
            tls=tls,
            channel_binding=binding,
            max_connections=args.max_connections,
            max_unauthenticated=args.max_unauthenticated,
            max_unauthenticated_per_address=args.max_unauthenticated_per_address,
            idle_timeout=args.idle_timeout or None,
            handshake_timeout=args.handshake_timeout or None,
            send_timeout=args.send_timeout or None,
        )

    def run(self) -> str | None:
        """Serve until SIGTERM or SIGINT: the engine, the tier, retention once before the
        listener starts (clients see its result) and then every ``--gc-interval``; SIGHUP
        re-reads the retention settings and applies them at once. Returns None after a
        signal, or why the listening address could not be bound. StartError if the
        retention file is damaged."""
        failed: str | None = None
        try:
            self.reload_retention()
        except StorageError as exc:
            raise StartError(exc.message) from None

        async def main_task() -> None:
            nonlocal failed
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self.engine.run)
                    if self.tier is not None:
                        await nursery.start(self.tier.run)
                    await self._retention_once()  # before serving: clients see the result
                    try:
                        host, port = await nursery.start(self.listener.serve)
                    except ListenError as exc:
                        failed = str(exc)
                        nursery.cancel_scope.cancel()
                        return
                    nursery.start_soon(self._retention)
                    print(f"sos-server listening on {host}:{port}", file=sys.stderr, flush=True)
                    async for signum in signals:
                        if signum == signal.SIGHUP:
                            nursery.start_soon(self._reload_and_apply)
                            continue
                        log.info("stopping", extra={"signal": signal.Signals(signum).name})
                        nursery.cancel_scope.cancel()
                        break

        trio.run(main_task)
        return failed

    def reload_retention(self) -> bool:
        """Read the retention settings: ``DATA/retention`` (`sos-server retention`) if it
        exists, else the command line's. Logs them when they change; returns whether they did.
        StorageError (the old settings kept) if the file is damaged."""
        from_file = self.storage.read_retention()
        if from_file is not None:
            new, source = from_file, self.storage.retention_path
        elif self.args.keep_generations:
            new, source = Retention(self.args.keep_generations, self.args.min_age), "command line"
        else:
            new, source = None, "none"
        changed = (new, source) != (self.retention, self._retention_source)
        self.retention, self._retention_source = new, source
        if changed:
            log.info(
                "retention settings",
                extra={
                    "keep_generations": new.keep_generations if new else None,
                    "min_age": new.min_age if new else None,
                    "source": source,
                },
            )
        return changed

    async def _reload_and_apply(self) -> None:
        """SIGHUP: re-read the retention settings and run retention now with them."""
        try:
            self.reload_retention()
        except StorageError as exc:
            log.error("SIGHUP: %s; the retention settings in force are kept", exc.message)
            return
        await self._retention_once(reload=False)

    async def _retention_once(self, *, reload: bool = True) -> None:
        if reload:
            try:
                self.reload_retention()  # `sos-server retention` without a SIGHUP: taken up here
            except StorageError as exc:
                log.error("retention: %s; the settings in force are kept", exc.message)
        retention = self.retention
        if retention is None:
            return
        async with self._gc_lock:
            try:
                await self.engine.gc(retention.keep_generations, retention.min_age)
            except Exception:  # the retention task's last resort: logged, the next round retries
                log.exception("retention failed")

    async def _retention(self) -> None:
        while True:
            await trio.sleep(self.args.gc_interval)
            await self._retention_once()

    def close(self) -> None:
        """The tier's store and threads (the caller closes the storage)."""
        if self.tier is not None:
            self.tier.close()
