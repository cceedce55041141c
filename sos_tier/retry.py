"""The tier's retry policies, on tenacity like the client side's (``sos_client/retry.py``).

Three waits, each decided here with what it retries:

- :func:`busy_retrying`: a conditional PUT that S3 answers ``409 ConditionalRequestConflict``
  (:class:`~sos_tier.store.TierBusy`: another conditional write of the key is in flight) is
  tried again by ``S3Store.put_once`` itself: 5 tries in all, 50 ms between the first two,
  doubling (50, 100, 200, 400 ms), silently; then the TierBusy reaches the caller like any
  TierError. Nothing else is retried there (botocore's own retries have run below).
- :class:`Backoff`: the server's upload rounds (``sos_server/tiering.py``). A namespace whose
  round failed with a TierError is left alone for 1 s, doubling to 30 s (``BACKOFF_MIN``,
  ``BACKOFF_MAX``: a failing store is tried at least every 30 s), and a successful round starts
  it over. The rounds are the loop; this gives the wait before the next one of a namespace.
- :func:`fence_retrying`: FENCE's marker (``Tier.fence``): retried 0.2 s doubling to 2 s while
  FENCE's own deadline lasts (the caller's, which also cancels a call in flight), unless the
  error says retrying cannot help (:func:`fence_retryable`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    stop_never,
    wait_exponential,
)

from sos_tier.store import TierBusy, TierError
from sos_tier.uploader import TierFenced, TierMarkerTaken

__all__ = [
    "BACKOFF_MAX",
    "BACKOFF_MIN",
    "BUSY_FIRST_DELAY",
    "BUSY_TRIES",
    "FENCE_FIRST_DELAY",
    "FENCE_MAX_DELAY",
    "Backoff",
    "busy_retrying",
    "fence_retryable",
    "fence_retrying",
]

BUSY_TRIES = 5
BUSY_FIRST_DELAY = 0.05

BACKOFF_MIN = 1.0
BACKOFF_MAX = 30.0  # a failing store is retried at least this often

FENCE_FIRST_DELAY = 0.2
FENCE_MAX_DELAY = 2.0


def busy_retrying(sleep: Callable[[float], None] = time.sleep) -> Retrying:
    """``for attempt in busy_retrying(): with attempt: <the conditional PUT>``: retries
    :class:`TierBusy` only, :data:`BUSY_TRIES` tries in all, then raises the last error."""
    return Retrying(
        retry=retry_if_exception_type(TierBusy),
        wait=wait_exponential(multiplier=BUSY_FIRST_DELAY),
        stop=stop_after_attempt(BUSY_TRIES),
        reraise=True,
        sleep=sleep,
    )


class Backoff:
    """The server's wait before a failing namespace's next round: ``next()`` after each failed
    round (1, 2, 4, 8, 16, 30, 30 ... s), ``reset()`` after a round that worked."""

    def __init__(self, first: float = BACKOFF_MIN, cap: float = BACKOFF_MAX) -> None:
        self._wait = wait_exponential(multiplier=first, min=first, max=cap)
        self._state = RetryCallState(Retrying(), None, (), {})
        self._state.attempt_number = 0

    def next(self) -> float:
        self._state.attempt_number += 1
        return self._wait(self._state)

    def reset(self) -> None:
        self._state.attempt_number = 0


def fence_retryable(exc: BaseException) -> bool:
    """A store error, unless a higher fence is in the bucket (:class:`TierFenced`) or this
    epoch's marker key holds other bytes (:class:`TierMarkerTaken`): only a higher epoch helps."""
    return isinstance(exc, TierError) and not isinstance(exc, (TierFenced, TierMarkerTaken))


def fence_retrying(
    sleep: Callable[[float], Awaitable[None]],
    before_sleep: Callable[[RetryCallState], None] | None = None,
) -> AsyncRetrying:
    """``async for attempt in fence_retrying(trio.sleep, ...): with attempt: ...``: retries
    what :func:`fence_retryable` accepts, never stopping by itself (run it under the caller's
    deadline); *before_sleep* sees each failure that is retried."""
    return AsyncRetrying(
        retry=retry_if_exception(fence_retryable),
        wait=wait_exponential(multiplier=FENCE_FIRST_DELAY, max=FENCE_MAX_DELAY),
        stop=stop_never,
        reraise=True,
        sleep=sleep,
        before_sleep=before_sleep,
    )
