"""The gateway's HTTP timeouts on trio's virtual clock: the head deadline (``--head-timeout``),
the send timeout (``--send-timeout``) and the idle timeout between requests, each enforced by
the connection layer (spark_plugin.gateway.http: ``Conn`` under ``Gateway``'s connection
handler) and shown here in-process, on trio.testing's in-memory streams under
``MockClock(autojump_threshold=0)``: the clock jumps to the next deadline whenever every task
waits, so a 10 s timeout takes no real time and its moment is exact.

What a real ``sos gateway`` process does with the same flags over real sockets (and with many
connections at once: the slots, the memory of unread replies) is tests/gateway/test_http_limits.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from spark_plugin.gateway.http.auth import TokenAuthority
from spark_plugin.gateway.http.connection import IDLE_TIMEOUT
from spark_plugin.gateway.http.server import Gateway

pytestmark = [pytest.mark.hostile]

HEAD_TIMEOUT = 10.0  # as test_http_limits' --head-timeout 10
SEND_TIMEOUT = 7.0
#: a request whole in its head, without a token: the gateway answers 401 and keeps the connection
NO_TOKEN = b"GET /webhdfs/v1/?op=GETFILESTATUS HTTP/1.1\r\nHost: gw\r\n\r\n"


def _refuse(key: str) -> tuple[str, str]:
    raise PermissionError("no key is asked for here")


def _gateway() -> Gateway:
    """A gateway with no namespace behind it: these requests never reach one."""
    return Gateway(
        None,  # type: ignore[arg-type]
        TokenAuthority("ns", b"k" * 32),
        _refuse,
        head_timeout=HEAD_TIMEOUT,
        send_timeout=SEND_TIMEOUT,
    )


def _run(test) -> None:
    trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))


@contextlib.asynccontextmanager
async def _connected(gateway: Gateway) -> AsyncIterator[tuple[trio.abc.Stream, trio.Nursery]]:
    """(the client's end of an in-memory stream, the nursery) with ``gateway`` serving the
    other end as a connection it accepted now."""
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gateway._connection, server)
        yield client, nursery


async def _read_to_eof(stream: trio.abc.Stream) -> tuple[bytes, float]:
    """Everything the gateway sends until it closes, and the (virtual) time of the close."""
    data = b""
    while got := await stream.receive_some():
        data += got
    return data, trio.current_time()


async def _drip(stream: trio.abc.Stream, every: float, data: bytes = b"E") -> None:
    """One byte every ``every`` seconds (never long enough for a per-read timeout) until the
    gateway closes."""
    try:
        while True:
            await trio.sleep(every)
            await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def test_a_head_dripped_past_the_head_timeout_is_answered_408_and_closed():
    """A head dripped a byte every 2 s is due whole HEAD_TIMEOUT after the accept: then 408
    Request Timeout and the connection closes (after the linger that lets the 408 reach it)."""
    gateway = _gateway()

    async def test() -> None:
        async with _connected(gateway) as (client, nursery):
            accepted = trio.current_time()  # the virtual clock stands still until a task waits
            await client.send_all(b"GET /webhdfs/v1/x?op=LISTSTATUS HTTP/1.1\r\n")
            nursery.start_soon(_drip, client, 2.0)
            first = await client.receive_some()
            answered = trio.current_time() - accepted
            rest, closed = await _read_to_eof(client)
        assert first.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), first
        assert b"connection: close\r\n" in first
        assert b"the request head did not arrive whole in time" in first + rest
        assert answered == HEAD_TIMEOUT  # not a drip earlier, not a drip later
        assert closed - accepted < HEAD_TIMEOUT + 5  # the linger's 2 s, then closed
        assert not gateway.slots.open  # its slot is given back

    _run(test)


def test_a_head_whole_before_the_head_timeout_is_served():
    """The same drip that ends its head before the deadline gets its answer (401: no token)."""
    gateway = _gateway()

    async def test() -> None:
        async with _connected(gateway) as (client, nursery):
            accepted = trio.current_time()  # the virtual clock stands still until a task waits
            head = NO_TOKEN
            for i in range(0, len(head), 16):  # 16 bytes every 2 s: whole after 6 s
                await client.send_all(head[i : i + 16])
                if i + 16 < len(head):
                    await trio.sleep(2)
            reply = await client.receive_some()
            assert trio.current_time() - accepted < HEAD_TIMEOUT
            assert reply.startswith(b"HTTP/1.1 401 "), reply
            nursery.cancel_scope.cancel()

    _run(test)


def test_a_client_that_never_reads_its_reply_is_cut_after_the_send_timeout():
    """A client that sends a request and then reads nothing (a lockstep stream: every send
    waits for the reader) holds its connection SEND_TIMEOUT, no longer: the gateway drops it
    and gives its slot back, though the reply said keep-alive."""
    gateway = _gateway()

    async def test() -> None:
        client, server = trio.testing.lockstep_stream_pair()
        async with trio.open_nursery() as nursery:
            started = trio.current_time()
            nursery.start_soon(client.send_all, NO_TOKEN)
            await gateway._connection(server)  # returns once it has given up on the client
            gave_up = trio.current_time() - started
            assert gave_up == SEND_TIMEOUT
            assert not gateway.slots.open
            data, _ = await _read_to_eof(client)  # closed: at most the reply it never read
            assert data == b"" or data.startswith(b"HTTP/1.1 401 "), data[:100]

    _run(test)


def test_an_idle_connection_is_closed_after_the_idle_timeout():
    """After a reply, a keep-alive connection that sends nothing more is closed IDLE_TIMEOUT
    later (its slot with it)."""
    gateway = _gateway()

    async def test() -> None:
        async with _connected(gateway) as (client, _):
            await client.send_all(NO_TOKEN)
            reply = await client.receive_some()
            replied = trio.current_time()
            assert reply.startswith(b"HTTP/1.1 401 ") and b"connection: keep-alive" in reply, reply
            rest, closed = await _read_to_eof(client)
        assert closed - replied == IDLE_TIMEOUT
        assert not gateway.slots.open

    _run(test)
