"""The ``sos`` command: put, cat, ls, stat (here) and restore, verify, mount, gateway (plugged in).

    sos put LOCALFILE NS/NAME     upload a file as a new object (refuses an existing name and
                                  names under gen/, the journal's)
    sos cat NS/NAME               stream an object to stdout
    sos ls NS[/PREFIX]            one object per line: name<TAB>length[<TAB>sealed]
    sos stat NS/NAME              print the object's length

Connection options (every subcommand): ``--server HOST:PORT`` (default $SOS_SERVER or
127.0.0.1:7070), ``--key-file PATH`` (default $SOS_KEY_FILE; else the key is $SOS_KEY),
``--tls``/``--tls-ca FILE``, ``--timeout S``.  A key is never an argument: ``--key KEY``
is refused (usage error), since every local user reads a process's command line in
/proc/PID/cmdline for as long as it runs.  Exit status: 0 ok, 1 the operation failed, 2 usage.  Errors are
one line on stderr: ``sos: <message>``.

Other parts plug in subcommands through the ``sos.commands`` entry points
(:func:`plugged_commands`): ``sos_journal.cli.add_parsers`` (restore, verify),
``spark_plugin.mount.cli.add_parser``, ``spark_plugin.gateway.cli.add_parser``; this module
names none of them (they sit above it).  Each subparser sets ``func=callable(args) -> int`` and calls
:func:`add_connection_options`; :func:`client_from_args` builds a Client from them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import ssl
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, BinaryIO

from sos_client.core import DEFAULT_PORT, DEFAULT_SERVER, resolve_key, resolve_server
from sos_client.errors import (
    BadKey,
    Fenced,
    QuotaExceeded,
    SOSError,
    SOSNotFound,
    SOSPermissionError,
    TooLarge,
    token_key_message,
)
from sos_wire import argtypes
from sos_wire.auth import Key
from sos_wire.errors import ErrorCode
from sos_wire.logs import add_log_level_option, setup_logging
from sos_wire.names import BadName, validate_name, validate_namespace
from sos_wire.tls_options import add_tls_client_options

if TYPE_CHECKING:
    from sos_client.blocking import Client

__all__ = [
    "UsageError",
    "add_connection_options",
    "build_parser",
    "client_from_args",
    "key_from_args",
    "main",
    "split_target",
]

log = logging.getLogger(__name__)

CHUNK = 1 << 20
#: a file up to this size is uploaded as ONE append at offset 0, which creates the object
#: with its data or, refused (over the quota, ...), creates nothing (protocol.md 1.11 APPEND
#: rule 5). Every server takes it: max_body is at least 8 MiB + 4 KiB (1.9), a name at most 1 KiB.
ONE_APPEND = 8 << 20
#: the entry point group of the subcommands other packages add (see :func:`plugged_commands`)
COMMANDS_GROUP = "sos.commands"


class UsageError(Exception):
    """Bad command-line input (exit status 2)."""


KEY_ON_COMMAND_LINE = (
    "--key is not accepted: a key on the command line is readable by every local user "
    "(/proc/PID/cmdline, ps) for as long as the command runs; set SOS_KEY, or put the key "
    "in a file only you can read and pass --key-file PATH"
)


class _RefuseKeyArgument(argparse.Action):
    """``--key``/``--key=...``: a usage error naming the alternatives (the value is never shown)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        parser.error(KEY_ON_COMMAND_LINE)


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    """Add --server, --key-file, --tls, --tls-ca, --timeout to *parser* (defaults from
    SOS_SERVER, SOS_KEY_FILE; the key itself from SOS_KEY). ``--key`` is refused. Also
    --log-level: every command that connects is one of ``sos``'s subcommands."""
    add_log_level_option(parser, default=None)
    g = parser.add_argument_group("connection")
    # "" is read as $SOS_SERVER, else the default (argparse passes a string default through type)
    g.add_argument(
        "--server",
        type=_server_arg,
        default="",
        metavar="HOST[:PORT]",
        help=f"SOS server (default: $SOS_SERVER, else {DEFAULT_SERVER}; port {DEFAULT_PORT} if none is given)",
    )
    g.add_argument(
        "--key-file",
        default=os.environ.get("SOS_KEY_FILE") or None,
        metavar="PATH",
        help="file holding the key of the namespace, as printed by `sos-server keygen` "
        "(default: $SOS_KEY_FILE; without either the key is $SOS_KEY). "
        "Keys are never taken as arguments: --key is refused",
    )
    g.add_argument("--key", dest="_key_argument", nargs="?", action=_RefuseKeyArgument, help=argparse.SUPPRESS)
    add_tls_client_options(g)
    g.add_argument(
        "--timeout", type=float, default=30.0, metavar="S", help="seconds to wait for the server (default: %(default)s)"
    )


def _server_arg(text: str) -> str:
    try:
        return resolve_server(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def key_from_args(args: argparse.Namespace) -> str:
    """The key text: the content of ``--key-file`` (or $SOS_KEY_FILE), else $SOS_KEY.

    Raises SOSPermissionError (exit status 1) if there is none or the file cannot be read;
    messages name the file, never its content."""
    path = getattr(args, "key_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(4096).strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not a text file"
            raise SOSPermissionError(f"cannot read the key file {path}: {reason}") from None
        try:
            Key.parse(text)
        except ValueError as exc:
            raise SOSPermissionError(f"bad key in the key file {path}: {exc}") from None
        return text
    if not os.environ.get("SOS_KEY"):
        raise BadKey("no key given: set SOS_KEY or pass --key-file PATH (what `sos-server keygen` prints)")
    return str(resolve_key(None))  # $SOS_KEY, read and checked as every client does


def client_from_args(args: argparse.Namespace, namespace: str) -> Client:
    """A connected blocking Client from the options of :func:`add_connection_options`.
    SOSPermissionError for a token-role key: the server serves it nothing (protocol.md 1.6)."""
    # the client and the protocol's events only for a command that connects: not for --help
    from sos_client.blocking import Client  # noqa: PLC0415
    from sos_wire.events import KeyRole  # noqa: PLC0415

    tls = None
    if getattr(args, "tls_ca", None):
        tls = ssl.create_default_context(cafile=args.tls_ca)
    elif getattr(args, "tls", False):
        tls = ssl.create_default_context()
    client = Client(args.server, key_from_args(args), namespace, timeout=getattr(args, "timeout", 30.0), tls=tls)
    if client.role == KeyRole.TOKEN:
        client.close()
        raise SOSPermissionError(token_key_message(namespace), ErrorCode.FORBIDDEN)
    log.debug("connected", extra={"server": args.server, "namespace": namespace, "tls": tls is not None})
    return client


def split_target(text: str, *, need_name: bool = True) -> tuple[str, str]:
    """``"NS/a/b"`` -> ``("NS", "a/b")``; raises UsageError with a clear message."""
    ns, _sep, name = text.partition("/")
    if need_name and not name:
        raise UsageError(f"{text!r}: expected NAMESPACE/NAME")
    try:
        validate_namespace(ns)
        if need_name:
            validate_name(name)
    except BadName as exc:
        raise UsageError(str(exc)) from None
    return ns, name


# -- subcommands ----------------------------------------------------------------------
def _current_epoch(client: Client, ns: str) -> int:
    """The namespace's fence epoch, which every APPEND and SEAL must carry (protocol.md
    1.11). FENCE(0) never passes (0 is never above a fence) and FENCED tells the fence:
    a probe that changes nothing."""
    try:
        got = client.fence(0)
    except Fenced as exc:
        return exc.epoch
    except SOSPermissionError as exc:
        raise SOSPermissionError(f"sos put needs an append key for namespace {ns!r}: {exc.message}") from None
    raise SOSError(f"the server accepted FENCE(0) in namespace {ns!r} (answered {got}): it breaks protocol.md 1.11")


def cmd_put(args: argparse.Namespace) -> int:
    ns, name = split_target(args.target)
    if name.startswith("gen/"):
        raise UsageError(
            f"{name!r}: names under gen/ belong to the journal (protocol.md 2.1); sos put stores other objects"
        )
    src = sys.stdin.buffer if args.localfile == "-" else None
    if src is None:
        try:
            src = open(args.localfile, "rb")  # noqa: SIM115 - closed by the `with src` below, as stdin is
        except OSError as exc:
            raise SOSError(f"cannot read {args.localfile}: {exc.strerror or exc}") from None
    with src, client_from_args(args, ns) as client:
        try:
            length, sealed = client.stat(name)
        except SOSNotFound:
            pass
        else:
            raise FileExistsError(
                f"{ns}/{name} already exists ({length} bytes{', sealed' if sealed else ''}); objects are append-only"
            )

        # the first 8 MiB: a file no larger goes in one append, so a refusal (quota) creates nothing
        head = _read_up_to(src, ONE_APPEND + 1)

        def chunks() -> Iterator[bytes]:
            for start in range(0, len(head), CHUNK):
                yield head[start : start + CHUNK]
            while True:
                data = src.read(CHUNK)
                if not data:
                    return
                yield data

        # A journal writer's namespace is fenced: appends carry the current epoch. They
        # touch only this new object, never the journal's; a writer that fences while the
        # upload runs ends it (FENCED), with what was sent kept in the object.
        epoch = _current_epoch(client, ns)
        try:
            total = -1
            if len(head) <= ONE_APPEND:
                try:
                    total = client.append(name, 0, head, epoch=epoch)  # also an empty file: an empty object
                except TooLarge:  # a server with a smaller max_body (the client checks before sending)
                    total = -1
            if total < 0:
                total = client.append_many(name, 0, chunks(), epoch=epoch)
            if args.seal:
                client.seal(name, epoch=epoch)
        except Fenced as exc:
            raise SOSError(
                f"a writer fenced namespace {ns!r} during the upload (epoch {epoch} -> {exc.epoch}): {ns}/{name}"
                " is incomplete; upload again under another name"
            ) from None
        except QuotaExceeded as exc:
            raise SOSError(_over_quota(client, ns, name, exc), exc.code) from None
    if args.verbose:
        print(f"{ns}/{name}: {total} bytes", file=sys.stderr)
    return 0


def _read_up_to(src: BinaryIO, n: int) -> bytes:
    """Up to *n* bytes of *src* (fewer only at its end: a pipe returns short reads)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        data = src.read(min(CHUNK, n - got))
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _over_quota(client: Client, ns: str, name: str, exc: QuotaExceeded) -> str:
    """What a put refused by a limit left: nothing (the first append creates the object
    with its data, refused whole), or, for a file over one append, the part written."""
    try:
        length, _sealed = client.stat(name)
    except SOSError:
        return f"{exc.message} ({ns}/{name} was not created)"
    return (
        f"{exc.message}; {ns}/{name} was created and holds the first {length} bytes of the file: it is"
        f" larger than one append ({ONE_APPEND} bytes), and objects are append-only, so the part stays and the"
        " name is taken (`sos-server quota --data DIR NS` shows the namespace's usage beside its quota)"
    )


def cmd_cat(args: argparse.Namespace) -> int:
    ns, name = split_target(args.target)
    out = sys.stdout.buffer
    with client_from_args(args, ns) as client:
        for chunk in client.read_iter(name, args.offset, args.length):
            out.write(chunk)
    out.flush()
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    ns, prefix = split_target(args.target, need_name=False)
    out = sys.stdout
    with client_from_args(args, ns) as client:
        for entry in client.list(prefix):
            out.write(f"{entry.name}\t{entry.length}{chr(9) + 'sealed' if entry.sealed else ''}\n")
    out.flush()
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    ns, name = split_target(args.target)
    with client_from_args(args, ns) as client:
        length, sealed = client.stat(name)
    print(f"{length}\tsealed" if sealed and args.verbose else length)
    return 0


# -- parser ---------------------------------------------------------------------------


def build_parser(*, plugged: bool = True) -> argparse.ArgumentParser:
    """The ``sos`` command's parser: its own subcommands and, with *plugged*, those of the
    ``sos.commands`` entry points (:func:`plugged_commands`)."""
    parser = argparse.ArgumentParser(
        prog="sos",
        description="SOS: append-only journal replication for Spark checkpoints.",
        epilog="Exit status: 0 ok, 1 the operation failed, 2 usage; restore and verify also use 3 (corrupt data) and 4 (no journal in the namespace): see `sos restore --help`.",
    )
    add_log_level_option(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "put",
        help="upload a local file as a new object",
        description="Upload LOCALFILE (- for stdin) as the new object NS/NAME, e.g. a file "
        "kept beside a journal. Refuses a name that exists (objects are "
        "append-only) and names under gen/ (the journal's). Works in a namespace "
        "a journal writer has fenced: it appends with the current epoch.",
    )
    p.add_argument("localfile", metavar="LOCALFILE")
    p.add_argument("target", metavar="NS/NAME")
    p.add_argument("--seal", action="store_true", help="seal the object after the upload")
    p.add_argument("-v", "--verbose", action="store_true", help="print the length written on stderr")
    add_connection_options(p)
    p.set_defaults(func=cmd_put)

    p = sub.add_parser("cat", help="write an object to stdout", description="Stream NS/NAME to stdout.")
    p.add_argument("target", metavar="NS/NAME")
    p.add_argument("--offset", type=argtypes.integer(0), default=0, help="first byte (default 0)")
    p.add_argument("--length", type=argtypes.integer(0), default=0, help="bytes to write (default 0 = to the end)")
    add_connection_options(p)
    p.set_defaults(func=cmd_cat)

    p = sub.add_parser(
        "ls",
        help="list objects",
        description="List the objects of NS whose names start with PREFIX, one per line: NAME<TAB>LENGTH[<TAB>sealed].",
    )
    p.add_argument("target", metavar="NS[/PREFIX]")
    add_connection_options(p)
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("stat", help="print an object's length", description="Print the length of NS/NAME.")
    p.add_argument("target", metavar="NS/NAME")
    p.add_argument("-v", "--verbose", action="store_true", help="also say whether it is sealed")
    add_connection_options(p)
    p.set_defaults(func=cmd_stat)

    if plugged:
        for add_parser in plugged_commands():
            add_parser(sub)
    return parser


#: the subcommands this module defines (the others are plugged in)
OWN_COMMANDS = frozenset({"put", "cat", "ls", "stat"})


def needs_plugged(argv: list[str]) -> bool:
    """Whether parsing *argv* may need the plugged subcommands: False only when the command it
    names is one of :data:`OWN_COMMANDS`, with nothing before it but ``--log-level LEVEL``.
    So ``sos ls``, ``sos put``... do not import the entry points' metadata nor the modules of
    gateway, mount, restore and verify, and parse as they would with them (the parser of an own
    command and the top level's options are the same either way). Anything else (no command,
    -h before it, another command, an unusual spelling) builds the whole parser."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("--log-level="):
            i += 1
        elif len(word) > 2 and "--log-level".startswith(word):  # argparse takes an unambiguous prefix
            i += 2
        else:
            return word not in OWN_COMMANDS
    return True


def plugged_commands() -> list[Callable[[argparse._SubParsersAction], object]]:
    """The ``add_parser(subparsers)`` functions that the ``sos.commands`` entry points name
    (``pyproject.toml``: restore and verify, mount, gateway), in the order of their names.

    This is how the layers above (``sos_journal``, ``spark_plugin``) add subcommands
    without this module naming them. Each of those modules imports only core dependencies
    when the parser is built (pyfuse3, Spark and the like when the command runs), so an
    import error is a bug and is raised, never hidden; no entry point at all means the
    ``sos`` distribution is not installed (its metadata is where they are)."""
    from importlib.metadata import entry_points  # noqa: PLC0415 - 20-40 ms: only for the commands that need them

    found = sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name)
    if not found:
        raise RuntimeError(
            f"no {COMMANDS_GROUP} entry points: the sos distribution is not installed (pip install -e .)"
        )
    return [ep.load() for ep in found]


def _error(message: str | BaseException) -> None:
    print(f"sos: {' '.join(str(message).split())}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(plugged=needs_plugged(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    setup_logging(args.log_level)
    log.debug("command", extra={"command": args.command})
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        _error(exc)
        return 2
    except ValueError as exc:  # a malformed --server / $SOS_SERVER
        if isinstance(exc, SOSError):
            _error(exc.message or exc)
            return 1
        _error(exc)
        return 2
    except BrokenPipeError:  # `sos cat x | head`: the reader left; not worth a message
        # stdout stays replaced: the interpreter's last flush must not fail again at exit
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130
    except FileExistsError as exc:
        _error(exc)
        return 1
    except SOSError as exc:
        _error(exc.message or exc)
        return 1
    except OSError as exc:
        _error(exc)
        return 1


if __name__ == "__main__":  # run as the module itself, so that its logger has its name
    from sos_client.cli import main as _main

    sys.exit(_main())
