"""botocore's errors translated, in one place, into the store's typed errors (``store.py``).

As s3fs's ``errors.py`` does for fsspec: one table from S3 error codes to error classes, one
from HTTP statuses for the answers that carry no code of their own (a ``HEAD`` answers a bare
``404``), one from botocore's own exception types (no answer at all: the endpoint unreachable,
a timeout, no credentials), and one function, :func:`translate`, that every boto3 call of
:class:`~sos_tier.s3.S3Store` goes through. The code decides before the status; what neither
table names is a plain :class:`TierError`. Every class is a TierError, so what a caller
retries does not change with a row: the rows say what it *is*.

What each typed error means to the store:

- :class:`TierNotFound`: the key does not exist (``get``, ``size``). Only a call about one key
  gives it: a 404 from a listing or a batch delete, which name no key, is a TierError. A
  missing *bucket* is not a missing key either (``NoSuchBucket`` is a TierError): a reader
  must not take a misspelt or deleted bucket for an object that is not there.
- :class:`TierExists`: ``412 PreconditionFailed`` on the conditional create (``If-None-Match:
  *``) is the write-once conflict: the key exists; ``put_once`` reads it to tell a retry that
  had landed from another writer's bytes.
- :class:`TierBusy`: ``409`` (``ConditionalRequestConflict``: another conditional write of the
  key is in flight; S3 asks to retry): ``put_once`` retries it (``retry.busy_retrying``).
- :class:`TierBadRange`: ``416 InvalidRange``: a range from at or past the end: ``get`` gives
  ``b""``.
- :class:`TierDenied`: ``403`` and the credential codes: the request was refused.

This module imports botocore: only ``s3.py`` (the optional extra ``tier``) imports it.
"""

from __future__ import annotations

import botocore.exceptions

from sos_tier.store import TierBadRange, TierBusy, TierDenied, TierError, TierExists, TierNotFound

__all__ = ["BOTOCORE_TYPES", "CODES", "STATUSES", "classify", "translate"]

#: S3 error codes (``response["Error"]["Code"]``), decided before the HTTP status
CODES: dict[str, type[TierError]] = {
    "NoSuchKey": TierNotFound,
    "NotFound": TierNotFound,
    "NoSuchBucket": TierError,  # not a missing key: the bucket is missing (or misspelt)
    "PreconditionFailed": TierExists,
    "ConditionalRequestConflict": TierBusy,
    "InvalidRange": TierBadRange,
    "AccessDenied": TierDenied,
    "AllAccessDisabled": TierDenied,
    "AccountProblem": TierDenied,
    "ExpiredToken": TierDenied,
    "InvalidAccessKeyId": TierDenied,
    "InvalidToken": TierDenied,
    "SignatureDoesNotMatch": TierDenied,
}

#: HTTP statuses, for an answer whose code no row names (``HEAD`` answers a bare ``404``)
STATUSES: dict[int, type[TierError]] = {
    403: TierDenied,
    404: TierNotFound,
    409: TierBusy,
    412: TierExists,
    416: TierBadRange,
}

#: botocore's own exceptions (no answer from S3), the first that matches
BOTOCORE_TYPES: tuple[tuple[type[Exception], type[TierError]], ...] = (
    (botocore.exceptions.NoCredentialsError, TierDenied),
    (botocore.exceptions.PartialCredentialsError, TierDenied),
    (botocore.exceptions.BotoCoreError, TierError),  # unreachable, a timeout, a bad answer
)


def classify(code: str | None, status: int | None = None) -> type[TierError]:
    """The typed error of an S3 error *code* and HTTP *status*: the code's row, else the
    status's row, else :class:`TierError`. ``DeleteObjects`` reports per key with codes."""
    if code and code in CODES:
        return CODES[code]
    if status is not None and status in STATUSES:
        return STATUSES[status]
    return TierError


def _class_of(error: BaseException) -> type[TierError]:
    if isinstance(error, botocore.exceptions.ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = error.response.get("Error", {}).get("Code")
        return classify(str(code) if code is not None else None, status if isinstance(status, int) else None)
    for kind, cls in BOTOCORE_TYPES:
        if isinstance(error, kind):
            return cls
    return TierError


def translate(error: BaseException, *, context: str = "", key: str | None = None) -> TierError:
    """The store's typed error for a boto3 call's *error* (``raise translate(exc, ...) from
    exc``); *error* is chained as ``__cause__`` in any case. *context* starts the message (``S3
    GET of s3://bucket/key``); *key* is the key the call was about (the store's key, relative
    to its root), which :class:`TierNotFound` carries: without one, not-found is a TierError."""
    cls = _class_of(error)
    out: TierError
    if cls is TierNotFound:
        out = TierNotFound(key) if key is not None else TierError(f"{context}: {error}" if context else str(error))
    else:
        out = cls(f"{context}: {error}" if context else str(error))
    out.__cause__ = error
    return out
