"""``sos restore`` and ``sos verify`` (thin shells over restore() and verify()).

Exit codes: 0 ok, 1 the operation failed, 2 usage (argparse), 3 corrupt data.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .errors import JournalCorrupt, JournalError

EXIT_OK, EXIT_FAIL, EXIT_CORRUPT = 0, 1, 3


def _add_connection_options(parser: argparse.ArgumentParser) -> None:
    try:
        from sos_client.cli import add_connection_options  # owner: wire
    except ImportError:
        add_connection_options = None
    if add_connection_options is not None:
        add_connection_options(parser)
        return
    parser.add_argument("--server", default=os.environ.get("SOS_SERVER", "127.0.0.1:7070"),
                        help="host:port of the SOS server (default $SOS_SERVER or 127.0.0.1:7070)")
    parser.add_argument("--key", default=os.environ.get("SOS_KEY"),
                        help="key for the namespace (default $SOS_KEY)")


def _factory(args, namespace: str):
    try:
        from sos_client.cli import client_from_args  # owner: wire (TLS, timeout options)
    except ImportError:
        client_from_args = None

    def make():
        if client_from_args is not None:
            return client_from_args(args, namespace)
        from sos_client import Client

        return Client(getattr(args, "server", None), getattr(args, "key", None), namespace)

    return make


class ProgressBar:
    """A small progress bar on stderr: redraws in place on a terminal, a line every few
    seconds otherwise."""

    def __init__(self, label: str, stream=None, *, interval: float | None = None):
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval if interval is not None else (0.2 if self.tty else 5.0)
        self.t0 = time.monotonic()
        self._last = 0.0
        self._shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last < self.interval and done < total:
            return
        self._last = now
        self._draw(done, total)

    def _draw(self, done, total):
        rate = done / max(now_s := time.monotonic() - self.t0, 1e-6)
        if total:
            frac = min(done / total, 1.0)
            bar = "#" * int(frac * 30)
            text = (f"{self.label} [{bar:<30}] {frac * 100:5.1f}% {done / 1e6:.1f}/{total / 1e6:.1f} MB "
                    f"{rate / 1e6:.1f} MB/s {now_s:.0f}s")
        else:
            text = f"{self.label} {done / 1e6:.1f} MB {rate / 1e6:.1f} MB/s"
        self.stream.write(("\r" + text) if self.tty else (text + "\n"))
        self.stream.flush()
        self._shown = True

    def finish(self) -> None:
        if self._shown and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _err(msg: str) -> None:
    print(f"sos: {msg}", file=sys.stderr)


def cmd_restore(args) -> int:
    from .restore import restore

    opts = {}
    if args.at is not None:
        opts["at"] = args.at
    if args.position is not None:
        opts["position"] = args.position
    if args.batch is not None:
        opts["batch"] = args.batch
    bar = None if args.quiet else ProgressBar(f"restore {args.namespace}")
    try:
        summary = restore(_factory(args, args.namespace), args.namespace, args.target, force=args.force,
                          progress=bar, **opts)
    except JournalCorrupt as e:
        if bar:
            bar.finish()
        s = getattr(e, "summary", None)
        _err(f"{e}; restore stopped before it"
             + (f" (applied up to record {s.last_seq}: {s.files} files, {s.bytes} bytes)" if s else ""))
        return EXIT_CORRUPT
    except (JournalError, ValueError, OSError) as e:
        if bar:
            bar.finish()
        _err(str(e))
        return EXIT_FAIL
    except Exception as e:  # noqa: BLE001 - client errors: one line, exit 1
        if bar:
            bar.finish()
        _err(f"{type(e).__name__}: {e}")
        return EXIT_FAIL
    if bar:
        bar.finish()
    print(summary.text(), file=sys.stderr)
    for n in summary.notes:
        print(f"note: {n}", file=sys.stderr)
    return EXIT_OK


def cmd_verify(args) -> int:
    from .verify import verify

    bar = None if args.quiet else ProgressBar(f"verify {args.namespace}")
    try:
        rep = verify(_factory(args, args.namespace), args.namespace, progress=bar)
    except JournalError as e:
        _err(str(e))
        return EXIT_FAIL
    except Exception as e:  # noqa: BLE001
        _err(f"{type(e).__name__}: {e}")
        return EXIT_FAIL
    finally:
        if bar:
            bar.finish()
    print(rep.text())
    return EXIT_OK if rep.ok else EXIT_CORRUPT


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


def _batch(text: str) -> str:
    from .restore import parse_batch

    try:
        parse_batch(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _iso(text: str) -> str:
    from .restore import parse_time

    try:
        parse_time(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_parsers(subparsers) -> None:
    """Add ``restore`` and ``verify`` to the ``sos`` command's subparsers."""
    p = subparsers.add_parser(
        "restore", help="rebuild a namespace's tree from the server into an empty directory",
        description="Restore NAMESPACE into the empty directory TARGET, to the latest state or to a "
                    "point: --at ISO-TIME, --position N (after record N) or --batch QUERYDIR:N (right "
                    "after Spark committed batch N of the query checkpointed in QUERYDIR, i.e. right after "
                    "the record that makes QUERYDIR/commits/N exist). Exit 3 on corrupt data.")
    p.add_argument("namespace")
    p.add_argument("target")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--at", metavar="ISO-TIME", type=_iso, help="state at this time (naive = UTC)")
    g.add_argument("--position", metavar="N", type=_nonneg_int, help="state right after record N")
    g.add_argument("--batch", metavar="QUERYDIR:N", type=_batch,
                   help="state right after Spark batch N committed; QUERYDIR is the checkpoint "
                        "directory's path relative to the namespace root (e.g. 'checkpoint' for "
                        "MOUNTPOINT/checkpoint; '.' for the root itself), as in the 'checkpoint' "
                        "field of the spark.batch markers")
    p.add_argument("--force", action="store_true", help="replace the contents of a non-empty TARGET")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_connection_options(p)
    p.set_defaults(func=cmd_restore)

    v = subparsers.add_parser("verify", help="check every segment and record of a namespace",
                              description="Read and check every record of NAMESPACE without restoring; "
                                          "names each broken range. Exit 3 if anything is broken.")
    v.add_argument("namespace")
    v.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_connection_options(v)
    v.set_defaults(func=cmd_verify)


def main(argv=None) -> int:
    """Standalone entry (``python -m sos_client.journal.cli``) while ``sos`` is not wired."""
    parser = argparse.ArgumentParser(prog="sos")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
