"""``s3://bucket/prefix``: the tier on S3 or any S3-compatible store (MinIO, Ceph RGW, moto).

Why boto3 and not obstore (both checked, issue 19): boto3 is AWS's own, well-kept client;
``put_object(IfNoneMatch="*")`` is the conditional create the layout relies on (412
PreconditionFailed when the key exists); moto's server, which the tests and the demo run on
127.0.0.1, speaks exactly its API; and it reads credentials (environment, shared config and
credentials files, SSO, instance and workload identity), region, addressing style and the
endpoint (``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``) from the same standard chain and files
as the AWS CLI, so one URL and one environment work for every tool an operator uses. obstore
would add GCS and Azure for free, but its credentials and endpoint come from its own options
(an S3-compatible endpoint is not read from ``AWS_ENDPOINT_URL`` by every version), and a
native wheel is one more thing to trust on the server; the :class:`~sos_tier.store.Store`
interface keeps the door open for a ``gs://``/``az://`` backend on it later.

Credentials and the endpoint never come from arguments (they would show on a command line):
only from boto3's chain. TLS is whatever the endpoint says (``https://`` by default, with
boto3's certificate checks; ``AWS_CA_BUNDLE`` for a private CA).
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions

from sos_tier.errors import classify, translate
from sos_tier.retry import busy_retrying
from sos_tier.store import PutOutcome, StoredKey, TierBadRange, TierExists, TierNotFound, byte_range, check_key

__all__ = ["MAX_ROOT_PREFIX", "S3Store", "translate"]

MAX_ROOT_PREFIX = 256

_BOTO_ERRORS = (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError)


class S3Store:
    """See the module docstring. *page_size* is the ``MaxKeys`` of each listing page (S3
    returns at most 1000); *pool* the number of HTTP connections kept (parallel GETs; the
    server's requests at once: up to 32 fence checks after a takeover, beside a flush, its
    uploads and compaction's; a request beyond the pool opens a connection and discards it).

    Every boto3 call goes through :meth:`_call`, which turns botocore's errors into the store's
    typed errors (:func:`sos_tier.errors.translate`, the one table)."""

    def __init__(self, url: str, *, page_size: int = 1000, pool: int = 64) -> None:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"bad S3 tier URL {url!r}: s3://BUCKET/PREFIX")
        self.url = url
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        if len(self.prefix.encode()) > MAX_ROOT_PREFIX:
            # the layout's keys fit S3's 1024-byte limit under a prefix of at most this (protocol.md 4.2)
            raise ValueError(f"the tier prefix in {url!r} is over {MAX_ROOT_PREFIX} bytes")
        if not 1 <= page_size <= 1000:
            raise ValueError("page_size must be 1..1000")
        self.page_size = page_size
        #: the wait between the tries of a conditional PUT S3 answers 409 (sos_tier.retry)
        self.sleep: Callable[[float], None] = time.sleep
        config = botocore.config.Config(
            max_pool_connections=pool,
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=10,
            read_timeout=60,
        )
        try:
            self._s3: Any = boto3.session.Session().client("s3", config=config)
        except botocore.exceptions.BotoCoreError as exc:
            raise translate(exc, context=f"cannot set up the S3 client for {url}") from exc

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, where: str, key: str | None, call: Callable[..., Any], **args: Any) -> Any:
        """``call(Bucket=self.bucket, **args)``, its botocore errors translated: *what* (``GET
        of``) and *where* (the full key or prefix) begin the message; *key* (the store's key,
        None for a listing or a batch) is what :class:`TierNotFound` names."""
        try:
            return call(Bucket=self.bucket, **args)
        except _BOTO_ERRORS as exc:
            raise translate(exc, context=f"S3 {what} s3://{self.bucket}/{where}", key=key) from exc

    def put_once(self, key: str, data: bytes) -> PutOutcome:
        full, body, put = self._full(key), bytes(data), self._s3.put_object
        try:
            for attempt in busy_retrying(self.sleep):  # 409: another conditional write in flight
                with attempt:
                    self._call("conditional PUT of", full, key, put, Key=full, Body=body, IfNoneMatch="*")
            return PutOutcome.CREATED
        except TierExists:  # 412 PreconditionFailed: the key exists, the write-once conflict
            pass
        return PutOutcome.ALREADY_SAME if self.get(key) == body else PutOutcome.CONFLICT

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        s, e = byte_range(start, end)
        if e is not None and e == s:
            self.size(key)  # a missing key is still TierNotFound
            return b""
        full = self._full(key)
        args: dict[str, Any] = {"Key": full}
        if s or e is not None:
            args["Range"] = f"bytes={s}-{'' if e is None else e - 1}"
        try:
            return bytes(self._call("GET of", full, key, self._fetch, **args))
        except TierBadRange:  # start at or past the end (or an empty key): nothing there
            return b""

    def _fetch(self, **args: Any) -> bytes:
        return bytes(self._s3.get_object(**args)["Body"].read())  # reading the body can fail too

    def size(self, key: str) -> int:
        full = self._full(key)
        return int(self._call("HEAD of", full, key, self._s3.head_object, Key=full)["ContentLength"])

    def list(self, prefix: str = "") -> Iterator[StoredKey]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        cut = len(self.prefix) + 1 if self.prefix else 0
        args: dict[str, Any] = {"Prefix": full, "MaxKeys": self.page_size}
        while True:
            page = self._call("LIST of", full, None, self._s3.list_objects_v2, **args)
            for item in page.get("Contents", ()):
                yield StoredKey(item["Key"][cut:], int(item["Size"]))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            args["ContinuationToken"] = token

    def delete(self, keys: Iterable[str]) -> None:
        batch: list[str] = []
        for key in keys:
            batch.append(self._full(key))
            if len(batch) == 1000:  # DeleteObjects takes at most 1000 keys
                self._delete(batch)
                batch = []
        if batch:
            self._delete(batch)

    def _delete(self, full_keys: builtins.list[str]) -> None:
        delete = {"Objects": [{"Key": k} for k in full_keys], "Quiet": True}
        resp = self._call("DELETE in", self.prefix, None, self._s3.delete_objects, Delete=delete)
        # per key, by code through the same table: a key not found is not an error
        errors = [e for e in resp.get("Errors", ()) if classify(e.get("Code")) is not TierNotFound]
        if errors:
            first = errors[0]
            raise classify(first.get("Code"))(
                f"S3 DELETE in s3://{self.bucket}: {len(errors)} keys not deleted, "
                f"first {first.get('Key')}: {first.get('Code')} {first.get('Message')}"
            )

    def close(self) -> None:
        self._s3.close()
