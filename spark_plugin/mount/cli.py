"""`sos mount NAMESPACE MOUNTPOINT [--cache DIR] [--async] [--owner UID[:GID]] ...`: FUSE mount.

Hooked into `sos` by `sos_client.cli` through `add_parser(subparsers)`; also
runnable alone as `python -m spark_plugin.mount.cli ...` (what `MountProcess`
starts, so it works before the console script is installed).
"""

from __future__ import annotations

import argparse
import grp
import pwd
import sys

from sos_client.cli import add_connection_options
from sos_journal.faces.command import add_journal_options, run_alone, serve_command, start_command
from sos_wire import argtypes


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
    add_journal_options(
        p,
        waits="on rename/close",
        barriers="a rename onto (or the close of) a Spark batch file, fsync and markers",
        min_lag=0,
        lag_when="async mode: ",
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

    start = start_command(args)
    if isinstance(start, int):
        return start
    return serve_command(
        "mount",
        lambda: run_mount(
            args.namespace,
            args.mountpoint,
            allow_other=args.allow_other,
            debug=args.debug,
            writeback_cache=args.writeback_cache,
            owner=args.owner,
            fence_check=args.fence_check,
            **start.journal_options(),
        ),
    )


def main(argv: list[str] | None = None) -> int:
    return run_alone(add_parser, "mount", argv)


if __name__ == "__main__":
    sys.exit(main())
