"""SIGKILL the real server at random moments (fixed seed) while pipelined appends stream
in, 20 times; after every restart each acknowledged byte is present and intact, and what
is stored beyond the acknowledged length is only whole appends the writer really sent."""

from __future__ import annotations

import hashlib
import random
import threading

import pytest

from sos_wire import events as ev
from sos_wire.crc import crc32c
from tests.conftest import RawClient

NS = "crash"
OBJECTS = ["j/a", "j/b", "j/c"]
WINDOW = 24  # appends in flight per connection
ROUNDS = 20
SEED = 20261123


def chunk(obj: str, offset: int) -> bytes:
    """The append a writer sends at *offset* of *obj*: size and bytes are a function of both."""
    h = hashlib.sha256(f"{obj}:{offset}".encode()).digest()
    cap = 100_000 if h[4] % 4 == 0 else 6_000
    size = 1 + int.from_bytes(h[:4], "big") % cap
    return (h * (size // 32 + 1))[:size]


def writer(address, key, start, acked, reached, stop_after, errors):
    """Pipeline appends until the connection dies; record acks; set *reached* after
    *stop_after* acks (the test then kills the server)."""
    next_off = dict(start)
    inflight: dict[int, tuple[str, int]] = {}
    got = 0
    i = 0
    try:
        c = RawClient(address, timeout=120)
        try:
            r = c.login(key, NS)
            if not isinstance(r, ev.AuthOk):
                errors.append(f"login: {r}")
                return
            while True:
                while len(inflight) < WINDOW:
                    obj = OBJECTS[i % len(OBJECTS)]
                    i += 1
                    data = chunk(obj, next_off[obj])
                    rid = c.rid()
                    c.send(ev.Append(rid, obj, next_off[obj], 0, crc32c(data), data))
                    next_off[obj] += len(data)
                    inflight[rid] = (obj, next_off[obj])
                r = c.next()
                obj, end = inflight.pop(r.request_id)
                if not isinstance(r, ev.AppendOk) or r.length != end:
                    errors.append(f"{obj}@{end}: {r}")
                    return
                acked[obj] = max(acked[obj], end)
                got += 1
                if got == stop_after:
                    reached.set()
        finally:
            c.close()
    except (EOFError, OSError):
        return  # the server died under us: expected
    finally:
        reached.set()


def check_object(c: RawClient, obj: str, acked: int) -> int:
    st = c.stat(obj)
    if isinstance(st, ev.Error):
        assert acked == 0, f"{obj}: acked {acked} bytes but the object is gone: {st}"
        return 0
    assert st.length >= acked, f"{obj}: acked {acked} but only {st.length} bytes survived"
    data = c.read(obj)
    assert isinstance(data, bytes), data
    assert len(data) == st.length
    pos = 0
    while pos < len(data):  # every stored byte belongs to a whole append the writer sent
        want = chunk(obj, pos)
        assert data[pos : pos + len(want)] == want, f"{obj}: bytes at {pos} are not what was appended"
        pos += len(want)
    assert pos == len(data)
    return st.length


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_during_pipelined_appends_loses_no_acked_byte(sos_server):
    key = sos_server.keygen(NS)
    rng = random.Random(SEED)
    lengths = {o: 0 for o in OBJECTS}
    total_acks = 0
    for _ in range(ROUNDS):
        acked = dict(lengths)
        reached = threading.Event()
        errors: list[str] = []
        stop_after = rng.randint(1, 80)
        t = threading.Thread(
            target=writer, args=(sos_server.address, key, lengths, acked, reached, stop_after, errors), daemon=True
        )
        t.start()
        assert reached.wait(300), "writer made no progress"
        sos_server.kill()
        t.join(300)
        assert not t.is_alive()
        assert errors == [], errors
        sos_server.start()
        with RawClient(sos_server.address) as c:
            assert isinstance(c.login(key, NS), ev.AuthOk)
            for obj in OBJECTS:
                lengths[obj] = check_object(c, obj, acked[obj])
        total_acks += sum(1 for o in OBJECTS if acked[o] > 0)
    assert sos_server.starts == ROUNDS + 1
    assert sum(lengths.values()) > 0
