"""The journal's test helpers (fixtures: the root conftest's servers)."""

from __future__ import annotations

import itertools
import os

_n = itertools.count()


def new_ns(server, prefix: str) -> tuple[str, str]:
    """A namespace no other test of this process uses (``prefix`` first) and an append key for it."""
    ns = f"{prefix}{next(_n)}-{os.getpid()}"
    return ns, server.keygen(ns, "append")
