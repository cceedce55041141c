"""The object-store tier (protocol.md Part 4), below both the server and the clients: write-once copies of every object's bytes in an
object store, from whose listing alone a reader rebuilds every namespace.

- ``store.py``: the :class:`Store` interface (``put_once``, ranged ``get``, paginated
  ``list``, ``delete``), its typed errors and :class:`LocalStore` (``file:///path``);
  ``s3.py``: :class:`S3Store` (``s3://bucket/prefix``, boto3; imported only when used, it is
  the optional extra ``tier``); ``errors.py``: botocore's errors into the typed errors (one
  table, :func:`~sos_tier.errors.translate`; imported by ``s3.py`` only); ``open.py``:
  :func:`open_store`, the store a URL names.
- ``retry.py``: the tier's retry policies on tenacity (S3's 409, the server's back-off,
  FENCE's marker).
- ``files.py``: the file modes and directory fsync of every local file (the server's data
  directory uses them too).
- ``layout.py``: key names, :func:`scan` (the listing to per-object states and problems),
  :func:`read_object` / :func:`iter_object` (parallel ranged GETs, every piece's CRC32C checked).
- ``log.py``: flushed objects (``v1/log/``, protocol.md 4.2a): one per flush holding every
  namespace's new bytes, with an index; readers take its entries as pieces.
- ``uploader.py``: :class:`Uploader`, the part the server drives (a flush; compaction into
  per-object pieces, written once, then the flushed objects deleted; progress learned from the
  bucket; lag per namespace).

Everything is synchronous; the server calls it from trio worker threads. Nothing here imports
the engine or parses journal records.
"""

from typing import TYPE_CHECKING

from sos_wire.lazy import lazy_exports

if TYPE_CHECKING:
    from sos_tier.layout import (
        NamespaceState,
        ObjectIncomplete,
        ObjectState,
        Piece,
        Problem,
        TierConflict,
        TierDamage,
        TierPieceTooLarge,
        iter_object,
        read_object,
        scan,
        scan_object,
    )
    from sos_tier.open import open_store
    from sos_tier.store import (
        LocalStore,
        PutOutcome,
        Store,
        StoredKey,
        TierBadRange,
        TierBusy,
        TierDenied,
        TierError,
        TierExists,
        TierNotFound,
    )
    from sos_tier.uploader import Lag, Step, TierFenced, Uploader

__all__ = [
    "Lag",
    "LocalStore",
    "NamespaceState",
    "ObjectIncomplete",
    "ObjectState",
    "Piece",
    "Problem",
    "PutOutcome",
    "Step",
    "Store",
    "StoredKey",
    "TierBadRange",
    "TierBusy",
    "TierConflict",
    "TierDamage",
    "TierDenied",
    "TierError",
    "TierExists",
    "TierFenced",
    "TierNotFound",
    "TierPieceTooLarge",
    "Uploader",
    "iter_object",
    "open_store",
    "read_object",
    "scan",
    "scan_object",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "sos_tier.layout": (
            "NamespaceState",
            "ObjectIncomplete",
            "ObjectState",
            "Piece",
            "Problem",
            "TierConflict",
            "TierDamage",
            "TierPieceTooLarge",
            "iter_object",
            "read_object",
            "scan",
            "scan_object",
        ),
        "sos_tier.open": ("open_store",),
        "sos_tier.store": (
            "LocalStore",
            "PutOutcome",
            "Store",
            "StoredKey",
            "TierBadRange",
            "TierBusy",
            "TierDenied",
            "TierError",
            "TierExists",
            "TierNotFound",
        ),
        "sos_tier.uploader": (
            "Lag",
            "Step",
            "TierFenced",
            "Uploader",
        ),
    },
)
