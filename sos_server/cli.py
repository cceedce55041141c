"""The ``sos-server`` command: serve, keygen, quota, gc, reset-fence. A thin shell over the layers."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

from sos_wire import argtypes

__all__ = ["build_parser", "main", "parse_duration", "parse_hostport", "parse_size"]

log = logging.getLogger("sos_server.cli")

#: argparse types (humanfriendly's parsers, shared with `sos`): kept under these names
parse_duration = argtypes.duration
parse_size = argtypes.size(0)
_positive = argtypes.integer(1)


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"bad address {text!r}: use HOST:PORT, e.g. 127.0.0.1:7070")
    return host.strip("[]") or "127.0.0.1", int(port)


def _epoch(text: str) -> int:
    from .storage import MAX_EPOCH

    return argtypes.integer(0, MAX_EPOCH)(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sos-server", description="SOS append-only journal server")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the server")
    s.add_argument("--data", required=True, help="data directory")
    s.add_argument("--listen", type=parse_hostport, default=("127.0.0.1", 7070), help="HOST:PORT (port 0: any free)")
    s.add_argument("--metrics", type=parse_hostport, default=None, help="HOST:PORT of the Prometheus endpoint")
    s.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve TLS with this certificate (chain) file; AUTH proofs are then bound to it")
    s.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    s.add_argument("--keep-generations", type=_positive, default=None, help="retention: complete generations kept")
    s.add_argument("--min-age", type=parse_duration, default=None, help="retention: minimum age before removal")
    s.add_argument("--max-connections", type=_positive, default=1024)
    s.add_argument(
        "--max-unauthenticated", type=_positive, default=128,
        help="connections not authenticated yet, at most (BUSY beyond; default 128)",
    )
    s.add_argument(
        "--max-unauthenticated-per-address", type=_positive, default=8,
        help="connections not authenticated yet from one IPv4 address or IPv6 /64, at most (default 8)",
    )
    s.add_argument(
        "--idle-timeout", type=parse_duration, default=600.0,
        help="close a connection after this long without a request (default 10m; 0: never)",
    )
    s.add_argument(
        "--handshake-timeout", type=parse_duration, default=10.0,
        help="close a connection not authenticated this long after it was accepted (default 10s; 0: never)",
    )
    s.add_argument(
        "--send-timeout", type=parse_duration, default=60.0,
        help="close a connection whose replies make no progress this long: the peer does not read them"
        " (default 60s; 0: never)",
    )
    s.add_argument(
        "--max-objects", type=_positive, default=10_000,
        help="quota: objects per namespace (default 10000: a journal needs a few dozen per generation; each"
        " object also counts 4 KiB toward the namespace's byte quota)",
    )
    s.add_argument(
        "--max-objects-total", type=_positive, default=2_000_000,
        help="limit: objects in all namespaces together (each costs ~0.75 KiB of memory)",
    )
    s.add_argument("--max-object-size", type=_positive, default=1 << 40, help="quota: bytes per object")
    s.add_argument(
        "--namespace-quota", type=parse_size, default=None, metavar="SIZE",
        help="quota: bytes per namespace, for namespaces without their own (`sos-server quota`); default none",
    )
    s.add_argument(
        "--max-open-objects", type=_positive, default=None, metavar="N",
        help="object write descriptors kept open (least recently used closed first; default: a quarter of"
        " the descriptor limit, at most 4096)",
    )
    s.add_argument(
        "--wal-size", type=parse_size, default=64 << 20, metavar="SIZE",
        help="checkpoint when the write-ahead log file reaches SIZE: object files are synced and the log"
        " file deleted (default 64MiB; a crash replays at most about this much at the next start)",
    )
    s.add_argument("--gc-interval", type=parse_duration, default=300.0, help="how often retention runs")
    s.add_argument(
        "--tier", default=None, metavar="URL",
        help="copy every object to an object store as write-once pieces (protocol.md Part 4): s3://BUCKET/PREFIX"
        " (credentials, region and endpoint only from boto3's standard chain: environment, shared files, instance"
        " or workload identity, AWS_ENDPOINT_URL for an S3-compatible store) or file:///PATH (another disk);"
        " default: none",
    )
    s.add_argument(
        "--tier-interval", type=parse_duration, default=1.0,
        help="upload what is pending at least this often (default 1s)",
    )
    s.add_argument(
        "--tier-bytes", type=parse_size, default=8 << 20, metavar="SIZE",
        help="upload at once when this much was acknowledged since the last upload round (default 8MiB)",
    )
    s.add_argument(
        "--tier-lag-warn", type=parse_duration, default=30.0,
        help="log a warning when the oldest acknowledged byte not in the store is older than this, and again"
        " when it recovers (default 30s)",
    )
    s.add_argument(
        "--tier-parallel", type=_positive, default=4, metavar="N",
        help="objects uploaded at once (default 4)",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)

    k = sub.add_parser(
        "keygen", help="create a key for a namespace and print it",
        description="Create a key for NAMESPACE and print it. Roles: append (write, fence and read), read (read"
        " only), token (a gateway client's credential: `sos gateway` issues an append bearer token for it, and"
        " the server itself answers its every request but PING with FORBIDDEN, so a Spark job holding it cannot"
        " FENCE or write the namespace directly).",
    )
    k.add_argument("--data", required=True)
    k.add_argument("namespace")
    k.add_argument("--role", required=True, choices=["append", "read", "token"])
    k.add_argument("--quota", type=parse_size, default=None, metavar="SIZE",
                   help="also set the namespace's byte quota (as `sos-server quota`)")
    k.set_defaults(func=cmd_keygen)

    q = sub.add_parser(
        "quota", help="show or set a namespace's byte quota",
        description="Print the byte quota of NAMESPACE, or set it to SIZE (`none` removes it). A running server"
        " applies it from the next APPEND to the namespace, also on connections already open; an APPEND beyond"
        " it is refused (QUOTA_EXCEEDED) and writes nothing. The quota counts each object's data plus 4096 bytes"
        " per object (its file's block, header and name: protocol.md 1.9); the objects of a namespace are also"
        " capped by `serve --max-objects` (default 10000).",
    )
    q.add_argument("--data", required=True)
    q.add_argument("namespace")
    q.add_argument("size", nargs="?", default=None, help="bytes (e.g. 500G), or none")
    q.set_defaults(func=cmd_quota)

    f = sub.add_parser(
        "reset-fence", help="set a namespace's fence epoch (the server must not be running on --data)",
        description="Set the fence epoch of NAMESPACE, e.g. after a hostile FENCE pushed it to the end of the"
        " epoch range. Default: the highest epoch in the namespace's segment names (the newest writer's), so a"
        " writer that restarts fences one above it. A lower fence lets writers of epochs up to it back in:"
        " stop every old writer first.",
    )
    f.add_argument("--data", required=True)
    f.add_argument("namespace")
    f.add_argument("--epoch", type=_epoch, default=None)
    f.set_defaults(func=cmd_reset_fence)

    g = sub.add_parser("gc", help="apply retention once (the server must not be running on --data)")
    g.add_argument("--data", required=True)
    g.add_argument("--keep-generations", type=_positive, required=True)
    g.add_argument("--min-age", type=parse_duration, required=True)
    g.add_argument("--dry-run", action="store_true", help="print what would be removed")
    g.set_defaults(func=cmd_gc)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 ok, 1 failed (one line ``sos-server: ...`` on stderr), 2 usage."""
    from .storage import StorageError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except StorageError as exc:
        return _fail(exc.message)
    except OSError as exc:  # the data directory or a file in it: say which, no traceback
        return _fail(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))


def _fail(msg: str, status: int = 1) -> int:
    print(f"sos-server: {' '.join(str(msg).split())}", file=sys.stderr)
    return status


def _usage(msg: str) -> int:
    return _fail(msg, 2)


def cmd_keygen(args) -> int:
    from sos_wire.names import BadName

    from .storage import Storage

    try:
        key = Storage(args.data).keygen(args.namespace, args.role)
        if args.quota is not None:
            Storage(args.data).set_quota(args.namespace, args.quota)
    except (BadName, ValueError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        return _fail(f"cannot write a key under {args.data}: {exc.strerror or exc}{where}")
    print(key)
    return 0


def cmd_quota(args) -> int:
    from sos_wire.names import BadName

    from .storage import Storage

    st = Storage(args.data)
    try:
        if args.size is not None:
            if args.size.strip().lower() == "none":
                size = None
            else:
                try:
                    size = parse_size(args.size)
                except argparse.ArgumentTypeError as exc:
                    return _usage(str(exc))
            st.set_quota(args.namespace, size)
        quota = st.get_quota(args.namespace)
    except (BadName, ValueError) as exc:
        return _fail(str(exc))
    print(f"{args.namespace}\t{'none' if quota is None else quota}")
    return 0


def cmd_reset_fence(args) -> int:
    from sos_wire.errors import ErrorCode
    from sos_wire.names import BadName

    from .storage import Storage, StorageError

    st = Storage(args.data)
    try:
        st.lock(create=False)
    except StorageError as exc:
        if exc.code is ErrorCode.BUSY:
            return _fail(exc.message + " (stop it first: the fence is read at start-up)")
        return _fail(exc.message)
    try:
        old, new = st.reset_fence(args.namespace, args.epoch)
    except (BadName, ValueError) as exc:
        return _fail(str(exc))
    finally:
        st.close()
    print(f"{args.namespace}: fence {old} -> {new}")
    return 0


def cmd_gc(args) -> int:
    from sos_wire.errors import ErrorCode

    from .engine import plan_retention
    from .logs import setup_logging
    from .storage import Storage, StorageError

    setup_logging("info")
    st = Storage(args.data)
    try:
        st.lock(create=False)  # a mistyped --data must not become a new, empty data directory
    except StorageError as exc:
        if exc.code is ErrorCode.BUSY:
            return _fail(exc.message + " (retention runs inside it: use serve --keep-generations)")
        return _fail(exc.message)
    try:
        st.open()
        now = time.time()
        total = 0
        for ns in list(st.namespaces.values()):
            for name in plan_retention(ns, args.keep_generations, args.min_age, now=now):
                print(f"{'would remove' if args.dry_run else 'removed'} {ns.name}/{name}")
                if not args.dry_run:
                    ns.remove(name)
                total += 1
        print(f"{total} objects {'to remove' if args.dry_run else 'removed'}", file=sys.stderr)
    finally:
        st.close()
    return 0


def cmd_serve(args) -> int:
    import trio

    from .engine import Engine, Limits
    from .listener import Listener, ListenError, certificate_binding, make_tls_context, raise_nofile_limit, tune_malloc
    from .logs import setup_logging
    from .metrics import Metrics
    from .storage import Storage, StorageError

    setup_logging(args.log_level)
    if (args.tls_cert is None) != (args.tls_key is None):
        return _usage("--tls-cert and --tls-key go together")
    if (args.keep_generations is None) != (args.min_age is None):
        return _usage("--keep-generations and --min-age go together")
    tls, binding = None, None
    if args.tls_cert:
        try:
            tls = make_tls_context(args.tls_cert, args.tls_key)
            binding = certificate_binding(args.tls_cert)
        except (OSError, ValueError) as exc:
            return _fail(f"cannot load TLS certificate/key: {exc}")
    elif args.listen[0] not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "listening without TLS on a non-loopback address: anyone on the path can read the data and "
            "take over authenticated connections; pass --tls-cert/--tls-key (docs/DEPLOY.md)",
            extra={"listen": f"{args.listen[0]}:{args.listen[1]}"},
        )
    nofile = raise_nofile_limit()
    tune_malloc()
    limit = nofile if nofile > 0 else 1 << 20  # RLIM_INFINITY is -1
    max_open = args.max_open_objects or max(16, min(4096, limit // 4))
    if args.wal_size < 1:
        return _usage("--wal-size must be at least 1 byte")
    if args.tier_interval <= 0:
        return _usage("--tier-interval must be positive")
    if args.tier_bytes < 1:
        return _usage("--tier-bytes must be at least 1 byte")
    store = None
    if args.tier:
        from sos_tier import TierError, open_store

        try:
            store = open_store(args.tier)
        except ValueError as exc:
            return _usage(f"--tier: {exc}")
        except ImportError as exc:
            return _fail(f"--tier {args.tier}: {exc} (install the extra: pip install 'sos[tier]')")
        except TierError as exc:
            return _fail(f"--tier {args.tier}: {exc}")
    storage = Storage(args.data, max_open_files=max_open, wal_checkpoint_bytes=args.wal_size)
    try:
        storage.lock()  # creates the data directory if it does not exist yet
    except StorageError as exc:
        return _fail(exc.message)
    if store is not None:
        from .tier_bootstrap import BootstrapError, bootstrap, needs_bootstrap

        if needs_bootstrap(storage.root):
            # a replacement server on an empty --data: rebuild what the store holds, then serve it
            # (protocol.md 4.8); an empty store makes an empty data directory
            try:
                report = bootstrap(storage.root, store, lock=False, progress=log.debug)
            except BootstrapError as exc:
                storage.close()
                return _fail(f"--tier {args.tier}: {exc}")
            log.info("tier bootstrap", extra={"namespaces": len(report.namespaces), "objects": len(report.objects),
                                              "bytes": report.total_bytes, "cut": len(report.cut),
                                              "problems": len(report.problems), "seconds": round(report.seconds, 3)})
    metrics = Metrics()
    t0 = time.monotonic()
    try:
        storage.open()
        storage.start_wal()
    except (StorageError, OSError) as exc:
        storage.close()
        return _fail(exc.message if isinstance(exc, StorageError) else f"cannot load {args.data}: {exc}")
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
    if args.metrics:
        try:
            httpd, _ = metrics.serve(*args.metrics)
        except OSError as exc:
            return _fail(f"cannot listen for metrics on {args.metrics[0]}:{args.metrics[1]}: {exc}")
        print(f"sos-server metrics on {args.metrics[0]}:{httpd.server_port}", file=sys.stderr, flush=True)
    limits = Limits(
        max_objects=args.max_objects,
        max_object_size=args.max_object_size,
        max_total_objects=args.max_objects_total,
        namespace_quota=args.namespace_quota,
    )
    engine = Engine(storage, limits=limits, metrics=metrics)
    tier = None
    if store is not None:
        from .tiering import Tier

        tier = engine.tier = Tier(
            store, storage, metrics, interval=args.tier_interval, bytes_trigger=args.tier_bytes,
            lag_warn=args.tier_lag_warn, parallel=args.tier_parallel,
        )
    listener = Listener(
        engine,
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

    async def retention_once() -> None:
        try:
            await engine.gc(args.keep_generations, args.min_age)
        except Exception:
            log.exception("retention failed")

    async def retention() -> None:
        while True:
            await trio.sleep(args.gc_interval)
            await retention_once()

    rc = 0

    async def main_task() -> None:
        nonlocal rc
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                if tier is not None:
                    await nursery.start(tier.run)
                if args.keep_generations:
                    await retention_once()  # before serving: clients see the result
                try:
                    host, port = await nursery.start(listener.serve)
                except ListenError as exc:
                    rc = _fail(str(exc))
                    nursery.cancel_scope.cancel()
                    return
                if args.keep_generations:
                    nursery.start_soon(retention)
                print(f"sos-server listening on {host}:{port}", file=sys.stderr, flush=True)
                async for signum in signals:
                    log.info("stopping", extra={"signal": signal.Signals(signum).name})
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main_task)
    finally:
        storage.close()
        if tier is not None:
            tier.close()
    log.info("stopped", extra={"exit_code": rc})
    return rc


if __name__ == "__main__":
    sys.exit(main())
