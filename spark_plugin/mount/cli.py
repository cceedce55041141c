"""`sos mount NAMESPACE MOUNTPOINT [--cache DIR] [--async] [--owner UID[:GID]] ...`: FUSE mount.

Hooked into `sos` by `sos_client.cli` through `add_parser(subparsers)`; also
runnable alone as `python -m spark_plugin.mount.cli ...` (what `MountProcess`
starts, so it works before the console script is installed).
"""

from __future__ import annotations

import argparse
import grp
import logging
import pwd
import sys
from typing import TYPE_CHECKING

from sos_client.cli import add_connection_options, client_from_args, key_from_args
from sos_client.errors import SOSError
from sos_client.journal.facade import add_durability_options, durability_refusal, tier_patience_of
from sos_wire import argtypes
from sos_wire.names import validate_namespace

if TYPE_CHECKING:
    from sos_client import Client


def _owner(text: str) -> tuple[int, int]:
    """UID[:GID] (numbers or names); without GID the user's group (passwd), else GID=UID."""
    user, _, group = text.partition(":")
    try:
        if user.isdigit():
            uid = int(user)
            try:
                default_gid = pwd.getpwuid(uid).pw_gid
            except KeyError:  # e.g. Spark's uid 185 in the sidecar image
                default_gid = uid
        else:
            entry = pwd.getpwnam(user)
            uid, default_gid = entry.pw_uid, entry.pw_gid
        if not group:
            gid = default_gid
        elif group.isdigit():
            gid = int(group)
        else:
            gid = grp.getgrnam(group).gr_gid
    except KeyError as exc:
        raise argparse.ArgumentTypeError(f"unknown user or group in {text!r}") from exc
    return uid, gid


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "mount",
        help="mount a namespace as a journaled directory (FUSE)",
        description="Mount NAMESPACE at MOUNTPOINT. Every change is journaled to the SOS "
        "server; reads come from the local cache. An empty cache is first "
        "restored from the server. SIGTERM/SIGINT unmount cleanly. A mount "
        "run as root gives what a process creates through it to that process.",
    )
    p.add_argument("namespace")
    p.add_argument("mountpoint")
    p.add_argument(
        "--cache", metavar="DIR", default=None, help="local cache + spool directory (default: ~/.cache/sos/NAMESPACE)"
    )
    p.add_argument(
        "--async",
        dest="async_",
        action="store_true",
        help="do not wait for the server on rename/close; bound the lag instead",
    )
    add_durability_options(p, what="a rename onto (or the close of) a Spark batch file, fsync and markers")
    p.add_argument(
        "--max-lag",
        type=argtypes.size(0),
        default=64 << 20,
        metavar="BYTES",
        help="async mode: most unshipped journal bytes before writes wait (default 64M)",
    )
    p.add_argument(
        "--generation-bytes",
        type=argtypes.size(1),
        default=None,
        metavar="BYTES",
        help="start a new journal generation (a snapshot of the tree, after "
        "which the server may drop older generations) once the current one "
        "holds this many bytes (default 1G)",
    )
    p.add_argument(
        "--writeback-cache",
        action="store_true",
        help="let the kernel batch small writes (much faster for 4 KiB writes; "
        "write errors then surface at close/fsync)",
    )
    p.add_argument(
        "--allow-other",
        action="store_true",
        help="let other users access the mount (a non-root mount needs user_allow_other in /etc/fuse.conf)",
    )
    p.add_argument(
        "--owner",
        type=_owner,
        default=None,
        metavar="UID[:GID]",
        help="owner of the mount's root directory and of everything rebuilt from "
        "the server, e.g. 185:185 (the Spark image's user); needs root, "
        "implies --allow-other",
    )
    p.add_argument(
        "--fence-check",
        type=argtypes.duration,
        default=5.0,
        metavar="DURATION",
        help="ask the SOS server this often whether a newer writer fenced this mount "
        "(default 5): a fenced mount logs who fenced it, unmounts itself and exits "
        "with code 3",
    )
    p.add_argument("--debug", action="store_true", help="verbose logging, FUSE debug")
    add_connection_options(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from spark_plugin.mount.run import run_mount  # noqa: PLC0415 - trio, pyfuse3 (optional): only when a mount runs

    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        key = key_from_args(args)  # $SOS_KEY or --key-file: never an argument (/proc/PID/cmdline)
    except SOSError as exc:
        print(f"sos: {exc.message}", file=sys.stderr)
        return 1  # as put/cat/ls/stat/restore/verify: a missing key is an operation failure
    try:
        validate_namespace(args.namespace)
    except ValueError as exc:
        print(f"sos: {exc}", file=sys.stderr)
        return 2
    refusal = durability_refusal(args.durability, not args.async_)
    if refusal:
        print(f"sos: {refusal}", file=sys.stderr)
        return 2

    def factory() -> Client:
        return client_from_args(args, args.namespace)

    try:
        return run_mount(
            args.namespace,
            args.mountpoint,
            server=args.server,
            key=key,
            cache_dir=args.cache,
            sync=not args.async_,
            max_lag_bytes=args.max_lag,
            allow_other=args.allow_other,
            debug=args.debug,
            client_factory=factory,
            writeback_cache=args.writeback_cache,
            owner=args.owner,
            generation_bytes=args.generation_bytes,
            durability=args.durability,
            tier_patience=tier_patience_of(args.tier_patience),
            fence_check=args.fence_check,
        )
    except KeyboardInterrupt:  # before mounting, or a second ^C during the final flush
        print("sos: mount interrupted (the spool keeps what the server does not have yet)", file=sys.stderr)
        return 130
    except Exception as exc:
        logging.getLogger("sos.mount").debug("mount failed", exc_info=True)
        print(f"sos: mount failed: {' '.join(str(exc).split()) or type(exc).__name__}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sos")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["mount", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
