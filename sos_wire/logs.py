"""Structured logs, one JSON object per line on stderr, for every command: ``sos-server`` and
``sos`` (put/cat/ls/stat, restore/verify, mount, gateway). It lives in sos_wire, the package
every other one imports, so the server and the clients format their logs the same way.

Loggers are named by their module (``logging.getLogger(__name__)``): :data:`PACKAGES` are the
product's top-level packages, whose loggers :func:`setup_logging` sets to the chosen level;
every other logger (trio, botocore, ...) stays at WARNING. Messages meant for a person (the
one-line ``sos: ...`` errors, progress bars, the ready lines that tools wait for) are plain
text printed by the commands, not log records.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import TextIO

__all__ = ["LEVELS", "PACKAGES", "JsonFormatter", "add_log_level_option", "setup_logging"]

#: the values of ``--log-level``
LEVELS = ("debug", "info", "warning", "error")

#: the product's top-level packages: their modules' loggers log at ``--log-level``
PACKAGES = ("sos_wire", "sos_tier", "sos_server", "sos_client", "sos_journal", "spark_plugin")

_HANDLER = "sos-json-stderr"

_STD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """A record as one JSON object: ts, level, logger, msg, the record's ``extra`` fields and
    ``exc`` (the traceback) if any."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at each record (a test's capture, a redirect)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """JSON lines on ``stream`` (default: stderr) for the product's loggers at ``level``
    (one of :data:`LEVELS`) and for any other logger's warnings. Called again, it replaces
    the handler it installed before (a command run twice in one process logs once)."""
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(JsonFormatter())
    handler.set_name(_HANDLER)  # marks ours, to be replaced
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if h.get_name() != _HANDLER] + [handler]
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    for name in PACKAGES:
        logging.getLogger(name).setLevel(level.upper())


def add_log_level_option(parser: argparse.ArgumentParser, *, default: str | None = "info") -> None:
    """``--log-level {debug,info,warning,error}``. A subcommand passes ``default=None``: its
    parser then sets the option only when given, so ``sos --log-level debug ls NS`` keeps the
    top-level value (argparse lets a subparser's default overwrite its parent's)."""
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        default=default if default is not None else argparse.SUPPRESS,
        metavar="LEVEL",
        help="log JSON lines on stderr from LEVEL up: debug, info, warning or error (default info)",
    )
