"""The server's test helpers (its fixtures are the root conftest's: ``sos_server``,
``sos_server_factory``, ``server``)."""

from __future__ import annotations

import psutil


def rss(pid: int) -> int:
    """The resident memory of the process ``pid`` now, in bytes."""
    return psutil.Process(pid).memory_info().rss
