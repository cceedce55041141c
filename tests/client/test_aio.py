"""The trio client against a REAL sos-server process; and TLS for both clients."""

from __future__ import annotations

import ssl

import pytest
import trio
import trio.lowlevel

from sos_client import Client, ConnectionLost, Fenced, OffsetMismatch, SealedError, SOSNotFound, SOSPermissionError
from sos_client.aio import open_client
from sos_wire import ErrorCode, KeyRole
from tests.support import self_signed_cert


def run(fn):
    trio.run(fn)


def test_operations(server, ns):
    name, key, _ = ns

    async def main():
        async with open_client(server.address, key, name, timeout=60) as c:
            assert c.role == KeyRole.APPEND
            assert await c.ping(b"p") == b"p"
            assert await c.append("x/1", 0, b"abc") == 3
            assert await c.append("x/1", 3, b"def") == 6
            assert await c.stat("x/1") == (6, False)
            assert await c.read("x/1") == b"abcdef"
            assert await c.read("x/1", 1, 2) == b"bc"
            assert [chunk async for chunk in c.read_iter("x/1", step=4)] == [b"abcd", b"ef"]
            await c.append("x/2", 0, b"")
            assert [(e.name, e.length) async for e in c.list("x/")] == [("x/1", 6), ("x/2", 0)]
            assert await c.seal("x/1") == 6
            assert await c.fence(3) == 3

    run(main)


def test_errors_are_mapped(server, ns):
    name, key, read_key = ns

    async def main():
        async with open_client(server.address, key, name, timeout=60) as c:
            with pytest.raises(SOSNotFound):
                await c.stat("nope")
            await c.append("o", 0, b"12345")
            with pytest.raises(OffsetMismatch) as info:
                await c.append("o", 2, b"zz")
            assert info.value.length == 5
            await c.seal("o")
            with pytest.raises(SealedError):
                await c.append("o", 5, b"z")
            await c.fence(7)
            with pytest.raises(Fenced) as info:
                await c.append("p", 0, b"z", epoch=6)
            assert info.value.epoch == 7
        async with open_client(server.address, read_key, name, timeout=60) as r:
            assert r.role == KeyRole.READ
            with pytest.raises(SOSPermissionError) as info:
                await r.append("q", 0, b"z")
            assert info.value.code == ErrorCode.FORBIDDEN
            assert await r.read("o") == b"12345"

    run(main)


def test_append_many_from_async_and_sync_iterables(server, ns):
    name, key, _ = ns
    parts = [bytes([i]) * (i * 97 + 1) for i in range(200)]

    async def agen():
        for p in parts:
            await trio.lowlevel.checkpoint()
            yield p

    async def main():
        async with open_client(server.address, key, name, timeout=60) as c:
            n = await c.append_many("s", 0, agen(), window_bytes=256 * 1024)
            assert n == sum(map(len, parts))
            n2 = await c.append_many("s", n, parts)
            assert n2 == 2 * n
            assert await c.read("s") == b"".join(parts) * 2

    run(main)


def test_concurrent_tasks_share_one_client(server, ns):
    name, key, _ = ns

    async def main():
        async with open_client(server.address, key, name, timeout=60) as c:

            async def writer(i):
                off = 0
                for j in range(15):
                    off = await c.append(f"w{i}", off, b"%d-%d," % (i, j))

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(writer, i)
            for i in range(5):
                assert await c.read(f"w{i}") == b"".join(b"%d-%d," % (i, j) for j in range(15))

    run(main)


def test_refused_connection(ns):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()

    async def main():
        with pytest.raises(ConnectionLost):
            async with open_client(f"127.0.0.1:{port}", ns[1], ns[0], timeout=5):
                pass

    run(main)


@pytest.fixture
def tls_server(sos_server_factory, tmp_path):
    cert, key = self_signed_cert(tmp_path, cn="127.0.0.1")
    srv = sos_server_factory(args=["--tls-cert", cert, "--tls-key", key])
    return srv, ssl.create_default_context(cafile=str(cert))


def test_tls_both_clients(tls_server):
    srv, ctx = tls_server
    key = srv.keygen("tls", "append")
    with Client(srv.address, key, "tls", timeout=60, tls=ctx) as c:
        assert c.append("t", 0, b"secret bytes") == 12
        assert c.read("t") == b"secret bytes"

    async def main():
        async with open_client(srv.address, key, "tls", timeout=60, tls=ctx) as c:
            assert await c.stat("t") == (12, False)
            assert await c.append_many("t", 12, [b"x" * 100_000] * 5) == 500_012

    trio.run(main)
    # a client without TLS cannot talk to a TLS server, and one that does not trust the
    # certificate refuses it: both are ConnectionLost
    with pytest.raises(ConnectionLost):
        Client(srv.address, key, "tls", timeout=60)
    with pytest.raises(ConnectionLost, match="TLS"):
        Client(srv.address, key, "tls", timeout=60, tls=ssl.create_default_context())


def test_connection_closed_by_the_idle_timeout_is_reopened_transparently(sos_server_factory):
    import time

    srv = sos_server_factory(args=["--idle-timeout", "1"], start=False)
    key = srv.keygen("idle", "append")
    srv.start()

    async def wait_for_idle_close(count: int) -> None:
        deadline = time.monotonic() + 120
        while srv.log_text().count("idle timeout, closing") < count:
            assert time.monotonic() < deadline, "the server never closed the idle connection"
            await trio.sleep(0.05)

    async def main():
        async with open_client(srv.address, key, "idle", timeout=60) as c:
            assert await c.append("x", 0, b"a") == 1
            await wait_for_idle_close(1)
            assert await c.fence(5) == 5  # not retried blindly: the client must notice the close
            assert await c.stat("x") == (1, False)
            await wait_for_idle_close(2)
            assert await c.append("x", 1, b"b", epoch=5) == 2
            await wait_for_idle_close(3)
            assert await c.read("x") == b"ab"

    run(main)
