"""What the commands of the journal's faces (``sos mount``, ``sos gateway``) share, written
once: their journal options (:func:`add_journal_options`; :class:`FaceChild`, a face's command in
a child process, puts them on its command line), the start of a run (logging, the key, the
namespace and durability checks, the client factory: :func:`start_command`) and its end
(:func:`serve_command`: an interrupt or a failure said in one line, with the exit code)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from sos_client.cli import client_from_args, key_from_args
from sos_client.errors import SOSError
from sos_client.process import ReadyChild
from sos_journal.faces.facade import add_durability_options, durability_refusal, tier_patience_of
from sos_journal.format.auth import JOURNAL_KEY_ENV, JOURNAL_KEY_FILE_ENV, load_journal_keys, resolve_journal_keys
from sos_wire import argtypes
from sos_wire.logs import setup_logging
from sos_wire.names import validate_namespace

if TYPE_CHECKING:
    from sos_client.blocking import Client

__all__ = [
    "MAX_LAG",
    "CommandStart",
    "FaceChild",
    "JournalOptions",
    "add_journal_options",
    "configure_logging",
    "fail",
    "one_line",
    "read_key",
    "run_alone",
    "serve_command",
    "start_command",
]

log = logging.getLogger(__name__)

#: the writer's default bound of unshipped journal bytes (``--max-lag``)
MAX_LAG = 64 << 20


def add_journal_options(
    p: argparse.ArgumentParser,
    *,
    waits: str,
    barriers: str,
    failure: str = "ETIMEDOUT",
    min_lag: int = 1,
    lag_when: str = "",
) -> None:
    """``--cache``, ``--async``, ``--durability``/``--tier-patience``, ``--max-lag`` and
    ``--generation-bytes`` (in ``args``: ``cache``, ``async_``, ``durability``,
    ``tier_patience``, ``max_lag``, ``generation_bytes``). The face's words: ``waits``,
    which of its operations wait for the server ("on rename/close"); ``barriers`` and
    ``failure`` as :func:`~.facade.add_durability_options`'s ``what`` and ``failure``;
    ``min_lag``, the smallest ``--max-lag``; ``lag_when``, a prefix of its help."""
    p.add_argument(
        "--cache", metavar="DIR", default=None, help="local cache + spool directory (default: ~/.cache/sos/NAMESPACE)"
    )
    p.add_argument(
        "--async",
        dest="async_",
        action="store_true",
        help=f"do not wait for the server {waits}; bound the lag instead",
    )
    add_durability_options(p, what=barriers, failure=failure)
    p.add_argument(
        "--max-lag",
        type=argtypes.size(min_lag),
        default=MAX_LAG,
        metavar="BYTES",
        help=f"{lag_when}most unshipped journal bytes before writes wait (default 64M)",
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
        "--journal-key-file",
        metavar="PATH",
        default=None,
        help="the namespace's journal key, which authenticates every record so that neither the "
        "server nor its bucket can forge the journal (protocol.md 2.5; default: $SOS_JOURNAL_KEY, "
        "else the file $SOS_JOURNAL_KEY_FILE; none: the journal is unauthenticated, with a warning)",
    )


class FaceChild(ReadyChild):
    """A face's command (``sos gateway``, ``sos mount``) in a child process, its key passed by
    environment, never on the command line: what both keep, and :meth:`journal_args`, the
    options of :func:`add_journal_options` (and ``--server``) on its command line."""

    def __init__(
        self,
        name: str,
        ready_prefix: str,
        log_path: str,
        *,
        namespace: str,
        cache_dir: str,
        server: str,
        key: str,
        sync: bool = True,
        extra_args: tuple[str, ...] | list[str] = (),
        durability: str = "server",
        tier_patience: float | None = None,
        start_timeout: float = 120.0,
        new_session: bool = False,
        journal_key_file: str | None = None,
    ) -> None:
        super().__init__(name, ready_prefix, log_path, start_timeout=start_timeout, new_session=new_session)
        self.namespace = namespace
        self.cache_dir = cache_dir
        self.server = server
        self.key = key
        self.sync = sync
        self.extra_args = list(extra_args)
        self.durability = durability
        self.tier_patience = tier_patience
        self.journal_key_file = journal_key_file

    def journal_args(self) -> list[str]:
        """``--cache``, ``--server`` and the journal options that differ from the defaults."""
        args = ["--cache", self.cache_dir, "--server", self.server]
        if not self.sync:
            args.append("--async")
        if self.durability != "server":
            args += ["--durability", self.durability]
        if self.tier_patience is not None:
            args += ["--tier-patience", f"{self.tier_patience:g}"]
        if self.journal_key_file:  # a path: the key itself never goes on a command line
            args += ["--journal-key-file", self.journal_key_file]
        return args


def configure_logging(debug: bool, level: str = "info") -> None:
    """A face's log on stderr, JSON lines as every command's (``--log-level``; ``--debug``
    is ``--log-level debug``)."""
    setup_logging("debug" if debug else level)


def fail(message: str, code: int) -> int:
    """``sos: message`` on stderr; returns ``code``."""
    print(f"sos: {message}", file=sys.stderr)
    return code


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (a server's message may hold newlines)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def read_key(args: argparse.Namespace) -> str | int:
    """Logging configured, the key read ($SOS_KEY or ``--key-file``: never an argument, it
    would show in /proc/PID/cmdline); the exit code 1 (said why) when there is none, as
    put/cat/ls/stat/restore/verify: a missing key is an operation failure."""
    configure_logging(args.debug, getattr(args, "log_level", "info"))
    try:
        return key_from_args(args)
    except SOSError as exc:
        return fail(exc.message, 1)


class JournalOptions(TypedDict):
    """The keywords a face's runner (``run_mount``, ``GatewayOptions``) takes for its
    journal, as the command line gives them (:meth:`CommandStart.journal_options`)."""

    server: str
    key: str
    client_factory: Callable[[], Client]
    cache_dir: str | None
    sync: bool
    max_lag_bytes: int
    generation_bytes: int | None
    durability: str
    tier_patience: float | None


@dataclass(frozen=True)
class CommandStart:
    """A face's command past its checks: the key and a factory of connected clients for
    ``args.namespace`` (the connection options' TLS and timeout)."""

    key: str
    args: argparse.Namespace

    def client(self) -> Client:
        return client_from_args(self.args, self.args.namespace)

    def journal_options(self) -> JournalOptions:
        """The server, key, client factory and the options of :func:`add_journal_options`."""
        args = self.args
        return JournalOptions(
            server=args.server,
            key=self.key,
            client_factory=self.client,
            cache_dir=args.cache,
            sync=not args.async_,
            max_lag_bytes=args.max_lag,
            generation_bytes=args.generation_bytes,
            durability=args.durability,
            tier_patience=tier_patience_of(args.tier_patience),
        )


def start_command(args: argparse.Namespace, key: str | int | None = None) -> CommandStart | int:
    """The start of ``sos mount`` and ``sos gateway``: the key (:func:`read_key`, unless
    ``key`` was read already), ``args.namespace`` and ``--durability`` with ``--async``
    checked: a :class:`CommandStart`, or the exit code (said why: 1 no key, 2 usage)."""
    if key is None:
        key = read_key(args)
    if isinstance(key, int):
        return key
    try:
        validate_namespace(args.namespace)
    except ValueError as exc:
        return fail(str(exc), 2)
    refusal = durability_refusal(args.durability, not args.async_)
    if refusal:
        return fail(refusal, 2)
    refusal = _journal_key_refusal(getattr(args, "journal_key_file", None))
    if refusal:
        return fail(refusal, 2)
    return CommandStart(key, args)


def _journal_key_refusal(path: str | None) -> str:
    """Check the journal key (``--journal-key-file``, else the environment) before serving;
    the file given becomes the process's $SOS_JOURNAL_KEY_FILE, which every writer and reader
    of the face (its cache rebuild, a standby's tail) reads. A refusal's text, or ""."""
    try:
        if path:
            load_journal_keys(path)
            os.environ.pop(JOURNAL_KEY_ENV, None)
            os.environ[JOURNAL_KEY_FILE_ENV] = os.path.abspath(path)
        else:
            resolve_journal_keys()
    except ValueError as exc:
        return str(exc)
    return ""


def serve_command(face: str, serve: Callable[[], int]) -> int:
    """``serve()``'s exit code; an interrupt (before serving, or a second one during the final
    flush) is 130 and any other failure 1, each said in one line (the traceback logged at
    debug)."""
    try:
        return serve()
    except KeyboardInterrupt:
        return fail(f"{face} interrupted (the spool keeps what the server does not have yet)", 130)
    except Exception as exc:
        log.debug("%s failed", face, exc_info=True)
        return fail(f"{face} failed: {one_line(exc)}", 1)


def run_alone(
    add_parser: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], argparse.ArgumentParser],
    command: str,
    argv: list[str] | None = None,
) -> int:
    """``python -m`` of a face's command (what its child process runs, before the ``sos``
    console script may be installed): ``sos COMMAND`` with ``argv`` (default: sys.argv[1:])."""
    parser = argparse.ArgumentParser(prog="sos")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code
