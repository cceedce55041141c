"""The old home of the journal core, kept so that imports written before it moved still work.

The journal (format, writer, tree, restore, verify) moved to the top-level package
``sos_journal`` (issue 27: packages that show their parts). ``from sos_client.journal import
JournaledTree, JournalWriter, restore`` and every old module path (``sos_client.journal.bucket``,
``.restore``, ``.writer``...) still import: each is the very object of its new home
(``sos_wire.lazy.moved_modules``), imported by name on first use. New code imports ``sos_journal``.
May import: nothing statically. sos_client sits below the journal (the layer contract in
pyproject.toml); this package reaches up only by the names it forwards, at the caller's request.
"""

from __future__ import annotations

import importlib
import sys
import types

from sos_wire.lazy import moved_modules

#: each old module of this package -> its module in sos_journal
MOVED = {
    "_store": "sos_journal.store",
    "barriers": "sos_journal.tree.barrier_rule",
    "beneath": "sos_journal.beneath",
    "bucket": "sos_journal.read.bucket",
    "cli": "sos_journal.cli",
    "commit_wait": "sos_journal.writer.barrier_waits",
    "errors": "sos_journal.errors",
    "facade": "sos_journal.faces.facade",
    "face_command": "sos_journal.faces.command",
    "layout": "sos_journal.format.layout",
    "memstore": "sos_journal.memstore",
    "open": "sos_journal.tree.open",
    "points": "sos_journal.read.points",
    "reading": "sos_journal.read.reading",
    "record_layout": "sos_journal.format.record_layout",
    "records": "sos_journal.format.records",
    "replay": "sos_journal.rebuild.replay",
    "replicator": "sos_journal.writer.replicator",
    "restore": "sos_journal.rebuild.restore",
    "resume": "sos_journal.writer.resume",
    "rollback": "sos_journal.rebuild.rollback",
    "spark_log": "sos_journal.read.spark_log",
    "spool": "sos_journal.writer.spool",
    "testing": "sos_journal.testing",
    "tier_wait": "sos_journal.writer.tier_wait",
    "tree": "sos_journal.tree.tree",
    "verify": "sos_journal.read.verify",
    "writer": "sos_journal.writer.writer",
    "writer_state": "sos_journal.writer.state",
}

#: the names this package exported (``restore``, ``replay`` and ``verify`` are the functions,
#: as they were; their modules import by their paths)
__all__ = [
    "BatchNotFound",
    "Create",
    "Delete",
    "GenerationBreak",
    "JournalCorrupt",
    "JournalError",
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

_module_attr = moved_modules(__name__, MOVED)


class _OldPackage(types.ModuleType):
    """Keeps ``restore``, ``replay`` and ``verify`` the functions this package exported: the
    import system sets a package's attribute to a submodule the first time one is imported."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in __all__ and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _OldPackage


def __getattr__(name: str) -> object:
    if name in __all__:
        value = getattr(importlib.import_module("sos_journal"), name)
        globals()[name] = value
        return value
    return _module_attr(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *MOVED})
