"""Typed errors of the journal layer.

Each class declares how :mod:`sos_client.errors` classifies it: ``retryable`` (never: a
journal error is an answer about the journal, the spool or the tree), ``os_errno`` (what
a filesystem reports: EIO unless said otherwise) and ``fenced`` (a newer writer took
the namespace over).
"""

from __future__ import annotations

import errno

from sos_journal.stats import ReplayStats, Summary


class JournalError(Exception):
    """Base class of every journal error."""

    retryable = False
    os_errno = errno.EIO
    fenced = False


class JournalCorrupt(JournalError):
    """Journal bytes that do not decode: bad length, checksum, type, body or sequence.

    ``segment`` names the segment object (or local spool file) and ``offset`` the byte
    offset inside it where the broken record starts.
    """

    #: set when raised during a replay (by replay) and a restore (by restore): what was
    #: applied before the broken record
    replay_stats: ReplayStats | None = None
    summary: Summary | None = None

    def __init__(self, segment: str, offset: int, reason: str) -> None:
        self.segment = segment
        self.offset = offset
        self.reason = reason
        super().__init__(f"corrupt journal: {segment or '<stream>'} at offset {offset}: {reason}")


class GenerationBreak(JournalCorrupt):
    """The generations on the server do not form one chain (protocol.md 2.1): a generation
    does not continue the one before it (its number is not the previous one + 1, or it does
    not start with the record after the previous one's last), or a ``ready`` object stands
    where no generation was written. Written by someone else with an append key, or damage:
    readers refuse rather than guess which side is the journal. ``segment`` names the first
    object of the generation that breaks the chain."""

    def __init__(self, segment: str, reason: str, *, generation: int = 0, previous: int = 0):
        self.generation = generation
        self.previous = previous
        super().__init__(segment, 0, reason)
        self.args = (f"the journal's generations do not form one chain: {reason}",)


class WriterFenced(JournalError):
    """Another writer took over the namespace (fenced our epoch or sealed our segment)."""

    os_errno = errno.EROFS
    fenced = True


class JournalQuotaExceeded(JournalError):
    """The server refuses the journal for the namespace's quota (QUOTA_EXCEEDED): a barrier
    whose records cannot become durable, or a new change refused before it touched the tree.

    Nothing is lost: the writer keeps its spool and retries with backoff, so raising the
    quota (``sos-server quota``) lets the journal drain by itself. A filesystem reports it
    as EDQUOT; the gateway as HDFS's DSQuotaExceededException. ``applied``: False when
    the change was refused up front (nothing changed, nothing journaled); True when a
    barrier failed (the change and every record before it are in the cache and the spool,
    and become durable, in order, once the quota allows)."""

    os_errno = errno.EDQUOT

    def __init__(self, message: str, *, applied: bool) -> None:
        super().__init__(message)
        self.applied = applied


class JournalTierBehind(JournalError):
    """``durability="tier"``: a barrier's records are durable on the SOS server, but the
    server's object-store tier (the bucket) did not hold them within the caller's patience
    (the store is down or slow). Nothing is lost: the server keeps uploading and a later
    barrier returns once the bucket has caught up. A filesystem reports it as ETIMEDOUT.
    ``tiered``: what the bucket held of ``segment`` (the object waited for) of ``wanted``
    bytes at the last answer."""

    os_errno = errno.ETIMEDOUT

    def __init__(self, message: str, *, segment: str = "", tiered: int = 0, wanted: int = 0) -> None:
        super().__init__(message)
        self.segment = segment
        self.tiered = tiered
        self.wanted = wanted


class JournalTierUnavailable(JournalError):
    """``durability="tier"`` cannot be had from this server: it has no object-store tier
    (started without ``--tier``: a configuration error, refused when the writer opens), or its
    tier stopped copying the namespace or the object (another server took the namespace over
    in the bucket, a conflict: its log and metrics say which). The server's message is kept."""


class WriterClosed(JournalError):
    """The writer is closed (or failed) and accepts no more records."""


class SpoolStale(JournalError):
    """The local spool is older than what the server holds: another writer took over."""

    os_errno = errno.EROFS
    fenced = True


class TargetNotEmpty(JournalError, FileExistsError):
    """restore() refuses to write into a non-empty directory unless force=True."""

    os_errno = errno.ENOTEMPTY


class JournalNotFound(JournalError, LookupError):
    """The namespace holds no complete generation: nothing to restore (a mistyped
    namespace, another server, or a namespace whose first snapshot never finished)."""

    os_errno = errno.ENOENT

    def __init__(self, namespace: str, message: str):
        self.namespace = namespace
        super().__init__(message)


class BatchNotFound(JournalError, LookupError):
    """The journal never makes ``QUERYDIR/commits/N`` exist (batch N of that checkpoint)."""

    os_errno = errno.ENOENT


class PositionUnavailable(JournalError, LookupError):
    """The requested point is not in the journal the server keeps: before the oldest
    generation it still has, before the first record, or beyond the last record."""

    os_errno = errno.ENOENT


class ReplayError(JournalError):
    """A record could not be applied to the target directory (inconsistent journal)."""

    def __init__(self, seq: int, message: str):
        self.seq = seq
        super().__init__(f"record {seq}: {message}")


class JournalTruncated(JournalCorrupt):
    """A segment ends inside a record (a torn tail: in progress, or broken if sealed)."""


class JournalIncomplete(JournalError):
    """A writer (a gateway, a mount, fsspec) opening on an empty cache found records on the
    server but no generation whose snapshot is whole (the namespace's first snapshot was cut
    short): there is no tree to continue, and starting a new generation from an empty tree
    would put an empty history in front of those records (protocol.md 2.1, "Opening over a
    generation that is not complete"). Nothing was written."""

    def __init__(self, namespace: str, message: str):
        self.namespace = namespace
        super().__init__(message)


class JournalAuthError(JournalCorrupt):
    """A record the journal key does not vouch for (protocol.md 2.5): its tag does not verify
    (planted, altered, reordered, replayed, or from another namespace or generation), it is
    not authenticated in a journal read with a key, or it is authenticated with a key the
    reader does not hold. ``segment`` and ``offset`` name the object and the record's
    position; nothing from it on is applied."""

    def __init__(self, segment: str, offset: int, reason: str) -> None:
        super().__init__(segment, offset, reason)
        self.args = (f"journal not authentic: {segment or '<stream>'} at offset {offset}: {reason}",)


class JournalKeyRequired(JournalAuthError):
    """The journal is authenticated (its records carry a key fingerprint) but no journal key
    was given (``SOS_JOURNAL_KEY`` or ``--journal-key-file``)."""
