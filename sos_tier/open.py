"""``open_store(url)``: the store a tier URL names. A module of its own, above both backends
(``store.py``'s :class:`LocalStore` and ``s3.py``'s :class:`S3Store`, which builds on
``store.py``), so that no backend imports another."""

from __future__ import annotations

from urllib.parse import urlsplit

from sos_tier.store import LocalStore, Store

__all__ = ["open_store"]


def open_store(url: str, **options: int) -> Store:
    """The store a URL names: ``s3://bucket/prefix`` (:class:`~sos_tier.s3.S3Store`;
    credentials, region and endpoint from boto3's standard chain and ``AWS_ENDPOINT_URL``) or
    ``file:///path`` (:class:`~sos_tier.store.LocalStore`). *options* go to the backend
    (``page_size`` for both). ImportError for ``s3://`` without boto3 (the extra ``tier``)."""
    scheme = urlsplit(url).scheme
    if scheme == "s3":
        from sos_tier.s3 import S3Store  # noqa: PLC0415 - boto3 is the optional extra "tier"

        return S3Store(url, **options)
    if scheme == "file":
        return LocalStore(url, **options)
    raise ValueError(f"unsupported tier URL {url!r}: s3://BUCKET/PREFIX or file:///PATH")
