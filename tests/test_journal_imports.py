"""The journal core's module graph (issue 12.2): the tree does not import restore (the
cache rebuild is injected by the opener), and building a tree does no network I/O."""

from __future__ import annotations

import ast
import pathlib

from sos_client.journal import JournaledTree, JournalWriter

JOURNAL = pathlib.Path(__file__).resolve().parent.parent / "sos_client" / "journal"


def _journal_imports() -> dict[str, set[str]]:
    """module -> the journal modules it imports (lazy imports inside functions included;
    imports for type checking only are not imports at run time)."""
    graph: dict[str, set[str]] = {}
    for path in JOURNAL.glob("*.py"):
        if path.stem == "__init__":
            continue
        tree = ast.parse(path.read_text())
        type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                     and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
        deps: set[str] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or id(node) in type_only:
                continue
            if node.level == 1:
                deps.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
            elif node.module and node.module.startswith("sos_client.journal."):
                deps.add(node.module.split(".")[2])
        graph[path.stem] = deps
    return graph


def test_the_journal_modules_import_each_other_without_a_cycle():
    graph = _journal_imports()
    assert "restore" not in graph["tree"] and "tree" not in graph["restore"]
    assert "tree" not in graph["replay"]
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + [module])}"
        if module in done:
            return
        for dep in graph.get(module, ()):
            visit(dep, path + [module])
        done.add(module)

    for module in graph:
        visit(module, [])


def test_building_a_tree_does_no_network_io_until_it_is_opened(tmp_path):
    calls = []

    def factory():
        calls.append("connect")
        raise ConnectionRefusedError("no server in this test")

    w = JournalWriter(factory, "ns", str(tmp_path / "spool"), open_timeout=0)
    tree = JournaledTree(str(tmp_path / "cache"), w)
    assert calls == [] and not w.is_open
    try:
        tree.open()
    except OSError:
        pass
    assert calls  # open() is where the writer connects
    w.close()
