"""SIGKILL the real server at random moments (fixed seed) while pipelined appends stream
in, 20 times; after every restart each acknowledged byte is present and intact, and what
is stored beyond the acknowledged length is only whole appends the writer really sent."""

from __future__ import annotations

import random
import threading

import pytest

from sos_wire import events as ev
from tests.conftest import RawClient
from tests.server.support import WRITER_NS as NS
from tests.server.support import WRITER_OBJECTS as OBJECTS
from tests.server.support import check_object, writer

ROUNDS = 20
SEED = 20261123


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
