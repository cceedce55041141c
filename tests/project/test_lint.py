"""The code is clean under ruff and mypy, and its imports keep the layers, as configured in
pyproject.toml ([tool.ruff], [tool.mypy], [tool.importlinter]); all three run from this
interpreter's environment (they are in the ``test`` extra)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.sizes import LONG, sizes

ROOT = Path(__file__).resolve().parents[2]

#: Files whose findings are shown (``pytest -rP``) but not failed on: none. Keep it empty.
PENDING: frozenset[str] = frozenset()


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False
    )


def _split(findings: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(findings in files that must be clean, findings in PENDING files)."""
    bad = [text for path, text in findings if path not in PENDING]
    pending = [text for path, text in findings if path in PENDING]
    return bad, pending


def test_ruff_finds_nothing():
    r = _run("ruff", "check", ".", "--no-cache", "--output-format", "json")
    assert r.returncode in (0, 1) and r.stdout.strip().startswith("["), (r.returncode, r.stdout, r.stderr)
    findings = [
        (
            os.path.relpath(f["filename"], ROOT),
            f"{os.path.relpath(f['filename'], ROOT)}:{f['location']['row']}: {f['code']} {f['message']}",
        )
        for f in json.loads(r.stdout)
    ]
    bad, pending = _split(findings)
    print("\n".join(["ruff, in files still being changed elsewhere:", *pending]))
    assert not bad, "ruff check . found:\n" + "\n".join(bad)
    if not pending:
        assert r.returncode == 0, (r.stdout, r.stderr)


def test_ruff_format_is_applied():
    """The tree is as `ruff format` writes it (applied once to everything; pre-commit keeps it)."""
    r = _run("ruff", "format", "--check", ".", "--no-cache")
    assert r.returncode == 0, "ruff format --check . would reformat:\n" + r.stdout + r.stderr


def test_pre_commit_runs_what_this_file_checks():
    """.pre-commit-config.yaml runs the same tools as these tests, so a commit that passes its
    hooks passes CI's lint."""
    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    entries = " ".join(h["entry"] for repo in config["repos"] for h in repo["hooks"])
    for tool in ("ruff check", "ruff format --check", "mypy", "lint-imports"):
        assert tool in entries, tool


def test_mypy_finds_nothing(tmp_path):
    r = _run("mypy", "--cache-dir", str(tmp_path / "mypy-cache"), "--no-error-summary")
    errors = [line for line in r.stdout.splitlines() if ": error:" in line]
    assert r.returncode == 0 or errors, (r.returncode, r.stdout, r.stderr)  # a crash is not a pass
    bad, pending = _split([(line.split(":", 1)[0], line) for line in errors])
    print("\n".join(["mypy, in files still being changed elsewhere:", *pending]))
    assert not bad, "mypy found:\n" + "\n".join(bad) + "\n" + r.stderr
    if not pending:
        assert r.returncode == 0, (r.stdout, r.stderr)


def test_import_contracts_hold():
    """import-linter's contracts: the layers (wire < tier < server | client < spark_plugin <
    tools; the journal above the clients; the Spark helpers above the faces, which do not
    import each other), no cycle inside a package."""
    lint_imports = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run(
        [str(lint_imports), "--no-cache"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-6000:] + r.stderr[-2000:]


def test_no_product_function_is_over_80_lines():
    """Issue 18's "smaller pieces": no function in the product packages or tools/ is longer than
    80 lines (``python -m tools.sizes`` lists the largest)."""
    _files, funcs = sizes(ROOT)
    assert funcs, "no function found: wrong root?"
    assert [f"{name} ({n} lines)" for n, name in funcs if n > LONG] == []
