"""The packages' lazy exports (sos_wire/lazy.py, issue 27 item 4): ``sos_wire``, ``sos_client``,
``sos_journal`` and ``sos_tier`` import a re-exported name when it is first used, so that a
command's start pays only for what it runs. Every name of their ``__all__`` still resolves to
the object of the module it comes from, and the ``TYPE_CHECKING`` imports that mypy and readers
see name the same modules as the lazy table. And CRC32C, loaded without the crc32c package's
``__init__``, is the package's own function."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
PACKAGES = ("sos_wire", "sos_client", "sos_journal", "sos_tier")


def _absolute(package: str, module: str) -> str:
    return importlib.util.resolve_name(module, package) if module.startswith(".") else module


def _tables(package: str) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> module of the TYPE_CHECKING imports, name -> module of the lazy_exports table)
    of *package*'s ``__init__.py``, read from its source."""
    tree = ast.parse((ROOT / package / "__init__.py").read_text())
    typed: dict[str, str] = {}
    lazy: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.dump(imp)
                for alias in imp.names:
                    typed[alias.asname or alias.name] = _absolute(package, "." * imp.level + (imp.module or ""))
        call = node.value if isinstance(node, ast.Assign) else None
        if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "lazy_exports":
            table = ast.literal_eval(call.args[1])
            lazy = {name: _absolute(package, module) for module, names in table.items() for name in names}
    return typed, lazy


@pytest.mark.parametrize("package", PACKAGES)
def test_the_lazy_table_is_the_typed_imports(package):
    typed, lazy = _tables(package)
    assert lazy, f"{package}/__init__.py has no lazy_exports table"
    assert typed == lazy


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves_to_its_modules_object(package):
    code = (
        f"import importlib, {package} as p\n"
        "from sos_wire.lazy import lazy_exports\n"
        f"names = list(p.__all__)\n"
        "assert len(set(names)) == len(names)\n"
        "for name in names:\n"
        "    getattr(p, name)\n"
        "assert set(names) <= set(dir(p))\n"
        f"ns = {{}}\nexec('from {package} import *', ns)\n"
        "assert set(names) <= set(ns)\n"
        "try:\n"
        "    p.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('an unknown name resolved')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    typed, lazy = _tables(package)
    pkg = importlib.import_module(package)
    for name, module in lazy.items():
        assert getattr(pkg, name) is getattr(importlib.import_module(module), name), name


def test_crc32c_is_the_packages_function_without_its_version_lookup():
    code = (
        "import sys\n"
        "from sos_wire.crc import crc32c, crc32c_compiled\n"
        "assert 'importlib.metadata' not in sys.modules and 'crc32c' not in sys.modules, 'the package ran'\n"
        "import crc32c as package\n"
        "for data in (b'', b'123456789', bytes(range(256)) * 70, memoryview(b'x' * 5000)[3:]):\n"
        "    assert crc32c(data) == package.crc32c(data) == crc32c_compiled(data, 0)\n"
        "    assert crc32c(data, 7) == package.crc32c(data, 7)\n"
        "assert crc32c(b'123456789') == 0xE3069283\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("package", ["sos_wire", "sos_client", "sos_journal", "sos_tier"])
def test_a_submodule_is_an_attribute_of_its_package_as_before(package):
    """``import sos_wire; sos_wire.events`` worked when the package imported every module at
    its start: it still does (imported then), and a name that is neither says so."""
    code = (
        f"import importlib, pkgutil, {package} as p\n"
        "names = [m.name for m in pkgutil.iter_modules(p.__path__) if not m.name.startswith('_')]\n"
        "assert names and all(getattr(p, n) is importlib.import_module(p.__name__ + '.' + n) for n in names)\n"
        "try:\n    p.no_such_thing\nexcept AttributeError as e:\n    print('AttributeError', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    assert f"AttributeError module '{package}' has no attribute 'no_such_thing'" in out.stdout


def test_the_spark_helpers_export_every_name_lazily_and_without_sos_packages():
    """``spark_plugin.spark`` (a package by role since issue 27) re-exports every name its modules
    offer, from the module that defines it, without sos_wire.lazy (the Spark job ships the
    package without any sos package): its ``EXPORTS`` table is its ``TYPE_CHECKING`` imports,
    and importing it loads neither pyspark nor a module of the package until a name is used."""
    tree = ast.parse((ROOT / "spark_plugin" / "spark" / "__init__.py").read_text())
    typed: dict[str, str] = {}
    table: dict[str, tuple[str, ...]] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            typed = {a.asname or a.name: imp.module for imp in node.body for a in imp.names}
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "EXPORTS":
            table = ast.literal_eval(node.value)
    assert typed and typed == {name: module for module, names in table.items() for name in names}
    code = (
        "import importlib, sys\n"
        "import spark_plugin.spark as p\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('pyspark', 'sos_', 'spark_plugin.spark.')))\n"
        "assert not loaded, loaded\n"
        "assert sorted(p.__all__) == sorted(n for ns in p.EXPORTS.values() for n in ns)\n"
        "for module, names in p.EXPORTS.items():\n"
        "    for name in names:\n"
        "        assert getattr(p, name) is getattr(importlib.import_module(module), name), name\n"
        "assert not [m for m in sys.modules if m.startswith('sos_')], 'a sos package was imported'\n"
        "assert p.markers is importlib.import_module('spark_plugin.spark.markers')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
