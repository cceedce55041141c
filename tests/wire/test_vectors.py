"""Golden byte vectors: one (or more) per frame type. They pin the wire format.

If one of these fails, the format changed: that breaks every deployed peer.
Bump the protocol version instead (protocol.md, "Versioning").
"""

import pytest

from sos_wire import (
    NEED_DATA,
    Append,
    AppendOk,
    Auth,
    AuthOk,
    Connection,
    Error,
    ErrorCode,
    Fence,
    FenceOk,
    Hello,
    HelloOk,
    KeyRole,
    List,
    ListEntry,
    ListOk,
    Op,
    Ping,
    Pong,
    Read,
    ReadData,
    Request,
    Role,
    Seal,
    SealOk,
    Stat,
    StatOk,
    TierWait,
    TierWaitOk,
    crc32c,
    decode_body,
    encode_event,
)
from sos_wire.connection import OP_OF
from sos_wire.frames import Header, build_header
from tests.support import client_expecting

NONCE = bytes(range(32))
PROOF = bytes(range(32, 64))
KEY_ID = bytes.fromhex("0123456789abcdef")

VECTORS = [
    (Hello(1, "sos-py/0.1", 1, 1), "534f0101000000010000000e9b8cb6f9000a736f732d70792f302e310101"),
    (
        HelloOk(1, 1, NONCE, 8392704, "sos-server/0.1"),
        "534f01810000000100000035948e5198"
        "01"
        "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
        "00801000"
        "000e736f732d7365727665722f302e31",
    ),
    (
        Auth(2, KEY_ID, "ns1", PROOF),
        "534f0102000000020000002df9fd770e"
        "0123456789abcdef"
        "00036e7331"
        "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f",
    ),
    (AuthOk(2, KeyRole.APPEND), "534f01820000000200000001326b33eb01"),
    (AuthOk(2, KeyRole.READ), "534f01820000000200000001326b33eb02"),
    (AuthOk(2, KeyRole.TOKEN), "534f01820000000200000001326b33eb03"),  # a gateway-only key (1.6)
    (Ping(3, b"hi"), "534f010300000003000000068ce6eb0f000000026869"),
    (Pong(3, b"hi"), "534f018300000003000000062a8eeee4000000026869"),
    (List(4, "gen/", "", 1000), "534f0104000000040000000c88120369000467656e2f0000000003e8"),
    (
        ListOk(4, (ListEntry("a", 5, False), ListEntry("b/c", 0, True)), False),
        "534f0184000000040000001f2d743219000000020001610000000000000005000003622f6300000000000000000100",
    ),
    (ListOk(4, (), True), "534f0184000000040000000556c8dd4e0000000001"),
    (Stat(5, "a/b"), "534f010500000005000000053c8f61410003612f62"),
    (StatOk(5, 11, True), "534f01850000000500000009d7a4ab7a000000000000000b01"),
    (
        Append(6, "log", 0, 7, 0x9A71BB4C, b"hello"),
        "534f01060000000600000022996437a900036c6f67000000000000000000000000000000079a71bb4c0000000568656c6c6f",
    ),
    (AppendOk(6, 5), "534f01860000000600000008745394a40000000000000005"),
    (Read(7, "log", 0, 0), "534f01070000000700000015b162a31700036c6f6700000000000000000000000000000000"),
    (ReadData(7, 0, True, b"hello"), "534f01870000000700000012c3c0c2170000000000000000010000000568656c6c6f"),
    (Seal(8, "log", 7), "534f0108000000080000000d39e705ef00036c6f670000000000000007"),
    (SealOk(8, 5), "534f01880000000800000008aa7e14180000000000000005"),
    (Fence(9, 8), "534f01090000000900000008c039a8170000000000000008"),
    (FenceOk(9, 8), "534f018900000009000000086651adfc0000000000000008"),
    (TierWait(11, "log", 5, 30000), "534f010a0000000b00000011c15867c500036c6f67000000000000000500007530"),
    (TierWaitOk(11, 5), "534f018a0000000b000000080fdc7e8d0000000000000005"),
    (
        Error(11, ErrorCode.TIER_UNAVAILABLE, 0, "no tier configured"),
        "534f01ff0000000b0000001e5d0cc79d0014000000000000000000126e6f207469657220636f6e66696775726564",
    ),
    (
        Error(6, ErrorCode.OFFSET_MISMATCH, 5, "offset 0 != length 5"),
        "534f01ff0000000600000020dca4eb860009000000000000000500146f6666736574203020213d206c656e6774682035",
    ),
    (
        Error(0, ErrorCode.BAD_FRAME, 0, "bad magic"),
        "534f01ff000000000000001549d1d7c3000100000000000000000009626164206d61676963",
    ),
]


def test_every_frame_type_has_a_vector():
    assert {OP_OF[type(e)] for e, _ in VECTORS} == set(Op)


def test_crc32c_check_value():
    # the standard CRC-32C check value (RFC 3720 appendix B.4)
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"hello") == 0x9A71BB4C


@pytest.mark.parametrize("event,hexdata", VECTORS, ids=lambda v: type(v).__name__ if not isinstance(v, str) else "")
def test_encode_matches_vector(event, hexdata):
    assert encode_event(event).hex() == hexdata


@pytest.mark.parametrize("event,hexdata", VECTORS, ids=lambda v: type(v).__name__ if not isinstance(v, str) else "")
def test_decode_vector(event, hexdata):
    data = bytes.fromhex(hexdata)
    # header fields through the construct reference definition
    h = Header.parse(data[:16])
    assert h.fields.value.opcode == OP_OF[type(event)]
    assert h.fields.value.request_id == event.request_id
    assert h.fields.value.body_len == len(data) - 16
    assert build_header(OP_OF[type(event)], event.request_id, len(data) - 16) == data[:16]
    # body through the construct reference decoder
    assert decode_body(OP_OF[type(event)], event.request_id, data[16:]) == event
    # and through a connection of the receiving role (fast paths included)
    if isinstance(event, Request):
        conn = Connection(Role.SERVER)
    else:
        # a reply is accepted only for a request in flight: the client sent it
        conn = client_expecting(OP_OF[type(event)], event.request_id)
    conn.receive_data(data)
    got = conn.next_event()
    assert got == event
    assert type(got.request_id) is int
    assert conn.next_event() is NEED_DATA


@pytest.mark.parametrize("role", [0, 4, 255])
def test_auth_ok_with_a_role_outside_1_to_3_is_a_bad_frame(role):
    from sos_wire.errors import RemoteProtocolError

    conn = client_expecting(Op.AUTH_OK, 2)
    conn.receive_data(bytes.fromhex("534f01820000000200000001326b33eb") + bytes([role]))
    with pytest.raises(RemoteProtocolError) as ei:
        conn.next_event()
    assert ei.value.code is ErrorCode.BAD_FRAME
