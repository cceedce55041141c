"""Bearer tokens of `sos gateway` (OAuth2 client credentials, RFC 6749 section 4.4).

A client POSTs ``grant_type=client_credentials``, ``client_id=<namespace>`` and
``client_secret=<a key of the namespace>`` to ``/oauth2/token``; the gateway checks the
key by authenticating with it at the SOS server (it cannot see the server's key files)
and answers ``{"access_token", "token_type": "Bearer", "expires_in"}``. Every other
request carries ``Authorization: Bearer <token>``.

Tokens are sealed, not stored: ``sos2.<payload>.<mac>`` where the payload (base64url)
names the namespace, the role (``append`` or ``read``), the expiry (unix seconds), the
key id it was issued for, a random nonce and the key's secret *encrypted* under a key
derived from the gateway's own key (encrypt-then-MAC: an HMAC-SHA256 keystream over the
nonce, then HMAC-SHA256 over the whole payload with a second derived key). A gateway that
restarts (even on an empty cache, on another machine) with the same key accepts the
tokens it issued before: Hadoop's ConfCredentialBasedAccessTokenProvider fetches a new
token only when its timer says the old one expires, never after a 401, so in-memory
tokens would fail every Spark query for up to an hour after a gateway restart. The
sealed secret is what lets any such gateway ask the SOS server again whether the key
still stands (:class:`KeyChecks`): removing a key on the server stops its tokens within
the re-check interval, not at their expiry. Tokens of the old ``sos1`` format (no
sealed secret) are refused.

:class:`KeyChecks` also keeps the token endpoint cheap to defend: a token bucket per
client address, at most one key check in flight per address, a bounded and fair wait
queue for the key-check slots, malformed keys refused without asking the server, a short
negative cache, and a fast lane for keys the server accepted recently.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import logging
import math
import secrets
import ssl
import time
import urllib.parse
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import trio

from sos_client import Client
from sos_wire.auth import Key
from sos_wire.events import KeyRole
from spark_plugin.gateway.http.connection import Conn, Reply, json_body, remote_error

__all__ = [
    "DEFAULT_KEY_RECHECK",
    "DEFAULT_TOKEN_TTL",
    "TOKEN_PATH",
    "KeyChecks",
    "KeyRevoked",
    "OAuth2",
    "Throttled",
    "TokenAuthority",
    "TokenInfo",
    "key_verifier",
]

log = logging.getLogger(__name__)

#: the token endpoint (client credentials)
TOKEN_PATH = "/oauth2/token"

DEFAULT_TOKEN_TTL = 3600
#: seconds after which a token's key is asked again at the SOS server (``--key-recheck``)
DEFAULT_KEY_RECHECK = 10.0
_PREFIX = "sos2"
#: tokens a gateway remembers as verified (TokenAuthority.check): a few per client
VERIFIED_TOKENS = 4096
ROLES = ("append", "read")
_NONCE_LEN = 16


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
    #: the secret of the key the token was issued for (b"" if none was sealed in it)
    key_secret: bytes = field(default=b"", repr=False)

    @property
    def can_write(self) -> bool:
        return self.role == "append"

    @property
    def key_text(self) -> str:
        """The key as ``sos-server keygen`` prints it (to ask the server about it again)."""
        return f"{self.key_id}.{self.key_secret.hex()}"


class TokenAuthority:
    """Issues and checks the gateway's bearer tokens for one namespace.

    ``secret``: the gateway's key secret (bytes) the sealing keys are derived from, or None
    for a random one (tokens then die with the process). ``clock``: seconds since the epoch.
    """

    def __init__(
        self,
        namespace: str,
        secret: bytes | None,
        *,
        ttl: int = DEFAULT_TOKEN_TTL,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if ttl < 1:
            raise ValueError("token ttl must be at least 1 second")
        self.namespace = namespace
        self.ttl = int(ttl)
        self._clock = clock
        base = secret if secret is not None else secrets.token_bytes(32)
        ns = namespace.encode()
        # two keys, never one for both jobs: one encrypts the sealed secret, one MACs
        self._mac_key = hmac.new(base, b"sos-gateway-token-v2-mac\x00" + ns, hashlib.sha256).digest()
        self._enc_key = hmac.new(base, b"sos-gateway-token-v2-enc\x00" + ns, hashlib.sha256).digest()
        #: tokens found good: token -> grant, least recently used first (see check)
        self._verified: OrderedDict[str, TokenInfo] = OrderedDict()

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._mac_key, payload, hashlib.sha256).digest()

    def _keystream_xor(self, nonce: bytes, data: bytes) -> bytes:
        """``data`` XOR HMAC-SHA256(enc_key, nonce || counter) blocks (a stream cipher in
        counter mode from the standard library; the nonce is fresh for every token)."""
        stream = b"".join(
            hmac.new(self._enc_key, nonce + i.to_bytes(4, "big"), hashlib.sha256).digest()
            for i in range((len(data) + 31) // 32)
        )
        return bytes(a ^ b for a, b in zip(data, stream, strict=False))

    def issue(self, role: str, key_id: str = "", key_secret: bytes = b"") -> tuple[str, int]:
        """(token, expires_in seconds) for the key ``key_id`` (secret ``key_secret``) of
        ``role`` ("append" or "read")."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        expires = int(self._clock()) + self.ttl
        nonce = secrets.token_bytes(_NONCE_LEN)
        sealed = self._keystream_xor(nonce, key_secret)
        payload = "\n".join([self.namespace, role, str(expires), key_id, nonce.hex(), _b64(sealed)]).encode()
        return f"{_PREFIX}.{_b64(payload)}.{_b64(self._mac(payload))}", self.ttl

    def check(self, token: str) -> TokenInfo | None:
        """The token's grant, or None if it is malformed, forged, expired, of the old format
        or for another namespace. A token found good is remembered (at most
        VERIFIED_TOKENS, the least recently used forgotten first), so the next requests that
        carry it skip the MAC and the decryption; its expiry is checked every time."""
        grant = self._verified.get(token)
        if grant is not None:
            if self._clock() >= grant.expires:
                del self._verified[token]
                return None
            self._verified.move_to_end(token)
            return grant
        grant = self._check(token)
        if grant is not None:
            self._verified[token] = grant
            while len(self._verified) > VERIFIED_TOKENS:
                self._verified.popitem(last=False)
        return grant

    def _check(self, token: str) -> TokenInfo | None:
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
            namespace, role, expires_text, key_id, nonce_hex, sealed_b64 = payload.decode().split("\n")
            expires = int(expires_text)
            nonce, sealed = bytes.fromhex(nonce_hex), _unb64(sealed_b64)
        except ValueError:
            return None
        if namespace != self.namespace or role not in ROLES or self._clock() >= expires:
            return None
        return TokenInfo(namespace, role, expires, key_id, self._keystream_xor(nonce, sealed))


# ---------------------------------------------------------------------------
# Key checks: the token endpoint's throttles and the bearer tokens' re-checks
# ---------------------------------------------------------------------------

#: key checks of token requests at once. Each is a connection to the SOS server, which
#: takes at most 8 unauthenticated connections from one address: CHECK_SLOTS + FAST_SLOTS
#: leave room for the gateway's own reconnects.
CHECK_SLOTS = 4
#: checks of keys the server accepted recently, and re-checks of tokens' keys: a lane of
#: their own, so that no flood of made-up keys ever queues before them
FAST_SLOTS = 2
#: token requests that may wait for a check slot (beyond: 503 at once)
CHECK_QUEUE = 64
#: ... of which from one client address (beyond: 429 at once)
CHECK_QUEUE_PER_ADDRESS = 2
#: token requests per client address: a burst of TOKEN_BURST, then TOKEN_RATE a second.
#: A request whose key the server accepts gives its token back, so honest clients are
#: never throttled however often they ask; made-up keys pay.
TOKEN_BURST = 10
TOKEN_RATE = 1.0
#: a (key id, secret) the server refused is answered 401 without asking for this long
NEGATIVE_TTL = 15.0
#: a key the server accepted within this long takes the fast lane (it is still asked)
KNOWN_GOOD_TTL = 3600.0
MAX_REMEMBERED = 4096
MAX_ADDRESSES = 10_000

_Ident = tuple[bytes, bytes]  # (key id, SHA-256 of the secret): never the secret itself


def _ident(key_id: bytes, secret: bytes) -> _Ident:
    return key_id, hashlib.sha256(secret).digest()


@functools.lru_cache(maxsize=MAX_REMEMBERED)
def _bearer_ident(key_id: str, secret: bytes) -> _Ident:
    """The _Ident of a token's key (every request of a token asks for it: computed once)."""
    try:
        return _ident(bytes.fromhex(key_id), secret)
    except ValueError:
        return b"", b""


class Throttled(Exception):
    """A token request refused before its key is checked: ``status`` 429 (this address asks
    too often) or 503 (every check slot is busy and the queue is full), ``retry_after``
    seconds."""

    def __init__(self, status: int, retry_after: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = max(1, int(retry_after))
        self.message = message


class KeyRevoked(PermissionError):
    """The SOS server no longer accepts the key a token was issued for (removed, changed,
    or its role differs from the token's)."""


class _Buckets:
    """A token bucket per address: ``burst`` at once, then ``rate`` a second."""

    def __init__(self, burst: int, rate: float, clock: Callable[[], float]) -> None:
        self.burst, self.rate, self._clock = float(burst), rate, clock
        self._seen: dict[str, tuple[float, float]] = {}  # address -> (tokens, when), oldest first

    def _level(self, address: str, now: float) -> float:
        tokens, when = self._seen.pop(address, (self.burst, now))
        return min(self.burst, tokens + (now - when) * self.rate)

    def _store(self, address: str, tokens: float, now: float) -> None:
        self._seen[address] = (tokens, now)
        while len(self._seen) > MAX_ADDRESSES:
            del self._seen[next(iter(self._seen))]

    def take(self, address: str) -> float:
        """Take a token: 0.0 if there was one, else the seconds until there is."""
        now = self._clock()
        tokens = self._level(address, now)
        if tokens >= 1.0:
            self._store(address, tokens - 1.0, now)
            return 0.0
        self._store(address, tokens, now)
        return (1.0 - tokens) / self.rate

    def give_back(self, address: str) -> None:
        now = self._clock()
        self._store(address, min(self.burst, self._level(address, now) + 1.0), now)


@dataclass
class _Good:
    role: str
    checked: float  # clock() of the server's last acceptance


@dataclass(eq=False)
class _Waiter:
    address: str
    arrival: int
    event: trio.Event = field(default_factory=trio.Event)
    granted: bool = False


class KeyChecks:
    """Asks the SOS server about keys for the token endpoint and for bearer tokens.

    ``verify(key_text) -> (role, key_id)`` authenticates with the key at the server in a
    worker thread (PermissionError or ValueError: refused; ConnectionError: unreachable).

    Token requests (:meth:`for_token`): nothing is cached that would issue a token without
    asking the server, so a removed key gets no new token. The asking is kept cheap and
    fair: malformed keys and keys refused in the last ``negative_ttl`` seconds are refused
    locally; each client address has a token bucket (429 when empty; a good key gives its
    token back); at most one check per address runs at a time; the ``slots`` check slots
    serve the waiting addresses least recently served first, so one address, or a few,
    with failing checks (which the server delays, per source address: all of the gateway's
    checks come from one) never make another address wait for more than one slot; the
    queue is bounded (503 when full). Keys the server accepted within KNOWN_GOOD_TTL
    skip all of that and use ``fast_slots`` slots of their own; requests with a key whose
    check is already under way wait for it, then ask again on the right lane (never
    throttled for asking together).

    Bearer tokens (:meth:`for_bearer`): the token's key is asked again once its last
    answer is ``recheck`` seconds old, by the first request that needs it (in a worker
    thread; the other requests of the key carry on meanwhile on the last answer, for at
    most another ``recheck``). Between re-checks a request costs no server round trip.
    """

    def __init__(
        self,
        verify: Callable[[str], tuple[str, str]],
        *,
        recheck: float = DEFAULT_KEY_RECHECK,
        slots: int = CHECK_SLOTS,
        fast_slots: int = FAST_SLOTS,
        queue: int = CHECK_QUEUE,
        per_address_queue: int = CHECK_QUEUE_PER_ADDRESS,
        burst: int = TOKEN_BURST,
        rate: float = TOKEN_RATE,
        negative_ttl: float = NEGATIVE_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if recheck <= 0:
            raise ValueError("the key re-check interval must be positive")
        self._verify = verify
        self.recheck = float(recheck)
        self.slots = slots
        self.queue = queue
        self.per_address_queue = per_address_queue
        self.negative_ttl = negative_ttl
        self._clock = clock
        self._threads = trio.CapacityLimiter(slots)
        self._fast = trio.CapacityLimiter(fast_slots)
        self._buckets = _Buckets(burst, rate, clock)
        self._free = slots
        self._running: set[str] = set()
        self._waiting: dict[str, deque[_Waiter]] = {}
        self._n_waiting = 0
        self._arrivals = count()
        self._served: dict[str, float] = {}  # address -> when it last got a slot, oldest first
        self._good: dict[_Ident, _Good] = {}
        self._refused: dict[_Ident, float] = {}
        self._pending: dict[_Ident, trio.Event] = {}  # bearer re-checks in flight
        self._joining: dict[_Ident, trio.Event] = {}  # token checks on the shared slots

    # -- token requests --------------------------------------------------------------
    async def for_token(self, key_text: str, address: str) -> tuple[str, str]:
        """(role, key_id) of a client secret the server accepts now. Raises Throttled,
        ValueError (malformed), PermissionError (refused) or ConnectionError."""
        try:
            key = Key.parse(key_text)
        except ValueError:
            self._charge(address)
            raise
        ident = _ident(key.key_id, key.secret)
        while True:
            good = self._good.get(ident)
            if good is not None and self._clock() - good.checked < KNOWN_GOOD_TTL:
                return await self._ask(ident, str(key), self._fast)
            # the same key is being checked for another request (Spark's executors on one
            # node ask at once): wait for that answer, then ask again on the right lane
            joining = self._joining.get(ident)
            if joining is None:
                break
            await joining.wait()
        self._charge(address)
        refused = self._refused.get(ident)
        if refused is not None and self._clock() - refused < self.negative_ttl:
            raise PermissionError("the SOS server refused this key moments ago")
        done = self._joining[ident] = trio.Event()
        try:
            await self._acquire(address)
            try:
                result = await self._ask(ident, str(key), self._threads)
            except ConnectionError:
                self._buckets.give_back(address)  # not the client's fault
                raise
            finally:
                self._release(address)
        finally:
            del self._joining[ident]
            done.set()
        self._buckets.give_back(address)
        return result

    def _charge(self, address: str) -> None:
        wait = self._buckets.take(address)
        if wait > 0:
            raise Throttled(
                429, math.ceil(wait), f"too many token requests from {address}: retry in {math.ceil(wait)} s"
            )

    async def _acquire(self, address: str) -> None:
        """A check slot for ``address`` (at most one per address at a time)."""
        if self._free > 0 and address not in self._running:
            self._grant(address)
            return
        mine = self._waiting.get(address)
        if mine is not None and len(mine) >= self.per_address_queue:
            raise Throttled(429, 1, f"too many token requests from {address} are waiting for a key check")
        if self._n_waiting >= self.queue:
            raise Throttled(
                503,
                math.ceil(self._n_waiting / max(self.slots, 1)),
                "every key check slot is busy and the wait queue is full",
            )
        waiter = _Waiter(address, next(self._arrivals))
        self._waiting.setdefault(address, deque()).append(waiter)
        self._n_waiting += 1
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.granted:
                self._release(address)
            else:
                self._unqueue(waiter)
            raise

    def _grant(self, address: str) -> None:
        self._free -= 1
        self._running.add(address)
        self._served.pop(address, None)
        self._served[address] = self._clock()
        while len(self._served) > MAX_ADDRESSES:
            del self._served[next(iter(self._served))]

    def _unqueue(self, waiter: _Waiter) -> None:
        queue = self._waiting[waiter.address]
        queue.remove(waiter)
        self._n_waiting -= 1
        if not queue:
            del self._waiting[waiter.address]

    def _release(self, address: str) -> None:
        self._free += 1
        self._running.discard(address)
        while self._free > 0:
            ready = [a for a in self._waiting if a not in self._running]
            if not ready:
                return
            # least recently served first (never served: first of all), then arrival order
            best = min(ready, key=lambda a: (self._served.get(a, -math.inf), self._waiting[a][0].arrival))
            waiter = self._waiting[best][0]
            self._unqueue(waiter)
            self._grant(best)
            waiter.granted = True
            waiter.event.set()

    async def _ask(self, ident: _Ident, key_text: str, limiter: trio.CapacityLimiter) -> tuple[str, str]:
        try:
            role, key_id = await trio.to_thread.run_sync(self._verify, key_text, limiter=limiter)
        except (PermissionError, ValueError):
            self._remember_refused(ident)
            raise
        except ConnectionError:
            raise
        except Exception as exc:  # e.g. the server answered BUSY: not a verdict on the key
            raise ConnectionError(f"the key check failed: {exc}") from exc
        self._remember_good(ident, role)
        return role, key_id

    def _remember_good(self, ident: _Ident, role: str) -> None:
        self._refused.pop(ident, None)
        self._good.pop(ident, None)
        self._good[ident] = _Good(role, self._clock())
        while len(self._good) > MAX_REMEMBERED:
            del self._good[next(iter(self._good))]

    def _remember_refused(self, ident: _Ident) -> None:
        self._good.pop(ident, None)
        self._refused.pop(ident, None)
        self._refused[ident] = self._clock()
        while len(self._refused) > MAX_REMEMBERED:
            del self._refused[next(iter(self._refused))]

    # -- bearer tokens ---------------------------------------------------------------
    async def for_bearer(self, info: TokenInfo) -> None:
        """Returns if the server accepted the token's key, with the token's role, within the
        last ``recheck`` seconds (asking it again if not). KeyRevoked if it refuses it now;
        ConnectionError if it could not be asked for two intervals."""
        ident = _bearer_ident(info.key_id, info.key_secret)
        if len(ident[0]) != 8 or len(info.key_secret) != 32:
            raise KeyRevoked("the token names no key the gateway can check again")
        verdict = self._verdict(ident, info.role, self.recheck)
        if verdict is None:
            pending = self._pending.get(ident)
            if pending is None:
                await self._recheck(ident, info.key_text)
            elif self._verdict(ident, info.role, 2 * self.recheck) is None:
                await pending.wait()
            verdict = self._verdict(ident, info.role, 2 * self.recheck)
        if verdict is None:
            raise ConnectionError("the SOS server could not be asked whether the token's key still stands")
        if not verdict:
            raise KeyRevoked("the SOS server no longer accepts the key of this token (removed, or its role changed)")

    def stands_now(self, info: TokenInfo) -> bool:
        """True when :meth:`for_bearer` would return at once: the server accepted the
        token's key, with the token's role, within the last ``recheck`` seconds."""
        ident = _bearer_ident(info.key_id, info.key_secret)
        return (
            len(ident[0]) == 8 and len(info.key_secret) == 32 and self._verdict(ident, info.role, self.recheck) is True
        )

    def _verdict(self, ident: _Ident, role: str, window: float) -> bool | None:
        """True/False: the server's answer of the last ``window`` seconds; None: none."""
        now = self._clock()
        good = self._good.get(ident)
        if good is not None and now - good.checked < window:
            return good.role == role
        refused = self._refused.get(ident)
        if refused is not None and now - refused < window:
            return False
        return None

    async def _recheck(self, ident: _Ident, key_text: str) -> None:
        done = self._pending[ident] = trio.Event()
        try:
            await self._ask(ident, key_text, self._fast)
        except (PermissionError, ValueError, ConnectionError):
            pass  # remembered by _ask (refused) or not a verdict (unreachable)
        finally:
            del self._pending[ident]
            done.set()


# ---------------------------------------------------------------------------
# The endpoint: token requests and bearer checks, over the connection layer
# ---------------------------------------------------------------------------


def bearer_token(auth: str) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` field's value; None for another
    scheme or an empty token."""
    scheme, _, token = auth.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class OAuth2:
    """The gateway's OAuth2 side: :meth:`token` serves TOKEN_PATH, :meth:`bearer` checks
    every other request's token (``insecure``: every request is granted the append role)."""

    def __init__(
        self, namespace: str, authority: TokenAuthority, key_checks: KeyChecks, *, insecure: bool = False
    ) -> None:
        self.namespace = namespace
        self.authority = authority
        self.key_checks = key_checks
        self.insecure = insecure

    async def token(self, conn: Conn, method: str, headers: dict[str, str]) -> int:
        """``POST TOKEN_PATH``: a bearer token for a key the SOS server accepts now (asked
        every time: a removed key gets no new token), throttled per client address."""
        if method != "POST":
            raise Reply(
                405, {"error": "invalid_request", "error_description": f"{TOKEN_PATH} takes POST"}, [("allow", "POST")]
            )
        body = await conn.read_small_body()
        form = dict(urllib.parse.parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        auth = headers.get("authorization", "")
        if auth.lower().startswith("basic "):  # RFC 6749 2.3.1: credentials in the header
            try:
                user, _, secret = base64.b64decode(auth[6:].strip()).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                raise Reply(
                    400, {"error": "invalid_request", "error_description": "malformed Basic credentials"}
                ) from None
            form.setdefault("client_id", urllib.parse.unquote_plus(user))
            form.setdefault("client_secret", urllib.parse.unquote_plus(secret))
        no_store = [("cache-control", "no-store"), ("pragma", "no-cache")]
        if form.get("grant_type") != "client_credentials":
            raise Reply(
                400,
                {"error": "unsupported_grant_type", "error_description": "only grant_type=client_credentials"},
                no_store,
            )
        if form.get("client_id") != self.namespace:
            raise Reply(
                401,
                {"error": "invalid_client", "error_description": "client_id must be the gateway's namespace"},
                no_store,
            )
        secret = form.get("client_secret", "")
        if not secret:
            raise Reply(
                400,
                {"error": "invalid_request", "error_description": "client_secret (a key of the namespace) is missing"},
                no_store,
            )
        try:
            role, key_id = await self.key_checks.for_token(secret, conn.peer or "?")
        except Throttled as exc:
            log.info("token request throttled: %s", exc.message)
            raise Reply(
                exc.status,
                {"error": "temporarily_unavailable", "error_description": exc.message},
                [*no_store, ("retry-after", str(exc.retry_after))],
            ) from None
        except (PermissionError, ValueError) as exc:
            log.info("token refused: %s", exc)
            raise Reply(
                401,
                {"error": "invalid_client", "error_description": "the SOS server refused this key for the namespace"},
                no_store,
            ) from None
        except ConnectionError as exc:
            log.warning("cannot check a client key: %s", exc)
            raise Reply(
                503,
                {"error": "temporarily_unavailable", "error_description": "the SOS server cannot be reached"},
                [*no_store, ("retry-after", "5")],
            ) from None
        token, expires_in = self.authority.issue(role, key_id, Key.parse(secret).secret)
        log.info("issued a %s token for key %s (%d s)", role, key_id or "?", expires_in)
        await conn.respond(
            200, json_body({"access_token": token, "token_type": "Bearer", "expires_in": expires_in}), no_store
        )
        return 200

    def bearer_now(self, auth: str) -> TokenInfo | None:
        """The grant :meth:`bearer` gives a request whose ``Authorization`` field is ``auth``
        when it gives it at once (a valid token whose key the server accepted within the
        last key_recheck seconds); None when :meth:`bearer` must tell (a refusal, or a key
        to ask the server about again)."""
        if self.insecure:
            return TokenInfo(self.namespace, "append", 0, "")
        token = bearer_token(auth)
        if token is None:
            return None
        grant = self.authority.check(token)
        if grant is None or not self.key_checks.stands_now(grant):
            return None
        return grant

    async def bearer(self, headers: dict[str, str]) -> TokenInfo:
        """The grant of a request's ``Authorization: Bearer`` token; 401 without a valid one."""
        if self.insecure:
            return TokenInfo(self.namespace, "append", 0, "")
        token = bearer_token(headers.get("authorization", ""))
        if token is not None:
            grant = self.authority.check(token)
            if grant is not None:
                await self._key_stands(grant)
                return grant
            raise Reply(
                401,
                remote_error(
                    "AccessControlException", f"the bearer token is invalid or expired: get a new one at {TOKEN_PATH}"
                ),
                [("www-authenticate", 'Bearer realm="sos", error="invalid_token"')],
                reason="Unauthorized: invalid or expired bearer token",
            )
        raise Reply(
            401,
            remote_error(
                "AccessControlException",
                f"authentication required: send Authorization: Bearer <token> "
                f"(POST client credentials to {TOKEN_PATH} for one)",
            ),
            [("www-authenticate", 'Bearer realm="sos"')],
            reason="Unauthorized: no bearer token",
        )

    async def _key_stands(self, grant: TokenInfo) -> None:
        """401 once the SOS server refuses the token's key (revoked: asked again every
        key_recheck seconds, no server round trip in between); 503 if it cannot be asked."""
        try:
            await self.key_checks.for_bearer(grant)
        except KeyRevoked as exc:
            log.info("token of key %s refused: %s", grant.key_id or "?", exc)
            raise Reply(
                401,
                remote_error("AccessControlException", f"the bearer token's key was revoked: {exc}"),
                [("www-authenticate", 'Bearer realm="sos", error="invalid_token"')],
                reason="Unauthorized: the token's key was revoked",
            ) from None
        except ConnectionError as exc:
            raise Reply(
                503, remote_error("IOException", f"cannot check the token's key: {exc}"), [("retry-after", "5")]
            ) from None


def key_verifier(
    server: str, namespace: str, *, timeout: float = 30.0, tls: ssl.SSLContext | None = None
) -> Callable[[str], tuple[str, str]]:
    """``verify(key_text) -> (role, key_id)``: authenticates with the key at the SOS server."""

    def verify(key_text: str) -> tuple[str, str]:
        key = Key.parse(key_text)  # BadKey (a ValueError) for a malformed secret
        client = Client(server, key, namespace, timeout=timeout, tls=tls)
        try:
            # APPEND and TOKEN (the gateway clients' key role, protocol.md 1.6) get an append token
            role = "read" if client.role == KeyRole.READ else "append"
        finally:
            client.close()
        return role, key.key_id_hex

    return verify
