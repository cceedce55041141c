"""What the faces (fsspec, the mount, the gateway) share when they call the journal: the one
translation of its failures, and the latch that makes a fenced face read-only.

A journal call fails with a :class:`~sos_client.journal.errors.JournalError` or an
:class:`~sos_client.errors.SOSError`; a face reports it as a filesystem would, through
:func:`journal_error`: the OSError of :func:`sos_client.errors.to_oserror` (its errno: EIO,
EDQUOT for a quota, EROFS as a PermissionError once a newer writer took the namespace over),
with a message that names the namespace and says, for a fenced writer, that this face can no
longer change it. Any other exception (an OSError of the tree: ENOENT, EEXIST...) is the
caller's own answer and comes back as it is. :class:`FenceLatch` remembers the first fenced
failure so that every later change is refused at once (EROFS) and the reason logged once.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import TypeVar

from sos_client.errors import SOSError, is_fenced, to_oserror

from .errors import JournalError

__all__ = ["FenceLatch", "call_journal", "journal_error"]

T = TypeVar("T")


def journal_error(exc: BaseException, namespace: str, who: str = "this process") -> BaseException:
    """The exception a face raises (``from exc``) for ``exc`` from a journal call: for a
    JournalError or SOSError, the OSError described in the module docstring (``who``: the face,
    e.g. "this gateway"); anything else as it is."""
    if not isinstance(exc, (JournalError, SOSError)):
        return exc
    what = f"was taken over by another writer (fenced); {who} can no longer change it" if is_fenced(exc) else "failed"
    return to_oserror(exc, f"journal of namespace {namespace!r} {what}", namespace)


def call_journal(namespace: str, fn: Callable[..., T], *args: object, who: str = "this process",
                 **kwargs: object) -> T:
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
            raise PermissionError(errno.EROFS, f"{self.who} of namespace {self.namespace!r} is read-only: "
                                  f"fenced ({self.fenced})")

    def note(self, exc: BaseException) -> bool:
        """Remember ``exc`` if it says a newer writer took over; True if it did."""
        if not is_fenced(exc):
            return False
        if self.fenced is None:
            self.fenced = str(exc) or type(exc).__name__
            self.log.error("%s: FENCED: a newer writer took over namespace %r (%s); it is read-only "
                           "from now on, its later changes fail; restart it to continue",
                           self.who, self.namespace, self.fenced)
        return True
