"""The struct fast paths of the hot frames agree with the construct definitions byte for byte."""

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sos_wire import NEED_DATA, Append, AppendOk, Connection, ReadData, RemoteProtocolError, Role, decode_body
from sos_wire.connection import _HEADER, _encode_body_parts, _header
from sos_wire.frames import BODIES, Header, Op, build_header
from tests.support import client_expecting

# CI runs a fixed set of examples (derandomized: the suite must be deterministic);
# SOS_FUZZ_SCALE=50 runs fifty times more, with fresh random examples, for a deep fuzz.
EXAMPLES = max(1, int(os.environ.get("SOS_FUZZ_SCALE", "1")))
DERANDOMIZE = EXAMPLES == 1

u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@settings(deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 300)
@given(st.sampled_from(sorted(Op)), u32, u32)
def test_header_fast_path_matches_construct(op, rid, body_len):
    fast = _header(op, rid, body_len)
    assert fast == build_header(op, rid, body_len)
    c = Header.parse(fast)
    assert _HEADER.unpack(fast) == (b"SO", 1, op, rid, body_len, c.header_crc)


@settings(deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 300)
@given(st.builds(Append, st.integers(1, 2**32 - 1), text, u64, u64, u32, st.binary(max_size=100)))
def test_append_fast_path_matches_construct(event):
    fast = b"".join(_encode_body_parts(Op.APPEND, event))
    ref = BODIES[Op.APPEND].build({f: getattr(event, f) for f in ("name", "offset", "epoch", "crc", "data")})
    assert fast == ref


@settings(deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 300)
@given(st.builds(ReadData, st.integers(1, 2**32 - 1), u64, st.booleans(), st.binary(max_size=100)))
def test_read_data_fast_path_matches_construct(event):
    fast = b"".join(_encode_body_parts(Op.READ_DATA, event))
    assert fast == BODIES[Op.READ_DATA].build({"offset": event.offset, "last": event.last, "data": event.data})


@settings(deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 100)
@given(u64)
def test_append_ok_fast_path_matches_construct(length):
    assert b"".join(_encode_body_parts(Op.APPEND_OK, AppendOk(1, length))) == BODIES[Op.APPEND_OK].build(
        {"length": length}
    )


def _fast_decode(op, body):
    role = Role.SERVER if op is Op.APPEND else Role.CLIENT
    conn = Connection(role) if role is Role.SERVER else client_expecting(op, 1)
    conn.receive_data(_header(op, 1, len(body)) + body)
    try:
        e = conn.next_event()
    except RemoteProtocolError:
        return "error"
    assert e is not NEED_DATA
    return e


def _ref_decode(op, body):
    try:
        return decode_body(op, 1, body)
    except RemoteProtocolError:
        return "error"


def _mutated_bodies():
    """Valid hot-path bodies with random damage: both decoders must agree on every one."""
    valid = st.one_of(
        st.builds(lambda n, o, d: (Op.APPEND, encode_append(n, o, d)), text, u64, st.binary(max_size=40)),
        st.builds(
            lambda o, last, d: (Op.READ_DATA, b"".join(_encode_body_parts(Op.READ_DATA, ReadData(1, o, last, d)))),
            u64,
            st.booleans(),
            st.binary(max_size=40),
        ),
        st.builds(lambda n: (Op.APPEND_OK, n.to_bytes(8, "big")), u64),
    )
    return valid


def encode_append(name, offset, data):
    return b"".join(_encode_body_parts(Op.APPEND, Append(1, name, offset, 0, 0, data)))


@settings(
    deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 500, suppress_health_check=[HealthCheck.too_slow]
)
@given(_mutated_bodies(), st.data())
def test_fast_and_reference_decoders_agree_on_damaged_bodies(case, data):
    op, body = case
    body = bytearray(body)
    action = data.draw(st.sampled_from(["keep", "flip", "cut", "extend", "byte"]))
    if action == "flip" and body:
        i = data.draw(st.integers(0, len(body) * 8 - 1))
        body[i // 8] ^= 1 << (i % 8)
    elif action == "cut":
        del body[data.draw(st.integers(0, len(body))) :]
    elif action == "extend":
        body += data.draw(st.binary(min_size=1, max_size=5))
    elif action == "byte" and body:
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    body = bytes(body)
    assert _fast_decode(op, body) == _ref_decode(op, body)
