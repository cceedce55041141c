"""A barrier with durability "tier" waits through a replacement server that does not hold
the writer's bytes yet (sos_journal.writer.tier_wait): after the server's disk was lost, the
replacement rebuilt from the bucket holds less of a segment than the writer was acknowledged,
and answers TIER_WAIT BAD_REQUEST "beyond the durable length" (or NOT_FOUND for an object it
does not hold) until the writer's replicator has resent the rest. The barrier asks again
within its patience instead of failing the change (found by the crash loop's disk event with
tier durability: the rename onto offsets/N failed and Spark stopped). One layer: the server
is a stand-in client here; the crash loop runs the real thing."""

from __future__ import annotations

import threading

import pytest

from sos_client.errors import SOSError
from sos_journal.errors import JournalError, JournalTierBehind
from sos_journal.writer.tier_wait import TierDurability
from sos_wire.errors import ErrorCode


class Replacement:
    """TIER_WAIT answers of a replacement server: ``refusals`` first, then OK at the length."""

    def __init__(self, refusals: list[SOSError]) -> None:
        self.refusals = refusals
        self.asked = 0

    def tier_wait(self, name: str, length: int, wait: float) -> int:
        self.asked += 1
        if self.refusals:
            raise self.refusals.pop(0)
        return length

    def close(self) -> None:
        pass


def durability(client: Replacement) -> TierDurability:
    tier = TierDurability("ns", lambda: client, threading.Condition(), threading.Event(), 1.0, 0.01)  # type: ignore[arg-type,return-value]
    tier.checked = True
    with tier.cv:
        tier.owe("seg-1", 10_343)
    return tier


def beyond() -> SOSError:
    return SOSError("TIER_WAIT offset 10343 is beyond the durable length of 'seg-1' (7726)", code=ErrorCode.BAD_REQUEST)


def test_the_barrier_waits_until_the_replacement_holds_what_was_acknowledged() -> None:
    client = Replacement([beyond(), SOSError("no object", code=ErrorCode.NOT_FOUND), beyond()])
    tier = durability(client)
    tier.barrier(deadline=None)
    assert client.asked == 4 and tier.owed == {}


def test_within_the_patience_only() -> None:
    import time

    client = Replacement([beyond() for _ in range(10_000)])
    with pytest.raises(JournalTierBehind):
        durability(client).barrier(deadline=time.monotonic() + 0.3)


def test_another_bad_request_still_fails_at_once() -> None:
    client = Replacement([SOSError("bad name", code=ErrorCode.BAD_REQUEST)])
    with pytest.raises(JournalError):
        durability(client).barrier(deadline=None)
    assert client.asked == 1
