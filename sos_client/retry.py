"""The one retry policy of the client side, built on tenacity.

Every wait on the server (a first connection, a reconnection, a writer opening its journal,
the replicator shipping it) backs off the same way: 50 ms, doubling, plus up to 50 ms of
jitter so that the nodes of a cluster do not come back in step, capped (1 s unless the caller
says otherwise), until the caller's patience runs out. What is retried is decided in one
place too: :func:`sos_client.errors.is_retryable` (a lost connection, a busy or short server),
never a refused key or a bad name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_before_delay,
    wait_exponential_jitter,
)

from sos_client.errors import is_retryable

__all__ = ["FIRST_DELAY", "MAX_DELAY", "Backoff", "async_retrying", "retrying"]

FIRST_DELAY = 0.05
MAX_DELAY = 1.0


def _wait(cap: float) -> wait_exponential_jitter:
    return wait_exponential_jitter(multiplier=FIRST_DELAY, max=cap, jitter=FIRST_DELAY)


def _log_before_sleep(log: logging.Logger | None, what: str) -> Callable[[RetryCallState], None] | None:
    if log is None:
        return None

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        log.warning("%s: %s: %s; retrying in %.2fs", what, type(exc).__name__, exc, delay)

    return before_sleep


def retrying(
    patience: float,
    *,
    cap: float = MAX_DELAY,
    retry_on: Callable[[BaseException], bool] = is_retryable,
    log: logging.Logger | None = None,
    what: str = "retry",
) -> Retrying:
    """``for attempt in retrying(30): with attempt: ...``: retries what ``retry_on`` accepts
    while the next wait still ends within ``patience`` seconds; then the last error is raised."""
    return Retrying(
        retry=retry_if_exception(retry_on),
        wait=_wait(cap),
        stop=stop_before_delay(patience),
        reraise=True,
        before_sleep=_log_before_sleep(log, what),
    )


def async_retrying(
    patience: float, *, cap: float = MAX_DELAY, retry_on: Callable[[BaseException], bool] = is_retryable
) -> AsyncRetrying:
    """The same policy for trio code: ``async for attempt in async_retrying(30): with attempt: ...``."""
    import trio  # noqa: PLC0415 - only trio callers load trio (the blocking client does not)

    return AsyncRetrying(
        retry=retry_if_exception(retry_on),
        wait=_wait(cap),
        stop=stop_before_delay(patience),
        reraise=True,
        sleep=trio.sleep,
    )


class Backoff:
    """The policy's delays for a loop that retries until it is told to stop (the
    replicator): ``next()`` gives the next wait, ``reset()`` after a success."""

    def __init__(self, cap: float = MAX_DELAY) -> None:
        self._wait = _wait(cap)
        self._state = RetryCallState(Retrying(), None, (), {})
        self._state.attempt_number = 0

    def next(self) -> float:
        self._state.attempt_number += 1
        return self._wait(self._state)

    def reset(self) -> None:
        self._state.attempt_number = 0
