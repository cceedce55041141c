"""The sizes issue 18 asks to watch: the largest product files and functions, and how many
functions are over 80 lines, of a checkout (default: this one).

    python -m tools.sizes [ROOT] [--top N]
"""

from __future__ import annotations

import argparse
import ast
import pathlib

PACKAGES = ("sos_wire", "sos_tier", "sos_server", "sos_client", "sos_journal", "spark_plugin", "tools")
LONG = 80


def sizes(root: pathlib.Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, file) per file and (lines, file:function) per function, largest first."""
    files: list[tuple[int, str]] = []
    funcs: list[tuple[int, str]] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            text = path.read_text()
            name = str(path.relative_to(root))
            files.append((text.count("\n"), name))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                    funcs.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    return sorted(files, reverse=True), sorted(funcs, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", nargs="?", default=".", help="a checkout (default: .)")
    parser.add_argument("--top", type=int, default=6, help="how many of each to list (default: 6)")
    args = parser.parse_args()
    files, funcs = sizes(pathlib.Path(args.root))
    print("largest files:", ", ".join(f"{f} {n}" for n, f in files[: args.top]))
    print("largest functions:", ", ".join(f"{f} {n}" for n, f in funcs[: args.top]))
    print(f"functions over {LONG} lines: {sum(n > LONG for n, _ in funcs)} of {len(funcs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
