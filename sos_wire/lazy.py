"""The names a package re-exports, imported from their modules when first used (PEP 562).

A package's ``__init__`` runs whenever any of its modules is imported: one that imports every
module to re-export their names makes ``sos --help`` or ``sos-server keygen`` pay for the
protocol's codec, the journal's writer or the tier's uploader (tens of ms of CPU each, at the
start of every process). The packages (sos_wire, sos_client, sos_journal, sos_tier) name their
exports here instead, with a ``TYPE_CHECKING`` import of the same names for mypy and readers:
``from sos_wire import Key`` and ``sos_wire.Key`` work as before and import ``sos_wire.auth``
only then. tests/project/test_startup.py checks that every name of each ``__all__`` resolves.

``moved_modules`` keeps an old module path importable after its module moved (issue 27's
packages): ``import OLD.sub`` gives the module object of its new home, the same object (so a
monkeypatch through either name changes both); tests/project/test_moved_names.py checks them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["lazy_exports", "moved_modules"]


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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``OLD.sub`` where *moves* maps it to its new module, and loads it as that very
    module object (imported on first use)."""

    def __init__(self, moves: dict[str, str]) -> None:
        self.moves = moves
        self.home_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moves:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.moves[spec.name])
        self.home_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module was imported at its new home): only its own spec put
        back, which the import system replaced with the old name's."""
        module.__spec__ = self.home_specs.pop(module.__name__, module.__spec__)


def moved_modules(package: str, moves: dict[str, str]) -> Callable[[str], object]:
    """Make the submodules of *package* that moved importable by their old names: *moves* maps
    each old submodule name (``"bucket"``) to its new module's full name. Returns a
    ``__getattr__`` for *package* that also reaches them as attributes."""
    full = {f"{package}.{old}": new for old, new in moves.items()}
    if not any(isinstance(f, _MovedModules) and f.moves == full for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules(full))

    def __getattr__(name: str) -> object:
        if name in moves:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
