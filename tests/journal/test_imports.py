"""The journal core's tree (issue 12.2): building one does no network I/O. Its module graph
(the tree does not import restore: the cache rebuild is injected by the opener; no cycle) is
import-linter's contracts in pyproject.toml (tests/project/test_lint.py runs them)."""

from __future__ import annotations

from sos_journal import JournaledTree, JournalWriter


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
