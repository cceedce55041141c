"""Helpers for tests of code built on the journal (not used at run time)."""

from __future__ import annotations

import hashlib
import os

from sos_journal.memstore import MemStore  # noqa: F401 - re-exported for tests


def tree_state(root: str, *, digest: bool = False) -> dict[str, bytes | str]:
    """{relative path: file bytes (or sha256 hex if digest) | "<dir>"} of everything under root."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        rel = "" if rel == "." else rel.replace(os.sep, "/")
        for d in dirnames:
            out[f"{rel}/{d}" if rel else d] = "<dir>"
        for f in filenames:
            p = os.path.join(dirpath, f)
            key = f"{rel}/{f}" if rel else f
            if digest:
                h = hashlib.sha256()
                with open(p, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
                out[key] = h.hexdigest()
            else:
                with open(p, "rb") as fh:
                    out[key] = fh.read()
    return out
