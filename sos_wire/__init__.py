"""sos_wire: the sans-IO codec of the SOS protocol (no sockets, no trio), at the bottom of
every other package. protocol.md (Part 1) is the normative description of the bytes.

Its parts: ``frames`` (one construct layout per frame), ``events`` (a dataclass per frame),
``connection`` (bytes in, events out, h11 style), ``errors``, ``names``, ``auth`` (keys, the
handshake's proof), ``crc`` (CRC32C); and what every command shares: ``addresses``,
``argtypes``, ``tls_options``, ``logs`` (JSON lines), ``lazy`` (the packages' lazy exports).
May import: the standard library, construct, crc32c and humanfriendly only; never another
sos package (each of them imports this one). Names load on first use (``lazy``).
"""

from typing import TYPE_CHECKING

from .lazy import lazy_exports

if TYPE_CHECKING:
    from .auth import BadKey, Key, proof, tls_server_end_point, verify_proof
    from .connection import NEED_DATA, Connection, Role, decode_body, encode_event
    from .crc import crc32c
    from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
    from .events import (
        Append,
        AppendOk,
        Auth,
        AuthOk,
        Error,
        Event,
        Fence,
        FenceOk,
        Hello,
        HelloOk,
        KeyRole,
        List,
        ListEntry,
        ListOk,
        Ping,
        Pong,
        Read,
        ReadData,
        Reply,
        Request,
        Seal,
        SealOk,
        Stat,
        StatOk,
        TierWait,
        TierWaitOk,
    )
    from .frames import DEFAULT_MAX_BODY, HEADER_LEN, MAX_LIST_LIMIT, MAX_PING_PAYLOAD, MAX_TIER_WAIT_MS, VERSION, Op
    from .names import BadName, validate_name, validate_namespace

__all__ = [
    "DEFAULT_MAX_BODY",
    "HEADER_LEN",
    "MAX_LIST_LIMIT",
    "MAX_PING_PAYLOAD",
    "MAX_TIER_WAIT_MS",
    "NEED_DATA",
    "VERSION",
    "Append",
    "AppendOk",
    "Auth",
    "AuthOk",
    "BadKey",
    "BadName",
    "Connection",
    "Error",
    "ErrorCode",
    "Event",
    "Fence",
    "FenceOk",
    "Hello",
    "HelloOk",
    "Key",
    "KeyRole",
    "List",
    "ListEntry",
    "ListOk",
    "LocalProtocolError",
    "Op",
    "Ping",
    "Pong",
    "ProtocolError",
    "Read",
    "ReadData",
    "RemoteProtocolError",
    "Reply",
    "Request",
    "Role",
    "Seal",
    "SealOk",
    "Stat",
    "StatOk",
    "TierWait",
    "TierWaitOk",
    "crc32c",
    "decode_body",
    "encode_event",
    "proof",
    "tls_server_end_point",
    "validate_name",
    "validate_namespace",
    "verify_proof",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        ".auth": ("BadKey", "Key", "proof", "tls_server_end_point", "verify_proof"),
        ".connection": ("NEED_DATA", "Connection", "Role", "decode_body", "encode_event"),
        ".crc": ("crc32c",),
        ".errors": ("ErrorCode", "LocalProtocolError", "ProtocolError", "RemoteProtocolError"),
        ".events": (
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
        ),
        ".frames": (
            "DEFAULT_MAX_BODY",
            "HEADER_LEN",
            "MAX_LIST_LIMIT",
            "MAX_PING_PAYLOAD",
            "MAX_TIER_WAIT_MS",
            "VERSION",
            "Op",
        ),
        ".names": ("BadName", "validate_name", "validate_namespace"),
    },
)
