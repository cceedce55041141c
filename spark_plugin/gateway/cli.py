"""`sos gateway NAMESPACE --listen HOST:PORT [--cache DIR] [--async] ...`: the WebHDFS gateway.

Registered in `sos` by `sos_client.cli` (an import error here is an error, never a
silently missing subcommand); also runnable alone as `python -m spark_plugin.gateway.cli`
(what `GatewayProcess` starts). Everything heavy is imported when the command runs.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from typing import TYPE_CHECKING

from sos_client.cli import add_connection_options
from sos_journal.faces.command import (
    CommandStart,
    add_journal_options,
    fail,
    one_line,
    read_key,
    run_alone,
    serve_command,
    start_command,
)
from sos_journal.read.points import parse_batch
from sos_wire import argtypes
from sos_wire.addresses import format_address, is_loopback, is_wildcard
from sos_wire.names import validate_namespace
from sos_wire.tls_options import add_tls_server_options

if TYPE_CHECKING:
    from spark_plugin.gateway.options import GatewayOptions

__all__ = ["add_parser", "main", "run"]


def _positive_duration(text: str) -> float:
    value = argtypes.duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 s, not {text!r}")
    return value


def _workers(text: str) -> int:
    try:
        if text.strip().lower() == "auto":
            return max(1, len(os.sched_getaffinity(0)))
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes or auto, not {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"at least 1 (1: one process), not {text!r}")
    return count


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "gateway",
        help="serve a namespace over WebHDFS (webhdfs:// for a Spark cluster)",
        description="Serve NAMESPACE over the WebHDFS REST API that Hadoop's client speaks, as "
        "the namespace's single journal writer: every node of a Spark cluster "
        "checkpoints to webhdfs://HOST:PORT/path with no privileges. Clients get a "
        "bearer token at /oauth2/token (client_id = NAMESPACE, client_secret = a "
        "key of it). An empty cache is first restored from the server. MKDIRS, "
        "RENAME, DELETE, TRUNCATE and file bodies (CREATE, APPEND) reply once "
        "durable on the server (sync mode), but for a checkpoint's state files "
        "with --barrier commit. Fenced by a newer writer, it refuses "
        "every request and exits with code 3. SIGTERM/SIGINT stop it gracefully: no new "
        "connections, the requests in progress finish (at most 25 s; a second "
        "signal stops at once), then the journal is flushed.",
    )
    p.add_argument(
        "namespace",
        help="the namespace to serve; or `promote` to promote a standby: "
        "sos gateway promote NAMESPACE URL (URL: the standby's "
        "loopback address, e.g. http://127.0.0.1:9870: plain http:// "
        "is refused to any other host, the token request carries the "
        "key; the key as for serving: an append-role key)",
    )
    p.add_argument("promote_args", nargs="*", metavar="NAMESPACE URL", help=argparse.SUPPRESS)
    p.add_argument(
        "--listen", metavar="HOST:PORT", help="address to serve on, e.g. 0.0.0.0:9870 (port 0: any free one); required"
    )
    add_standby_options(p)
    p.add_argument(
        "--barrier",
        choices=("commit", "every"),
        default=None,
        help="which changes wait until durable on the server (sync mode, protocol.md 3.4): "
        "'commit' (default alone): a checkpoint's state files and temp files are answered "
        "from the local spool, a batch's commit (offsets/N, commits/N, metadata, sources/, "
        "_spark_metadata/N) and everything outside a checkpoint wait, and a gateway whose "
        "cache was rebuilt from the server refuses the commit of a batch that was in flight "
        "until the query runs it again; 'every' (default of a pair, --lease or --standby): "
        "every RENAME, DELETE, TRUNCATE, MKDIRS and file body waits",
    )
    add_journal_options(
        p,
        waits="(RENAME, DELETE, file bodies)",
        barriers="RENAME, DELETE, TRUNCATE, markers and file bodies",
        failure="403 RetriableException",
    )
    add_http_options(p)
    add_limit_options(p)
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve every request without a token, with full rights (only accepted "
        "on a loopback --listen address: tests and single-machine demos)",
    )
    p.add_argument(
        "--fence-check",
        type=_positive_duration,
        default=5.0,
        metavar="DURATION",
        help="ask the SOS server this often whether a newer writer fenced this gateway "
        "(default 5): a fenced gateway refuses every request (503; its health "
        "check fails), logs who fenced it and exits with code 3",
    )
    p.add_argument("--debug", action="store_true", help="log every request")
    add_operations_options(p)
    add_connection_options(p)
    p.set_defaults(func=run)
    return p


def add_http_options(p: argparse.ArgumentParser) -> None:
    """HTTPS, tokens, threads and the address the redirects name."""
    add_tls_server_options(p, serves="HTTPS (swebhdfs://)")
    p.add_argument(
        "--token-ttl",
        type=argtypes.integer(1),
        default=3600,
        metavar="SECONDS",
        help="lifetime of the bearer tokens it issues (default 3600)",
    )
    p.add_argument(
        "--key-recheck",
        type=argtypes.integer(1),
        default=10,
        metavar="SECONDS",
        help="ask the SOS server again whether a bearer token's key still stands "
        "once its last answer is this old: a removed key's tokens stop within "
        "it (default 10)",
    )
    p.add_argument("--threads", type=argtypes.integer(1), default=32, help="most worker threads at once (default 32)")
    p.add_argument(
        "--workers",
        type=_workers,
        default=1,
        metavar="N",
        help="processes serving the namespace (default 1; auto: one per core this process may "
        "run on): this one is the journal writer, and N-1 workers share its listening "
        "socket, take every client connection, answer reads (GETFILESTATUS, LISTSTATUS, "
        "OPEN, ...) and token requests from the cache themselves and hand every change to "
        "the writer; a worker that dies is started again; --threads, --max-connections "
        "and --open-memory are per process (docs/DEPLOY.md, Sizing the gateway). Not with --standby",
    )
    p.add_argument(
        "--advertise",
        metavar="HOST[:PORT]",
        default=None,
        help="the address clients reach the gateway at, named in the redirects of "
        "CREATE, APPEND and OPEN (default: the --listen address; for a wildcard "
        "one such as 0.0.0.0, the address each client connected to). With TLS, "
        "a name of the certificate, e.g. sos-gateway:9870",
    )
    p.add_argument(
        "--insecure-plaintext",
        action="store_true",
        help="serve plain HTTP on a --listen address that is not loopback (refused "
        "without it: token requests carry a key of the namespace in clear); "
        "only where the network itself is trusted or encrypted",
    )


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """The bounds a client cannot push the gateway past: connections, deadlines, OPEN memory."""
    p.add_argument(
        "--max-connections",
        type=argtypes.integer(8),
        default=1024,
        metavar="N",
        help="most client connections at once (default 1024; lowered to what the "
        "descriptor limit holds); a quarter of them for connections that have "
        "not shown a valid token yet",
    )
    p.add_argument(
        "--max-connections-per-address",
        type=argtypes.integer(1),
        default=64,
        metavar="N",
        help="most connections from one client address (an IPv4 address or an IPv6 /64; default 64)",
    )
    p.add_argument(
        "--head-timeout",
        type=_positive_duration,
        default=20.0,
        metavar="DURATION",
        help="a request head must arrive whole within this long of its first byte "
        "(of the connection, for its first request; default 20)",
    )
    p.add_argument(
        "--send-timeout",
        type=_positive_duration,
        default=60.0,
        metavar="DURATION",
        help="close a connection whose client reads nothing of its reply for this long (default 60)",
    )
    p.add_argument(
        "--open-memory",
        type=argtypes.size(1 << 20),
        default=64 << 20,
        metavar="BYTES",
        help="most bytes of OPEN replies held in memory for their "
        "readers, gateway-wide (default 64M; a new OPEN that "
        "finds no room in 10 s gets 503)",
    )


def add_standby_options(p: argparse.ArgumentParser) -> None:
    """``--standby`` and ``--lease`` (a gateway pair, protocol.md 3.6)."""
    p.add_argument(
        "--standby",
        action="store_true",
        help="serve as a standby (a standby NameNode for Hadoop's HA client): tail the "
        "namespace's journal into the cache, answer every WebHDFS request with "
        "StandbyException, and take over as the writer once the active gateway's "
        "lease is silent for --lease seconds, or on `sos gateway promote`. Promoted, it "
        "runs with its own options: give it the active's (--durability, --async, "
        "--generation-bytes, --lease, --tls-ca, ...) with its own --tls-cert/--tls-key, "
        "--advertise, --cache and --metrics (docs/SPARK.md, A gateway pair)",
    )
    p.add_argument(
        "--lease",
        type=_positive_duration,
        default=None,
        metavar="DURATION",
        help="renew a lease the standby watches (every DURATION/4) and serve only "
        "while holding it; the standby takes over after DURATION of silence "
        "(default with --standby: 10s; without it, no lease)",
    )


def run_promote(args: argparse.Namespace, key: str) -> int:
    """``sos gateway promote NAMESPACE URL``."""
    from spark_plugin.gateway.client import GatewayError  # noqa: PLC0415 - as below
    from spark_plugin.gateway.pair.standby import promote, promote_url_refusal  # noqa: PLC0415 - only when it runs

    namespace, url = args.promote_args
    try:
        validate_namespace(namespace)
    except ValueError as exc:
        return fail(str(exc), 2)
    refusal = promote_url_refusal(url)
    if refusal:  # before anything is sent: the key would go in clear
        return fail(refusal, 2)
    try:
        doc = promote(url, namespace, key, context=_trust(args) if url.strip().startswith("https:") else None)
    except (GatewayError, OSError) as exc:
        return fail(f"promote failed: {one_line(exc)}", 1)
    state = "promoted" if doc.get("promoted") else "already active"
    print(f"{url}: {state}: writer epoch {doc.get('epoch')}, journal at record {doc.get('seq')}")
    return 0


def _trust(args: argparse.Namespace) -> ssl.SSLContext:
    """The TLS trust of the connection options: ``--tls-ca``, else the system CAs."""
    return ssl.create_default_context(cafile=args.tls_ca) if args.tls_ca else ssl.create_default_context()


def add_operations_options(p: argparse.ArgumentParser) -> None:
    """--metrics, --restore-batch and --yes (issue 23 items 5 and 8)."""
    p.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        default=None,
        help="serve Prometheus metrics on this address (:PORT is 127.0.0.1:PORT; port 0: any "
        "free one): spool lag, writer state, replicator errors, barrier latency, last "
        "committed batch per checkpoint, fenced, requests by operation; a --standby serves "
        "its role, tail and lease view, and keeps serving once promoted (docs/DEPLOY.md, "
        "Gateway metrics; default: none); loopback only, unless --metrics-public",
    )
    p.add_argument(
        "--metrics-public",
        action="store_true",
        help="let --metrics bind an address that is not loopback (every interface, a pod's "
        "address): its page needs no authentication and names the namespace and its "
        "checkpoints, so only where a firewall or NetworkPolicy admits only Prometheus",
    )
    p.add_argument(
        "--restore-batch",
        metavar="CHECKPOINT:N",
        default=None,
        help="before serving, roll the namespace back to right after batch N of the "
        "checkpoint CHECKPOINT (its path in the namespace) committed: the cache is "
        "rebuilt at that journal position and a new journal generation starts from "
        "that tree. THE WHOLE NAMESPACE goes back: every other checkpoint in it "
        "returns to the same point in the journal. Refused when it discards later "
        "changes unless --yes is given (docs/SPARK.md, Rolling back)",
    )
    p.add_argument(
        "--yes", action="store_true", help="with --restore-batch: confirm discarding everything written after the batch"
    )


def run(args: argparse.Namespace) -> int:
    key = read_key(args)
    if isinstance(key, int):
        return key
    if args.namespace == "promote" and args.listen is None:
        if len(args.promote_args) != 2:
            return fail("usage: sos gateway promote NAMESPACE URL", 2)
        return run_promote(args, key)
    if args.promote_args or args.listen is None:
        return fail("usage: sos gateway NAMESPACE --listen HOST:PORT [...] (or: sos gateway promote NAMESPACE URL)", 2)
    start = start_command(args, key)
    if isinstance(start, int):
        return start
    refusal = usage_refusal(args)
    if refusal:
        return fail(refusal, 2)
    options = gateway_options(args, start)
    return serve_command("gateway", lambda: serve(options, standby=args.standby))


def usage_refusal(args: argparse.Namespace) -> str:
    """Why the serving options are refused as a usage error ("" if they are not): addresses,
    the rollback point, plain HTTP off loopback, what a standby does not serve."""
    # trio, h11 and the gateway: only when it runs (`sos` loads every command's parser)
    from spark_plugin.gateway.serving import (  # noqa: PLC0415
        parse_advertise,
        parse_listen,
        parse_metrics_listen,
        plaintext_refusal,
    )

    try:
        parse_listen(args.listen)
        if args.advertise:
            parse_advertise(args.advertise)
        if args.metrics:
            host, port = parse_metrics_listen(args.metrics)
            if not args.metrics_public and not is_loopback(host):
                return metrics_public_refusal(host, port)
        if args.restore_batch:
            parse_batch(args.restore_batch)
    except ValueError as exc:
        return str(exc)
    if not args.insecure_no_auth:  # that one: loopback only
        tls = bool(args.tls_cert or args.tls_key)
        refusal = plaintext_refusal(args.listen, tls=tls, insecure_plaintext=args.insecure_plaintext)
        if refusal:
            return refusal
    if args.standby and args.restore_batch:
        return "--restore-batch is not served by a --standby gateway (roll back on the active one)"
    if args.barrier == "commit" and (args.standby or args.lease):
        return (
            "--barrier commit is not served by a gateway pair (--standby, --lease): a promoted standby "
            "never holds its active's spool, so every failover in the middle of a batch would stop the "
            "query; a pair runs --barrier every (protocol.md 3.4)"
        )
    if args.standby and args.workers > 1:
        return "--workers is not served by a --standby gateway yet (a promoted standby serves with one process)"
    return ""


def metrics_public_refusal(host: str, port: int) -> str:
    """Why ``--metrics HOST:PORT`` off loopback is refused without ``--metrics-public``."""
    where = "every interface" if is_wildcard(host) else "an address that is not loopback"
    return (
        f"--metrics {format_address(host, port)} serves {where}: the metrics page needs no "
        "authentication and its labels name the namespace and its checkpoints to whoever reaches "
        f"it. Bind it to loopback (e.g. --metrics {format_address('127.0.0.1', port)}, for a "
        "Prometheus on this host or in this pod or container's network), or add --metrics-public "
        f"where a firewall or NetworkPolicy lets only Prometheus reach {format_address(host, port)} "
        "(docs/DEPLOY.md, Gateway metrics)"
    )


def gateway_options(args: argparse.Namespace, start: CommandStart) -> GatewayOptions:
    """The :class:`~spark_plugin.gateway.options.GatewayOptions` of the command line."""
    from spark_plugin.gateway.options import GatewayOptions  # noqa: PLC0415 - as usage_refusal

    return GatewayOptions(
        namespace=args.namespace,
        listen=args.listen,
        timeout=args.timeout,
        tls_client=_trust(args) if args.tls_ca or args.tls else None,  # checks client keys at the server
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        insecure_no_auth=args.insecure_no_auth,
        token_ttl=args.token_ttl,
        threads=args.threads,
        insecure_plaintext=args.insecure_plaintext,
        advertise=args.advertise,
        max_connections=args.max_connections,
        max_per_address=args.max_connections_per_address,
        head_timeout=args.head_timeout,
        send_timeout=args.send_timeout,
        open_memory=args.open_memory,
        key_recheck=args.key_recheck,
        fence_check=args.fence_check,
        metrics=args.metrics,
        restore_batch=args.restore_batch,
        restore_yes=args.yes,
        lease=args.lease,
        barrier=args.barrier,
        workers=args.workers,
        tls_ca=args.tls_ca,
        **start.journal_options(),
    )


def serve(options: GatewayOptions, *, standby: bool) -> int:
    """Run the gateway (a standby with ``standby``); a refused rollback is a usage error."""
    from sos_journal.rebuild.rollback import RollbackRefused  # noqa: PLC0415 - as usage_refusal

    try:
        if standby:
            from spark_plugin.gateway.pair.standby import run_standby  # noqa: PLC0415 - the standby's alone

            return run_standby(options)
        from spark_plugin.gateway.run import run_gateway  # noqa: PLC0415

        return run_gateway(options)
    except RollbackRefused as exc:
        return fail(str(exc), 2)


def main(argv: list[str] | None = None) -> int:
    return run_alone(add_parser, "gateway", argv)


if __name__ == "__main__":
    sys.exit(main())
