"""The journal core: one package under every face (fsspec, the FUSE mount, the WebHDFS gateway)
and under ``sos restore`` / ``sos verify`` (protocol.md Part 2 is the format).

Its parts, from the bottom: ``errors``, ``store`` (the slice of the blocking client it calls),
``beneath`` (file access that never follows a link), ``stats``; ``format/`` (records, their
construct layout, object names); ``read/`` (generations and segments read back, checked;
the bucket as a source; verify; Spark's commit log); ``rebuild/`` (replay, restore, rollback)
and ``writer/`` (spool, resume, replicator, barrier waits); ``tree/`` (``JournaledTree`` and its
opener); ``faces/`` (what the faces share); ``cli`` (``sos restore/verify``).
May import: sos_client, sos_tier, sos_wire. Never a face (spark_plugin), never sos_server.
"""

from typing import TYPE_CHECKING

from sos_wire.lazy import lazy_exports

if TYPE_CHECKING:
    from sos_journal.errors import (
        BatchNotFound,
        GenerationBreak,
        JournalAuthError,
        JournalCorrupt,
        JournalError,
        JournalIncomplete,
        JournalKeyRequired,
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
    from sos_journal.format.auth import JournalKeys
    from sos_journal.format.records import (
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
    from sos_journal.read.verify import verify
    from sos_journal.rebuild.replay import replay
    from sos_journal.rebuild.restore import Summary, restore
    from sos_journal.tree.tree import JournaledTree
    from sos_journal.writer.writer import JournalWriter

__all__ = [
    "BatchNotFound",
    "Create",
    "Delete",
    "GenerationBreak",
    "JournalAuthError",
    "JournalCorrupt",
    "JournalError",
    "JournalIncomplete",
    "JournalKeyRequired",
    "JournalKeys",
    "JournalNotFound",
    "JournalQuotaExceeded",
    "JournalTierBehind",
    "JournalTierUnavailable",
    "JournalTruncated",
    "JournalWriter",
    "JournaledTree",
    "Marker",
    "Mkdir",
    "PositionUnavailable",
    "Record",
    "RecordDecoder",
    "RecordType",
    "Rename",
    "ReplayError",
    "Rmdir",
    "SnapshotEnd",
    "SpoolStale",
    "Summary",
    "TargetNotEmpty",
    "Truncate",
    "Write",
    "WriterClosed",
    "WriterFenced",
    "replay",
    "restore",
    "verify",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "sos_journal.errors": (
            "BatchNotFound",
            "GenerationBreak",
            "JournalAuthError",
            "JournalCorrupt",
            "JournalError",
            "JournalIncomplete",
            "JournalKeyRequired",
            "JournalNotFound",
            "JournalQuotaExceeded",
            "JournalTierBehind",
            "JournalTierUnavailable",
            "JournalTruncated",
            "PositionUnavailable",
            "ReplayError",
            "SpoolStale",
            "TargetNotEmpty",
            "WriterClosed",
            "WriterFenced",
        ),
        "sos_journal.format.auth": ("JournalKeys",),
        "sos_journal.format.records": (
            "Create",
            "Delete",
            "Marker",
            "Mkdir",
            "Record",
            "RecordDecoder",
            "RecordType",
            "Rename",
            "Rmdir",
            "SnapshotEnd",
            "Truncate",
            "Write",
        ),
        "sos_journal.read.verify": ("verify",),
        "sos_journal.rebuild.replay": ("replay",),
        "sos_journal.rebuild.restore": (
            "Summary",
            "restore",
        ),
        "sos_journal.tree.tree": ("JournaledTree",),
        "sos_journal.writer.writer": ("JournalWriter",),
    },
)
