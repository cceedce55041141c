"""The object-store tier (protocol.md Part 4), below both the server and the clients: write-once copies of every object's bytes in an
object store, from whose listing alone a reader rebuilds every namespace.

- ``store.py``: the :class:`Store` interface (``put_once``, ranged ``get``, paginated
  ``list``, ``delete``), its typed errors, :class:`LocalStore` (``file:///path``) and
  :func:`open_store`; ``s3.py``: :class:`S3Store` (``s3://bucket/prefix``, boto3; imported
  only when used, it is the optional extra ``tier``).
- ``layout.py``: key names, :func:`scan` (the listing to per-object states and problems),
  :func:`read_object` / :func:`iter_object` (parallel ranged GETs, every piece's CRC32C checked).
- ``uploader.py``: :class:`Uploader`, the part the server drives (next piece, written once;
  progress learned from the bucket; lag per namespace).

Everything is synchronous; the server calls it from trio worker threads. Nothing here imports
the engine or parses journal records.
"""

from sos_tier.layout import (
    NamespaceState,
    ObjectIncomplete,
    ObjectState,
    Piece,
    Problem,
    TierConflict,
    TierDamage,
    iter_object,
    read_object,
    scan,
    scan_object,
)
from sos_tier.store import LocalStore, PutOutcome, Store, StoredKey, TierError, TierNotFound, open_store
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
    "TierConflict",
    "TierDamage",
    "TierError",
    "TierFenced",
    "TierNotFound",
    "Uploader",
    "iter_object",
    "open_store",
    "read_object",
    "scan",
    "scan_object",
]
