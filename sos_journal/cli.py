"""``sos restore`` and ``sos verify`` (thin shells over restore() and verify()).

Exit codes: RESTORE_EXIT_CODES and VERIFY_EXIT_CODES (printed by each command's --help).

``sos`` builds this module's parsers for every plugged command (``sos gateway``, ``sos mount``
too), so the journal's reader, restore and key ring are imported only when a command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TextIO

from sos_client.cli import add_connection_options, client_from_args
from sos_client.core import resolve_server
from sos_client.errors import SOSPermissionError
from sos_journal.errors import GenerationBreak, JournalCorrupt, JournalError, JournalNotFound
from sos_wire import argtypes
from sos_wire.errors import ErrorCode
from sos_wire.logs import setup_logging

if TYPE_CHECKING:
    from tqdm import tqdm

    from sos_journal.format.auth import JournalKeys
    from sos_journal.store import StoreClient

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_CORRUPT, EXIT_NO_JOURNAL = 0, 1, 2, 3, 4

RESTORE_EXIT_CODES = """exit status:
  0   ok: TARGET holds the requested state
  1   failed. A server, bucket or I/O error (TARGET may hold part of the tree; with
      --from: the bucket unreachable, no credentials, access denied), no key, or
      nothing written: TARGET not empty without --force, or the requested point is
      not in the journal (batch N never committed, or committed before the oldest
      generation the server keeps; position past the last record; time before the
      first record or the oldest generation kept). A position past the last record
      is only found while replaying: with --force, TARGET is then left empty
  2   usage
  3   corrupt data before the requested point (segment and offset named): restore
      applied what came before the broken record and stopped there. So is a record
      the journal key does not vouch for (planted, altered, reordered; not
      authenticated, or by another key, when a journal key is given; any
      authenticated record when none is given). Or the
      generations on the server do not form one chain (one does not continue the
      one before it: written by someone else with an append key, or damaged):
      nothing written; `sos verify` lists the breaks, --generation G restores one.
      With --from: also a piece of the bucket that is damaged (CRC), missing in the
      middle (a gap) or in conflict (another server's history), its key named:
      restore applied every whole record before it and stopped there
  4   no journal in this namespace (no complete generation on this server: a mistyped
      namespace, the wrong server, or a lost one): nothing written. Also when the
      server refuses the key for NAMESPACE (AUTH_FAILED): no such namespace there, or
      the key is not one of its keys (the server does not say which, by design)
  130 interrupted"""

VERIFY_EXIT_CODES = """exit status:
  0   ok: every record checked, no problem. A generation that is not complete is
      no problem (a note; a WARNING line when it holds records a restore leaves out)
  1   failed: server or bucket error (--from: unreachable, no credentials), no key
  2   usage
  3   corrupt data: broken ranges found (listed on stdout), or generations that do
      not form one chain (a generation that does not continue the one before it),
      or records the journal key does not vouch for (or an authenticated journal
      read without its key);
      with --from also pieces damaged, missing or in conflict (their keys named)
  4   no journal in this namespace (no complete generation on this server: a mistyped
      namespace, the wrong server, or a lost one). Also when the server refuses the
      key for NAMESPACE (AUTH_FAILED): no such namespace there, or the key is not one
      of its keys (the server does not say which, by design)
  130 interrupted"""


class _Usage(Exception):
    """A usage error found once the arguments are parsed (exit 2)."""


#: connection options that name a server: meaningless with --from (the bucket is the source)
_SERVER_OPTIONS = (("server", "--server"), ("key_file", "--key-file"), ("tls", "--tls"), ("tls_ca", "--tls-ca"))


def _factory(args: argparse.Namespace, namespace: str) -> Callable[[], StoreClient]:
    """The client factory the options name: a tier bucket (``--from URL``; a BucketSource,
    closed by the caller) or the server (``--server`` or $SOS_SERVER, the key from
    ``--key-file``, $SOS_KEY_FILE or $SOS_KEY)."""
    url = getattr(args, "from_url", None)
    if url is not None:
        given = [flag for attr, flag in _SERVER_OPTIONS if getattr(args, attr, None)]
        if given:
            raise _Usage(
                f"--from reads the bucket alone: {', '.join(given)} cannot go with it "
                f"(credentials and the endpoint come from the environment, see docs/DEPLOY.md)"
            )
        from sos_journal.read.bucket import BucketSource  # noqa: PLC0415 - the tier's modules only for --from

        return BucketSource.open(url, namespace)
    if getattr(args, "server", None) is None:  # not given: $SOS_SERVER, else the default
        args.server = resolve_server("")
    if getattr(args, "key_file", None) is None:
        args.key_file = os.environ.get("SOS_KEY_FILE") or None
    return lambda: client_from_args(args, namespace)


def _close(factory: object) -> None:
    close = getattr(factory, "close", None)
    if close is not None:
        close()


class ProgressBar:
    """Progress on stderr, as ``progress(done_bytes, total_bytes)`` calls arrive.

    On a terminal: a tqdm bar redrawn in place (at most every 0.2 s, and at 100% when it
    ends), one bar per pass (restore --batch: the scan, then the replay), its line ended
    before anything else is printed. Elsewhere (a log file, a pipe): tqdm's same meter as a
    plain line at most every ``interval`` seconds (default 10) while the work goes on, and
    nothing at 0% nor at the end (the summary follows), so a quick run prints no progress.
    Calls may come from several threads. ``clock`` is for tests of the log lines.
    """

    def __init__(
        self,
        label: str,
        stream: TextIO | None = None,
        *,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.2 if self.tty else 10.0)
        self.clock = clock
        self.t0 = clock()
        self._last = self.t0  # when the last log line was written
        self._prev_done = 0
        self._bar: tqdm | None = None  # the terminal's tqdm bar of this pass
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            now = self.clock()
            if done < self._prev_done:  # a new pass
                self.t0 = self._last = now
                self._close_bar()
            self._prev_done = done
            if self.tty:
                self._draw(done, total)
            elif now - self._last >= self.interval:
                self._last = now
                self.stream.write(self.meter(done, total, now - self.t0) + "\n")
                self.stream.flush()

    def meter(self, done: int, total: int, elapsed: float) -> str:
        """The progress text: tqdm's meter in binary byte units."""
        from tqdm import tqdm  # noqa: PLC0415 - 70 ms at every `sos` command's start: only for progress

        return tqdm.format_meter(
            done, total or None, elapsed, ncols=100, prefix=self.label, unit="B", unit_scale=True, unit_divisor=1024
        )

    def _draw(self, done: int, total: int) -> None:
        from tqdm import tqdm  # noqa: PLC0415 - 70 ms at every `sos` command's start: only for progress

        if self._bar is None:
            cols, rows = self._size()
            self._bar = tqdm(
                total=total or None,
                desc=self.label,
                file=self.stream,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                mininterval=self.interval,
                ncols=cols,
                nrows=rows,
                leave=True,
            )
        if total and self._bar.total != total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)

    def _size(self) -> tuple[int, int]:
        """The terminal's columns and lines; 100 x 24 where it says 0 (a fresh
        pseudo-terminal: tqdm would then draw nothing) or cannot say."""
        try:
            size = os.get_terminal_size(self.stream.fileno())
        except (AttributeError, OSError, ValueError):
            return 100, 24
        return size.columns or 100, size.lines or 24

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()  # draws the final state and ends the line
            self._bar = None

    def finish(self) -> None:
        """End the progress line (call before printing anything else)."""
        with self._lock:
            self._close_bar()


def _err(msg: str) -> None:
    print(f"sos: {msg}", file=sys.stderr)


def _auth_refused(exc: BaseException) -> bool:
    """The server answered AUTH_FAILED: an unknown namespace and a key of another one look
    the same by design (protocol.md 1.6), so neither is named; exit 4 like no journal."""
    return isinstance(exc, SOSPermissionError) and exc.code == ErrorCode.AUTH_FAILED


def _auth_message(namespace: str, args: argparse.Namespace) -> str:
    return (
        f"the server refused the key for namespace {namespace!r}: no such namespace{_where(args)}, or the key"
        " is not for it (the server does not say which)"
    )


def _where(args: argparse.Namespace) -> str:
    url = getattr(args, "from_url", None)
    if url is not None:
        return f" (bucket {url})"
    server = getattr(args, "server", None)
    return f" (server {server})" if server else ""


def _source(args: argparse.Namespace) -> Callable[[], StoreClient] | int:
    """The client factory of ``args.namespace``'s source (restore's and verify's), or, when
    the options name none, the exit status after saying why on stderr."""
    try:
        return _factory(args, args.namespace)
    except _Usage as e:
        _err(str(e))
        return EXIT_USAGE
    except (JournalError, ValueError) as e:
        _err(str(e))
        return EXIT_FAIL


@contextlib.contextmanager
def _progress(args: argparse.Namespace, verb: str, factory: Callable[[], StoreClient]) -> Iterator[ProgressBar | None]:
    """The progress bar of ``verb`` (None with --quiet); on the way out, however it ends,
    its line ended and the source closed."""
    bar = None if args.quiet else ProgressBar(f"{verb} {args.namespace}")
    try:
        yield bar
    finally:
        if bar:
            bar.finish()
        _close(factory)


def _journal_key(args: argparse.Namespace) -> JournalKeys | int | None:
    """The journal key ring (``--journal-key-file``, else $SOS_JOURNAL_KEY or
    $SOS_JOURNAL_KEY_FILE; None: none), or exit 1 said why (a malformed or unreadable key)."""
    from sos_journal.format.auth import load_journal_keys, resolve_journal_keys  # noqa: PLC0415 - see the module's docstring

    try:
        if getattr(args, "journal_key_file", None):
            return load_journal_keys(args.journal_key_file)
        keys = resolve_journal_keys()
    except ValueError as e:
        _err(str(e))
        return EXIT_FAIL
    if keys is None:
        log.debug("no journal key: the journal is read unauthenticated")
    return keys


def cmd_restore(args: argparse.Namespace) -> int:
    from sos_journal.rebuild.restore import restore  # noqa: PLC0415 - see the module's docstring

    opts: dict[str, Any] = {}
    if args.at is not None:
        opts["at"] = args.at
    if args.position is not None:
        opts["position"] = args.position
    if args.batch is not None:
        opts["batch"] = args.batch
    if args.generation is not None:
        opts["generation"] = args.generation
    if args.workers is not None:
        opts["workers"] = args.workers
    keys = _journal_key(args)
    if isinstance(keys, int):
        return keys
    factory = _source(args)
    if isinstance(factory, int):
        return factory
    try:
        with _progress(args, "restore", factory) as bar:
            summary = restore(
                factory, args.namespace, args.target, force=args.force, progress=bar, journal_key=keys, **opts
            )
    except GenerationBreak as e:
        _err(f"{e}; nothing written")
        return EXIT_CORRUPT
    except JournalCorrupt as e:
        s = getattr(e, "summary", None)
        _err(
            f"{e}; restore stopped before it"
            + (f" (applied up to record {s.last_seq}: {s.files} files, {s.bytes} bytes)" if s else "")
        )
        return EXIT_CORRUPT
    except JournalNotFound as e:
        _err(f"{e}{_where(args)}")
        return EXIT_NO_JOURNAL
    except SOSPermissionError as e:
        if _auth_refused(e):
            _err(_auth_message(args.namespace, args) + "; nothing written")
            return EXIT_NO_JOURNAL
        _err(str(e))
        return EXIT_FAIL
    except (JournalError, ValueError, OSError) as e:
        _err(str(e))
        return EXIT_FAIL
    except Exception as e:  # noqa: BLE001 - client errors: one line, exit 1
        _err(f"{type(e).__name__}: {e}")
        return EXIT_FAIL
    for w in summary.warnings:
        _err(f"warning: {w}")
    print(summary.text(), file=sys.stderr)
    for n in summary.notes:
        print(f"note: {n}", file=sys.stderr)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from sos_journal.read.verify import verify  # noqa: PLC0415 - see the module's docstring

    keys = _journal_key(args)
    if isinstance(keys, int):
        return keys
    factory = _source(args)
    if isinstance(factory, int):
        return factory
    try:
        with _progress(args, "verify", factory) as bar:
            rep = verify(factory, args.namespace, progress=bar, journal_key=keys)
    except JournalError as e:
        _err(str(e))
        return EXIT_FAIL
    except SOSPermissionError as e:
        if _auth_refused(e):
            _err(_auth_message(args.namespace, args))
            return EXIT_NO_JOURNAL
        _err(str(e))
        return EXIT_FAIL
    except Exception as e:  # noqa: BLE001
        _err(f"{type(e).__name__}: {e}")
        return EXIT_FAIL
    if not rep.generations:
        _err(f"namespace {args.namespace!r} has no journal (no objects under gen/): nothing to verify{_where(args)}")
        return EXIT_NO_JOURNAL
    print(rep.text())
    if not rep.ok:
        return EXIT_CORRUPT
    if not rep.complete_generations:
        _err(f"namespace {args.namespace!r} has no complete generation: nothing to restore{_where(args)}")
        return EXIT_NO_JOURNAL
    return EXIT_OK


def _batch(text: str) -> str:
    from sos_journal.read.points import parse_batch  # noqa: PLC0415 - see the module's docstring

    try:
        parse_batch(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _iso(text: str) -> str:
    from sos_journal.read.points import parse_time  # noqa: PLC0415 - see the module's docstring

    try:
        parse_time(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _add_source_options(p: argparse.ArgumentParser) -> None:
    """The server's connection options, and ``--from URL`` instead of them."""
    p.add_argument(
        "--from",
        dest="from_url",
        metavar="URL",
        help="read the namespace from the object-store tier's bucket alone, with no server: "
        "s3://BUCKET/PREFIX (credentials, region and endpoint from the AWS SDK's standard "
        "chain and AWS_ENDPOINT_URL, never arguments) or file:///PATH. Every check and "
        "option works as from a server; --server, --key-file, --tls and --tls-ca cannot "
        "go with it",
    )
    p.add_argument(
        "--journal-key-file",
        metavar="PATH",
        help="the namespace's journal key (protocol.md 2.5; default: $SOS_JOURNAL_KEY, else the file "
        "$SOS_JOURNAL_KEY_FILE): every record must verify under it. Without one, an "
        "authenticated journal is refused (exit 3)",
    )
    add_connection_options(p)
    # None = not given, so that --from can refuse them; _factory fills in the usual defaults
    p.set_defaults(server=None, key_file=None)


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``restore`` and ``verify`` to the ``sos`` command's subparsers."""
    p = subparsers.add_parser(
        "restore",
        help="rebuild a namespace's tree from the server into an empty directory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Restore NAMESPACE into the empty directory TARGET, to the latest state or to a\n"
        "point: --at ISO-TIME, --position N (right after record N) or --batch QUERYDIR:N\n"
        "(right after Spark committed batch N of the query checkpointed in QUERYDIR, i.e.\n"
        "right after the record that makes QUERYDIR/commits/N exist). Progress goes to\n"
        "stderr: redrawn in place on a terminal; elsewhere a line every 10 s (none for a\n"
        "quick run); -q: none.",
        epilog=RESTORE_EXIT_CODES,
    )
    p.add_argument("namespace")
    p.add_argument("target")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--at",
        metavar="ISO-TIME",
        type=_iso,
        help="state after every record stamped at or before this time, e.g. "
        "2026-11-23T12:00:00Z or with up to 9 fractional digits (naive = UTC)",
    )
    g.add_argument("--position", metavar="N", type=argtypes.integer(0), help="state right after record N")
    g.add_argument(
        "--batch",
        metavar="QUERYDIR:N",
        type=_batch,
        help="state right after Spark batch N committed; QUERYDIR is the checkpoint "
        "directory's path relative to the namespace root (e.g. 'checkpoint' for "
        "MOUNTPOINT/checkpoint; '' for the root itself: --batch :N, the same as "
        "--batch .:N), as in the 'checkpoint' field of the spark.batch markers",
    )
    p.add_argument(
        "--generation",
        metavar="G",
        type=argtypes.integer(0),
        help="restore from generation G alone (its end, or a point inside it) without reading "
        "or checking the others: the way out when the generations do not form one chain "
        "(exit 3, see `sos verify`)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the contents of a non-empty TARGET (without it: exit 1, nothing written)",
    )
    p.add_argument(
        "--workers",
        metavar="N",
        type=argtypes.integer(1, 64),
        help="threads writing different files at once, each file's records in journal order "
        "(default: the CPU count, at most 4; 1: every record in order in one thread)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress")
    _add_source_options(p)
    p.set_defaults(func=cmd_restore)

    v = subparsers.add_parser(
        "verify",
        help="check every segment and record of a namespace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Read and check every record of NAMESPACE without restoring;\n"
        "names each broken range. Progress on stderr as for restore.",
        epilog=VERIFY_EXIT_CODES,
    )
    v.add_argument("namespace")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress")
    _add_source_options(v)
    v.set_defaults(func=cmd_verify)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m sos_journal.cli``) while ``sos`` is not wired."""
    parser = argparse.ArgumentParser(prog="sos")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "log_level", "info"))
    return int(args.func(args))


if __name__ == "__main__":  # run as the module itself, so that its logger has its name
    from sos_journal.cli import main as _main

    sys.exit(_main())
