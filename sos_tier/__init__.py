"""The object-store tier (protocol.md Part 4), below both the server and the clients: write-once
copies of every object's bytes in an object store, from whose listing alone a reader rebuilds
every namespace.

Its parts: ``store`` (the :class:`Store` interface, typed errors, :class:`LocalStore`), ``s3``
(:class:`S3Store`, the optional extra ``tier``), ``errors`` (botocore's errors translated),
``open`` (:func:`open_store`), ``retry`` (tenacity), ``files`` (file modes, directory fsync),
``layout`` (key names, the scan, verified reads), ``log`` (flushed objects) and ``uploader``
(the part the server drives). Everything is synchronous; the server calls it from trio worker
threads. May import: sos_wire only; never the server's engine, and it parses no journal record.
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
