"""The barriers of a JournalWriter: waiting until records are durable (and restorable).

:class:`Barriers` (a role of :class:`~sos_journal.writer.writer.JournalWriter`) waits, on
the writer's condition variable, until the replicator has had every record up to a sequence
number acknowledged and the ``ready`` object of every generation that starts at or before it
exists; with durability "tier", then until the server's bucket holds them too
(:class:`~sos_journal.writer.tier_wait.TierDurability`). In the quota state a barrier wakes the
replicator for one more attempt and fails promptly (:class:`JournalQuotaExceeded`) rather
than wait for an operator. ``close()`` flushes through the same waits.
"""

from __future__ import annotations

import logging
import time

from sos_journal.errors import JournalError, JournalQuotaExceeded, WriterClosed
from sos_journal.writer.state import WriterState

__all__ = ["CLOSE_TIER_PATIENCE", "QUOTA_RECHECK", "Barriers"]

log = logging.getLogger(__name__)

#: In the quota state a barrier waits at most this long for one more attempt of the
#: replicator (woken at once) before it fails: a quota raised a moment ago is then seen,
#: and an unreachable server does not turn the prompt refusal into a wait.
QUOTA_RECHECK = 5.0

#: close() waits at most this long for the bucket when neither its timeout nor the writer's
#: tier_patience bounds it (a store down at shutdown must not hold a process forever)
CLOSE_TIER_PATIENCE = 60.0


class Barriers(WriterState):
    """The waiting side of a writer (see the module docstring)."""

    def durable_now(self, seq: int | None = None, *, wake: bool = True, server_part: bool = False) -> bool | None:
        """Without waiting: True when :meth:`barrier` would return at once for ``seq``
        (durability "server": every record <= ``seq`` acknowledged, the ready objects made);
        False when it would wait while the writer is healthy (the replicator is shipping
        them; its ``progress_listener`` tells when to ask again); None when only
        :meth:`barrier` can tell (durability "tier": a round trip to the server; the quota
        state; a failed, closed or stopped writer): call it, in a thread that may block.
        ``wake=False``: a caller that ships the records itself (:meth:`claim_round`) does
        not hurry the thread (it is told if the claim is refused). ``server_part``: the
        same answers about the server's part alone, whatever the durability (with "tier",
        True says only that :meth:`barrier` has the bucket's part left to wait for)."""
        with self._cv:
            if self.durability != "server" and not server_part:
                return None
            target = self._seq if seq is None else seq
            if self._durable(target):
                return True
            if (
                self._error is not None
                or self._closed
                or self._quota is not None
                or self._thread is None
                or not self._thread.is_alive()
            ):
                return None
            if wake:
                self._want(target)  # the caller waits for it: nothing of it is held back
            return False

    def barrier(self, seq: int | None = None, timeout: float | None = None) -> None:
        """Block until every record <= seq (default: all so far) is durable on the server
        and restorable: the ``ready`` object of every generation that starts at or before
        ``seq`` exists (restore ignores a generation without it, so records acked after an
        asynchronous rotation would otherwise not count). With durability "tier", then until
        the server's tier holds them too (the writer's module docstring): JournalTierBehind after
        ``timeout`` (else ``tier_patience``), JournalTierUnavailable if the server has no
        working tier."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._server_barrier(seq, deadline, timeout)
        if self.durability == "tier":
            if deadline is None and self.tier_patience is not None:
                deadline = time.monotonic() + self.tier_patience
            self._tier.barrier(deadline)

    def check_tier(self, timeout: float | None = None) -> None:
        """Durability "tier": make sure the server has a working tier (JournalTierUnavailable
        otherwise), if open() could not ask (a new namespace held no object yet): waits until
        something is durable on the server, then asks about it. A no-op once known."""
        if self.durability != "tier" or self._tier.checked:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        self._server_barrier(None, deadline, timeout)
        self._tier.check(self.open_timeout if timeout is None else timeout)

    def _flush(self, timeout: float | None) -> None:
        """close()'s wait: everything acknowledged (and in the bucket, unless the server has no
        tier), up to ``timeout``; what is not is logged, never raised."""
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._server_barrier(None, deadline, timeout)
            if self.durability == "tier" and not self._tier.refused:
                if deadline is None:
                    patience = self.tier_patience if self.tier_patience is not None else CLOSE_TIER_PATIENCE
                    deadline = time.monotonic() + patience
                self._tier.barrier(deadline)
        except (TimeoutError, JournalError) as e:
            log.warning("close: journal not fully shipped: %s", e)

    def _server_barrier(self, seq: int | None, deadline: float | None, timeout: float | None) -> None:
        with self._cv:
            target = self._seq if seq is None else seq
            while not self._durable(target):
                self._want(target)
                if self._error is not None:
                    self._check_usable()
                if self._thread is None or not self._thread.is_alive():
                    raise WriterClosed(f"replicator is not running; records up to {target} not acked")
                if self._quota is not None:
                    self._recheck_quota(target, deadline)
                    continue
                wait = 1.0
                if deadline is not None:
                    wait = deadline - time.monotonic()
                    if wait <= 0:
                        raise TimeoutError(
                            f"barrier: record {target} not durable after {timeout} s "
                            f"(acked {self._acked}; last error: {self.last_error})"
                        )
                    wait = min(wait, 1.0)
                self._cv.wait(wait)

    def _recheck_quota(self, target: int, deadline: float | None) -> None:
        """With the lock held, in the quota state: wake the replicator for one more attempt
        and wait for it (at most QUOTA_RECHECK s); raise JournalQuotaExceeded if the server
        still refuses and ``target`` is not durable."""
        attempts = self._attempts
        self._wake.set()
        limit = time.monotonic() + QUOTA_RECHECK
        if deadline is not None:
            limit = min(limit, deadline)
        while (
            self._quota is not None and self._attempts == attempts and self._error is None and not self._durable(target)
        ):
            left = limit - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)
        if self._quota is not None and self._error is None and not self._durable(target):
            raise JournalQuotaExceeded(
                f"namespace {self.namespace!r} is over its quota on the SOS server ({self._quota}): record "
                f"{target} cannot become durable (acknowledged up to {self._acked}). It and every record "
                f"before it stay in the spool and are shipped, in order, once the server's operator raises "
                f"the quota (sos-server quota)",
                applied=True,
            )
