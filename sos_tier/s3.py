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
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import boto3
import botocore.config
import botocore.exceptions

from sos_tier.store import PutOutcome, StoredKey, TierError, TierNotFound, _range, check_key

__all__ = ["MAX_ROOT_PREFIX", "S3Store"]

MAX_ROOT_PREFIX = 256

_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_EXISTS = {"PreconditionFailed", "412"}
# 409 ConditionalRequestConflict: another conditional write of the key is in flight; S3 asks to retry
_RACE = {"ConditionalRequestConflict", "409"}
_BAD_RANGE = {"InvalidRange", "416"}


def _code(exc: botocore.exceptions.ClientError) -> set[str]:
    err = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return {str(err.get("Code", "")), str(status)}


class S3Store:
    """See the module docstring. *page_size* is the ``MaxKeys`` of each listing page (S3
    returns at most 1000); *pool* the number of HTTP connections kept (parallel GETs)."""

    def __init__(self, url: str, *, page_size: int = 1000, pool: int = 16) -> None:
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
        config = botocore.config.Config(
            max_pool_connections=pool,
            retries={"mode": "standard", "max_attempts": 3},
            connect_timeout=10,
            read_timeout=60,
        )
        try:
            self._s3: Any = boto3.session.Session().client("s3", config=config)
        except botocore.exceptions.BotoCoreError as exc:
            raise TierError(f"cannot set up the S3 client for {url}: {exc}") from exc

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, what: str, key: str, exc: Exception) -> TierError:
        return TierError(f"S3 {what} of s3://{self.bucket}/{self._full(key) if key else self.prefix}: {exc}")

    def put_once(self, key: str, data: bytes) -> PutOutcome:
        full = self._full(key)
        for attempt in range(5):
            try:
                self._s3.put_object(Bucket=self.bucket, Key=full, Body=bytes(data), IfNoneMatch="*")
                return PutOutcome.CREATED
            except botocore.exceptions.ClientError as exc:
                codes = _code(exc)
                if codes & _EXISTS:
                    break
                if codes & _RACE and attempt < 4:
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise self._fail("conditional PUT", key, exc) from exc
            except botocore.exceptions.BotoCoreError as exc:
                raise self._fail("conditional PUT", key, exc) from exc
        return PutOutcome.ALREADY_SAME if self.get(key) == bytes(data) else PutOutcome.CONFLICT

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        s, e = _range(start, end)
        if e is not None and e == s:
            self.size(key)  # a missing key is still TierNotFound
            return b""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key)}
        if s or e is not None:
            args["Range"] = f"bytes={s}-{'' if e is None else e - 1}"
        try:
            resp = self._s3.get_object(**args)
            return bytes(resp["Body"].read())
        except botocore.exceptions.ClientError as exc:
            codes = _code(exc)
            if codes & _NOT_FOUND:
                raise TierNotFound(key) from exc
            if codes & _BAD_RANGE:  # start at or past the end (or an empty key): nothing there
                return b""
            raise self._fail("GET", key, exc) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise self._fail("GET", key, exc) from exc

    def size(self, key: str) -> int:
        try:
            return int(self._s3.head_object(Bucket=self.bucket, Key=self._full(key))["ContentLength"])
        except botocore.exceptions.ClientError as exc:
            if _code(exc) & _NOT_FOUND:
                raise TierNotFound(key) from exc
            raise self._fail("HEAD", key, exc) from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise self._fail("HEAD", key, exc) from exc

    def list(self, prefix: str = "") -> Iterator[StoredKey]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        cut = len(self.prefix) + 1 if self.prefix else 0
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full, "MaxKeys": self.page_size}
        while True:
            try:
                page = self._s3.list_objects_v2(**args)
            except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
                raise TierError(f"S3 LIST of s3://{self.bucket}/{full}: {exc}") from exc
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
        try:
            resp = self._s3.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in full_keys], "Quiet": True}
            )
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise TierError(f"S3 DELETE in s3://{self.bucket}/{self.prefix}: {exc}") from exc
        errors = [e for e in resp.get("Errors", ()) if e.get("Code") not in ("NoSuchKey",)]
        if errors:
            raise TierError(
                f"S3 DELETE in s3://{self.bucket}: {len(errors)} keys not deleted, "
                f"first {errors[0].get('Key')}: {errors[0].get('Code')} {errors[0].get('Message')}"
            )

    def close(self) -> None:
        self._s3.close()
