"""sos_wire: the sans-IO codec of the SOS protocol (no sockets, no trio).

See protocol.md (Part 1) for the normative description of the bytes.
"""

from .auth import BadKey, Key, proof, tls_server_end_point, verify_proof
from .connection import NEED_DATA, Connection, Role, decode_body, encode_event
from .crc import crc32c
from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from .events import (
    Append, AppendOk, Auth, AuthOk, Error, Event, Fence, FenceOk, Hello, HelloOk, KeyRole, List,
    ListEntry, ListOk, Ping, Pong, Read, ReadData, Reply, Request, Seal, SealOk, Stat, StatOk, TierWait,
    TierWaitOk,
)
from .frames import DEFAULT_MAX_BODY, HEADER_LEN, MAX_LIST_LIMIT, MAX_PING_PAYLOAD, MAX_TIER_WAIT_MS, VERSION, Op
from .names import BadName, validate_name, validate_namespace

__all__ = [
    "BadKey", "Key", "proof", "tls_server_end_point", "verify_proof",
    "NEED_DATA", "Connection", "Role", "decode_body", "encode_event",
    "crc32c",
    "ErrorCode", "LocalProtocolError", "ProtocolError", "RemoteProtocolError",
    "Append", "AppendOk", "Auth", "AuthOk", "Error", "Event", "Fence", "FenceOk", "Hello", "HelloOk",
    "KeyRole", "List", "ListEntry", "ListOk", "Ping", "Pong", "Read", "ReadData", "Reply", "Request",
    "Seal", "SealOk", "Stat", "StatOk", "TierWait", "TierWaitOk",
    "DEFAULT_MAX_BODY", "HEADER_LEN", "MAX_LIST_LIMIT", "MAX_PING_PAYLOAD", "MAX_TIER_WAIT_MS", "VERSION", "Op",
    "BadName", "validate_name", "validate_namespace",
]
