"""Reconnect and resume: the server is SIGKILLed and restarted in the middle of an
append_many; the object ends up with every byte exactly once."""

from __future__ import annotations

import random

import pytest
import trio

from sos_client import Client, ConnectionLost
from sos_client.aio import open_client


def _data(n_chunks: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.randint(1, 200_000)) for _ in range(n_chunks)]


def _crashing(chunks, server, client, at: set[int]):
    """Yield *chunks*; before chunk i in *at*, SIGKILL the server and start it again."""
    for i, chunk in enumerate(chunks):
        if i in at:
            server.kill()
            server.restart()
            host, port = server.host_port
            client.host, client.port = host, port  # the same port unless it was taken meanwhile
            client.server = server.address
        yield chunk


def test_append_many_resumes_after_server_crash(sos_server, monkeypatch):
    key = sos_server.keygen("res", "append")
    chunks = _data(300, 1)
    with Client(sos_server.address, key, "res", timeout=60, reconnect_timeout=120) as c:
        reconnects = []
        real = c._reconnect_until_deadline
        monkeypatch.setattr(c, "_reconnect_until_deadline", lambda: (reconnects.append(1), real())[1])
        c.append("log", 0, b"head")  # already there before the stream starts
        total = c.append_many("log", 4, _crashing(chunks, sos_server, c, {60, 200}), window_bytes=2 << 20)
        assert reconnects, "the server crash went unnoticed"
        want = b"head" + b"".join(chunks)
        assert total == len(want)
        assert c.stat("log") == (len(want), False)
        assert c.read("log") == want  # nothing missing, nothing doubled
    # and the bytes survived: a fresh connection to the restarted server sees the same
    with Client(sos_server.address, key, "res", timeout=60) as c2:
        assert c2.read("log") == want


def test_aio_append_many_resumes_after_server_crash(sos_server):
    key = sos_server.keygen("ares", "append")
    chunks = _data(200, 2)

    async def main():
        async with open_client(sos_server.address, key, "ares", timeout=60, reconnect_timeout=120) as c:

            async def gen():
                for i, chunk in enumerate(chunks):
                    if i == 80:
                        sos_server.kill()
                        sos_server.restart()
                        c.host, c.port = sos_server.host_port
                        c.server = sos_server.address
                    yield chunk

            total = await c.append_many("alog", 0, gen(), window_bytes=2 << 20)
            assert total == sum(map(len, chunks))
            assert await c.read("alog") == b"".join(chunks)

    trio.run(main)


def test_read_iter_resumes_after_server_crash(sos_server):
    key = sos_server.keygen("rd", "append")
    data = random.Random(3).randbytes(3 << 20)
    with Client(sos_server.address, key, "rd", timeout=60, reconnect_timeout=120) as c:
        c.append_many("obj", 0, [data])
        got = []
        for i, chunk in enumerate(c.read_iter("obj", step=256 * 1024)):
            got.append(chunk)
            if i == 3:
                sos_server.kill()
                sos_server.restart()
                c.host, c.port = sos_server.host_port
                c.server = sos_server.address
        assert b"".join(got) == data


def test_gives_up_with_connection_lost_when_the_server_stays_down(sos_server):
    key = sos_server.keygen("down", "append")
    with Client(sos_server.address, key, "down", timeout=10, reconnect_timeout=0.5) as c:
        c.append("x", 0, b"a")
        sos_server.kill()
        with pytest.raises(ConnectionLost):
            c.append_many("x", 1, [b"b"] * 10)
        with pytest.raises(ConnectionLost):
            c.stat("x")
        # once the server is back, the same client works again (lazy reconnect)
        sos_server.restart()
        c.host, c.port = sos_server.host_port
        assert c.stat("x") == (1, False)
