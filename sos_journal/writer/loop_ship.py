"""Shipping a writer's rounds from a trio event loop (the gateway's): the same rounds, another transport.

A barrier in the event loop that finds its records unacknowledged would otherwise wake the
replicator thread (a condition variable) and sleep until the thread's report of progress
wakes the loop again (trio's token): two cross-thread hand-offs and a blocking round in
another thread per barrier. :class:`LoopShipper` instead claims the next APPEND round from the
writer (:meth:`~sos_journal.writer.replicator.Replicator.claim_round`: what to send, chosen by
the replicator's own logic, the thread shipping nothing meanwhile), sends it on an
:class:`~sos_client.aio.AsyncClient` the loop owns (offset-checked, epoch-fenced, as the
thread's) and reports the answer (``round_done``: what counts as acknowledged, the same
bookkeeping as the thread's). One journal core: only the transport differs.

Everything else stays the thread's: a STAT after a reconnect, the confirmation of bytes
this writer did not have acknowledged itself, a new generation's check, seals, ready
objects, the quota state, backoff. A round that fails in any way (its APPEND may or may
not have landed) is handed to the thread (``round_failed``): it asks the server's length
again and retries with its backoff, and its verdict (fenced, quota, a foreign byte) is the
writer's, exactly as when the thread had shipped the round; rounds are claimed again only
after the thread's next successful one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from sos_client.aio import AsyncClient

if TYPE_CHECKING:
    from sos_journal.writer.writer import JournalWriter

__all__ = ["LoopShipper"]

log = logging.getLogger(__name__)


class LoopShipper:
    """Ships rounds of ``writer`` from the trio loop it runs in (module docstring);
    ``client_factory`` makes the loop's :class:`AsyncClient` (connected at its first use)."""

    def __init__(self, writer: JournalWriter, client_factory: Callable[[], AsyncClient]) -> None:
        self.writer = writer
        self.client_factory = client_factory
        self._client: AsyncClient | None = None
        #: rounds shipped here, and rounds handed to the thread after a failure
        self.rounds = 0
        self.failures = 0

    async def ship(self, target: int) -> bool:
        """One round towards record ``target``, if the writer lets this transport ship it:
        True once the server acknowledged it; False when the thread ships (it was told a
        barrier waits) and its progress is to be waited for."""
        writer = self.writer
        rnd = writer.claim_round(target)
        if rnd is None:
            return False
        try:
            client = self._client
            if client is None:
                client = self._client = self.client_factory()
            if len(rnd.chunks) == 1:
                new_len = await client.append(rnd.seg.name, rnd.offset, rnd.chunks[0], epoch=writer.epoch)
            else:
                new_len = await client.append_many(rnd.seg.name, rnd.offset, rnd.chunks, epoch=writer.epoch)
        except BaseException as exc:
            writer.round_failed(rnd)
            self.failures += 1
            await self._drop()
            if not isinstance(exc, Exception):
                raise  # (a cancellation: the round is the thread's now, as on any failure)
            log.info("shipping from the event loop: %s: %s; the replicator thread takes over", type(exc).__name__, exc)
            return False
        writer.round_done(rnd, new_len)
        self.rounds += 1
        return True

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                await client.aclose()

    async def aclose(self) -> None:
        """Close the loop's connection (the writer's thread ships whatever is left)."""
        log.info(
            "%d journal rounds shipped from the event loop, %d handed to the replicator thread",
            self.rounds,
            self.failures,
        )
        await self._drop()
