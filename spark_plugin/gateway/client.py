"""A small client of `sos gateway` (standard library only): tokens, status, markers.

What the Spark driver's batch listener needs (and tests use): it fetches a bearer token
from ``/oauth2/token`` with the namespace's key, renews it before it expires (or after a
401), asks whether a path exists and appends MARKER records through
``POST /sos/v1/marker``. Files go through Hadoop's WebHdfsFileSystem, not through this.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

__all__ = ["GatewayClient", "GatewayError"]


class GatewayError(OSError):
    """A refusal of the gateway: ``status`` and ``exception`` (HDFS's Java exception name)."""

    def __init__(self, status: int, exception: str, message: str) -> None:
        super().__init__(f"gateway: HTTP {status} {exception}: {message}")
        self.status = status
        self.exception = exception


class GatewayClient:
    """``url``: ``http(s)://HOST:PORT`` of the gateway, or several (a sequence, or separated
    by commas) of a gateway pair: a request that finds its gateway unreachable or a standby
    (StandbyException) goes to the next one, as Hadoop's HA client does; ``key``: a key of
    ``namespace`` (as ``sos-server keygen`` prints it); ``context``: SSL context for https."""

    def __init__(
        self,
        url: str | Sequence[str],
        namespace: str,
        key: str,
        *,
        timeout: float = 60.0,
        context: ssl.SSLContext | None = None,
        failover_patience: float = 60.0,
    ) -> None:
        urls = url.split(",") if isinstance(url, str) else list(url)
        self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not self.urls:
            raise ValueError("no gateway url")
        self.url = self.urls[0]
        self.failover_patience = failover_patience
        self.namespace = namespace
        self._key = key
        self.timeout = timeout
        self.context = context
        self._token: str | None = None
        self._expires = 0.0
        self._lock = threading.Lock()

    def token(self, *, renew: bool = False) -> str:
        """A valid bearer token (fetched again 30 s before the old one expires)."""
        with self._lock:
            if renew or self._token is None or time.monotonic() > self._expires - 30:
                form = urllib.parse.urlencode(
                    {"grant_type": "client_credentials", "client_id": self.namespace, "client_secret": self._key}
                ).encode()
                doc = self._send("POST", self.url + "/oauth2/token", form, {})
                self._token = str(doc["access_token"])
                self._expires = time.monotonic() + float(doc["expires_in"])
            return self._token

    def _send(self, method: str, url: str, body: bytes | None, headers: dict[str, str]) -> dict[str, Any]:
        req = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self.context) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                doc = json.loads(raw)
            except ValueError:
                doc = {}
            remote = doc.get("RemoteException") if isinstance(doc, dict) else None
            if remote:
                raise GatewayError(
                    exc.code, self._scrub(str(remote.get("exception", ""))), self._scrub(str(remote.get("message", "")))
                ) from None
            raise GatewayError(
                exc.code,
                self._scrub(str(doc.get("error", "")) if isinstance(doc, dict) else ""),
                self._scrub(
                    str(doc.get("error_description", raw[:200]))
                    if isinstance(doc, dict)
                    else raw[:200].decode("utf-8", "replace")
                ),
            ) from None
        return json.loads(text) if text else {}

    def _scrub(self, text: str) -> str:
        """``text`` (an answer's error, which ends up in messages and logs) without the key's
        secret: whatever answers at the URL (a proxy, a wrong service) may echo the token
        request's body, which holds it."""
        secret = self._key.strip().rpartition(".")[2]
        if len(secret) < 16:
            return text
        return re.sub(re.escape(secret), "<secret>", text, flags=re.IGNORECASE)

    def call(self, method: str, path: str, body: bytes | None = None, **params: str) -> dict[str, Any]:
        """One authenticated request (a 401 fetches a new token once and retries). With
        several gateways, one that is unreachable or a standby sends it to the next (for at
        most ``failover_patience`` seconds, sleeping 0.5 s once every address was tried)."""
        if len(self.urls) == 1:
            return self._call_one(method, path, body, params)
        deadline = time.monotonic() + self.failover_patience
        tried = 0
        while True:
            try:
                return self._call_one(method, path, body, params)
            except (GatewayError, urllib.error.URLError, ConnectionError) as exc:
                standby = isinstance(exc, GatewayError) and exc.exception == "StandbyException"
                unreachable = not isinstance(exc, GatewayError)
                if not (standby or unreachable) or time.monotonic() > deadline:
                    raise
            tried += 1
            with self._lock:
                self.url = self.urls[(self.urls.index(self.url) + 1) % len(self.urls)]
            if tried % len(self.urls) == 0:
                time.sleep(0.5)

    def _call_one(self, method: str, path: str, body: bytes | None, params: dict[str, str]) -> dict[str, Any]:
        query = urllib.parse.urlencode(params)
        url = f"{self.url}{urllib.parse.quote(path)}" + (f"?{query}" if query else "")
        for attempt in (0, 1):
            headers = {"Authorization": f"Bearer {self.token(renew=attempt == 1)}"}
            try:
                return self._send(method, url, body, headers)
            except GatewayError as exc:
                if exc.status != 401 or attempt == 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def exists(self, path: str) -> bool:
        """Does ``path`` (inside the namespace, e.g. "chk/commits/3") exist?"""
        try:
            self.call("GET", "/webhdfs/v1/" + path.lstrip("/"), op="GETFILESTATUS")
        except GatewayError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def marker(self, label: str, payload: bytes) -> int:
        """Append a MARKER record; returns its sequence number once it is durable (sync)."""
        return int(self.call("POST", "/sos/v1/marker", payload, label=label)["seq"])
