"""Issue 28 item 2: the gateway reads the request heads of Hadoop's plain requests without
h11 (``http.parse_fast_head``) and writes their replies itself. It must accept nothing h11
refuses, read what it accepts exactly as h11 does, hand everything else to h11 unchanged,
and answer byte for byte as the h11 path does: checked on a corpus of heads, then against a
real ``sos gateway`` and ``sos-server`` over raw sockets (pipelined requests, a head split
over two reads, a fast request followed by one h11 reads, ``Connection: close``)."""

from __future__ import annotations

import json
import os
import time

import h11
import pytest

from spark_plugin.gateway.http import connection
from spark_plugin.gateway.http.connection import FAST_HEAD, json_body, parse_fast_head
from spark_plugin.gateway.webhdfs.hdfs import file_status, file_status_json
from tests.gateway.support import closed_after, connect, port_of, read_reply
from tests.support import start_gateway, token_for

HADOOP_GET = (
    b"GET /webhdfs/v1/cp/offsets/7?op=GETFILESTATUS&user.name=spark HTTP/1.1\r\n"
    b"Authorization: Bearer abc.def\r\nUser-Agent: Java/17.0.15\r\nHost: 10.0.0.5:9870\r\n"
    b"Accept: */*\r\nConnection: keep-alive\r\n\r\n"
)
HADOOP_PUT = (
    b"PUT /webhdfs/v1/cp/a?op=RENAME&destination=/cp/b&user.name=spark HTTP/1.1\r\n"
    b"Authorization: Bearer abc.def\r\nUser-Agent: Java/17.0.15\r\nHost: gw:9870\r\nAccept: */*\r\n"
    b"Connection: keep-alive\r\nContent-type: application/x-www-form-urlencoded\r\nContent-Length: 0\r\n\r\n"
)

#: heads the fast path must leave to h11 (some h11 refuses, some it reads)
SLOW = [
    b"GET / HTTP/1.0\r\nHost: a\r\n\r\n",
    b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /caf\xc3\xa9 HTTP/1.1\r\nHost: a\r\n\r\n",  # raw UTF-8 in the target (ascii_request_line)
    b"GET / HTTP/1.1\r\nHost: a\r\nX-Note: caf\xe9\r\n\r\n",  # obs-text in a value
    b"GET / HTTP/1.1\r\nHost: a\r\nX-Fold: a\r\n b\r\n\r\n",  # obs-fold
    b"GET / HTTP/1.1\nHost: a\r\n\r\n",  # a bare LF
    b"GET / HTTP/1.1\r\nHost: a\nX: b\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",  # no Host
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost : a\r\n\r\n",  # space before the colon
    b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x7fb\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, Upgrade\r\nUpgrade: h2c\r\n\r\n",
    b"PUT / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n",
    b"PUT / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
    b"PUT / HTTP/1.1\r\nHost: a\r\nContent-Length: 00\r\n\r\n",
    b"PUT / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"PUT / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",  # a leading empty line
    b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.1 \r\nHost: a\r\n\r\n",
    b"get / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n",  # not whole yet
    b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"y" * FAST_HEAD + b"\r\n\r\n",
]
#: heads it takes
FAST = [
    HADOOP_GET,
    HADOOP_PUT,
    b"POST /sos/v1/marker?label=b7 HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer t\r\nContent-Length: 0\r\n\r\n",
    b"DELETE /webhdfs/v1/x?op=DELETE HTTP/1.1\r\nHOST:a\r\nX-Empty:\r\nX-Tab:\tv\t w \r\n\r\n",
]

NS = "gwhttp"


def h11_reads(data: bytes) -> tuple[h11.Request, bytes] | None:
    """What h11 reads from ``data``: its first request and the bytes left, or None."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    if not isinstance(event, h11.Request):
        return None
    # a bodiless request's end (EndOfMessage) comes from the framing h11 chose
    end = conn.next_event()
    assert isinstance(end, h11.EndOfMessage), end
    return event, conn.trailing_data[0]


@pytest.mark.parametrize("head", FAST, ids=range(len(FAST)))
def test_the_fast_path_reads_hadoops_heads_as_h11_does(head):
    after = b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n"
    parsed = parse_fast_head(head + after)
    assert parsed is not None, head
    fast, used = parsed
    theirs = h11_reads(head + after)
    assert theirs is not None
    req, rest = theirs
    assert (fast.method, fast.target) == (req.method, req.target)
    assert fast.headers == list(req.headers)  # lower-case names, values without outer whitespace
    assert (head + after)[used:] == rest == after


@pytest.mark.parametrize("head", SLOW, ids=range(len(SLOW)))
def test_every_other_shape_is_left_to_h11(head):
    assert parse_fast_head(head) is None


@pytest.mark.parametrize("head", FAST + SLOW, ids=range(len(FAST + SLOW)))
def test_a_head_read_again_gets_the_same_answer(head):
    # the fields a client repeats are read once (their bytes kept with what they gave):
    # reading the same head again, or the same fields under another request line, is the
    # same answer as the first reading, taken or refused
    first = parse_fast_head(head)
    again = parse_fast_head(head)
    if first is None:
        assert again is None
        return
    assert again is not None
    assert (again[0].method, again[0].target, again[0].headers, again[0].auth, again[1]) == (
        first[0].method,
        first[0].target,
        first[0].headers,
        first[0].auth,
        first[1],
    )
    other_line = b"PUT /webhdfs/v1/other?op=MKDIRS HTTP/1.1" + head[head.index(b"\r\n") :]
    other = parse_fast_head(other_line)
    assert other is not None and other[0].target == b"/webhdfs/v1/other?op=MKDIRS"
    assert other[0].headers == first[0].headers and other[0].headers is not first[0].headers


def test_the_kept_field_blocks_are_bounded():
    for i in range(connection.FIELD_BLOCKS + 10):
        assert parse_fast_head(b"GET / HTTP/1.1\r\nHost: a\r\nX-N: %d\r\n\r\n" % i) is not None
    assert len(connection._FIELD_BLOCKS) <= connection.FIELD_BLOCKS
    big = b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: " + b"b" * connection.FIELD_BLOCK_MAX + b"\r\n\r\n"
    assert parse_fast_head(big) is not None
    assert not any(len(block) > connection.FIELD_BLOCK_MAX for block, _ in connection._FIELD_BLOCKS)


# ---------------------------------------------------------------------------- a real gateway


@pytest.fixture(scope="module")
def gw(server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gwfast")
    g = start_gateway(server, tmp, name="fast", namespace=NS)
    g.token = token_for(g.url, g.key, NS)
    s = connect(port_of(g))
    s.sendall(
        f"PUT /webhdfs/v1/d?op=MKDIRS HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {g.token}\r\n"
        "Content-Length: 0\r\n\r\n".encode()
    )
    assert read_reply(s)[0] == 200
    s.close()
    yield g
    assert g.stop() == 0


def stat_head(token: str, extra: bytes = b"") -> bytes:
    return (
        b"GET /webhdfs/v1/d?op=GETFILESTATUS&user.name=spark HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Authorization: Bearer " + token.encode() + b"\r\nConnection: keep-alive\r\n" + extra + b"\r\n"
    )


def replies(sock, count: int) -> list[tuple[int, dict, bytes]]:
    """``count`` whole replies (status, headers, body), in the order they came."""
    buf = bytearray()
    return [read_reply(sock, buf) for _ in range(count)]


def raw_reply(sock, buf: bytearray | None = None) -> bytes:
    """One whole reply as the bytes sent (head and body); ``buf`` keeps what was read beyond
    it (a pipelined reply that came in the same read), as read_reply's does."""
    buf = bytearray() if buf is None else buf
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head = bytes(buf).partition(b"\r\n\r\n")[0].lower()
    length = int(head.partition(b"content-length: ")[2].partition(b"\r\n")[0])
    while len(buf) < len(head) + 4 + length:
        buf += sock.recv(65536)
    got = bytes(buf[: len(head) + 4 + length])
    del buf[: len(got)]
    return got


def test_a_fast_reply_is_the_h11_reply_byte_for_byte(gw):
    s = connect(port_of(gw))
    try:
        got = []
        # fast; then one with an obs-text header value, which only h11 reads; then fast again
        for extra in (b"", b"X-Note: caf\xe9\r\n", b""):
            s.sendall(stat_head(gw.token, extra))
            got.append(raw_reply(s))
        heads = [reply.partition(b"\r\n\r\n")[0] for reply in got]
        docs = [json.loads(reply.partition(b"\r\n\r\n")[2]) for reply in got]
        for doc in docs:  # (the cache's access time of the directory: not the path's doing)
            doc["FileStatus"].pop("accessTime")
        assert heads[0] == heads[1] == heads[2]
        assert docs[0] == docs[1] == docs[2] and docs[0]["FileStatus"]["type"] == "DIRECTORY"
        assert got[0].startswith(b"HTTP/1.1 200 \r\n")
        assert b"connection: keep-alive\r\nkeep-alive: timeout=1\r\n" in got[0]
    finally:
        s.close()


def test_pipelined_requests_of_both_paths_are_answered_in_order(gw):
    s = connect(port_of(gw))
    try:
        missing = (
            b"GET /webhdfs/v1/nothing?op=GETFILESTATUS HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer "
            + gw.token.encode()
            + b"\r\n\r\n"
        )
        slow = stat_head(gw.token, b"X-Note: caf\xe9\r\n")
        s.sendall(stat_head(gw.token) + missing + slow + missing + stat_head(gw.token))
        statuses = [status for status, _, _ in replies(s, 5)]
        assert statuses == [200, 404, 200, 404, 200]
        s.sendall(missing)  # the connection still serves
        assert read_reply(s)[0] == 404
    finally:
        s.close()


def test_a_head_split_over_two_reads_is_served(gw):
    s = connect(port_of(gw))
    try:
        head = stat_head(gw.token)
        s.sendall(head[:20])
        time.sleep(0.3)
        s.sendall(head[20:])
        assert read_reply(s)[0] == 200
        s.sendall(head)  # and the next, whole, on the same connection
        assert read_reply(s)[0] == 200
    finally:
        s.close()


def test_connection_close_is_honoured(gw):
    s = connect(port_of(gw))
    try:
        s.sendall(stat_head(gw.token).replace(b"Connection: keep-alive", b"Connection: close"))
        status, headers, _ = read_reply(s)
        assert status == 200 and headers.get("connection") == "close"
        assert closed_after(s, 30)
    finally:
        s.close()


def test_a_refused_fast_request_closes_when_the_refusal_says_so(gw):
    s = connect(port_of(gw))
    try:
        # two Authorization headers: both paths' head check refuses it (400, close)
        s.sendall(stat_head(gw.token, b"Authorization: Bearer other\r\n"))
        status, headers, _ = read_reply(s)
        assert status == 400 and headers.get("connection") == "close"
        assert closed_after(s, 30)
    finally:
        s.close()


def test_an_open_reply_of_the_fast_path_streams_the_file_and_the_connection_goes_on(gw):
    content = bytes(range(256)) * 1100  # 281,600 bytes: more than one OPEN piece
    auth = b"Authorization: Bearer " + gw.token.encode() + b"\r\n"
    s = connect(port_of(gw))
    try:
        s.sendall(
            b"PUT /webhdfs/v1/d/f?op=CREATE&data=true&overwrite=true HTTP/1.1\r\nHost: a\r\n"
            + auth
            + b"Content-Length: %d\r\n\r\n" % len(content)
            + content
        )
        assert read_reply(s)[0] == 201
        for query, want in ((b"", content), (b"&offset=1000&length=70000", content[1000:71000])):
            s.sendall(
                b"GET /webhdfs/v1/d/f?op=OPEN&data=true"
                + query
                + b" HTTP/1.1\r\nHost: a\r\n"
                + auth
                + b"Connection: keep-alive\r\n\r\n"
            )
            status, headers, body = read_reply(s)
            assert status == 200 and body == want and headers["content-length"] == str(len(want))
        s.sendall(stat_head(gw.token))
        assert read_reply(s)[0] == 200
    finally:
        s.close()


# ---------------------------------------------------------------------------- chunked bodies

HADOOP_CREATE_DATA = (
    b"PUT /webhdfs/v1/d/f?op=CREATE&user.name=spark&overwrite=true&data=true HTTP/1.1\r\n"
    b"Authorization: Bearer abc.def\r\nUser-Agent: Java/17.0.15\r\nHost: gw:9870\r\nAccept: */*\r\n"
    b"Connection: keep-alive\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)

#: chunked requests the fast path reads whole (their head and body)
FAST_CHUNKED = [
    HADOOP_CREATE_DATA + b"5\r\nhello\r\n0\r\n\r\n",
    HADOOP_CREATE_DATA + b"3\r\nabc\r\nA\r\n0123456789\r\n0\r\n\r\n",
    HADOOP_CREATE_DATA + b"0\r\n\r\n",  # an empty file
    HADOOP_CREATE_DATA.replace(b"chunked", b"Chunked") + b"1\r\n\x00\r\n0\r\n\r\n",
]
#: chunked requests it leaves to h11: not whole, extensions, trailers, odd framing, too large
SLOW_CHUNKED = [
    HADOOP_CREATE_DATA + b"5\r\nhel",
    HADOOP_CREATE_DATA + b"5\r\nhello\r\n0\r\n",
    HADOOP_CREATE_DATA + b"5;ext=1\r\nhello\r\n0\r\n\r\n",
    HADOOP_CREATE_DATA + b"5\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n",
    HADOOP_CREATE_DATA + b"5\r\nhelloXX0\r\n\r\n",
    HADOOP_CREATE_DATA + b" 5\r\nhello\r\n0\r\n\r\n",
    HADOOP_CREATE_DATA + b"5\nhello\r\n0\r\n\r\n",
    HADOOP_CREATE_DATA + b"-5\r\nhello\r\n0\r\n\r\n",
    HADOOP_CREATE_DATA.replace(b"Transfer-Encoding: chunked\r\n", b"Transfer-Encoding: gzip, chunked\r\n")
    + b"0\r\n\r\n",
    HADOOP_CREATE_DATA.replace(b"\r\n\r\n", b"\r\nContent-Length: 5\r\n\r\n") + b"5\r\nhello\r\n0\r\n\r\n",
    HADOOP_CREATE_DATA.replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n") + b"0\r\n\r\n",
    HADOOP_CREATE_DATA.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n") + b"0\r\n\r\n",
    HADOOP_CREATE_DATA + b"10001\r\n" + b"x" * 0x10001 + b"\r\n0\r\n\r\n",  # beyond FAST_BODY
]


def h11_reads_body(data: bytes) -> tuple[h11.Request, bytes, bytes] | None:
    """What h11 reads from ``data``: its first request, its whole body, the bytes left."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    body = b""
    try:
        req = conn.next_event()
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                return None
    except h11.RemoteProtocolError:
        return None
    assert isinstance(req, h11.Request)
    return req, body, conn.trailing_data[0]


@pytest.mark.parametrize("request_bytes", FAST_CHUNKED, ids=range(len(FAST_CHUNKED)))
def test_the_fast_path_reads_a_whole_chunked_body_as_h11_does(request_bytes):
    after = b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n"
    parsed = parse_fast_head(request_bytes + after, chunked=True)
    assert parsed is not None
    fast, used = parsed
    theirs = h11_reads_body(request_bytes + after)
    assert theirs is not None
    req, body, rest = theirs
    assert (fast.method, fast.target, fast.headers) == (req.method, req.target, list(req.headers))
    assert fast.body == body
    assert (request_bytes + after)[used:] == rest == after
    assert parse_fast_head(request_bytes) is None  # without chunked=True: h11's, as before


@pytest.mark.parametrize("request_bytes", SLOW_CHUNKED, ids=range(len(SLOW_CHUNKED)))
def test_every_other_chunked_shape_is_left_to_h11(request_bytes):
    assert parse_fast_head(request_bytes, chunked=True) is None


def create_data(token: str, path: str, body: bytes, chunk: int = 32 << 10) -> bytes:
    chunks = b"".join(
        b"%x\r\n%b\r\n" % (len(body[i : i + chunk]), body[i : i + chunk]) for i in range(0, len(body), chunk)
    )
    return (
        (
            f"PUT /webhdfs/v1/{path}?op=CREATE&user.name=spark&overwrite=true&data=true HTTP/1.1\r\n"
            f"Authorization: Bearer {token}\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n"
            "Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        ).encode()
        + chunks
        + b"0\r\n\r\n"
    )


def open_data(token: str, path: str) -> bytes:
    return (
        f"GET /webhdfs/v1/{path}?op=OPEN&user.name=spark&data=true&offset=0 HTTP/1.1\r\n"
        f"Authorization: Bearer {token}\r\nHost: 127.0.0.1\r\n\r\n"
    ).encode()


def test_chunked_bodies_of_both_paths_write_the_same_files_and_the_connection_goes_on(gw):
    """A CREATE body read with its head (fast) and one split over reads (h11): the same
    201 reply byte for byte, the same bytes in the file, pipelined requests after it served."""
    s = connect(port_of(gw))
    try:
        fast_body, slow_body = b"fast\x00body" * 100, b"slow\x00body" * 100
        s.sendall(create_data(gw.token, "d/fast", fast_body) + stat_head(gw.token))
        buf = bytearray()
        fast_reply = raw_reply(s, buf)
        assert read_reply(s, buf)[0] == 200  # the request pipelined behind the body
        assert not buf
        req = create_data(gw.token, "d/slow", slow_body)
        s.sendall(req[:-30])
        time.sleep(0.3)
        s.sendall(req[-30:])
        slow_reply = raw_reply(s)
        assert fast_reply.startswith(b"HTTP/1.1 201 ") and fast_reply == slow_reply
        for path, body in (("d/fast", fast_body), ("d/slow", slow_body)):
            s.sendall(open_data(gw.token, path))
            status, _, got = read_reply(s)
            assert (status, got) == (200, body)
        # a refused one (its parent is a file) keeps the connection as h11's path does
        s.sendall(create_data(gw.token, "d/fast/under", b"x"))
        assert read_reply(s)[0] in (400, 403, 404, 409)
        s.sendall(stat_head(gw.token))
        assert read_reply(s)[0] == 200
    finally:
        s.close()


# ---------------------------------------------------------------------------- the read lane


def read_head(token: str, target: str, extra: bytes = b"") -> bytes:
    return (
        (
            f"GET /webhdfs/v1/{target} HTTP/1.1\r\nAuthorization: Bearer {token}\r\nUser-Agent: Java/17.0.15\r\n"
            "Host: 127.0.0.1\r\nAccept: */*\r\nConnection: keep-alive\r\n"
        ).encode()
        + extra
        + b"\r\n"
    )


@pytest.mark.parametrize(
    "target",
    [
        "d?op=GETFILESTATUS&user.name=spark",
        "d/lane?op=GETFILESTATUS&user.name=spark",
        "d/lane?op=GETFILELINKSTATUS&user.name=spark",
        "d/lane?op=getfilestatus&OP=GETFILELINKSTATUS",  # the last op, in any case
        "d/missing?op=GETFILESTATUS&user.name=spark",  # 404
        "d/lane/under?op=GETFILESTATUS",  # below a file: 404
        "d/%6Cane?op=GETFILESTATUS",  # percent-encoded: the full path's, the same answer
        "d/../d?op=GETFILESTATUS",  # refused (400) by the full path
        "?op=GETSERVERDEFAULTS&user.name=spark",
        "d?op=GETSERVERDEFAULTS",
    ],
)
def test_the_read_lane_answers_as_the_full_path_byte_for_byte(gw, target):
    """GETFILESTATUS, GETFILELINKSTATUS and GETSERVERDEFAULTS of a plain head take the
    gateway's read lane (Gateway._fast_read); a head only h11 reads takes the full path.
    Both replies are the same bytes (but the access time of what was read), and the
    connection goes on serving."""
    s = connect(port_of(gw))
    try:
        s.sendall(create_data(gw.token, "d/lane", b"lane" * 300))
        assert read_reply(s)[0] == 201
        got = []
        for extra in (b"", b"X-Note: caf\xe9\r\n", b""):  # lane, full path (h11), lane
            s.sendall(read_head(gw.token, target, extra))
            got.append(raw_reply(s))
        heads = [reply.partition(b"\r\n\r\n")[0] for reply in got]
        docs = [json.loads(reply.partition(b"\r\n\r\n")[2]) for reply in got]
        for doc in docs:
            doc.get("FileStatus", {}).pop("accessTime", None)
        assert heads[0] == heads[1] == heads[2]
        assert docs[0] == docs[1] == docs[2]
        if "SERVERDEFAULTS" in target:
            assert got[0] == got[1] and docs[0]["FsServerDefaults"]["blockSize"] == 128 << 20
        s.sendall(stat_head(gw.token))
        assert read_reply(s)[0] == 200
    finally:
        s.close()


def test_the_read_lane_refuses_what_the_full_path_refuses(gw):
    """No token, a forged one, a token beside another Authorization field: the same
    refusals (401, 400) with or without the lane."""
    s = connect(port_of(gw))
    try:
        for extra in (b"", b"X-Note: caf\xe9\r\n"):
            s.sendall(read_head("forged.x.y", "d?op=GETFILESTATUS", extra))
            status, headers, body = read_reply(s)
            assert status == 401 and "invalid_token" in headers.get("www-authenticate", "")
        s.sendall(b"GET /webhdfs/v1/d?op=GETSERVERDEFAULTS HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\n\r\n")
        assert read_reply(s)[0] == 401
        s.sendall(read_head(gw.token, "d?op=GETFILESTATUS", b"Authorization: Bearer " + gw.token.encode() + b"\r\n"))
        status, headers, _ = read_reply(s)
        assert status == 400 and headers.get("connection") == "close"
    finally:
        s.close()


@pytest.mark.parametrize("owner", ["sos", "spark", 'caf\u00e9 "q" \\ \u2603'])
def test_the_read_lanes_file_status_is_the_json_encoders_byte_for_byte(tmp_path, owner):
    (tmp_path / "f").write_bytes(b"x" * 1234)
    (tmp_path / "d").mkdir(mode=0o1750)
    for name, children in (("f", None), ("d", 0), ("d", 17)):
        st = os.lstat(tmp_path / name)
        want = json_body({"FileStatus": file_status(st, "", owner, owner + "g", children)})
        assert file_status_json(st, owner, owner + "g", children) == want
