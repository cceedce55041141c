"""Events: one small frozen dataclass per frame type (h11 style).

Every event has ``request_id`` as its first field.  Requests are sent by
clients, replies by servers; ``Error`` is a reply to any request.  Events carry
values, not bytes: ``Connection.send`` turns them into frames and
``Connection.next_event`` turns frames into them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from .errors import ErrorCode

#: a payload: bytes as built, or a memoryview of the body's own buffer when the connection
#: received a large body straight into it (connection.DIRECT_BODY_MIN)
Payload = bytes | bytearray | memoryview

__all__ = [
    "Append",
    "AppendOk",
    "Auth",
    "AuthOk",
    "Error",
    "Event",
    "Fence",
    "FenceOk",
    "Hello",
    "HelloOk",
    "KeyRole",
    "List",
    "ListEntry",
    "ListOk",
    "Payload",
    "Ping",
    "Pong",
    "Read",
    "ReadData",
    "Reply",
    "Request",
    "Seal",
    "SealOk",
    "Stat",
    "StatOk",
    "TierWait",
    "TierWaitOk",
]


class KeyRole(IntEnum):
    """What an authenticated connection may do (AUTH_OK.role). APPEND can also read.
    TOKEN may do nothing but PING: a gateway client's credential, which only proves itself
    (AUTH) so that ``sos gateway`` issues it an append bearer token (protocol.md 1.6)."""

    APPEND = 1
    READ = 2
    TOKEN = 3


class Event:
    """Base class of every event."""

    __slots__ = ()
    request_id: int


class Request(Event):
    __slots__ = ()


class Reply(Event):
    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Hello(Request):
    request_id: int
    client: str
    min_version: int = 1
    max_version: int = 1


@dataclass(frozen=True, slots=True)
class HelloOk(Reply):
    request_id: int
    version: int
    nonce: bytes
    max_body: int
    server: str


@dataclass(frozen=True, slots=True)
class Auth(Request):
    request_id: int
    key_id: bytes
    namespace: str
    proof: bytes


@dataclass(frozen=True, slots=True)
class AuthOk(Reply):
    request_id: int
    role: KeyRole


@dataclass(frozen=True, slots=True)
class Ping(Request):
    request_id: int
    payload: bytes = b""


@dataclass(frozen=True, slots=True)
class Pong(Reply):
    request_id: int
    payload: bytes = b""


@dataclass(frozen=True, slots=True)
class List(Request):
    request_id: int
    prefix: str = ""
    after: str = ""
    limit: int = 1000


@dataclass(frozen=True, slots=True)
class ListEntry:
    name: str
    length: int
    sealed: bool


@dataclass(frozen=True, slots=True)
class ListOk(Reply):
    request_id: int
    entries: tuple[ListEntry, ...]
    more: bool


@dataclass(frozen=True, slots=True)
class Stat(Request):
    request_id: int
    name: str


@dataclass(frozen=True, slots=True)
class StatOk(Reply):
    request_id: int
    length: int
    sealed: bool


@dataclass(frozen=True, slots=True)
class Append(Request):
    """Append *data* at *offset* (must equal the current length). *crc* = CRC32C(data)."""

    request_id: int
    name: str
    offset: int
    epoch: int
    crc: int
    data: Payload


@dataclass(frozen=True, slots=True)
class AppendOk(Reply):
    request_id: int
    length: int


@dataclass(frozen=True, slots=True)
class Read(Request):
    request_id: int
    name: str
    offset: int = 0
    length: int = 0  # 0 = to the end


@dataclass(frozen=True, slots=True)
class ReadData(Reply):
    request_id: int
    offset: int
    last: bool
    data: Payload


@dataclass(frozen=True, slots=True)
class Seal(Request):
    request_id: int
    name: str
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class SealOk(Reply):
    request_id: int
    length: int


@dataclass(frozen=True, slots=True)
class Fence(Request):
    request_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class FenceOk(Reply):
    request_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class TierWait(Request):
    """Wait until the server's object-store tier holds *name*'s bytes [0, *offset*), at most
    *timeout_ms* (capped at 60,000; 0: answer at once). protocol.md 1.11 TIER_WAIT."""

    request_id: int
    name: str
    offset: int
    timeout_ms: int = 0


@dataclass(frozen=True, slots=True)
class TierWaitOk(Reply):
    """*tiered*: the length of the object's contiguous run of pieces in the bucket (>= offset)."""

    request_id: int
    tiered: int


@dataclass(frozen=True, slots=True)
class Error(Reply):
    """A refusal. *length* is the current length for OFFSET_MISMATCH, the current
    fence epoch for FENCED, the object's length in the bucket for
    TIER_UNAVAILABLE, else 0. *code* is an ErrorCode, or a bare int for a code
    this version does not know (treat it as a generic failure)."""

    request_id: int
    code: ErrorCode
    length: int
    message: str
