"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import os


def tree_snapshot(root: str | os.PathLike[str]) -> dict[str, bytes | None]:
    """{relative path: bytes for a file, None for a directory} of everything below root."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in filenames:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.normpath(os.path.join(rel, f))] = fh.read()
    return out
