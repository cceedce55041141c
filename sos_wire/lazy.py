"""The names a package re-exports, imported from their modules when first used (PEP 562).

A package's ``__init__`` runs whenever any of its modules is imported: one that imports every
module to re-export their names makes ``sos --help`` or ``sos-server keygen`` pay for the
protocol's codec, the journal's writer or the tier's uploader (tens of ms of CPU each, at the
start of every process). The packages (sos_wire, sos_client, sos_journal, sos_tier) name their
exports here instead, with a ``TYPE_CHECKING`` import of the same names for mypy and readers:
``from sos_wire import Key`` and ``sos_wire.Key`` work as before and import ``sos_wire.auth``
only then. tests/project/test_startup.py checks that every name of each ``__all__`` resolves.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, modules: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for *package*, which re-exports the names *modules* lists per
    module (``{".auth": ("Key", ...)}``, relative to *package*). A name is imported on first use,
    then kept in the package's namespace (so the next use is a plain attribute)."""
    where = {name: module for module, names in modules.items() for name in names}
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            # a submodule (``sos_wire.events``), reachable as an attribute as when the package
            # imported every module at its start
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return __getattr__, __dir__
