"""The flush cadence's token bucket (sos_server.tiering.FlushSlots, protocol.md 4.3a item 2):
a few flushes at once after a quiet spell, never more than depth + T / every over T seconds."""

from __future__ import annotations

from sos_server.tiering import FlushSlots


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
