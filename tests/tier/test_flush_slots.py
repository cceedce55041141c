"""The flush cadence's token bucket (sos_server.tiering.FlushSlots, protocol.md 4.3a item 2):
a few flushes at once after a quiet spell, never more than depth + T / every over T seconds;
and compaction's PUTs on the same slots (4.3b), on trio's MockClock."""

from __future__ import annotations

import itertools

import pytest
import trio
import trio.lowlevel
from trio.testing import MockClock

from sos_server.tiering import COMPACT_SHARE, FlushSlots, Tier


def test_a_quiet_server_flushes_a_burst_at_once_then_one_per_interval() -> None:
    slots = FlushSlots(0.1, 3, now=0.0)
    assert [slots.take(5.0) for _ in range(3)] == [5.0, 5.0, 5.0]  # three saved slots
    assert abs(slots.take(5.0) - 5.1) < 1e-9  # the fourth waits for a slot to refill
    assert abs(slots.take(5.1) - 5.2) < 1e-9


def test_over_any_span_the_flushes_are_bounded_by_depth_plus_rate() -> None:
    slots = FlushSlots(0.1, 3, now=0.0)
    now, starts = 0.0, []
    for _ in range(200):  # a flush asked for as soon as the previous one may start
        now = slots.take(now)
        starts.append(now)
    for i, first in enumerate(starts):
        within = [t for t in starts[i:] if t < first + 1.0]
        assert len(within) <= 3 + 10  # depth + 1 s / 100 ms
    assert starts[-1] >= (200 - 3) * 0.1 - 1e-6  # the sustained rate is one per interval


def test_slots_never_save_up_beyond_the_depth() -> None:
    slots = FlushSlots(0.1, 3, now=0.0)
    starts = [slots.take(3600.0) for _ in range(4)]
    assert starts[:3] == [3600.0] * 3 and starts[3] > 3600.0


def test_compaction_spends_only_what_the_flushes_leave_and_keeps_one_for_them() -> None:
    """protocol.md 4.3b: compaction's PUTs draw on the same slots (one PUT budget)."""
    slots = FlushSlots(0.1, 3, now=0.0)
    assert slots.spare(10.0) and slots.spare(10.0)  # three saved: two for compaction...
    assert not slots.spare(10.0)  # ...the last one kept for the next flush
    assert slots.take(10.0) == 10.0
    assert not slots.spare(10.05)  # half a slot refilled: nothing spare
    assert slots.spare(10.25)  # two refilled


def test_flushes_and_compaction_together_stay_within_depth_plus_rate() -> None:
    slots = FlushSlots(0.1, 3, now=0.0)
    now, puts = 0.0, []
    for i in range(300):  # a loaded server: a flush as soon as it may start; compaction beside it
        if i % 3 == 0 and slots.spare(now):
            puts.append(now)
        now = slots.take(now)
        puts.append(now)
    for i, first in enumerate(puts):
        assert len([t for t in puts[i:] if t < first + 1.0]) <= 3 + 10


def _paced_tier(every: float) -> Tier:
    """A Tier with only what its compaction pacing reads (the rest of it needs a server)."""
    tier = Tier.__new__(Tier)
    tier._slots = FlushSlots(every, 3, now=trio.current_time())
    return tier


@pytest.mark.parametrize("every", [0.1, 1.0, 60.0])
def test_on_a_quiet_server_compaction_takes_spare_slots_and_never_delays_a_flush(every: float) -> None:
    async def main() -> None:
        tier = _paced_tier(every)
        t0 = trio.current_time()
        for _ in range(4):
            await tier._compaction_slot()
        # two saved slots at once, then one each time the bucket holds two again
        assert trio.current_time() - t0 <= 2 * every + 1e-6
        assert tier._slots is not None and tier._slots.take(trio.current_time()) == trio.current_time()

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_a_flush_that_waits_pays_compactions_share_and_one_that_does_not_never_does() -> None:
    slots = FlushSlots(0.1, 3, now=0.0)
    slots.sharing = True
    assert [slots.take(5.0) for _ in range(3)] == [5.0, 5.0, 5.0]  # saved slots: no share
    assert not slots.shared()
    starts = [slots.take(5.0) for _ in range(9)]  # each waits: 1 + 1/9 slot each
    gaps = [b - a for a, b in zip([5.0, *starts], starts)]
    assert all(abs(g - 0.1 * (1 + COMPACT_SHARE)) < 1e-9 for g in gaps), gaps
    assert slots.shared() and not slots.shared()  # nine shares: one whole slot, spent once


def _flushes_beside_compaction(waits: bool, seconds: float) -> tuple[FlushSlots, list[float], list[float]]:
    """On trio's MockClock, a Tier's pacing at --tier-flush 100ms: a flush loop (``waits``:
    Tier.run's, a flush wanted at every slot, so each waits for its slot; else one that asks
    only once a slot has just refilled, never waiting) and compaction asking for slot after
    slot beside it, for ``seconds``; the times of the flushes and of compaction's slots."""
    flushes: list[float] = []
    compactions: list[float] = []

    async def main() -> FlushSlots:
        tier = _paced_tier(0.1)
        assert tier._slots is not None
        slots = tier._slots

        async def flush_loop() -> None:
            if not waits:
                for _ in range(3):
                    slots.take(trio.current_time())  # the saved slots spent
            while True:
                if not waits:
                    await trio.sleep(0.1)
                await trio.sleep_until(slots.take(trio.current_time()))
                flushes.append(trio.current_time())
                await trio.lowlevel.checkpoint()

        async def compaction() -> None:
            while True:
                await tier._compaction_slot()
                compactions.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(flush_loop)
            await trio.sleep(0.01)
            nursery.start_soon(compaction)
            await trio.sleep(seconds)
            nursery.cancel_scope.cancel()
        return slots

    slots = trio.run(main, clock=MockClock(autojump_threshold=0))
    puts = sorted(flushes + compactions)
    for i, first in enumerate(puts):  # the budget holds for both together
        assert len([t for t in puts[i:] if t < first + 1.0]) <= 3 + 10
    return slots, flushes, compactions


def test_on_a_loaded_server_compaction_takes_one_slot_in_ten_and_the_flushes_stay_evenly_spaced() -> None:
    slots, flushes, compactions = _flushes_beside_compaction(waits=True, seconds=60.0)
    assert 50 <= len(compactions) <= 66, len(compactions)  # about one a second (60 here)
    assert len(flushes) >= 530, len(flushes)  # the flushes keep about nine slots in ten
    # ...evenly: no flush waits a whole extra interval now and then (a barrier's wait grows
    # by a ninth of an interval, protocol.md 4.3a item 2)
    gaps = [b - a for a, b in itertools.pairwise(flushes)]
    assert max(gaps) <= 0.1 * (1 + COMPACT_SHARE) + 1e-6, max(gaps)
    assert not slots.sharing  # the waiting compaction was cancelled: flushes pay no share


def test_flushes_right_at_the_cadence_never_starve_compaction() -> None:
    """Flushes that always find their slot just refilled neither leave one spare nor wait (so
    pay no share): compaction then takes one ahead of them after COMPACT_AHEAD_AFTER
    intervals, and the budget still holds for both."""
    _slots, flushes, compactions = _flushes_beside_compaction(waits=False, seconds=30.0)
    assert len(compactions) >= 10, len(compactions)  # one at least every 2 s and a slot
    assert len(flushes) >= 250, len(flushes)
