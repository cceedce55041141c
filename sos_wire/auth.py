"""Keys and the challenge-response proof of the AUTH handshake.

A key is ``<key_id: 8 bytes>`` + ``<secret: 32 bytes>``, written as
``<16 hex>.<64 hex>`` (what ``sos-server keygen`` prints and ``SOS_KEY`` holds).
The client proves it knows the secret without sending it::

    proof = HMAC-SHA256(secret, nonce || namespace.encode("utf-8") || key_id)

where *nonce* is the 32 random bytes of the server's HELLO_OK.  On a connection that
runs inside TLS the proof is bound to the channel (protocol.md 1.6)::

    proof = HMAC-SHA256(secret, nonce || namespace || key_id || channel_binding)
    channel_binding = b"tls-server-end-point:" || SHA-256(DER of the server's certificate)

so a relay that terminates the client's TLS with a certificate of its own cannot pass
the client's proof on to the real server.  This module does no I/O: the caller gets the
certificate (client: ``getpeercert(binary_form=True)``; server: its own certificate file)
and passes :func:`tls_server_end_point` of it in.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

__all__ = [
    "KEY_ID_LEN",
    "NONCE_LEN",
    "PROOF_LEN",
    "SECRET_LEN",
    "TLS_SERVER_END_POINT",
    "BadKey",
    "Key",
    "proof",
    "tls_server_end_point",
    "verify_proof",
]

KEY_ID_LEN = 8
SECRET_LEN = 32
NONCE_LEN = 32
PROOF_LEN = 32
#: the label of the channel binding (RFC 5929's channel binding type, as SCRAM writes it)
TLS_SERVER_END_POINT = b"tls-server-end-point:"

_KEY_TEXT = re.compile(r"([0-9a-fA-F]{16})\.([0-9a-fA-F]{64})")


class BadKey(ValueError):
    """Key text that is not ``<16 hex>.<64 hex>``. The message never contains the secret."""


@dataclass(frozen=True, repr=False)
class Key:
    key_id: bytes
    secret: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.key_id, bytes) or len(self.key_id) != KEY_ID_LEN:
            raise BadKey(f"key_id must be {KEY_ID_LEN} bytes")
        if not isinstance(self.secret, bytes) or len(self.secret) != SECRET_LEN:
            raise BadKey(f"secret must be {SECRET_LEN} bytes")

    @classmethod
    def parse(cls, text: str) -> Key:
        if isinstance(text, Key):
            return text
        if not isinstance(text, str):
            raise BadKey(f"key must be str, not {type(text).__name__}")
        m = _KEY_TEXT.fullmatch(text.strip())
        if m is None:
            raise BadKey("key must look like <16 hex digits>.<64 hex digits> (what `sos-server keygen` prints)")
        return cls(bytes.fromhex(m.group(1)), bytes.fromhex(m.group(2)))

    @classmethod
    def generate(cls) -> Key:
        return cls(secrets.token_bytes(KEY_ID_LEN), secrets.token_bytes(SECRET_LEN))

    @property
    def key_id_hex(self) -> str:
        return self.key_id.hex()

    def proof(self, nonce: bytes, namespace: str, channel_binding: bytes = b"") -> bytes:
        return proof(self.secret, nonce, namespace, self.key_id, channel_binding)

    def __str__(self) -> str:
        return f"{self.key_id.hex()}.{self.secret.hex()}"

    def __repr__(self) -> str:  # never show the secret in logs or tracebacks
        return f"Key(key_id={self.key_id.hex()!r}, secret=<hidden>)"


def tls_server_end_point(certificate_der: bytes) -> bytes:
    """The channel binding of a TLS connection whose server presented *certificate_der*.

    ``b"tls-server-end-point:" + SHA-256(certificate_der)`` (53 bytes): RFC 5929's
    tls-server-end-point, with SHA-256 always (whatever the certificate's signature hash)."""
    if not isinstance(certificate_der, (bytes, bytearray, memoryview)) or not len(certificate_der):
        raise ValueError("tls_server_end_point needs the DER bytes of the server's certificate")
    return TLS_SERVER_END_POINT + hashlib.sha256(bytes(certificate_der)).digest()


def proof(secret: bytes, nonce: bytes, namespace: str, key_id: bytes, channel_binding: bytes = b"") -> bytes:
    """HMAC-SHA256(secret, nonce + namespace utf-8 + key_id + channel_binding): the 32-byte AUTH proof.

    *channel_binding*: ``b""`` on plain TCP, :func:`tls_server_end_point` of the server's
    certificate inside TLS."""
    message = bytes(nonce) + namespace.encode("utf-8") + bytes(key_id) + bytes(channel_binding)
    return hmac.new(secret, message, hashlib.sha256).digest()


def verify_proof(
    secret: bytes, nonce: bytes, namespace: str, key_id: bytes, candidate: bytes, channel_binding: bytes = b""
) -> bool:
    """Constant-time check of a client's proof (server side), bound to *channel_binding*."""
    return hmac.compare_digest(proof(secret, nonce, namespace, key_id, channel_binding), bytes(candidate))
