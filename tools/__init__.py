"""Tooling around the product, not shipped in the wheel: the disaster-recovery demo
(``tools.demo``, ``demo_cluster``, ``demo_common``), the crash loop (``tools.soak``), the
one-machine Spark cluster (``tools.cluster``) and what they and the tests share: a server as a
child process (``server``), the JVMs' options (``jvm``), containers (``container``), log text
(``logtext``), the size report of the code (``sizes``). Run from a checkout
(``./scripts/demo``, ``./scripts/soak``); ``ROOT`` and :func:`child_env` find it.
May import: every product package (sos_*, spark_plugin) and pyspark; nothing in the product
imports it (the top layer of import-linter's contract).
"""

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
