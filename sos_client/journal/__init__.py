"""The journal core: record format, layout, writer (spool + replicator), JournaledTree,
replay, restore and verify. See protocol.md, Part 2 for the format."""

from .errors import (
    BatchNotFound,
    GenerationBreak,
    JournalCorrupt,
    JournalError,
    JournalNotFound,
    JournalQuotaExceeded,
    JournalTierBehind,
    JournalTierUnavailable,
    JournalTruncated,
    PositionUnavailable,
    ReplayError,
    SpoolStale,
    TargetNotEmpty,
    WriterClosed,
    WriterFenced,
)
from .records import (
    Create,
    Delete,
    Marker,
    Mkdir,
    Record,
    RecordDecoder,
    RecordType,
    Rename,
    Rmdir,
    SnapshotEnd,
    Truncate,
    Write,
)
from .replay import replay
from .restore import Summary, restore
from .tree import JournaledTree
from .verify import verify
from .writer import JournalWriter

__all__ = [
    "JournalWriter", "JournaledTree", "replay", "restore", "verify", "Summary",
    "JournalError", "JournalCorrupt", "JournalNotFound", "JournalQuotaExceeded", "JournalTruncated", "GenerationBreak", "WriterFenced", "WriterClosed",
    "JournalTierBehind", "JournalTierUnavailable", "SpoolStale", "TargetNotEmpty", "BatchNotFound", "PositionUnavailable", "ReplayError",
    "Record", "RecordDecoder", "RecordType", "Mkdir", "Rmdir", "Create", "Write", "Truncate",
    "Rename", "Delete", "Marker", "SnapshotEnd",
]
