"""The code's shape a newcomer reads first (issue 27 item 1): every package opens with a short
docstring that says what it owns and what it may import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the product packages and the tools, each with every package below it
TOP = ("sos_wire", "sos_tier", "sos_server", "sos_client", "sos_journal", "spark_plugin", "tools")


def _packages() -> list[Path]:
    """Every folder of ``TOP`` that holds Python modules (each must be a package)."""
    folders = {p.parent for top in TOP for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
    return sorted(folders)


def test_every_folder_of_modules_is_a_package():
    missing = [str(f.relative_to(ROOT)) for f in _packages() if not (f / "__init__.py").is_file()]
    assert missing == []


@pytest.mark.parametrize("folder", _packages(), ids=lambda f: str(f.relative_to(ROOT)))
def test_each_package_opens_with_about_ten_lines_of_what_it_owns_and_may_import(folder):
    init = folder / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc, f"{init.relative_to(ROOT)} has no docstring"
    lines = doc.strip().splitlines()
    assert 6 <= len(lines) <= 15, f"{init.relative_to(ROOT)}: {len(lines)} lines (6 to 15: what it owns, may import)"
    assert "may import" in doc.lower(), f"{init.relative_to(ROOT)} does not say what it may import"
