"""The journal key: records authenticated so that neither the SOS server nor its bucket can
forge, reorder, replay or move them (protocol.md 2.5).

A journal key is 32 random bytes that the writers and the restorers of a namespace hold and
the server and the bucket do not (it is not an SOS server key: the server stores those). It is
given as 64 hex digits or base64 (``SOS_JOURNAL_KEY``, or a file: ``SOS_JOURNAL_KEY_FILE`` /
``--journal-key-file``; never on a command line). Several keys, separated by white space or
commas, make a key ring: the first is the one a writer signs with, every one is accepted by a
reader (key rotation, docs/DEPLOY.md).

Every record a writer with a key appends carries the key's fingerprint and a 16-byte tag:

    tag = HMAC-SHA256(mac_key, DOMAIN | u16 len(ns) | ns | record[8 : -16] | u64 G | prev_tag)[:16]

``record[8:-16]`` is the record from its type byte (with the flag 0x80) through the key
fingerprint, ``G`` the generation of the segment that holds it and ``prev_tag`` the tag of the
record before it in the generation (16 zero bytes for a generation's first record). The
decoder hashes the part that depends on the record alone (:class:`SegmentKeys`, in the
read-ahead threads); :class:`ChainCheck` adds the generation and the previous tag in order.

A writer also encrypts each record's body (flag 0x40): ChaCha20-Poly1305 under a key derived
from the journal key, the namespace, the generation and the writer's epoch (the segment's name
holds both), nonce the record's sequence number, the record's 17-byte head as associated data.
One writer (one epoch) writes each sequence number of a generation once, so a nonce never
repeats under a key; the HMAC tag then covers the sealed body (encrypt-then-MAC).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import logging
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sos_journal.errors import JournalAuthError, JournalKeyRequired
from sos_journal.format import layout

__all__ = [
    "JOURNAL_KEY_ENV",
    "JOURNAL_KEY_FILE_ENV",
    "KEY_ID_SIZE",
    "TAG_SIZE",
    "ZERO_TAG",
    "ChainCheck",
    "JournalKey",
    "JournalKeys",
    "ReadAuth",
    "SegmentKeys",
    "Signer",
    "TailCheck",
    "load_journal_keys",
    "resolve_journal_keys",
    "segment_keys",
]

log = logging.getLogger(__name__)

JOURNAL_KEY_ENV = "SOS_JOURNAL_KEY"
JOURNAL_KEY_FILE_ENV = "SOS_JOURNAL_KEY_FILE"
KEY_SIZE = 32
KEY_ID_SIZE = 8
TAG_SIZE = 16
ZERO_TAG = bytes(TAG_SIZE)
DOMAIN = b"SOS journal record v1\x00"
_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")
_HOW = (
    "a journal key is 32 random bytes written as 64 hex digits or base64 "
    '(make one: python3 -c "import secrets; print(secrets.token_hex(32))")'
)


def _subkey(master: bytes, label: bytes) -> bytes:
    return hmac.new(master, b"SOS journal key v1\x00" + label, hashlib.sha256).digest()


def _parse_one(text: str) -> bytes:
    """The 32 bytes of one key's text (ValueError without the text in the message)."""
    if len(text) == 2 * KEY_SIZE:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    try:
        padded = text + "=" * (-len(text) % 4)
        raw = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != KEY_SIZE:
        raise ValueError(f"malformed journal key ({len(text)} characters): {_HOW}")
    return raw


@dataclass(frozen=True)
class JournalKey:
    """One journal key: its MAC key and its fingerprint (the key itself is not kept)."""

    key_id: bytes
    mac_key: bytes
    enc_key: bytes = field(default=b"", repr=False)

    @classmethod
    def from_bytes(cls, master: bytes) -> JournalKey:
        if len(master) != KEY_SIZE:
            raise ValueError(f"a journal key is {KEY_SIZE} bytes, not {len(master)}")
        return cls(_subkey(master, b"key id")[:KEY_ID_SIZE], _subkey(master, b"mac"), _subkey(master, b"enc"))

    def cipher(self, namespace: str, generation: int, epoch: int) -> Any:
        """The AEAD of the records one writer (``epoch``) writes in ``generation`` of
        ``namespace``: each such record has its own sequence number, hence its own nonce."""
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305  # noqa: PLC0415

        ns = namespace.encode("utf-8", "surrogateescape")
        material = _U16.pack(len(ns)) + ns + _U64.pack(generation) + _U64.pack(epoch)
        return ChaCha20Poly1305(hmac.new(self.enc_key, material, hashlib.sha256).digest())

    @property
    def fingerprint(self) -> str:
        return self.key_id.hex()

    def __repr__(self) -> str:
        return f"JournalKey(fingerprint={self.fingerprint})"


class JournalKeys:
    """A key ring: the first key signs, every key verifies (see the module docstring)."""

    def __init__(self, keys: list[JournalKey]) -> None:
        if not keys:
            raise ValueError(f"no journal key given: {_HOW}")
        self.keys = keys
        self._by_id = {k.key_id: k for k in reversed(keys)}

    @classmethod
    def parse(cls, text: str) -> JournalKeys:
        return cls([JournalKey.from_bytes(_parse_one(t)) for t in text.replace(",", " ").split()])

    @property
    def signer(self) -> JournalKey:
        return self.keys[0]

    @property
    def fingerprints(self) -> str:
        return ", ".join(k.fingerprint for k in self.keys)

    def get(self, key_id: bytes) -> JournalKey | None:
        return self._by_id.get(bytes(key_id))

    def mac_start(self, namespace: str, key_id: bytes) -> Any:
        """An HMAC over the namespace's prefix under the key ``key_id`` (None: not in the ring)."""
        key = self.get(key_id)
        if key is None:
            return None
        ns = namespace.encode("utf-8", "surrogateescape")
        return hmac.new(key.mac_key, DOMAIN + _U16.pack(len(ns)) + ns, hashlib.sha256)

    def __repr__(self) -> str:
        return f"JournalKeys({self.fingerprints})"


def load_journal_keys(path: str) -> JournalKeys:
    """The key ring in file ``path`` (ValueError naming the file, never the key)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 16)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the journal key file {path}: {exc}") from None
    try:
        return JournalKeys.parse(text)
    except ValueError as exc:
        raise ValueError(f"journal key file {path}: {exc}") from None


def resolve_journal_keys(
    keys: JournalKeys | str | None = None, env: Mapping[str, str] | None = None
) -> JournalKeys | None:
    """The one reading of the journal key: the argument (a ring, or the key's text), else
    ``$SOS_JOURNAL_KEY``, else the file ``$SOS_JOURNAL_KEY_FILE``; None when none is set (the
    journal is then written and read unauthenticated). ValueError for a malformed key."""
    if isinstance(keys, JournalKeys):
        return keys
    env = os.environ if env is None else env
    if keys:
        return JournalKeys.parse(keys)
    text = env.get(JOURNAL_KEY_ENV, "")
    if text.strip():
        try:
            return JournalKeys.parse(text)
        except ValueError as exc:
            raise ValueError(f"${JOURNAL_KEY_ENV}: {exc}") from None
    path = env.get(JOURNAL_KEY_FILE_ENV, "")
    if path:
        return load_journal_keys(path)
    return None


class Signer:
    """What a writer signs its records with: the ring's first key, the namespace, the
    generation and the tag of the previous record (:meth:`restart` at a generation's start)."""

    def __init__(self, keys: JournalKeys, namespace: str, *, encrypt: bool = True) -> None:
        self.keys = keys
        self.key = keys.signer
        self.namespace = namespace
        self.generation = 0
        self.epoch = 0
        self.prev = ZERO_TAG
        self.encrypts = encrypt
        self._cipher: tuple[tuple[int, int], Any] | None = None

    def restart(self, generation: int) -> None:
        self.generation = generation
        self.prev = ZERO_TAG

    @property
    def encrypt(self) -> Callable[[bytes, int, bytes], bytes] | None:
        return self._encrypt if self.encrypts else None

    def _encrypt(self, head: bytes, seq: int, body: bytes) -> bytes:
        """The sealed body: ChaCha20-Poly1305 under the writer's (generation, epoch) key, nonce
        the sequence number, the record's head as associated data (protocol.md 2.5)."""
        place = (self.generation, self.epoch)
        if self._cipher is None or self._cipher[0] != place:
            self._cipher = (place, self.key.cipher(self.namespace, *place))
        sealed: bytes = self._cipher[1].encrypt(_nonce(seq), body, head)
        return sealed

    def __call__(self, parts: list[bytes]) -> bytes:
        """The trailer (fingerprint + tag) of a record whose bytes from the type byte to the
        end of the body are ``parts``."""
        m = self.keys.mac_start(self.namespace, self.key.key_id)
        for p in parts:
            m.update(p)
        m.update(self.key.key_id)
        m.update(_U64.pack(self.generation))
        m.update(self.prev)
        return self.key.key_id + m.digest()[:TAG_SIZE]


def _nonce(seq: int) -> bytes:
    return b"\0\0\0\0" + _U64.pack(seq)


class SegmentKeys:
    """The key ring as a RecordDecoder of one segment uses it: each authenticated record's
    MAC started, each encrypted record's body opened (the segment's name gives the
    generation and the writer's epoch of its key)."""

    def __init__(self, keys: JournalKeys, namespace: str, segment: str) -> None:
        self.keys = keys
        self.namespace = namespace
        self.segment = segment
        sn = layout.parse_segment_name(segment)
        self.place = (sn.generation, sn.epoch) if sn is not None else (0, 0)
        self._ciphers: dict[bytes, Any] = {}

    def mac_start(self, key_id: bytes) -> Any:
        return self.keys.mac_start(self.namespace, key_id)

    def decrypt(self, key_id: bytes, head: bytes, sealed: bytes, offset: int = 0) -> bytes | None:
        """The body of an encrypted record (None: its key is not in the ring); a body that does
        not open under it is a JournalAuthError."""
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            key = self.keys.get(key_id)
            if key is None:
                return None
            cipher = self._ciphers[key_id] = key.cipher(self.namespace, *self.place)
        from cryptography.exceptions import InvalidTag  # noqa: PLC0415

        seq = _U64.unpack_from(head, 1)[0]
        try:
            plain: bytes = cipher.decrypt(_nonce(seq), sealed, head)
        except InvalidTag:
            raise JournalAuthError(
                self.segment,
                offset,
                f"record {seq}: its encrypted body does not open with journal key {key_id.hex()}: not written "
                f"here by a holder of the key (altered, or moved from another segment)",
            ) from None
        return plain


def segment_keys(keys: JournalKeys | None, namespace: str) -> Callable[[str], SegmentKeys | None]:
    """What a reader of ``namespace`` gives each segment's RecordDecoder (None: no key)."""
    if keys is None:
        return lambda _segment: None
    return functools.partial(SegmentKeys, keys, namespace)


@dataclass(frozen=True)
class ReadAuth:
    """A reader's journal key ring (None: none given) for one namespace."""

    keys: JournalKeys | None
    namespace: str

    def chain(self, generation: int) -> ChainCheck:
        return ChainCheck(self.keys, self.namespace, generation)

    def for_segment(self, segment: str) -> SegmentKeys | None:
        return segment_keys(self.keys, self.namespace)(segment)


class ChainCheck:
    """The authentication of one generation's records, in order (protocol.md 2.5).

    ``keys`` None: an authenticated record is refused (JournalKeyRequired), others pass (an
    unauthenticated journal, read as before). With keys: every record must carry a tag of a
    key in the ring, the same key as the generation's first record, that verifies over the
    namespace, the generation and the previous record's tag."""

    def __init__(self, keys: JournalKeys | None, namespace: str, generation: int) -> None:
        self.keys = keys
        self.namespace = namespace
        self.generation = generation
        self.prev = ZERO_TAG
        self.key_id: bytes | None = None

    def for_segment(self, segment: str) -> SegmentKeys | None:
        return segment_keys(self.keys, self.namespace)(segment)

    def check(self, rec: Any) -> None:
        where = (rec.segment, rec.offset)
        if self.keys is None:
            if rec.tag:
                raise JournalKeyRequired(
                    *where,
                    f"record {rec.seq} is authenticated with journal key {rec.key_id.hex()} (fingerprint) "
                    f"and no journal key was given: set {JOURNAL_KEY_ENV} or --journal-key-file to the "
                    f"namespace's journal key (docs/DEPLOY.md, 'The journal key')",
                )
            return
        if not rec.tag:
            raise JournalAuthError(
                *where,
                f"record {rec.seq} is not authenticated but the journal is read with a journal key "
                f"({self.keys.fingerprints}): planted by someone without the key, or written without one",
            )
        if self.keys.get(rec.key_id) is None:
            raise JournalAuthError(
                *where,
                f"record {rec.seq} is authenticated with journal key {rec.key_id.hex()}, not with the "
                f"key given ({self.keys.fingerprints}): wrong journal key",
            )
        if self.key_id is not None and rec.key_id != self.key_id:
            raise JournalAuthError(
                *where, f"record {rec.seq} changes the journal key inside generation {self.generation}"
            )
        mac = rec.mac
        if mac is None:  # decoded without the ring (never by the readers of this package)
            raise JournalAuthError(*where, f"record {rec.seq} was decoded without the journal key")
        mac = mac.copy()
        mac.update(_U64.pack(self.generation))
        mac.update(self.prev)
        if not hmac.compare_digest(mac.digest()[:TAG_SIZE], bytes(rec.tag)):
            raise JournalAuthError(
                *where,
                f"record {rec.seq} fails authentication with journal key {rec.key_id.hex()}: it was not "
                f"written here by a holder of the key (planted, altered, reordered, replayed or moved "
                f"from another namespace or generation)",
            )
        self.key_id = bytes(rec.key_id)
        self.prev = bytes(rec.tag)


class TailCheck:
    """The journal key's check for a reader that follows the journal's end (a standby
    gateway's tail) from a record ``seq`` it already holds: the chain is anchored at that
    record's tag (read again: a tag that is not the journal's only makes the next genuine
    record fail, never a forged one pass) or restarts where a generation starts."""

    def __init__(self, keys: JournalKeys | None, namespace: str) -> None:
        self.keys = keys
        self.namespace = namespace
        self.chain: ChainCheck | None = None
        self.anchored = False

    def for_segment(self, segment: str) -> SegmentKeys | None:
        return segment_keys(self.keys, self.namespace)(segment)

    def reset(self) -> None:
        """The reader's tree was rebuilt: anchor again."""
        self.chain = None

    def enter(self, seg: Any, starts_generation: bool, seq: int, previous_last: Callable[[], Any]) -> None:
        """The reader starts reading segment ``seg`` for record ``seq + 1``; ``previous_last()``
        gives the last record of the segment before ``seg`` in its generation (None: none)."""
        if starts_generation and seg.first_seq == seq + 1:
            self.chain, self.anchored = ChainCheck(self.keys, self.namespace, seg.generation), True
            return
        if self.chain is not None and self.chain.generation == seg.generation:
            return
        self.chain = ChainCheck(self.keys, self.namespace, seg.generation)
        self.anchored = self.keys is None
        if not self.anchored and seg.first_seq == seq + 1:
            self.seen(previous_last(), seq)

    def seen(self, rec: Any, seq: int) -> None:
        """A record the reader holds already (``rec.seq <= seq``): the anchor if it is ``seq``."""
        if self.chain is not None and not self.anchored and rec is not None and rec.seq == seq and rec.tag:
            self.chain.prev, self.chain.key_id, self.anchored = bytes(rec.tag), bytes(rec.key_id), True

    def check(self, rec: Any) -> None:
        if self.chain is None or not self.anchored:
            raise JournalAuthError(
                rec.segment, rec.offset, f"record {rec.seq}: the record before it could not be read to check it"
            )
        self.chain.check(rec)
