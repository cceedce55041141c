"""Bearer tokens of `sos gateway` (OAuth2 client credentials, RFC 6749 section 4.4).

A client POSTs ``grant_type=client_credentials``, ``client_id=<namespace>`` and
``client_secret=<a key of the namespace>`` to ``/oauth2/token``; the gateway checks the
key by authenticating with it at the SOS server (it cannot see the server's key files)
and answers ``{"access_token", "token_type": "Bearer", "expires_in"}``. Every other
request carries ``Authorization: Bearer <token>``.

Tokens are signed, not stored: ``sos1.<payload>.<mac>`` where the payload (base64url)
names the namespace, the role (``append`` or ``read``), the expiry (unix seconds), the
key id it was issued for and a random nonce, and the MAC is HMAC-SHA256 under a secret
derived from the gateway's own key. A gateway that restarts (even on an empty cache, on
another machine) with the same key accepts the tokens it issued before: Hadoop's
ConfCredentialBasedAccessTokenProvider fetches a new token only when its timer says the
old one expires, never after a 401, so in-memory tokens would fail every Spark query for
up to an hour after a gateway restart. Tokens live ``ttl`` seconds (default 1 h); a
key removed from the server stops getting tokens at once, and its tokens expire.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DEFAULT_TOKEN_TTL", "TokenAuthority", "TokenInfo"]

DEFAULT_TOKEN_TTL = 3600
_PREFIX = "sos1"
ROLES = ("append", "read")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class TokenInfo:
    namespace: str
    role: str
    expires: int
    key_id: str

    @property
    def can_write(self) -> bool:
        return self.role == "append"


class TokenAuthority:
    """Issues and checks the gateway's bearer tokens for one namespace.

    ``secret``: the gateway's key secret (bytes) the MAC key is derived from, or None for
    a random one (tokens then die with the process). ``clock``: seconds since the epoch.
    """

    def __init__(self, namespace: str, secret: bytes | None, *, ttl: int = DEFAULT_TOKEN_TTL,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl < 1:
            raise ValueError("token ttl must be at least 1 second")
        self.namespace = namespace
        self.ttl = int(ttl)
        self._clock = clock
        base = secret if secret is not None else secrets.token_bytes(32)
        self._mac_key = hmac.new(base, b"sos-gateway-token-v1\x00" + namespace.encode(),
                                 hashlib.sha256).digest()

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._mac_key, payload, hashlib.sha256).digest()

    def issue(self, role: str, key_id: str = "") -> tuple[str, int]:
        """(token, expires_in seconds) for a key of ``role`` ("append" or "read")."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        expires = int(self._clock()) + self.ttl
        payload = "\n".join([self.namespace, role, str(expires), key_id,
                             secrets.token_hex(8)]).encode()
        return f"{_PREFIX}.{_b64(payload)}.{_b64(self._mac(payload))}", self.ttl

    def check(self, token: str) -> TokenInfo | None:
        """The token's grant, or None if it is malformed, forged, expired or for another
        namespace."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != _PREFIX:
            return None
        try:
            payload, mac = _unb64(parts[1]), _unb64(parts[2])
        except (ValueError, TypeError):
            return None
        if not hmac.compare_digest(mac, self._mac(payload)):
            return None
        try:
            namespace, role, expires_text, key_id, _nonce = payload.decode().split("\n")
            expires = int(expires_text)
        except ValueError:
            return None
        if namespace != self.namespace or role not in ROLES or self._clock() >= expires:
            return None
        return TokenInfo(namespace, role, expires, key_id)
