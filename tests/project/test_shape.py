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


def _architecture_rows() -> dict[str, str]:
    """docs/ARCHITECTURE.md's module tables: ``package/module.py`` -> its row, from each
    ``### `package/` ...`` heading of the "Packages" section and the rows under it."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Packages\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    folder = None
    for line in section.splitlines():
        if line.startswith("### `"):
            folder = line.split("`")[1]
        elif line.startswith("| `") and folder is not None:
            rows[folder + line.split("`")[1]] = line
    return rows


def test_architecture_has_one_short_row_per_module():
    """ARCHITECTURE.md "shrinks to one line per module" (issue 27): every module of the product
    packages and tools has its row (``__init__.py``: the package's heading), each row names an
    existing file, and no row is a paragraph."""
    rows = _architecture_rows()
    modules = {
        str(p.relative_to(ROOT))
        for top in TOP
        for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts and p.name != "__init__.py"
    }
    assert sorted(modules - set(rows)) == [], "modules without their row in docs/ARCHITECTURE.md"
    assert [r for r in rows if not (ROOT / r).exists()] == [], "rows of files that do not exist"
    assert [r for r, line in rows.items() if len(line) > 200] == [], "rows over 200 characters"
