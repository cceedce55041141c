"""The sans-IO Connection: framing, caps, roles, request ids, misuse."""

import os

import pytest

from sos_wire import (
    DEFAULT_MAX_BODY,
    NEED_DATA,
    Append,
    AppendOk,
    Connection,
    Error,
    ErrorCode,
    Fence,
    FenceOk,
    Hello,
    HelloOk,
    LocalProtocolError,
    Ping,
    Read,
    ReadData,
    RemoteProtocolError,
    Role,
    Stat,
    StatOk,
    crc32c,
    encode_event,
)
from sos_wire.connection import _header
from sos_wire.frames import Op


def pair():
    return Connection(Role.CLIENT), Connection(Role.SERVER)


def events(conn):
    out = []
    while (e := conn.next_event()) is not NEED_DATA:
        out.append(e)
    return out


def test_request_reply_exchange():
    client, server = pair()
    server.receive_data(client.send(Stat(1, "a")))
    assert events(server) == [Stat(1, "a")]
    client.receive_data(server.send(StatOk(1, 3, False)))
    assert events(client) == [StatOk(1, 3, False)]
    assert client.in_flight == 0 and server.in_flight == 0


def test_many_pipelined_frames_in_one_chunk():
    client, server = pair()
    reqs = [Append(i, "log", i * 3, 1, crc32c(b"abc"), b"abc") for i in range(1, 1001)]
    server.receive_data(b"".join(client.send(r) for r in reqs))
    assert events(server) == reqs
    assert server.buffered == 0
    client.receive_data(b"".join(server.send(AppendOk(r.request_id, r.offset + 3)) for r in reversed(reqs)))
    got = events(client)
    assert [e.request_id for e in got] == list(range(1000, 0, -1))
    assert client.in_flight == 0


def test_frames_split_at_every_byte_boundary():
    client, server = pair()
    stream = (
        client.send(Hello(1, "t"))
        + client.send(Append(2, "a/b", 0, 0, crc32c(b"xyz"), b"xyz"))
        + client.send(Read(3, "a/b"))
        + client.send(Ping(4, b"p"))
    )
    want = None
    for cut in range(len(stream) + 1):
        s = Connection(Role.SERVER)
        got = []
        for chunk in (stream[:cut], stream[cut:]):
            if chunk:
                s.receive_data(chunk)
            got += events(s)
        want = want or got
        assert got == want
        assert len(got) == 4
    # and one byte at a time
    s = Connection(Role.SERVER)
    got = []
    for i in range(len(stream)):
        s.receive_data(stream[i : i + 1])
        got += events(s)
    assert got == want


def test_lying_body_length_over_cap_rejected_from_the_header_alone():
    server = Connection(Role.SERVER, max_body=1024)
    # header claims 4 GiB - 1; nothing of the body is sent
    server.receive_data(_header(Op.APPEND, 7, 0xFFFFFFFF))
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert info.value.code == ErrorCode.TOO_LARGE
    assert info.value.request_id == 7
    assert info.value.fatal
    assert server.buffered == 0
    # the connection is dead from now on, and buffers nothing more
    server.receive_data(bytes(1 << 20))
    assert server.buffered == 0
    with pytest.raises(RemoteProtocolError):
        server.next_event()


def test_default_cap_allows_exactly_max_body():
    server = Connection(Role.SERVER)
    data = bytes(DEFAULT_MAX_BODY - 2 - 3 - 24)
    frame = encode_event(Append(1, "big", 0, 0, crc32c(data), data))
    assert len(frame) == 16 + DEFAULT_MAX_BODY
    server.receive_data(frame)
    (got,) = events(server)
    assert got.data == data
    server2 = Connection(Role.SERVER)
    server2.receive_data(_header(Op.APPEND, 1, DEFAULT_MAX_BODY + 1))
    with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
        server2.next_event()


def test_incomplete_header_is_not_parsed():
    server = Connection(Role.SERVER, max_body=10)
    # 15 bytes of a header that would be rejected: nothing happens until the 16th byte
    h = _header(Op.APPEND, 1, 1000)
    server.receive_data(h[:15])
    assert server.next_event() is NEED_DATA
    server.receive_data(h[15:])
    with pytest.raises(RemoteProtocolError):
        server.next_event()


@pytest.mark.parametrize(
    "mutate,match,code",
    [
        (lambda h: b"XX" + h[2:], "bad magic", ErrorCode.BAD_FRAME),
        (lambda h: h[:15] + bytes([h[15] ^ 1]), "checksum", ErrorCode.BAD_FRAME),
    ],
)
def test_bad_header(mutate, match, code):
    server = Connection(Role.SERVER)
    server.receive_data(mutate(encode_event(Ping(1, b""))))
    with pytest.raises(RemoteProtocolError, match=match) as info:
        server.next_event()
    assert info.value.code == code and info.value.fatal


def test_unsupported_version():
    from sos_wire.connection import _HEADER12

    h12 = _HEADER12.pack(b"SO", 2, Op.PING, 9, 4)
    server = Connection(Role.SERVER)
    server.receive_data(h12 + crc32c(h12).to_bytes(4, "big") + bytes(4))
    with pytest.raises(RemoteProtocolError, match="version 2") as info:
        server.next_event()
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION
    assert info.value.request_id == 9


def test_unknown_opcode_is_skipped_by_server_and_connection_survives():
    server = Connection(Role.SERVER)
    server.receive_data(_header(0x42, 5, 3) + b"abc" + encode_event(Ping(6, b"x")))
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert info.value.code == ErrorCode.UNKNOWN_OP and not info.value.fatal
    assert info.value.request_id == 5
    # the server answers it with an ERROR and goes on
    err = server.send(Error(5, ErrorCode.UNKNOWN_OP, 0, "unknown opcode 0x42"))
    assert err.startswith(b"SO")
    assert events(server) == [Ping(6, b"x")]


def test_oversized_ping_is_a_non_fatal_bad_request():
    server = Connection(Role.SERVER)
    body = (65).to_bytes(4, "big") + bytes(65)
    server.receive_data(_header(Op.PING, 3, len(body)) + body + encode_event(Ping(4)))
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert info.value.code == ErrorCode.BAD_REQUEST and not info.value.fatal
    server.send(Error(3, ErrorCode.BAD_REQUEST, 0, "ping payload too large"))
    assert events(server) == [Ping(4)]


def test_server_refuses_replies_and_client_refuses_requests():
    server = Connection(Role.SERVER)
    server.receive_data(encode_event(AppendOk(1, 5)))
    with pytest.raises(RemoteProtocolError, match="only requests"):
        server.next_event()
    client = Connection(Role.CLIENT)
    client.receive_data(encode_event(Stat(1, "x")))
    with pytest.raises(RemoteProtocolError, match="only replies"):
        client.next_event()
    client = Connection(Role.CLIENT)
    client.receive_data(_header(0x99, 1, 0))
    with pytest.raises(RemoteProtocolError, match="only replies"):
        client.next_event()


def test_client_rejects_replies_it_did_not_ask_for():
    client = Connection(Role.CLIENT)
    client.receive_data(encode_event(StatOk(1, 0, False)))
    with pytest.raises(RemoteProtocolError, match="not in flight"):
        client.next_event()
    client = Connection(Role.CLIENT)
    client.send(Stat(1, "a"))
    client.receive_data(encode_event(FenceOk(1, 3)))
    with pytest.raises(RemoteProtocolError, match="does not answer STAT"):
        client.next_event()


def test_client_accepts_error_for_any_request_and_connection_level_error():
    client = Connection(Role.CLIENT)
    client.send(Fence(1, 3))
    client.receive_data(encode_event(Error(1, ErrorCode.FENCED, 9, "fenced")))
    client.receive_data(encode_event(Error(0, ErrorCode.BAD_FRAME, 0, "bad frame")))
    got = events(client)
    assert got == [Error(1, ErrorCode.FENCED, 9, "fenced"), Error(0, ErrorCode.BAD_FRAME, 0, "bad frame")]


def test_unknown_error_code_is_kept_as_int():
    client = Connection(Role.CLIENT)
    client.send(Stat(1, "a"))
    client.receive_data(encode_event(Error(1, 999, 0, "future")))
    (e,) = events(client)
    assert e.code == 999 and not isinstance(e.code, ErrorCode)


def test_read_data_streams_until_last():
    client, server = pair()
    server.receive_data(client.send(Read(1, "a")))
    events(server)
    stream = server.send(ReadData(1, 0, False, b"ab")) + server.send(ReadData(1, 2, False, b"cd"))
    assert server.in_flight == 1
    stream += server.send(ReadData(1, 4, True, b""))
    assert server.in_flight == 0
    client.receive_data(stream)
    got = events(client)
    assert [e.data for e in got] == [b"ab", b"cd", b""]
    assert client.in_flight == 0
    client.receive_data(encode_event(ReadData(1, 4, True, b"")))
    with pytest.raises(RemoteProtocolError, match="not in flight"):
        client.next_event()


def test_request_id_rules():
    client = Connection(Role.CLIENT)
    with pytest.raises(LocalProtocolError, match="reserved"):
        client.send(Ping(0))
    client.send(Ping(1))
    with pytest.raises(LocalProtocolError, match="in flight"):
        client.send(Ping(1))
    server = Connection(Role.SERVER)
    server.receive_data(encode_event(Ping(0)))
    with pytest.raises(RemoteProtocolError, match="reserved"):
        server.next_event()
    server = Connection(Role.SERVER)
    server.receive_data(encode_event(Ping(1)) + encode_event(Ping(1)))
    assert server.next_event() == Ping(1)
    with pytest.raises(RemoteProtocolError, match="reused"):
        server.next_event()


def test_next_request_id_skips_zero_and_in_flight():
    client = Connection(Role.CLIENT)
    client._next_id = 0xFFFFFFFE
    a = client.next_request_id()
    client.send(Ping(a))
    assert a == 0xFFFFFFFF
    assert client.next_request_id() == 1  # wrapped around, skipping 0
    client._next_id = 0xFFFFFFFE
    assert client.next_request_id() == 1  # skipped 0xFFFFFFFF (in flight) and 0


def test_server_send_checks():
    server = Connection(Role.SERVER)
    with pytest.raises(LocalProtocolError, match="not in flight"):
        server.send(StatOk(1, 0, False))
    server.receive_data(encode_event(Stat(1, "a")))
    events(server)
    with pytest.raises(LocalProtocolError, match="does not answer"):
        server.send(AppendOk(1, 0))
    with pytest.raises(LocalProtocolError, match="only replies"):
        server.send(Stat(2, "a"))
    server.send(StatOk(1, 0, False))
    with pytest.raises(LocalProtocolError, match="not in flight"):
        server.send(StatOk(1, 0, False))


@pytest.mark.parametrize(
    "event",
    [
        Stat(1, "\udcff"),  # lone surrogate: not encodable as UTF-8
        Stat(1, "x" * 70000),  # longer than a u16 string
        Append(1, "a", -1, 0, 0, b""),
        Append(1, "a", 2**64, 0, 0, b""),
        Append(1, "a", 0, 0, 2**32, b""),
        Append(1, "a", 0, 0, 0, "text, not bytes"),
        Ping(1, bytes(65)),
        Hello(1, "c", 256, 1),
        Fence(1, None),
        "not an event",
    ],
)
def test_bad_events_raise_local_protocol_error(event):
    client = Connection(Role.CLIENT)
    with pytest.raises(LocalProtocolError):
        client.send(event)
    assert client.in_flight == 0


def test_send_respects_peer_max_body_from_hello_ok():
    client = Connection(Role.CLIENT)
    client.send(Hello(1, "c"))
    client.receive_data(encode_event(HelloOk(1, 1, bytes(32), 100, "s")))
    assert events(client)[0].max_body == 100
    assert client.peer_max_body == 100
    client.send(Append(2, "a", 0, 0, 0, bytes(50)))
    with pytest.raises(LocalProtocolError, match="limit of 100"):
        client.send(Append(3, "a", 0, 0, 0, bytes(100)))


def test_eof_between_frames_is_clean_and_inside_a_frame_is_an_error():
    server = Connection(Role.SERVER)
    server.receive_data(encode_event(Ping(1)))
    server.receive_data(b"")
    assert server.eof
    assert events(server) == [Ping(1)]
    with pytest.raises(LocalProtocolError):
        server.receive_data(b"more")
    server = Connection(Role.SERVER)
    server.receive_data(encode_event(Ping(1))[:-1])
    server.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="inside a frame body"):
        server.next_event()


def test_constructor_checks():
    with pytest.raises(LocalProtocolError):
        Connection("server")
    with pytest.raises(LocalProtocolError):
        Connection(Role.SERVER, max_body=0)


def test_big_payload_is_not_rejoined_per_chunk():
    # a 4 MiB append in 64 KiB chunks through receive_data: the connection keeps one growing
    # buffer and decodes once at the end; the result is byte-identical
    client, server = pair()
    data = bytes(range(256)) * (4 * 4096)
    frame = client.send(Append(1, "big", 0, 0, crc32c(data), data))
    for i in range(0, len(frame), 65536):
        server.receive_data(frame[i : i + 65536])
        if i + 65536 < len(frame):
            assert server.next_event() is NEED_DATA
    (got,) = events(server)
    assert got.data == data and type(got.data) is bytes


def test_large_bodies_are_received_straight_into_their_own_buffer():
    """receive_buffer/received (recv_into): a big APPEND's body is written in place, the
    bytes after it (the next frame, a small one) are buffered as usual; both decode."""
    client, server = pair()
    big = os.urandom(300_000)
    small = b"tail"
    stream = client.send(Append(1, "a", 0, 0, crc32c(big), big)) + client.send(
        Append(2, "b", 0, 0, crc32c(small), small)
    )
    got = []
    pos = 0
    direct = 0
    while pos < len(stream):  # a reader loop: events first, then recv_into or receive_data
        while (e := server.next_event()) is not NEED_DATA:
            got.append(e)
        view = server.receive_buffer()
        if view is None:
            server.receive_data(stream[pos : pos + 70_000])
            pos += 70_000
        else:
            n = min(len(view), 50_000)
            view[:n] = stream[pos : pos + n]
            server.received(n)
            pos += n
            direct += n
    got += events(server)
    assert [(e.request_id, bytes(e.data)) for e in got] == [(1, big), (2, small)]
    assert type(got[0].data) is memoryview  # a view of the body's own buffer: not copied
    assert direct > 200_000  # most of the big body never went through receive_data
    assert server.buffered == 0


def test_eof_inside_a_directly_received_body_is_a_bad_frame():
    client, server = pair()
    big = os.urandom(100_000)
    frame = client.send(Append(1, "a", 0, 0, crc32c(big), big))
    server.receive_data(frame[:1000])
    assert server.next_event() is NEED_DATA
    assert server.awaiting_body == len(frame) - 16
    assert server.receive_buffer(allocate=False) is None  # nothing allocated unless asked
    view = server.receive_buffer()
    assert view is not None and len(view) == 100_000 + len(frame) - 100_000 - 1000
    view[:500] = frame[1000:1500]
    server.received(500)
    with pytest.raises(LocalProtocolError):
        server.received(len(view) + 1)  # more than was handed out
    server.received(0)  # the peer closed
    with pytest.raises(RemoteProtocolError, match="inside a frame body"):
        server.next_event()
    assert server.receive_buffer() is None


def test_small_bodies_and_a_disabled_threshold_get_no_buffer_of_their_own():
    client, server = pair()
    data = os.urandom(1000)
    frame = client.send(Append(1, "a", 0, 0, crc32c(data), data))
    server.receive_data(frame[:100])
    assert server.next_event() is NEED_DATA
    assert server.awaiting_body == 0 and server.receive_buffer() is None
    client2, server2 = pair()
    server2.direct_body_min = None
    big = os.urandom(100_000)
    server2.receive_data(client2.send(Append(1, "a", 0, 0, crc32c(big), big))[:1000])
    assert server2.next_event() is NEED_DATA
    assert server2.awaiting_body == 0 and server2.receive_buffer() is None
