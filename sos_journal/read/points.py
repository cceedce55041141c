"""Restore points as users give them: a time (``--at``, ISO 8601 or ns since the epoch)
and a Spark batch (``--batch QUERYDIR:N``); parsing and formatting only."""

from __future__ import annotations

import datetime as _dt
import re

from sos_journal.format.records import validate_path

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
_FRACTION = re.compile(r"(\.\d{6})(\d{1,3})")


def parse_time(at: int | str | _dt.datetime | None) -> int | None:
    """ns since the epoch from a datetime, an int (ns) or an ISO-8601 string (naive = UTC;
    up to 9 fractional digits, as :func:`format_time` prints them)."""
    if at is None:
        return None
    if isinstance(at, int):
        return at
    extra_ns = 0
    if isinstance(at, str):
        text = at.strip()
        m = _FRACTION.search(text)
        if m:  # datetime keeps microseconds: carry the nanoseconds ourselves
            extra_ns = int(m.group(2).ljust(3, "0"))
            text = text[: m.start()] + m.group(1) + text[m.end() :]
        try:
            at = _dt.datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"bad time {at!r}: expected ISO-8601 like 2026-11-23T12:00:00Z") from None
    if isinstance(at, _dt.datetime):
        if at.tzinfo is None:
            at = at.replace(tzinfo=_dt.UTC)
        d = at - _EPOCH  # exact integer arithmetic (a float timestamp loses microseconds)
        return (d.days * 86400 + d.seconds) * 1_000_000_000 + d.microseconds * 1000 + extra_ns
    raise TypeError(f"bad time {at!r}")


def norm_dir(p: str) -> str:
    p = p.strip().strip("/")
    while p.startswith("./"):
        p = p[2:].lstrip("/")
    return "" if p == "." else p


def parse_batch(batch: str | tuple[str, int]) -> tuple[str, int]:
    """(querydir, N) from ``"QUERYDIR:N"`` or a tuple. QUERYDIR is the checkpoint directory's
    path relative to the namespace root ("" or "." for the root); N >= 0."""
    raw_n: int | str
    if isinstance(batch, tuple):
        q, raw_n = batch
    elif isinstance(batch, str) and ":" in batch:
        q, _, raw_n = batch.rpartition(":")
    else:
        raise ValueError(f"bad batch {batch!r}: expected QUERYDIR:N")
    try:
        n = int(raw_n)
    except (TypeError, ValueError):
        raise ValueError(f"bad batch {batch!r}: expected QUERYDIR:N with N a batch id >= 0") from None
    if n < 0:
        raise ValueError(f"bad batch {batch!r}: batch ids are >= 0")
    q = norm_dir(str(q))
    if q:
        try:
            validate_path(q)
        except ValueError:
            raise ValueError(
                f"bad batch {batch!r}: QUERYDIR must be a path relative to the namespace "
                f"root without empty, '.' or '..' parts"
            ) from None
    return q, n
