"""Durability "tier" of a JournalWriter: what its barriers owe the server's object-store bucket.

:class:`TierDurability` keeps the objects the server acknowledged and the bucket is not known
to hold yet (``owed``, under the writer's condition variable: the replicator adds to it), and
asks the server with TIER_WAIT (protocol.md 1.11) over a connection of its own, one barrier at
a time, until the bucket holds them: :class:`JournalTierBehind` once the caller's patience ran
out, :class:`JournalTierUnavailable` if the server has no working tier. It knows nothing of the
spool or the replicator: the writer's barrier waits for the server first, then calls
:meth:`TierDurability.barrier`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sos_client.errors import SOSError, TierUnavailable
from sos_client.retry import Backoff, retrying
from sos_journal.errors import JournalError, JournalTierBehind, JournalTierUnavailable, WriterClosed
from sos_journal.format import layout
from sos_journal.store import ListedObject, StoreClient, close_quietly, is_retryable, without_reconnects
from sos_wire.errors import ErrorCode

__all__ = ["DURABILITIES", "TierDurability"]

log = logging.getLogger(__name__)

#: ``durability`` values: a barrier waits for the server's disk, or also for its tier's bucket
DURABILITIES = ("server", "tier")


@dataclass(eq=False)
class TierDurability:
    """The bucket side of a writer's barriers (see the module docstring)."""

    namespace: str
    client_factory: Callable[[], StoreClient]
    #: the writer's condition variable: it guards ``owed`` (the replicator adds to it)
    cv: threading.Condition
    #: the writer's stop event, set once it is closed: a wait for the bucket stops, a backoff is cut short
    stop: threading.Event
    wait: float  # seconds one TIER_WAIT asks the server to wait
    max_backoff: float
    #: object -> length acknowledged by the server and not known to be in the bucket
    #: (what the next barrier waits for); under ``cv``
    owed: dict[str, int] = field(default_factory=dict, init=False)
    checked: bool = field(default=False, init=False)  # a TIER_WAIT at offset 0 said the server has a working tier
    refused: bool = field(default=False, init=False)  # ... or said it has none (close() then waits for the server only)
    waits: int = field(default=0, init=False)  # TIER_WAITs answered TIER_WAIT_OK
    #: one barrier asks the server at a time, over a connection of its own (waits can be long)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _client: StoreClient | None = field(default=None, init=False, repr=False)

    def owe(self, name: str, length: int) -> None:
        """With the lock held: the server acknowledged ``name`` up to ``length`` (whole
        records); the next barrier waits for the bucket to hold that much."""
        if length > self.owed.get(name, 0):
            self.owed[name] = length

    def owe_seal(self, name: str) -> None:
        """With the lock held: the server sealed ``name``; TIER_WAIT on a sealed object waits
        for its seal marker (protocol.md 1.11 rule 6)."""
        self.owed.setdefault(name, 0)

    def open(
        self, client: StoreClient, entries: Sequence[ListedObject], gens: dict[int, layout.GenerationInfo]
    ) -> None:
        """At open: refuse a server without a working tier (a TIER_WAIT at offset 0 of any
        object fails only then, protocol.md 1.11), and owe the bucket the objects a restore from
        it would read (the newest complete generation and any after it), which an earlier
        writer may have left acknowledged but not uploaded."""
        complete = [g.generation for g in gens.values() if g.ready and g.segments]
        floor = max(complete, default=0)
        owed = {s.name: s.length for g in gens.values() if g.generation >= floor for s in g.segments if s.length > 0}
        # a complete generation's ready marker too: a reader of the bucket alone needs it
        owed |= {layout.ready_name(g.generation): 0 for g in gens.values() if g.generation >= floor and g.ready}
        with self.cv:
            self.owed = owed
        if entries:
            self.probe(client, entries[0].name)

    def barrier(self, deadline: float | None) -> None:
        """Wait until the tier holds every object this writer owes it, as owed now (the
        server's durability of the barrier's records is already there)."""
        # one barrier asks at a time: the others wait here, then find its answers
        if not self._lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise JournalTierBehind(
                f"barrier: another barrier of namespace {self.namespace!r} is still waiting for "
                f"the object-store tier after the caller's patience ran out"
            )
        try:
            with self.cv:
                owed = sorted(self.owed.items())
            for name, length in owed:
                self._wait_for(name, length, deadline)
        finally:
            self._lock.release()

    def check(self, patience: float) -> None:
        """Ask the server whether it has a working tier about an object already durable on it
        (JournalTierUnavailable if not), retrying a lost connection for ``patience`` s; a no-op
        while nothing is owed (the first barrier asks)."""
        with self.cv:
            names = sorted(self.owed)
        if not names:
            return
        with self._lock:
            for attempt in retrying(patience, cap=self.max_backoff):
                with attempt:
                    try:
                        self.probe(self._conn(), names[0])
                    except JournalError:
                        raise
                    except Exception:
                        self.drop()
                        raise

    def _conn(self) -> StoreClient:
        if self._client is None:  # (_wait_for retries within the caller's patience: not the client)
            self._client = without_reconnects(self.client_factory())
        return self._client

    def drop(self) -> None:
        """Close the barriers' connection (the next one opens another)."""
        client, self._client = self._client, None
        close_quietly(client)

    def probe(self, client: StoreClient, name: str) -> None:
        """TIER_WAIT ``name`` at offset 0 (answered at once): fails only when the server has no
        tier or its tier stopped copying the namespace or the object (protocol.md 1.11)."""
        wait = getattr(client, "tier_wait", None)
        if wait is None:
            raise JournalTierUnavailable(
                f"durability 'tier' for namespace {self.namespace!r}: this client "
                f"({type(client).__name__}) cannot ask for the server's tier (TIER_WAIT)"
            )
        try:
            wait(name, 0, 0)
        except TierUnavailable as e:
            if "no tier configured" not in e.message and "tier stopped" not in e.message:
                # rule 7: the tier is there and has not caught up yet (a sealed object's marker, an
                # object not copied yet): the barriers wait for it
                self.checked = True
                return
            self.refused = True
            no_tier = "no tier configured" in e.message
            raise JournalTierUnavailable(
                f"durability 'tier' for namespace {self.namespace!r}: "
                + (
                    "the SOS server has no object-store tier: start it with `sos-server serve --tier URL`, "
                    "or use durability 'server'"
                    if no_tier
                    else "the SOS server's tier does not copy this namespace's journal (another server took the "
                    "namespace over in the bucket, or a conflict: see the server's log)"
                )
                + f" ({e})"
            ) from e
        self.checked = True

    def _wait_for(self, name: str, length: int, deadline: float | None) -> None:
        """Until the tier holds ``name`` up to ``length``: TIER_WAIT, asked again after each
        TIER_UNAVAILABLE (the bucket behind) and each lost connection, until ``deadline``."""
        backoff = Backoff(self.max_backoff)
        last: BaseException | None = None
        tiered = 0
        recheck = False  # after a TIER_UNAVAILABLE: is the tier behind, or not copying at all?
        while True:
            if self.stop.is_set():
                raise WriterClosed(f"writer closed while waiting for the tier to hold {name} up to {length}")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 and last is not None:
                raise JournalTierBehind(
                    f"barrier: the journal of namespace {self.namespace!r} is durable on the SOS server but its "
                    f"object-store tier (the bucket) holds {tiered} of the {length} bytes of {name} waited for, "
                    f"after the caller's patience ran out: {last}. Nothing is lost: the server keeps uploading",
                    segment=name,
                    tiered=tiered,
                    wanted=length,
                ) from last
            wait = self.wait if left is None else min(self.wait, max(0.0, left))
            started = time.monotonic()
            try:
                client = self._conn()
                if recheck or not self.checked:
                    self.probe(client, name)  # JournalTierUnavailable: it will never have it
                    recheck = False
                got = client.tier_wait(name, length, wait)  # type: ignore[attr-defined]  # probe found it
            except TierUnavailable as e:
                last, tiered, recheck = e, max(tiered, e.length), True
                if time.monotonic() - started < wait / 2:  # answered early: do not ask in a loop
                    self._sleep(backoff.next(), deadline)
                continue
            except JournalError:
                raise
            except Exception as e:
                if _not_durable_yet(e):
                    # a replacement server (its disk lost, rebuilt from the bucket) holds less
                    # of the object than this writer waits for until the replicator has resent
                    # the rest: asked again after that, within the patience (protocol.md 1.11
                    # TIER_WAIT rule 3)
                    last = e
                    self._sleep(backoff.next(), deadline)
                    continue
                if not is_retryable(e):
                    raise JournalError(
                        f"barrier: waiting for the tier to hold {name} up to {length}: {type(e).__name__}: {e}"
                    ) from e
                last = e
                self.drop()
                delay = backoff.next()
                log.warning("barrier: waiting for the tier: %s: %s; retrying in %.2fs", type(e).__name__, e, delay)
                self._sleep(delay, deadline)
                continue
            with self.cv:
                if self.owed.get(name, 0) <= got:
                    self.owed.pop(name, None)
                self.waits += 1
            return

    def _sleep(self, delay: float, deadline: float | None) -> None:
        if deadline is not None:
            delay = min(delay, max(0.0, deadline - time.monotonic()))
        self.stop.wait(delay)


def _not_durable_yet(exc: BaseException) -> bool:
    """What a replacement server answers a TIER_WAIT before this writer's resend reached it:
    BAD_REQUEST for an offset beyond what it holds durably, NOT_FOUND for an object it does
    not hold yet (protocol.md 1.11 TIER_WAIT)."""
    if not isinstance(exc, SOSError):
        return False
    return exc.code == ErrorCode.NOT_FOUND or (
        exc.code == ErrorCode.BAD_REQUEST and "beyond the durable length" in str(exc)
    )
