"""The one client-side retry policy (sos_client.retry, on tenacity): what it retries, how
long it waits, and that it ends with the last error."""

from __future__ import annotations

import pytest
import trio

from sos_client.errors import ConnectionLost, SOSPermissionError
from sos_client.retry import FIRST_DELAY, Backoff, async_retrying, retrying


def test_retryable_errors_are_retried_until_patience_runs_out_then_the_last_one_is_raised():
    calls = []
    with pytest.raises(ConnectionLost, match="try 3"):
        for attempt in retrying(0.25):
            with attempt:
                calls.append(1)
                raise ConnectionLost(f"try {len(calls)}")
    assert len(calls) == 3  # waits of ~0.05-0.1 and ~0.1-0.15 s fit in 0.25 s; a third would not


def test_a_refused_key_is_raised_at_once():
    calls = []
    with pytest.raises(SOSPermissionError):
        for attempt in retrying(60):
            with attempt:
                calls.append(1)
                raise SOSPermissionError("refused")
    assert calls == [1]


def test_success_ends_the_loop():
    results = []
    for attempt in retrying(5):
        with attempt:
            results.append(len(results))
            if len(results) < 2:
                raise ConnectionLost("once")
    assert results == [0, 1]


def test_backoff_doubles_from_50ms_with_jitter_and_stops_at_its_cap():
    b = Backoff(cap=0.5)
    delays = [b.next() for _ in range(10)]
    assert FIRST_DELAY <= delays[0] <= 2 * FIRST_DELAY
    assert 2 * FIRST_DELAY <= delays[1] <= 3 * FIRST_DELAY
    assert delays[-4:] == [0.5] * 4
    b.reset()
    assert b.next() <= 2 * FIRST_DELAY


def test_the_trio_form_retries_only_what_it_is_told():
    async def main() -> list[int]:
        calls: list[int] = []
        with pytest.raises(ValueError):
            async for attempt in async_retrying(5, retry_on=lambda e: isinstance(e, ConnectionLost)):
                with attempt:
                    calls.append(1)
                    raise ConnectionLost("lost") if len(calls) < 3 else ValueError("other")
        return calls

    assert trio.run(main) == [1, 1, 1]
