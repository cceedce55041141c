"""The one opener of a namespace's cache, writer and tree (sos_journal.tree.open), used by
fsspec, the mount and the gateway; against a real sos-server."""

from __future__ import annotations

import os

import pytest

from sos_journal.tree.open import default_cache_dir, open_namespace

NS = "opener"


def test_append_key_opens_writer_and_tree_read_key_a_read_only_copy(sos_server, tmp_path):
    key = sos_server.keygen(NS, "append")
    opened = open_namespace(NS, str(tmp_path / "w"), server=sos_server.address, key=key)
    assert not opened.read_only and opened.writer is not None
    opened.tree.mkdir("d")
    opened.tree.create("d/f")
    opened.tree.write("d/f", 0, b"journaled")
    opened.tree.rename("d/f", "d/g", overwrite=False)
    opened.close()

    read_key = sos_server.keygen(NS, "read")
    with pytest.raises(PermissionError, match="read role"):
        open_namespace(NS, str(tmp_path / "r"), server=sos_server.address, key=read_key)
    ro = open_namespace(NS, str(tmp_path / "r"), server=sos_server.address, key=read_key, allow_read_only=True)
    try:
        assert ro.read_only and ro.writer is None
        with open(os.path.join(ro.tree_dir, "d", "g"), "rb") as f:
            assert f.read() == b"journaled"
        with pytest.raises(PermissionError):
            ro.tree.mkdir("x")
    finally:
        ro.close()


def test_an_empty_cache_is_rebuilt_from_the_server(sos_server, tmp_path):
    key = sos_server.keygen(NS, "append")
    first = open_namespace(NS, str(tmp_path / "a"), server=sos_server.address, key=key)
    first.tree.create("kept")
    first.tree.write("kept", 0, b"1")
    first.close()
    second = open_namespace(NS, str(tmp_path / "b"), server=sos_server.address, key=key)
    try:
        assert second.rebuilt
        assert os.listdir(second.tree_dir) == ["kept"]
    finally:
        second.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["garbage", "0123456789abcdef." + "ab" * 32])
def test_the_mount_journal_refuses_a_bad_key_at_once(sos_server, tmp_path, bad):
    """Before the shared opener, a malformed key made the mount's writer retry for its whole
    open timeout (120 s): `sos mount` with a garbage key stalled two minutes."""
    from spark_plugin.mount.run import MountedTree

    journal = MountedTree(NS, sos_server.address, bad, str(tmp_path / "cache"))
    with pytest.raises(PermissionError):
        journal.open()
    assert journal.writer is None


def test_one_default_cache_dir(monkeypatch, tmp_path):
    from spark_plugin.mount.run import default_cache_dir as mount_default

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir("ns") == mount_default("ns") == str(tmp_path / "sos" / "ns")
