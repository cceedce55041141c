"""Round trips of every event and fuzzing of the decoder with hypothesis."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    Ping,
    Pong,
    Read,
    ReadData,
    RemoteProtocolError,
    Role,
    Seal,
    SealOk,
    Stat,
    StatOk,
    TierWait,
    TierWaitOk,
    encode_event,
)
from sos_wire.connection import EVENT_OF, OP_OF
from sos_wire.frames import Op
from tests import support

# CI runs a fixed set of examples (derandomized: the suite must be deterministic);
# SOS_FUZZ_SCALE=50 runs fifty times more, with fresh random examples, for a deep fuzz.
EXAMPLES = max(1, int(os.environ.get("SOS_FUZZ_SCALE", "1")))
DERANDOMIZE = EXAMPLES == 1

u8 = st.integers(0, 0xFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)
rid = st.integers(1, 0xFFFFFFFF)
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
blob = st.binary(max_size=300)
b32 = st.binary(min_size=32, max_size=32)

REQUEST_ARGS = {
    Hello: (rid, text, u8, u8),
    Auth: (rid, st.binary(min_size=8, max_size=8), text, b32),
    Ping: (rid, st.binary(max_size=64)),
    List: (rid, text, text, u32),
    Stat: (rid, text),
    Append: (rid, text, u64, u64, u32, blob),
    Read: (rid, text, u64, u64),
    Seal: (rid, text, u64),
    Fence: (rid, u64),
    TierWait: (rid, text, u64, u32),
}
entry = st.builds(ListEntry, text, u64, st.booleans())
error_codes = st.one_of(st.sampled_from(list(ErrorCode)), st.integers(0, 0xFFFF))
REPLY_ARGS = {
    HelloOk: (rid, u8, b32, u32, text),
    AuthOk: (rid, st.sampled_from(list(KeyRole))),
    Pong: (rid, st.binary(max_size=64)),
    ListOk: (rid, st.lists(entry, max_size=5).map(tuple), st.booleans()),
    StatOk: (rid, u64, st.booleans()),
    AppendOk: (rid, u64),
    ReadData: (rid, u64, st.booleans(), blob),
    SealOk: (rid, u64),
    FenceOk: (rid, u64),
    TierWaitOk: (rid, u64),
    Error: (st.integers(0, 0xFFFFFFFF), error_codes, u64, text),
}
REQUEST_STRATEGIES = [st.builds(cls, *args) for cls, args in REQUEST_ARGS.items()]
REPLY_STRATEGIES = [st.builds(cls, *args) for cls, args in REPLY_ARGS.items()]
requests = st.one_of(REQUEST_STRATEGIES)
replies = st.one_of(REPLY_STRATEGIES)


def test_strategies_cover_every_event():
    assert set(REQUEST_ARGS) | set(REPLY_ARGS) == set(EVENT_OF.values())


def client_expecting(reply):
    """A client connection that has the request this reply answers in flight."""
    return support.client_expecting(OP_OF[type(reply)], reply.request_id)


@settings(
    deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 300, suppress_health_check=[HealthCheck.too_slow]
)
@given(requests)
def test_request_round_trip(event):
    client = Connection(Role.CLIENT)
    data = client.send(event)
    assert data == encode_event(event)
    server = Connection(Role.SERVER)
    server.receive_data(data)
    got = server.next_event()
    assert got == event
    assert server.next_event() is NEED_DATA
    assert server.buffered == 0


@settings(
    deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 300, suppress_health_check=[HealthCheck.too_slow]
)
@given(replies)
def test_reply_round_trip(event):
    data = encode_event(event)
    conn = client_expecting(event)
    conn.receive_data(data)
    got = conn.next_event()
    assert got == event
    if isinstance(got, Error) and got.code in ErrorCode._value2member_map_:
        assert isinstance(got.code, ErrorCode)
    assert conn.next_event() is NEED_DATA


def drain(conn):
    """(events, fatal error or None, non-fatal errors) until NEED_DATA or a fatal error.
    A RemoteProtocolError is the only failure allowed."""
    out, skipped = [], []
    for _ in range(10_000):
        try:
            e = conn.next_event()
        except RemoteProtocolError as exc:
            assert isinstance(exc.code, ErrorCode)
            if exc.fatal:
                # a dead connection keeps saying so, with the same exception type
                with pytest.raises(RemoteProtocolError):
                    conn.next_event()
                return out, exc, skipped
            skipped.append(exc)
            continue
        if e is NEED_DATA:
            return out, None, skipped
        out.append(e)
    raise AssertionError("next_event never returned NEED_DATA")


@settings(
    deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 400, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.binary(max_size=200), st.sampled_from(list(Role)))
def test_garbage_raises_only_remote_protocol_error(data, role):
    conn = Connection(role)
    conn.receive_data(data)
    drain(conn)
    conn.receive_data(b"")
    drain(conn)


# garbage that gets past the header checks: a valid header in front of random bodies
@settings(
    deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 400, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.sampled_from(sorted(Op)), st.binary(max_size=120))
def test_random_body_behind_valid_header(op, body):
    from sos_wire.connection import _header

    role = Role.SERVER if op < 0x80 else Role.CLIENT
    conn = Connection(role) if role is Role.SERVER else support.client_expecting(op, 5)
    conn.receive_data(_header(op, 5, len(body)) + body)
    events, err, skipped = drain(conn)
    assert len(events) + (err is not None) + len(skipped) == 1
    if events:  # whatever decodes must re-encode to the same bytes (canonical format)
        assert encode_event(events[0])[16:] == body


@settings(
    deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 300, suppress_health_check=[HealthCheck.too_slow]
)
@given(requests, st.data())
def test_bit_flips_are_detected_or_harmless(event, data):
    frame = bytearray(encode_event(event))
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    conn = Connection(Role.SERVER)
    conn.receive_data(bytes(frame))
    events, err, _ = drain(conn)
    if bit < 16 * 8:
        # header bits are covered by the header CRC (or the magic check): always detected
        assert err is not None and not events
    else:
        # body bits: either rejected, or a different valid event (the body has no checksum of
        # its own; APPEND data is covered by the crc field, checked by the server)
        assert events != [event]


@settings(
    deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 200, suppress_health_check=[HealthCheck.too_slow]
)
@given(requests, st.data())
def test_truncation_needs_data_then_eof_fails(event, data):
    frame = encode_event(event)
    cut = data.draw(st.integers(0, len(frame) - 1))
    conn = Connection(Role.SERVER)
    conn.receive_data(frame[:cut])
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"")
    if cut == 0:
        assert conn.next_event() is NEED_DATA  # a clean close between frames
    else:
        with pytest.raises(RemoteProtocolError, match="closed the connection inside"):
            conn.next_event()


@settings(
    deadline=None, derandomize=DERANDOMIZE, max_examples=EXAMPLES * 50, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.lists(requests, min_size=1, max_size=20, unique_by=lambda e: e.request_id), st.data())
def test_pipelined_stream_split_anywhere(events, data):
    stream = b"".join(encode_event(e) for e in events)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    conn = Connection(Role.SERVER)
    got = []
    prev = 0
    for cut in [*cuts, len(stream)]:
        if cut > prev:  # (b"" would mean EOF)
            conn.receive_data(stream[prev:cut])
        prev = cut
        while (e := conn.next_event()) is not NEED_DATA:
            got.append(e)
    assert got == events
