"""The ``sos-server`` command: serve, keygen, keys, quota, gc, reset-fence. A thin shell over the layers."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from sos_wire import argtypes
from sos_wire.addresses import format_address, is_loopback, is_wildcard, parse_address
from sos_wire.errors import ErrorCode
from sos_wire.logs import add_log_level_option
from sos_wire.names import BadName
from sos_wire.tls_options import add_tls_server_options

from .logs import setup_logging
from .storage import MAX_EPOCH, OBJECT_CHARGE, Retention, Storage, StorageError

__all__ = [
    "DEFAULT_NAMESPACE_QUOTA",
    "NamespaceQuota",
    "build_parser",
    "main",
    "metrics_refusal",
    "parse_duration",
    "parse_hostport",
    "parse_namespace_quota",
    "parse_size",
]

log = logging.getLogger(__name__)

#: argparse types (humanfriendly's parsers, shared with `sos`): kept under these names
parse_duration = argtypes.duration
parse_size = argtypes.size(0)
_positive = argtypes.integer(1)


def parse_hostport(text: str) -> tuple[str, int]:
    """An argparse type: ``HOST:PORT`` or ``[V6]:PORT`` in the one address grammar
    (:mod:`sos_wire.addresses`), port 0 meaning any free port; ``:PORT`` is 127.0.0.1:PORT."""
    stripped = text.strip()
    try:
        return parse_address("127.0.0.1" + stripped if stripped.startswith(":") else stripped, any_port=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad address {text!r}: {exc}: use HOST:PORT, e.g. 127.0.0.1:7070") from None


_epoch = argtypes.integer(0, MAX_EPOCH)


@dataclass(frozen=True)
class NamespaceQuota:
    """``serve --namespace-quota``: the byte quota of every namespace without one of its own
    (`sos-server quota`): ``size`` bytes, or ``percent`` % of the size of the filesystem that
    holds the data directory (read when the server starts), or neither: no quota."""

    size: int | None = None
    percent: float | None = None

    def resolve(self, filesystem_bytes: int) -> int | None:
        """The quota in bytes on a data filesystem of *filesystem_bytes* (None: no quota)."""
        if self.percent is None:
            return self.size
        return int(filesystem_bytes * self.percent / 100)

    def __str__(self) -> str:
        if self.percent is not None:
            return f"{self.percent:g}%"
        return "none" if self.size is None else str(self.size)


#: the byte quota of a namespace when neither `sos-server quota` nor ``--namespace-quota``
#: sets one: a quarter of the data filesystem, so that one namespace (a runaway job, a
#: hostile key holder) leaves at least three quarters of the disk to the others, on a disk
#: of any size (a fixed default would protect nothing on a small volume and cap a big one
#: needlessly); `--namespace-quota none` turns it off
DEFAULT_NAMESPACE_QUOTA = "25%"


def parse_namespace_quota(text: str) -> NamespaceQuota:
    """An argparse type: ``SIZE`` (``10GiB``, ``500M``, bytes), ``PERCENT%`` of the data
    filesystem (above 0, at most 100) or ``none``."""
    stripped = text.strip()
    if stripped.lower() == "none":
        return NamespaceQuota()
    if stripped.endswith("%"):
        try:
            percent = float(stripped[:-1])
        except ValueError:
            percent = -1.0
        if not 0 < percent <= 100:  # also NaN
            raise argparse.ArgumentTypeError(
                f"bad percentage {text!r}: a share of the data filesystem above 0% and at most 100%, e.g. 25%"
            )
        return NamespaceQuota(percent=percent)
    try:
        return NamespaceQuota(size=parse_size(stripped))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"bad quota {text!r}: use a size (e.g. 10GiB), a share of the data filesystem (e.g. 25%) or none"
        ) from None


parse_namespace_quota.__name__ = "quota"  # argparse names the type in its error message


def metrics_refusal(option: str, host: str, port: int, *, what: str) -> str | None:
    """Why ``OPTION HOST:PORT`` (a metrics endpoint) is refused without ``--metrics-public``,
    or None if it is loopback. Its pages need no authentication and their labels name *what*,
    so by default they are served where only this host (or this network namespace: a pod, a
    container with its Prometheus sidecar) reaches them."""
    if is_loopback(host):
        return None
    where = "every interface" if is_wildcard(host) else "an address that is not loopback"
    return (
        f"{option} {format_address(host, port)} serves {where}: the metrics pages need no authentication and"
        f" their labels name {what} to whoever reaches them. Bind them to loopback (e.g. {option}"
        f" {format_address('127.0.0.1', port)}, for a Prometheus on this host or in this pod or container's"
        f" network), or add --metrics-public where a firewall or NetworkPolicy lets only Prometheus reach"
        f" {format_address(host, port)} (docs/DEPLOY.md, Server metrics)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sos-server", description="SOS append-only journal server")
    add_log_level_option(p)
    sub = p.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_admin(sub)
    return p


_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # argparse names no public type


def _add_serve(sub: _Subparsers) -> None:
    """serve's options, in the order ``--help`` lists them: one function per group."""
    s = sub.add_parser("serve", help="run the server")
    _serve_endpoint_options(s)
    _retention_options(
        s,
        keep_help="retention: complete generations kept (with --min-age; default: no retention; the file of"
        " `sos-server retention`, re-read on SIGHUP, overrides both)",
        age_help="retention: minimum age before removal (with --keep-generations; default: none)",
    )
    _serve_connection_options(s)
    _serve_storage_options(s)
    _serve_tier_options(s)
    add_log_level_option(s, default=None)
    s.set_defaults(func=cmd_serve)


def _serve_endpoint_options(s: argparse.ArgumentParser) -> None:
    """Where serve keeps its data and listens: --data, --listen, --metrics, TLS."""
    s.add_argument("--data", required=True, help="data directory")
    s.add_argument(
        "--listen",
        type=parse_hostport,
        default=("127.0.0.1", 7070),
        help="HOST:PORT or [IPV6]:PORT (port 0: any free; :PORT is 127.0.0.1; default 127.0.0.1:7070)",
    )
    s.add_argument(
        "--metrics",
        type=parse_hostport,
        default=None,
        help="HOST:PORT of the Prometheus endpoint (docs/DEPLOY.md, Server metrics; default: none); loopback"
        " only, unless --metrics-public",
    )
    s.add_argument(
        "--metrics-public",
        action="store_true",
        help="let --metrics bind an address that is not loopback (every interface, a pod's address): its pages"
        " need no authentication and name every namespace, so only where a firewall or NetworkPolicy admits"
        " only Prometheus",
    )
    add_tls_server_options(s, note="; AUTH proofs are then bound to it")


def _retention_options(
    p: argparse.ArgumentParser, *, keep_help: str | None = None, age_help: str | None = None, required: bool = False
) -> None:
    """--keep-generations N and --min-age D, the retention pair of serve, retention and gc."""
    p.add_argument("--keep-generations", type=_positive, default=None, required=required, help=keep_help)
    p.add_argument("--min-age", type=parse_duration, default=None, required=required, help=age_help)


def _serve_connection_options(s: argparse.ArgumentParser) -> None:
    """The caps on connections and their timeouts."""
    s.add_argument("--max-connections", type=_positive, default=1024, help="open connections, at most (default 1024)")
    s.add_argument(
        "--max-unauthenticated",
        type=_positive,
        default=128,
        help="connections not authenticated yet, at most (BUSY beyond; default 128)",
    )
    s.add_argument(
        "--max-unauthenticated-per-address",
        type=_positive,
        default=8,
        help="connections not authenticated yet from one IPv4 address or IPv6 /64, at most (default 8)",
    )
    s.add_argument(
        "--idle-timeout",
        type=parse_duration,
        default=600.0,
        help="close a connection after this long without a request (default 10m; 0: never)",
    )
    s.add_argument(
        "--handshake-timeout",
        type=parse_duration,
        default=10.0,
        help="close a connection not authenticated this long after it was accepted (default 10s; 0: never)",
    )
    s.add_argument(
        "--send-timeout",
        type=parse_duration,
        default=60.0,
        help="close a connection whose replies make no progress this long: the peer does not read them"
        " (default 60s; 0: never)",
    )


def _serve_storage_options(s: argparse.ArgumentParser) -> None:
    """Quotas and limits on objects, open descriptors, the write-ahead log, the retention round."""
    s.add_argument(
        "--max-objects",
        type=_positive,
        default=10_000,
        help="quota: objects per namespace (default 10000: a journal needs a few dozen per generation; each"
        " object also counts 4 KiB toward the namespace's byte quota)",
    )
    s.add_argument(
        "--max-objects-total",
        type=_positive,
        default=2_000_000,
        help="limit: objects in all namespaces together (each costs ~0.75 KiB of memory; default 2000000)",
    )
    s.add_argument("--max-object-size", type=_positive, default=1 << 40, help="quota: bytes per object (default 1 TiB)")
    s.add_argument(
        "--namespace-quota",
        type=parse_namespace_quota,
        default=DEFAULT_NAMESPACE_QUOTA,
        metavar="SIZE|PERCENT%|none",
        help="quota: bytes per namespace, for namespaces without their own (`sos-server quota`): a size, a share"
        " of the data directory's filesystem (its size when the server starts) or none (default"
        f" {DEFAULT_NAMESPACE_QUOTA.replace('%', '%%')}: one namespace cannot fill the disk of the others)",
    )
    s.add_argument(
        "--max-open-objects",
        type=_positive,
        default=None,
        metavar="N",
        help="object write descriptors kept open (least recently used closed first; default: a quarter of"
        " the descriptor limit, at most 4096)",
    )
    s.add_argument(
        "--wal-size",
        type=parse_size,
        default=64 << 20,
        metavar="SIZE",
        help="checkpoint when the write-ahead log file reaches SIZE: object files are synced and the log"
        " file deleted (default 64MiB; a crash replays at most about this much at the next start)",
    )
    s.add_argument(
        "--gc-interval",
        type=parse_duration,
        default=300.0,
        help="how often retention runs (default 5m; SIGHUP runs it at once with re-read settings)",
    )


def _serve_tier_options(s: argparse.ArgumentParser) -> None:
    """--tier URL and how the copy to the object store is paced."""
    s.add_argument(
        "--tier",
        default=None,
        metavar="URL",
        help="copy every object to an object store as write-once pieces (protocol.md Part 4): s3://BUCKET/PREFIX"
        " (credentials, region and endpoint only from boto3's standard chain: environment, shared files, instance"
        " or workload identity, AWS_ENDPOINT_URL for an S3-compatible store) or file:///PATH (another disk);"
        " default: none",
    )
    s.add_argument(
        "--tier-interval",
        type=parse_duration,
        default=1.0,
        help="flush what is pending at least this often when no TIER_WAIT asks sooner (default 1s)",
    )
    s.add_argument(
        "--tier-flush",
        type=parse_duration,
        default=0.1,
        help="at most one flush (ONE object in the store holding every namespace's new bytes) per this:"
        " TIER_WAITs are answered together when it lands; the server's PUT rate (flushes and compaction"
        " together) is at most one per this sustained, up to 3 at once after a quiet spell (default 100ms)",
    )
    s.add_argument(
        "--tier-bytes",
        type=parse_size,
        default=4 << 20,
        metavar="SIZE",
        help="flush (after --tier-flush) when this much was acknowledged since the last flush (default 4MiB;"
        " a flushed object holds at most 8MiB)",
    )
    s.add_argument(
        "--tier-compact",
        type=parse_duration,
        default=30.0,
        help="rewrite flushed objects into per-object pieces and delete them at least this often (default 30s);"
        " its PUTs take the slots the flushes leave, and one in ten when the flushes use them all (each"
        " waiting flush then starts a ninth of --tier-flush later)",
    )
    s.add_argument(
        "--tier-lag-warn",
        type=parse_duration,
        default=30.0,
        help="log a warning when the oldest acknowledged byte not in the store is older than this, and again"
        " when it recovers (default 30s)",
    )
    s.add_argument(
        "--tier-fence-timeout",
        type=parse_duration,
        default=10.0,
        help="FENCE answers TIER_UNAVAILABLE when its marker is not in the store within this (default 10s)",
    )
    s.add_argument(
        "--tier-retry-max",
        type=parse_duration,
        default=30.0,
        help="the longest wait between two tries of a failing store: the back-off starts at 1s (or this, if"
        " less) and doubles up to it (default 30s)",
    )
    s.add_argument(
        "--tier-parallel",
        type=_positive,
        default=4,
        metavar="N",
        help="objects uploaded at once (default 4)",
    )


def _data_command(
    sub: _Subparsers,
    name: str,
    func: Callable[[argparse.Namespace], int],
    *,
    help: str,
    namespace: bool = True,
) -> argparse.ArgumentParser:
    """The parser of an admin command on the data directory: ``--data`` (required), the positional
    ``namespace`` unless *namespace* is false, ``func`` to run; its docstring is the command's
    description in ``--help`` (argparse refills it: line breaks do not matter)."""
    p = sub.add_parser(name, help=help, description=inspect.getdoc(func))
    p.add_argument("--data", required=True)
    add_log_level_option(p, default=None)
    if namespace:
        p.add_argument("namespace")
    p.set_defaults(func=func)
    return p


def _add_admin(sub: _Subparsers) -> None:
    """keygen, keys, quota, reset-fence, retention, gc: on the data directory, not over the network."""
    _add_keygen(sub)
    _add_keys(sub)
    _add_quota(sub)
    _add_reset_fence(sub)
    _add_retention(sub)
    _add_gc(sub)


def _add_keygen(sub: _Subparsers) -> None:
    k = _data_command(
        sub,
        "keygen",
        cmd_keygen,
        help="create a key for a namespace and print it",
    )
    k.add_argument("--role", required=True, choices=["append", "read", "token"])
    k.add_argument(
        "--quota",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="also set the namespace's byte quota (as `sos-server quota`)",
    )
    k.add_argument(
        "--out",
        default=None,
        metavar="FILE",
        help="write the key to FILE (created with mode 0600; an existing FILE is refused) instead of"
        " printing it; the key id goes to stderr",
    )


def _add_keys(sub: _Subparsers) -> None:
    ks = sub.add_parser(
        "keys",
        help="list or revoke the keys of namespaces",
        description="List the keys under --data (never their secrets) or revoke one. Both work while the server"
        " runs. Rotation: `keygen` a new key, give it to the client, then `keys revoke` the old one.",
    )
    kss = ks.add_subparsers(dest="keys_command", required=True)
    kl = _data_command(
        kss,
        "list",
        cmd_keys_list,
        namespace=False,
        help="one key per line: NAMESPACE, KEY_ID, ROLE, CREATED (UTC), tab-separated",
    )
    kl.add_argument("namespace", nargs="?", default=None, help="only this namespace (default: all)")
    kr = _data_command(
        kss,
        "revoke",
        cmd_keys_revoke,
        help="remove a key (the running server refuses it from its next request)",
    )
    kr.add_argument("key_id", metavar="KEY_ID", help="16 hex digits: the part of the key before the '.'")


def _add_quota(sub: _Subparsers) -> None:
    q = _data_command(
        sub,
        "quota",
        cmd_quota,
        help="show or set a namespace's byte quota, and its usage",
    )
    q.add_argument("size", nargs="?", default=None, help="bytes (e.g. 500G), or none")


def _add_reset_fence(sub: _Subparsers) -> None:
    f = _data_command(
        sub,
        "reset-fence",
        cmd_reset_fence,
        help="set a namespace's fence epoch (the server must not be running on --data)",
    )
    f.add_argument(
        "--epoch",
        type=_epoch,
        default=None,
        help="the new fence epoch (default: the highest epoch in the namespace's segment names)",
    )


def _add_retention(sub: _Subparsers) -> None:
    r = _data_command(
        sub,
        "retention",
        cmd_retention,
        namespace=False,
        help="show or set the retention settings a running server re-reads",
    )
    _retention_options(
        r,
        keep_help="complete generations kept (with --min-age)",
        age_help="minimum age before removal (with --keep-generations)",
    )
    r.add_argument(
        "action", nargs="?", choices=["none"], default=None, help="none: remove the file (serve's options apply again)"
    )


def _add_gc(sub: _Subparsers) -> None:
    g = _data_command(
        sub,
        "gc",
        cmd_gc,
        namespace=False,
        help="apply retention once (the server must not be running on --data; --dry-run may run beside it)",
    )
    _retention_options(g, required=True)
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be removed, change nothing (works while the server runs)",
    )


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 ok, 1 failed (one line ``sos-server: ...`` on stderr), 2 usage."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    log.debug("command", extra={"command": args.command, "data": args.data})
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        return command(args)
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


def cmd_keygen(args: argparse.Namespace) -> int:
    """Create a key for NAMESPACE and print it. Roles: append (write, fence and read), read (read only), token (a gateway
    client's credential: `sos gateway` issues an append bearer token for it, and the server itself answers its every
    request but PING with FORBIDDEN, so a Spark job holding it cannot FENCE or write the namespace directly)."""
    out_fd = None
    if args.out is not None:
        # before the key exists: a FILE that cannot be made costs nothing (O_EXCL: never
        # overwrite, never follow a planted symlink; 0600 whatever the umask)
        try:
            out_fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            os.fchmod(out_fd, 0o600)
        except FileExistsError:
            return _fail(f"{args.out} exists: keygen --out never overwrites a file (remove it, or choose another)")
        except OSError as exc:
            return _fail(f"cannot create {args.out}: {exc.strerror or exc}")
    try:
        try:
            key = Storage(args.data).keygen(args.namespace, args.role)
            if args.quota is not None:
                Storage(args.data).set_quota(args.namespace, args.quota)
        except (BadName, ValueError) as exc:
            return _fail(str(exc))
        except OSError as exc:
            where = f" ({exc.filename})" if exc.filename else ""
            return _fail(f"cannot write a key under {args.data}: {exc.strerror or exc}{where}")
        if out_fd is None:
            print(key)
            return 0
        try:
            os.write(out_fd, (key + "\n").encode())
            os.fsync(out_fd)
        except OSError as exc:
            # the key exists on the server but its holder lost it: revoke it
            key_id = key.partition(".")[0]
            with contextlib.suppress(OSError, ValueError):
                Storage(args.data).revoke(args.namespace, key_id)
            return _fail(f"cannot write {args.out}: {exc.strerror or exc} (the key was revoked again)")
        os.close(out_fd)
        out_fd = None
        print(f"key {key.partition('.')[0]} ({args.role}) of {args.namespace} written to {args.out}", file=sys.stderr)
        return 0
    finally:
        if out_fd is not None:  # failed: the file holds no usable key
            os.close(out_fd)
            with contextlib.suppress(OSError):
                os.unlink(args.out)


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def cmd_keys_list(args: argparse.Namespace) -> int:
    """Print one line per key: NAMESPACE<TAB>KEY_ID<TAB>ROLE<TAB>CREATED (ISO 8601, UTC), for NAMESPACE or every namespace.
    Never a secret. Only reads: safe while the server runs. An unreadable key file is listed with role `?` and the
    reason on stderr (exit 1)."""
    st = Storage(args.data)
    try:
        if args.namespace is None and not os.path.isdir(args.data):
            return _fail(f"data directory {os.path.abspath(args.data)} does not exist")
        keys = st.list_keys(args.namespace)
    except BadName as exc:
        return _fail(str(exc))
    rc = 0
    for k in keys:
        print(f"{k.namespace}\t{k.key_id}\t{k.role or '?'}\t{_utc(k.created)}")
        if k.problem:
            rc = _fail(f"{k.namespace}/{k.key_id}: {k.problem}")
    return rc


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    """Remove key KEY_ID of NAMESPACE durably. A running server refuses its next AUTH, and every connection authenticated
    with it gets AUTH_FAILED at its next request and is closed; a `sos gateway` holding a bearer token made from it
    refuses the token within its --key-recheck."""
    try:
        Storage(args.data).revoke(args.namespace, args.key_id)
    except (BadName, ValueError, FileNotFoundError) as exc:
        return _fail(str(exc))
    print(f"revoked {args.namespace}/{args.key_id.strip().lower()}", file=sys.stderr)
    return 0


def cmd_quota(args: argparse.Namespace) -> int:
    """Print the byte quota of NAMESPACE beside its usage, or set it to SIZE (`none` removes it) and print the same line:
    NAMESPACE<TAB>QUOTA (bytes, or none)<TAB>used USED (objects N, data bytes D), where USED = D + 4096 N is what the
    quota counts, read from the object files (safe while the server runs; `serve --namespace-quota`, by default 25%
    of the data filesystem, applies to a namespace whose QUOTA is none). A running server applies it from the next
    APPEND to the namespace, also on connections already open; an APPEND beyond it is refused (QUOTA_EXCEEDED) and
    writes nothing. The quota counts each
    object's data plus 4096 bytes per object (its file's block, header and name: protocol.md 1.9); the objects of a
    namespace are also capped by `serve --max-objects` (default 10000)."""
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
        objects, data = st.usage(args.namespace)
    except (BadName, ValueError) as exc:
        return _fail(str(exc))
    used = data + OBJECT_CHARGE * objects
    print(f"{args.namespace}\t{'none' if quota is None else quota}\tused {used} (objects {objects}, data bytes {data})")
    return 0


def cmd_reset_fence(args: argparse.Namespace) -> int:
    """Set the fence epoch of NAMESPACE, e.g. after a hostile FENCE pushed it to the end of the epoch range. Default: the
    highest epoch in the namespace's segment names (the newest writer's), so a writer that restarts fences one above it.
    A lower fence lets writers of epochs up to it back in: stop every old writer first."""
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


def cmd_retention(args: argparse.Namespace) -> int:
    """Print the retention settings in DATA/retention, or set them (--keep-generations N --min-age DURATION) or remove them
    (none). The file, when it exists, overrides serve's --keep-generations and --min-age; without it those apply. A
    running server re-reads it at every retention round (each --gc-interval) and at once on SIGHUP (`kill -HUP PID`),
    which also runs a round with the new settings; a damaged file keeps the settings in force (error logged) and stops a
    start."""
    st = Storage(args.data)
    given = args.keep_generations is not None or args.min_age is not None
    if given and args.action == "none":
        return _usage("none removes the settings: no --keep-generations or --min-age with it")
    if given and (args.keep_generations is None or args.min_age is None):
        return _usage("--keep-generations and --min-age go together")
    if not os.path.isdir(st.root):
        return _fail(f"data directory {st.root} does not exist")
    if args.action == "none":
        st.write_retention(None)
    elif given:
        st.write_retention(Retention(args.keep_generations, args.min_age))
    current = st.read_retention()
    if current is None:
        print("retention\tnone (serve's --keep-generations/--min-age apply)")
    else:
        print(f"retention\tkeep-generations {current.keep_generations}\tmin-age {current.min_age:g}s")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """Remove the journal generations older than the newest --keep-generations complete ones that have been complete for
    --min-age (protocol.md 2.1, as `serve --keep-generations` does every --gc-interval). Refused while a server runs on
    --data, except --dry-run, which only reads the object files (no lock, no repair) and prints what would be removed."""
    from .engine import plan_retention  # noqa: PLC0415 - the engine (and trio) for gc alone: the others start faster

    setup_logging(args.log_level)
    st = Storage(args.data)
    if args.dry_run:
        # read-only: no lock, nothing replayed or repaired, so it also runs beside a live server
        if not os.path.isdir(os.path.join(st.root, "ns")) and not os.path.exists(os.path.join(st.root, "LOCK")):
            return _fail(f"{st.root} is not an sos-server data directory (no ns/ and no LOCK in it)")
        now = time.time()
        total = 0
        for ns in st.read_only_namespaces():
            for name in plan_retention(ns, args.keep_generations, args.min_age, now=now):
                print(f"would remove {ns.name}/{name}")
                total += 1
        print(f"{total} objects to remove", file=sys.stderr)
        return 0
    try:
        st.lock(create=False)  # a mistyped --data must not become a new, empty data directory
    except StorageError as exc:
        if exc.code is ErrorCode.BUSY:
            return _fail(
                exc.message + " (retention runs inside it: use serve --keep-generations, or gc --dry-run"
                " to see what it would remove)"
            )
        return _fail(exc.message)
    try:
        st.open()
        now = time.time()
        total = 0
        for ns in list(st.namespaces.values()):
            for name in plan_retention(ns, args.keep_generations, args.min_age, now=now):
                print(f"removed {ns.name}/{name}")
                ns.remove(name)
                total += 1
        print(f"{total} objects removed", file=sys.stderr)
    finally:
        st.close()
    return 0


def _serve_usage(args: argparse.Namespace) -> str | None:
    """What is wrong with serve's options together (argparse checked each one), or None."""
    if (args.tls_cert is None) != (args.tls_key is None):
        return "--tls-cert and --tls-key go together"
    if (args.keep_generations is None) != (args.min_age is None):
        return "--keep-generations and --min-age go together"
    if args.wal_size < 1:
        return "--wal-size must be at least 1 byte"
    if args.tier_interval <= 0:
        return "--tier-interval must be positive"
    if not 0 < args.tier_flush <= 60:
        return "--tier-flush must be positive and at most 1m"
    if args.tier_compact <= 0:
        return "--tier-compact must be positive"
    if args.tier_bytes < 1:
        return "--tier-bytes must be at least 1 byte"
    if args.tier_fence_timeout <= 0 or args.tier_retry_max <= 0:
        return "--tier-fence-timeout and --tier-retry-max must be positive"
    if args.metrics and not args.metrics_public:
        return metrics_refusal("--metrics", *args.metrics, what="every namespace the server holds")
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    """Start-up in order (each step in serve.py, which says what fails), then serve until a signal."""
    # trio, the engine and the tier only for serve: the other commands start faster
    from . import serve  # noqa: PLC0415 - see above
    from .metrics import Metrics  # noqa: PLC0415 - see above

    setup_logging(args.log_level)
    problem = _serve_usage(args)
    if problem is not None:
        return _usage(problem)
    try:
        tls, binding = serve.load_tls(args)
        store = serve.open_tier_store(args)
        metrics = Metrics()
        storage = serve.open_storage(args, store, metrics)
    except serve.StartError as exc:
        return _fail(exc.message, exc.status)
    try:
        serve.start_metrics(args, metrics)
    except serve.StartError as exc:
        storage.close()
        return _fail(exc.message, exc.status)
    server = serve.Server(args, storage, store, metrics, tls, binding)
    rc = 0
    try:
        failed = server.run()
        if failed is not None:
            rc = _fail(failed)
    except serve.StartError as exc:
        rc = _fail(exc.message, exc.status)
    finally:
        storage.close()
        server.close()
    log.info("stopped", extra={"exit_code": rc})
    return rc


if __name__ == "__main__":  # run as the module itself, so that its logger has its name
    from sos_server.cli import main as _main

    sys.exit(_main())
