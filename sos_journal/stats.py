"""What a replay and a restore report (:class:`ReplayStats`, :class:`Summary`) and how a record's
time is written (:func:`format_time`): plain values at the bottom of the journal, so that the
errors that carry them (``errors.JournalCorrupt``) import nothing above them."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field

__all__ = ["ReplayStats", "Summary", "format_time"]

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)


def format_time(ns: int) -> str:
    """ISO-8601 UTC with nanoseconds (what ``--at`` accepts back exactly)."""
    s, frac = divmod(ns, 1_000_000_000)
    return (_EPOCH + _dt.timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"


@dataclass
class ReplayStats:
    records: int = 0
    bytes_written: int = 0
    last_seq: int = 0
    last_time_ns: int = 0
    stopped: bool = False  # a stop condition ended the replay
    snapshot_done: bool = False


@dataclass
class Summary:
    namespace: str
    target: str
    generation: int = 0
    files: int = 0
    dirs: int = 0
    bytes: int = 0  # total size of the restored files
    records: int = 0  # records applied (snapshot included)
    last_seq: int = 0
    last_time_ns: int = 0
    bytes_read: int = 0  # journal bytes read from the server
    stopped: bool = False  # a point was requested and reached (rather than the end of the journal)
    seconds: float = 0.0
    notes: list = field(default_factory=list)
    warnings: list = field(default_factory=list)  # things the caller must hear (the CLI prints them first)

    @property
    def last_time(self) -> str:
        if not self.last_time_ns:
            return "-"
        return format_time(self.last_time_ns)

    def text(self) -> str:
        return (
            f"restored {self.namespace} into {self.target}: {self.files} files, {self.dirs} dirs, "
            f"{self.bytes} bytes; generation {self.generation}, last record {self.last_seq} "
            f"at {self.last_time}; {self.records} records, {self.bytes_read} journal bytes "
            f"in {self.seconds:.2f}s"
        )
