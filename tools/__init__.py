"""Tooling around the product, not shipped in the wheel: the disaster-recovery demo
(``tools.demo``), the crash loop (``tools.soak``) and the one-machine Spark cluster
(``tools.cluster``). Run from a checkout (``./scripts/demo``, ``./scripts/soak``)."""

from __future__ import annotations

import os

#: the checkout these tools belong to
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the checkout first on PYTHONPATH, so that a
    child ``python -m tools....`` finds the tools whatever its working directory."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, out.get("PYTHONPATH", "")) if p)
    return out
