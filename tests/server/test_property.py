"""Property (hypothesis, against the real server): arbitrary sequences of valid and invalid
requests from an authenticated client never change a byte that was acknowledged."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sos_wire import events as ev
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from tests.conftest import RawClient, ServerProcess

OBJS = ["a", "b/c", "d"]
_ns_counter = itertools.count()


op = st.one_of(
    st.tuples(
        st.just("append"),
        st.sampled_from(OBJS),
        st.sampled_from(["end", "end", "end", "retry", "mutated_retry", "random"]),
        st.binary(min_size=0, max_size=300),
        st.booleans(),  # crc correct?
        st.integers(-1, 1),  # epoch relative to the fence
        st.integers(0, 400),
    ),
    st.tuples(st.just("seal"), st.sampled_from(OBJS), st.integers(-1, 1)),
    st.tuples(st.just("fence"), st.integers(-1, 2)),
    st.tuples(st.just("read"), st.sampled_from(OBJS), st.integers(0, 400), st.integers(0, 400)),
    st.tuples(st.just("bad_name"), st.sampled_from(["../a", "/a", "a//b", ".", "x" * 1100])),
)


@settings(
    max_examples=40,
    derandomize=True,  # CI must be deterministic
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(op, min_size=1, max_size=25))
def test_acked_bytes_never_change(server: ServerProcess, ops):
    ns = f"p{next(_ns_counter)}"
    key = server.keygen(ns)
    acked = {o: b"" for o in OBJS}  # acknowledged prefix of each object
    length = {o: 0 for o in OBJS}  # what the server last told us
    fence = 0
    with RawClient(server.address) as c:
        assert isinstance(c.login(key, ns), ev.AuthOk)
        for o in ops:
            kind = o[0]
            if kind == "append":
                _, obj, how, data, crc_ok, de, rnd = o
                if how == "end":
                    off = length[obj]
                elif how in ("retry", "mutated_retry") and acked[obj]:
                    off = rnd % len(acked[obj])
                    data = acked[obj][off : off + max(1, len(data))]
                    if how == "mutated_retry":
                        data = bytes([data[0] ^ 0x5A]) + data[1:]
                else:
                    off = rnd
                crc = crc32c(data) if crc_ok else crc32c(data) ^ 0x1
                r = c.call(ev.Append(c.rid(), obj, off, max(fence + de, 0), crc, data))
                if isinstance(r, ev.AppendOk):
                    assert crc_ok and r.length == off + len(data)
                    known = acked[obj]
                    # the acknowledged bytes must agree with everything acked before
                    overlap = known[off : off + len(data)]
                    assert overlap == data[: len(overlap)], "an ack contradicts earlier acked bytes"
                    if off + len(data) > len(known):
                        assert off <= len(known)
                        acked[obj] = known[:off] + data
                    length[obj] = max(length[obj], r.length)
                else:
                    assert r.code in (
                        ErrorCode.OFFSET_MISMATCH,
                        ErrorCode.CHECKSUM_MISMATCH,
                        ErrorCode.SEALED,
                        ErrorCode.FENCED,
                    ), r
                    if r.code is ErrorCode.OFFSET_MISMATCH:
                        length[obj] = r.length
                    if r.code is ErrorCode.CHECKSUM_MISMATCH:
                        assert not crc_ok
            elif kind == "seal":
                _, obj, de = o
                r = c.call(ev.Seal(c.rid(), obj, max(fence + de, 0)))
                assert isinstance(r, (ev.SealOk, ev.Error))
                if isinstance(r, ev.SealOk):
                    assert r.length == len(acked[obj])
                else:
                    assert r.code in (ErrorCode.NOT_FOUND, ErrorCode.FENCED), r
            elif kind == "fence":
                want = fence + o[1]
                r = c.call(ev.Fence(c.rid(), max(want, 0)))
                if isinstance(r, ev.FenceOk):
                    assert r.epoch > fence
                    fence = r.epoch
                else:
                    assert r.code is ErrorCode.FENCED and r.length == fence
            elif kind == "read":
                _, obj, off, ln = o
                r = c.read(obj, off, ln)
                if isinstance(r, bytes):
                    want = acked[obj][off:] if ln == 0 else acked[obj][off : off + ln]
                    assert r[: len(want)] == want
                else:
                    assert r.code in (ErrorCode.NOT_FOUND, ErrorCode.BAD_REQUEST), r
            else:
                r = c.append(o[1], 0, b"x")
                assert r.code is ErrorCode.BAD_NAME
        for obj in OBJS:  # finally: every acked byte is there, unchanged
            data = c.read(obj)
            if isinstance(data, ev.Error):
                assert data.code is ErrorCode.NOT_FOUND and acked[obj] == b""
            else:
                assert data[: len(acked[obj])] == acked[obj]
