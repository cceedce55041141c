"""`serve_until_signal`: the one way a long-running command (``sos gateway``, ``sos mount``)
serves until SIGTERM/SIGINT and says on stderr that it is ready (the line
:class:`sos_client.process.ReadyChild` waits for)."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

__all__ = ["serve_until_signal"]

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def serve_until_signal(
    serve: Callable[..., Awaitable[Any]],
    ready_line: Callable[[Any], str],
    *,
    stop: Callable[[str], None] | None = None,
    grace: float | None = None,
    pending: Sequence[int] = (),
) -> None:
    """Run ``serve(task_status=...)`` until it returns or a signal stops it.

    Once it has started, ``ready_line(value it started with)`` is printed on stderr. The first
    SIGTERM/SIGINT calls ``stop(signal name)``, which begins a graceful stop, and gives
    ``serve`` ``grace`` seconds to return (None: as long as it takes); without ``stop`` the
    first signal, and otherwise a second one, cancels ``serve`` at once. ``pending``: signals
    that arrived before this receiver was open (handled first, as if they came now).
    """
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(*STOP_SIGNALS) as signals, trio.CancelScope() as watching:

            async def run(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
                await serve(task_status=task_status)
                watching.cancel()  # done: nothing left to wait for

            value = await nursery.start(run)
            print(ready_line(value), file=sys.stderr, flush=True)
            stopping = False

            def on_signal(signum: int) -> bool:
                """True once the serving is cancelled."""
                nonlocal stopping
                name = signal.Signals(signum).name
                if stop is None or stopping:
                    log.info("%s%s: stopping now", name, " again" if stopping else "")
                    nursery.cancel_scope.cancel()
                    return True
                stopping = True
                stop(name)
                if grace is not None:
                    nursery.cancel_scope.deadline = trio.current_time() + grace
                return False

            for signum in pending:
                if on_signal(signum):
                    return
            async for signum in signals:
                if on_signal(signum):
                    return
