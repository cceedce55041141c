"""What the faces (fsspec, the mount, the gateway) share when they call the journal: the one
translation of its failures, and the latch that makes a fenced face read-only.

A journal call fails with a :class:`~sos_journal.errors.JournalError` or an
:class:`~sos_client.errors.SOSError`; a face reports it as a filesystem would, through
:func:`journal_error`: the OSError of :func:`sos_client.errors.to_oserror` (its errno: EIO,
EDQUOT for a quota, EROFS as a PermissionError once a newer writer took the namespace over),
with a message that names the namespace and says, for a fenced writer, that this face can no
longer change it. Any other exception (an OSError of the tree: ENOENT, EEXIST...) is the
caller's own answer and comes back as it is. :class:`FenceLatch` remembers the first fenced
failure so that every later change is refused at once (EROFS) and the reason logged once.

Durability (issue 19 item 3): :func:`add_durability_options` gives ``sos gateway`` and ``sos mount``
the same ``--durability server|tier`` and ``--tier-patience`` options, whose values go to
:func:`~sos_journal.tree.open.open_namespace`; a barrier the bucket did not reach within the
patience (:class:`~sos_journal.errors.JournalTierBehind`) is reported as ETIMEDOUT, its
message saying the change is durable on the SOS server and nothing is lost.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from sos_client.errors import Fenced, SOSError, is_fenced, to_oserror
from sos_journal.errors import JournalError, JournalTierBehind
from sos_journal.writer.tier_wait import DURABILITIES
from sos_wire import argtypes

__all__ = [
    "DEFAULT_TIER_PATIENCE",
    "DURABILITIES",
    "FENCE_CHECK",
    "FenceLatch",
    "FenceWatch",
    "add_durability_options",
    "call_journal",
    "durability_refusal",
    "journal_error",
    "tier_patience_of",
]

#: a face's barrier waits this long for the bucket before it reports JournalTierBehind
#: (ETIMEDOUT; the gateway's 503): below Hadoop's 60 s WebHDFS read timeout, so that the
#: client hears why rather than a timeout of its own
DEFAULT_TIER_PATIENCE = 30.0


def add_durability_options(parser: argparse.ArgumentParser, *, what: str, failure: str = "ETIMEDOUT") -> None:
    """``--durability server|tier`` and ``--tier-patience DURATION`` (``what``: the barriers
    named in the help, e.g. "RENAME, DELETE and file bodies"; ``failure``: how the face reports
    a barrier the bucket did not reach in time)."""
    parser.add_argument(
        "--durability",
        choices=DURABILITIES,
        default="server",
        help=f"what {what} wait for: 'server' (default), the SOS server's disk; "
        f"'tier', also the server's object-store tier (the bucket of "
        f"`sos-server serve --tier URL`): a committed batch then survives the "
        f"loss of the server and its disk. Refused at start by a server "
        f"without --tier",
    )
    parser.add_argument(
        "--tier-patience",
        type=argtypes.duration,
        default=DEFAULT_TIER_PATIENCE,
        metavar="DURATION",
        help=f"--durability tier: how long a barrier waits for the bucket before "
        f"it fails with {failure} (the change stays applied and durable on "
        f"the server; nothing is lost); 0: wait as long as it takes "
        f"(default {DEFAULT_TIER_PATIENCE:g}s)",
    )


def durability_refusal(durability: str, sync: bool) -> str:
    """Why a face's ``--durability``/``--async`` combination is refused ("" if it is not):
    in async mode nothing waits, so the bucket would never be waited for either."""
    if durability == "tier" and not sync:
        return "--durability tier waits for the bucket at each barrier, and --async waits for nothing: drop one of them"
    return ""


def tier_patience_of(seconds: float | None) -> float | None:
    """The writer's ``tier_patience`` for a face's ``--tier-patience`` (0: no bound)."""
    return None if not seconds else float(seconds)


T = TypeVar("T")


def journal_error(exc: BaseException, namespace: str, who: str = "this process") -> BaseException:
    """The exception a face raises (``from exc``) for ``exc`` from a journal call: for a
    JournalError or SOSError, the OSError described in the module docstring (``who``: the face,
    e.g. "this gateway"); anything else as it is."""
    if not isinstance(exc, (JournalError, SOSError)):
        return exc
    if is_fenced(exc):
        what = f"was taken over by another writer (fenced); {who} can no longer change it"
    elif isinstance(exc, JournalTierBehind):
        what = "is behind in the object-store tier"
    else:
        what = "failed"
    return to_oserror(exc, f"journal of namespace {namespace!r} {what}", namespace)


def call_journal(namespace: str, fn: Callable[..., T], *args: object, who: str = "this process", **kwargs: object) -> T:
    """``fn(*args, **kwargs)``, its journal failures raised as :func:`journal_error`."""
    try:
        return fn(*args, **kwargs)
    except (JournalError, SOSError) as exc:
        raise journal_error(exc, namespace, who) from exc


class FenceLatch:
    """Read-only from the first fenced failure on: :meth:`check` raises EROFS once
    :meth:`note` saw one (``fenced`` holds why); ``log`` gets one error line then."""

    def __init__(self, namespace: str, log: logging.Logger, who: str) -> None:
        self.namespace = namespace
        self.log = log
        self.who = who
        self.fenced: str | None = None

    def check(self) -> None:
        if self.fenced is not None:
            raise PermissionError(
                errno.EROFS, f"{self.who} of namespace {self.namespace!r} is read-only: fenced ({self.fenced})"
            )

    def note(self, exc: BaseException) -> bool:
        """Remember ``exc`` if it says a newer writer took over; True if it did."""
        if not is_fenced(exc):
            return False
        if self.fenced is None:
            self.fenced = str(exc) or type(exc).__name__
            self.log.error(
                "%s: FENCED: a newer writer took over namespace %r (%s); it is read-only "
                "from now on, its later changes fail; restart it to continue",
                self.who,
                self.namespace,
                self.fenced,
            )
        return True


#: how often a face asks the SOS server for its namespace's fence epoch (FenceWatch)
FENCE_CHECK = 5.0

log = logging.getLogger(__name__)


class _Writer(Protocol):
    """What FenceWatch reads of a JournalWriter (named without importing the writer)."""

    epoch: int

    def status(self) -> dict[str, Any]: ...


class FenceWatch:
    """Tells whether a newer writer fenced a face's writer (the gateway and the mount both
    stop on it): the writer's own failure (FENCED or SEALED from the replicator), or the
    namespace's fence epoch above the writer's, asked every ``interval`` s with FENCE(0) (it
    never passes and changes nothing, protocol.md 1.11), so an idle face learns it too.
    :meth:`check` blocks (call it from a worker thread); ``who`` names the face."""

    def __init__(
        self,
        namespace: str,
        writer: _Writer,
        client_factory: Callable[[], Any] | None,
        interval: float = FENCE_CHECK,
        *,
        who: str = "this process",
    ) -> None:
        self.namespace = namespace
        self.writer = writer
        self.factory = client_factory
        self.interval = interval
        self.who = who
        self._client: Any = None
        self._asked = time.monotonic()

    def _writer_fenced(self) -> str | None:
        status = self.writer.status()
        error = status.get("error") or ""
        if status["state"] == "failed" and error.startswith(("Fenced:", "SealedError:")):
            return f"its writer (epoch {self.writer.epoch}) was refused by the server: {error}"
        return None

    def check(self) -> str | None:
        """Why this face is fenced, or None."""
        reason = self._writer_fenced()
        if reason is not None or self.factory is None:
            return reason
        if time.monotonic() - self._asked < self.interval:
            return None
        self._asked = time.monotonic()
        epoch = self.writer.epoch
        try:
            if self._client is None:
                self._client = self.factory()
            self._client.fence(0)
        except Fenced as exc:
            current = int(getattr(exc, "epoch", 0) or exc.length or 0)
            if current > epoch:
                return (
                    f"namespace {self.namespace!r} was fenced at epoch {current} by a newer "
                    f"writer ({self.who}'s writer holds epoch {epoch})"
                )
        except (SOSError, OSError) as exc:  # the server unreachable: the writer retries too
            log.debug("fence check failed: %r", exc)
            self.close()
        return None

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(SOSError, OSError):
                client.close()
