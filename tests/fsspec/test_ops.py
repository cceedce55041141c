"""SOSFileSystem against a real sos-server process: semantics, errors, the
fsspec entry point, sharing of one journaled tree per namespace, durability of
the close barrier, a second process rebuilding its cache from the server, and
hypothesis-generated operation sequences whose restore must equal the live tree."""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import subprocess
import sys
import textwrap

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_plugin.fsspec import filesystem as sosfs
from spark_plugin.fsspec.filesystem import SOSFileSystem
from tests.support import tree_snapshot as local_snapshot

_ns_counter = itertools.count()


@pytest.fixture(scope="module")
def server(server):
    """The module's server; fsspec instances are dropped after the module."""
    yield server
    sosfs.close_all()


class _Env:
    """A fresh namespace with its own key and cache directory."""

    def __init__(self, server, tmp_path_factory, prefix="t"):
        self.server = server
        self.ns = f"{prefix}{next(_ns_counter)}"
        self.key = server.keygen(self.ns, "append")
        self.cache = str(tmp_path_factory.mktemp(f"cache-{self.ns}"))
        self._tmp = tmp_path_factory

    def fs(self, **kw):
        kw.setdefault("cache_dir", self.cache)
        return SOSFileSystem(server=self.server.address, key=self.key, skip_instance_cache=True, **kw)

    def client_factory(self):
        from sos_client import Client

        return lambda: Client(self.server.address, self.key, self.ns)

    def restore(self):
        """Restore the namespace from the server into a fresh directory."""
        from sos_journal.rebuild.restore import restore

        target = str(self._tmp.mktemp(f"restore-{self.ns}")) + "/tree"
        restore(self.client_factory(), self.ns, target)
        return target


@pytest.fixture
def env(server, tmp_path_factory):
    e = _Env(server, tmp_path_factory)
    yield e
    sosfs.close_all()


def fs_snapshot(fs, top):
    """The same shape as local_snapshot, read through the filesystem."""
    out = {}
    for name, info in fs.find(top, withdirs=True, detail=True).items():
        rel = name[len(top) + 1 :]
        if not rel:
            continue
        out[rel] = None if info["type"] == "directory" else fs.cat_file(name)
    return out


def payload(seed, size):
    block = hashlib.sha256(str(seed).encode()).digest()
    return (block * (size // len(block) + 1))[:size]


# ------------------------------------------------------------------ plumbing


def test_entry_point_registers_protocol(env):
    assert fsspec.get_filesystem_class("sos") is SOSFileSystem
    opts = dict(server=env.server.address, key=env.key, cache_dir=env.cache)
    fs = fsspec.filesystem("sos", **opts)
    assert isinstance(fs, SOSFileSystem)
    with fsspec.open(f"sos://{env.ns}/dir/hello.txt", "w", **opts) as f:
        f.write("hello\nworld\n")
    with fsspec.open(f"sos://{env.ns}/dir/hello.txt", "r", **opts) as f:
        assert f.read() == "hello\nworld\n"
    assert fs.cat(f"sos://{env.ns}/dir/hello.txt") == b"hello\nworld\n"
    assert fs.ls(f"sos://{env.ns}/dir", detail=False) == [f"{env.ns}/dir/hello.txt"]
    assert fs.unstrip_protocol(f"{env.ns}/dir") == f"sos://{env.ns}/dir"


def test_environment_defaults(env, tmp_path, monkeypatch):
    monkeypatch.setenv("SOS_SERVER", env.server.address)
    monkeypatch.setenv("SOS_KEY", env.key)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    fs = fsspec.filesystem("sos", skip_instance_cache=True)
    fs.pipe_file(f"{env.ns}/a/b", b"payload")
    # the per-namespace cache directory under $XDG_CACHE_HOME/sos
    with open(tmp_path / "xdg" / "sos" / env.ns / "tree" / "a" / "b", "rb") as f:
        assert f.read() == b"payload"


def test_bad_options_and_paths_raise_typed_errors(env, monkeypatch):
    monkeypatch.delenv("SOS_KEY", raising=False)
    with pytest.raises(ValueError, match="key"):
        SOSFileSystem(server=env.server.address, skip_instance_cache=True)
    with pytest.raises(ValueError, match="key"):
        SOSFileSystem(server=env.server.address, key="not-a-key", skip_instance_cache=True)
    with pytest.raises(ValueError, match="port must be"):
        SOSFileSystem(server="host:99999", key=env.key, skip_instance_cache=True)
    fs = env.fs()
    for bad in ["Upper/x", "-lead/x", "", "sos://", f"{env.ns}/a/../b", f"{env.ns}/./x"]:
        with pytest.raises(ValueError):
            fs.info(bad)


def test_key_of_another_namespace_is_refused(env, server, tmp_path_factory):
    other = _Env(server, tmp_path_factory)
    fs = SOSFileSystem(server=server.address, key=other.key, cache_dir=env.cache, skip_instance_cache=True)
    with pytest.raises(PermissionError):
        fs.pipe_file(f"{env.ns}/x", b"data")


def test_read_key_reads_without_fencing_the_writer(env, tmp_path):
    fs = env.fs()
    fs.pipe_file(f"{env.ns}/r/x", b"visible")
    reader = SOSFileSystem(
        server=env.server.address,
        key=env.server.keygen(env.ns, "read"),
        cache_dir=str(tmp_path / "reader"),
        skip_instance_cache=True,
    )
    assert reader.cat_file(f"sos://{env.ns}/r/x") == b"visible"
    assert reader.ls(f"{env.ns}/r", detail=False) == [f"{env.ns}/r/x"]
    with pytest.raises(PermissionError):
        reader.pipe_file(f"{env.ns}/r/y", b"no")
    with pytest.raises(PermissionError):
        reader.rm(f"{env.ns}/r/x")
    with pytest.raises(PermissionError):
        reader.mv(f"{env.ns}/r/x", f"{env.ns}/r/z")
    with pytest.raises(PermissionError):
        reader.makedirs(f"{env.ns}/new")
    assert reader.cat_file(f"{env.ns}/r/x") == b"visible"
    # the reader fenced nobody: the writer goes on
    fs.pipe_file(f"{env.ns}/r/after", b"still writing")
    fs.fsync(env.ns)
    assert local_snapshot(env.restore()) == {"r": None, "r/x": b"visible", "r/after": b"still writing"}


# ------------------------------------------------------------------ files


def test_open_modes(env):
    fs = env.fs()
    p = f"{env.ns}/m/file"
    with fs.open(p, "w") as f:
        f.write("one")
    with fs.open(p, "r") as f:
        assert f.read() == "one"
    with fs.open(p, "a") as f:
        f.write("two")
    with fs.open(p, "ab") as f:
        f.write(b"three")
    assert fs.cat_file(p) == b"onetwothree"
    with fs.open(p, "wb") as f:  # truncates
        f.write(b"new")
    assert fs.cat_file(p) == b"new"
    with pytest.raises(FileExistsError):
        fs.open(p, "x")
    with pytest.raises(FileExistsError):
        fs.open(p, "xb")
    with fs.open(f"{env.ns}/m/fresh", "xb") as f:
        f.write(b"x")
    with fs.open(f"{env.ns}/m/appended", "ab") as f:  # append creates
        f.write(b"a")
    assert fs.cat_file(f"{env.ns}/m/fresh") == b"x"
    assert fs.cat_file(f"{env.ns}/m/appended") == b"a"
    assert fs.cat_file(p) == b"new"  # the failed exclusive opens changed nothing


def test_open_errors(env):
    fs = env.fs()
    fs.makedirs(f"{env.ns}/d")
    fs.pipe_file(f"{env.ns}/f", b"x")
    with pytest.raises(FileNotFoundError):
        fs.open(f"{env.ns}/missing", "rb")
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{env.ns}/missing")
    with pytest.raises(IsADirectoryError):
        fs.open(f"{env.ns}/d", "rb")
    with pytest.raises(IsADirectoryError):
        fs.open(f"{env.ns}/d", "wb")
    with pytest.raises(IsADirectoryError):
        fs.open(env.ns, "wb")
    with pytest.raises(NotADirectoryError):
        fs.open(f"{env.ns}/f/child", "wb")
    with pytest.raises(ValueError):
        fs.open(f"{env.ns}/f", "r+b")
    assert fs.cat_file(f"{env.ns}/f") == b"x"


def test_large_file_streams_in_bounded_chunks(env):
    fs = env.fs()
    p = f"{env.ns}/big/blob"
    data = payload("big", (3 << 20) + 12345)
    f = fs.open(p, "wb")
    f.write(data[: 5 << 19])  # 2.5 MiB: more than the write block
    # already in the live tree while the file is still open: streamed, not buffered whole
    assert fs.info(p)["size"] >= 2 << 20
    for i in range(5 << 19, len(data), 100_000):
        f.write(data[i : i + 100_000])
    f.close()
    assert fs.info(p)["size"] == len(data)
    assert fs.cat_file(p) == data
    assert fs.cat_file(p, start=10, end=20) == data[10:20]
    assert fs.cat_file(p, start=-5) == data[-5:]
    assert fs.cat_file(p, start=(1 << 20) - 3, end=(1 << 20) + 3) == data[(1 << 20) - 3 : (1 << 20) + 3]
    assert fs.cat_file(p, start=len(data) + 10) == b""
    with fs.open(p, "rb") as f:
        f.seek(3 << 20)
        assert f.read(7) == data[3 << 20 : (3 << 20) + 7]
        assert f.size == len(data)
    restored = env.restore()
    with open(os.path.join(restored, "big", "blob"), "rb") as f:
        assert f.read() == data


def test_file_fsync_makes_what_was_written_durable(env):
    fs = env.fs(sync=False)
    p = f"{env.ns}/log"
    f = fs.open(p, "wb")
    f.write(b"first part;")
    f.fsync()  # the buffered bytes become records and the barrier waits for them
    assert local_snapshot(env.restore()) == {"log": b"first part;"}
    f.write(b"second part")
    f.close()
    assert fs.cat_file(p) == b"first part;second part"
    fs.fsync(p)
    assert local_snapshot(env.restore()) == {"log": b"first part;second part"}


def test_threads_share_one_tree(env):
    import threading

    fs = env.fs()
    errors = []

    def work(t):
        try:
            for i in range(10):
                with fs.open(f"{env.ns}/th{t}/{i}", "wb") as f:
                    f.write(payload((t, i), 5000 + i))
            fs.mv(f"{env.ns}/th{t}/0", f"{env.ns}/th{t}/renamed")
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    live = fs_snapshot(fs, env.ns)
    assert len([v for v in live.values() if v is not None]) == 40
    assert live["th3/renamed"] == payload((3, 0), 5000)
    fs.fsync(env.ns)
    assert local_snapshot(env.restore()) == live


def _journal_ops(env):
    """Every op in the namespace's journal on the server, in order."""
    from sos_journal.rebuild.restore import generation_records, list_generations

    with env.client_factory()() as client:
        gens = list_generations(client)
        return [rec.op for g in sorted(gens) for rec in generation_records(client, gens[g])]


def test_journal_records_stream_and_rename(env):
    from sos_journal.format.records import Create, Rename, Write

    fs = env.fs()
    data = payload("records", (5 << 19) + 7)  # 2.5 MiB
    with fs.open(f"{env.ns}/j/.f.tmp", "wb", block_size=256 << 10) as f:
        for i in range(0, len(data), 100_000):
            f.write(data[i : i + 100_000])
    fs.mv(f"{env.ns}/j/.f.tmp", f"{env.ns}/j/f", overwrite=False)
    fs.pipe_file(f"{env.ns}/j/g", b"g")
    fs.mv(f"{env.ns}/j/g", f"{env.ns}/j/f")
    ops = [op for op in _journal_ops(env) if getattr(op, "path", "").startswith("j/") or isinstance(op, Rename)]
    tmp_ops = [op for op in ops if getattr(op, "path", None) == "j/.f.tmp"]
    assert isinstance(tmp_ops[0], Create)
    writes = tmp_ops[1:]
    assert writes and all(isinstance(w, Write) for w in writes)
    assert len(writes) >= 3 and all(len(w.data) <= 1 << 20 for w in writes)
    assert [w.offset for w in writes] == list(itertools.accumulate([0] + [len(w.data) for w in writes[:-1]]))
    assert b"".join(w.data for w in writes) == data
    renames = [op for op in ops if isinstance(op, Rename)]
    assert [(r.src, r.dst, r.overwrite) for r in renames] == [("j/.f.tmp", "j/f", False), ("j/g", "j/f", True)]


def test_generation_bytes_starts_new_generations_and_restore_equals_tree(env):
    """A small generation_bytes: several generations (each starting with a snapshot of the
    tree, all ready on the server), and the restore (from the newest) equals the tree."""
    from sos_journal.rebuild.restore import list_generations

    with pytest.raises(ValueError, match="generation_bytes"):
        env.fs(generation_bytes=0)
    fs = env.fs(generation_bytes=64 << 10)
    for i in range(12):  # ~240 KB of WRITE records: at least 3 rotations
        fs.pipe_file(f"{env.ns}/g/f{i}", payload(("gen", i), 20_000))
        if i % 3 == 2:
            fs.mv(f"{env.ns}/g/f{i}", f"{env.ns}/g/moved{i}")
            fs.rm(f"{env.ns}/g/f{i - 2}")
    fs.fsync(env.ns)
    with env.client_factory()() as client:
        gens = list_generations(client)
    assert len(gens) >= 4 and all(g.ready for g in gens.values())
    live = fs_snapshot(fs, env.ns)
    assert set(live) == {"g"} | {f"g/f{i}" for i in range(12) if i % 3 == 1} | {f"g/moved{i}" for i in range(2, 12, 3)}
    assert local_snapshot(env.restore()) == live


def test_reader_keeps_its_snapshot_across_replace(env):
    fs = env.fs()
    p = f"{env.ns}/snap"
    fs.pipe_file(p, b"old contents")
    f = fs.open(p, "rb")
    fs.pipe_file(f"{env.ns}/snap.tmp", b"new")
    fs.mv(f"{env.ns}/snap.tmp", p)
    assert f.read() == b"old contents"
    f.close()
    assert fs.cat_file(p) == b"new"


def test_touch_pipe_cp_put_get(env, tmp_path):
    fs = env.fs()
    fs.touch(f"{env.ns}/t/empty")
    assert fs.info(f"{env.ns}/t/empty")["size"] == 0
    fs.pipe_file(f"{env.ns}/t/full", b"abc")
    fs.touch(f"{env.ns}/t/full", truncate=False)
    assert fs.cat_file(f"{env.ns}/t/full") == b"abc"
    fs.touch(f"{env.ns}/t/full")
    assert fs.cat_file(f"{env.ns}/t/full") == b""
    fs.pipe({f"{env.ns}/t/p1": b"1", f"{env.ns}/t/p2": b"2"})
    assert fs.cat([f"{env.ns}/t/p1", f"{env.ns}/t/p2"]) == {f"{env.ns}/t/p1": b"1", f"{env.ns}/t/p2": b"2"}
    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{env.ns}/t/p1", b"x", mode="create")
    big = payload("cp", (1 << 20) + 77)
    fs.pipe_file(f"{env.ns}/t/src", big)
    fs.cp_file(f"{env.ns}/t/src", f"{env.ns}/t/sub/dst")
    assert fs.cat_file(f"{env.ns}/t/sub/dst") == big
    fs.cp_file(f"{env.ns}/t/src", f"sos://{env.ns}/t/src")  # onto itself: unchanged
    assert fs.cat_file(f"{env.ns}/t/src") == big
    with pytest.raises(FileNotFoundError):
        fs.cp_file(f"{env.ns}/t/nope", f"{env.ns}/t/x")
    local = tmp_path / "local.bin"
    local.write_bytes(b"from disk")
    fs.put(str(local), f"{env.ns}/t/put/local.bin")
    fs.get(f"{env.ns}/t/put/local.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == b"from disk"


def test_transaction_publishes_at_commit(env):
    fs = env.fs()
    p = f"{env.ns}/tx/out"
    fs.pipe_file(p, b"before")
    with fs.transaction:
        with fs.open(p, "wb") as f:
            f.write(b"after")
        assert fs.cat_file(p) == b"before"
    assert fs.cat_file(p) == b"after"
    with fs.transaction:
        with fs.open(p, "ab") as f:
            f.write(b"+more")
        with fs.open(f"{env.ns}/tx/new", "xb") as f:
            f.write(b"exclusive")
        assert fs.cat_file(p) == b"after"
        assert not fs.exists(f"{env.ns}/tx/new")
    assert fs.cat_file(p) == b"after+more"
    assert fs.cat_file(f"{env.ns}/tx/new") == b"exclusive"
    with pytest.raises(RuntimeError):
        with fs.transaction:
            with fs.open(f"{env.ns}/tx/discarded", "wb") as f:
                f.write(b"never published")
            raise RuntimeError("abort the transaction")
    assert not fs.exists(f"{env.ns}/tx/discarded")
    assert fs.ls(f"{env.ns}/tx", detail=False) == [f"{env.ns}/tx/new", p]  # no temp left


# ----------------------------------------------------------- directories


def test_ls_info_exists(env):
    fs = env.fs()
    fs.makedirs(f"{env.ns}/l/sub")
    fs.pipe_file(f"{env.ns}/l/b", b"12345")
    fs.pipe_file(f"{env.ns}/l/a", b"")
    names = fs.ls(f"{env.ns}/l", detail=False)
    assert names == [f"{env.ns}/l/a", f"{env.ns}/l/b", f"{env.ns}/l/sub"]
    detail = {e["name"]: e for e in fs.ls(f"sos://{env.ns}/l/")}
    assert detail[f"{env.ns}/l/b"]["type"] == "file"
    assert detail[f"{env.ns}/l/b"]["size"] == 5
    assert detail[f"{env.ns}/l/sub"]["type"] == "directory"
    info = fs.info(f"{env.ns}/l/b")
    assert info["name"] == f"{env.ns}/l/b" and info["size"] == 5
    assert isinstance(info["mtime"], float)
    assert fs.modified(f"{env.ns}/l/b").timestamp() == pytest.approx(info["mtime"])
    assert fs.info(env.ns)["type"] == "directory"
    assert fs.ls(f"{env.ns}/l/b", detail=False) == [f"{env.ns}/l/b"]
    assert fs.ls(f"{env.ns}/l/sub") == []
    with pytest.raises(FileNotFoundError):
        fs.ls(f"{env.ns}/nope")
    with pytest.raises(FileNotFoundError):
        fs.info(f"{env.ns}/nope")
    with pytest.raises(FileNotFoundError):
        fs.info(f"{env.ns}/l/b/under-a-file")
    assert fs.exists(f"{env.ns}/l/sub") and not fs.exists(f"{env.ns}/nope")
    assert fs.isdir(f"{env.ns}/l") and fs.isfile(f"{env.ns}/l/a")
    assert sorted(fs.find(f"{env.ns}/l")) == [f"{env.ns}/l/a", f"{env.ns}/l/b"]
    assert fs.glob(f"{env.ns}/l/*") == [f"{env.ns}/l/a", f"{env.ns}/l/b", f"{env.ns}/l/sub"]


def test_mkdir_makedirs_rmdir(env):
    fs = env.fs()
    d = f"{env.ns}/d1/d2"
    fs.makedirs(d)
    with pytest.raises(FileExistsError):
        fs.makedirs(d)
    fs.makedirs(d, exist_ok=True)
    fs.makedirs(env.ns, exist_ok=True)
    with pytest.raises(FileExistsError):
        fs.mkdir(d)
    with pytest.raises(FileNotFoundError):
        fs.mkdir(f"{env.ns}/none/x", create_parents=False)
    fs.mkdir(f"{env.ns}/p/q/r")  # create_parents=True by default
    assert fs.isdir(f"{env.ns}/p/q/r")
    fs.pipe_file(f"{env.ns}/file", b"x")
    with pytest.raises(FileExistsError):
        fs.makedirs(f"{env.ns}/file", exist_ok=True)
    with pytest.raises(NotADirectoryError):
        fs.makedirs(f"{env.ns}/file/sub")
    with pytest.raises(NotADirectoryError):
        fs.mkdir(f"{env.ns}/file/sub")
    with pytest.raises(OSError) as exc:
        fs.rmdir(f"{env.ns}/d1")
    assert exc.value.errno == errno.ENOTEMPTY
    with pytest.raises(NotADirectoryError):
        fs.rmdir(f"{env.ns}/file")
    with pytest.raises(FileNotFoundError):
        fs.rmdir(f"{env.ns}/gone")
    with pytest.raises(PermissionError):
        fs.rmdir(env.ns)
    fs.rmdir(d)
    assert not fs.exists(d) and fs.isdir(f"{env.ns}/d1")


def test_rm(env):
    fs = env.fs()
    fs.pipe({f"{env.ns}/r/a/1": b"1", f"{env.ns}/r/a/b/2": b"2", f"{env.ns}/r/c": b"3"})
    with pytest.raises(FileNotFoundError):
        fs.rm(f"{env.ns}/r/missing")
    with pytest.raises(FileNotFoundError):
        fs.rm(f"{env.ns}/r/missing", recursive=True)
    with pytest.raises(IsADirectoryError):
        fs.rm(f"{env.ns}/r/a")
    with pytest.raises(IsADirectoryError):
        fs.rm_file(f"{env.ns}/r/a")
    fs.rm(f"{env.ns}/r/c")
    assert not fs.exists(f"{env.ns}/r/c")
    fs.rm(f"{env.ns}/r/a", recursive=True)
    assert fs.ls(f"{env.ns}/r") == []
    fs.pipe({f"{env.ns}/r/x": b"", f"{env.ns}/r/y": b""})
    fs.rm([f"{env.ns}/r/x", f"{env.ns}/r/y"])
    assert fs.ls(f"{env.ns}/r") == []
    fs.rm(env.ns, recursive=True)  # empties the namespace, keeps its root
    assert fs.ls(env.ns) == []
    fs.fsync(env.ns)  # deletions are not barriers: wait for them explicitly
    assert local_snapshot(env.restore()) == {}


def test_mv(env):
    fs = env.fs()
    ns = env.ns
    fs.pipe({f"{ns}/a": b"A", f"{ns}/b": b"B", f"{ns}/dir/in": b"I", f"{ns}/dir/sub/deep": b"D"})
    fs.mv(f"{ns}/a", f"{ns}/b")  # atomic replace
    assert fs.cat_file(f"{ns}/b") == b"A" and not fs.exists(f"{ns}/a")
    fs.pipe_file(f"{ns}/a", b"A2")
    with pytest.raises(FileExistsError):
        fs.mv(f"{ns}/a", f"{ns}/b", overwrite=False)
    assert fs.cat_file(f"{ns}/b") == b"A"
    fs.mv(f"{ns}/a", f"{ns}/fresh", overwrite=False)
    assert fs.cat_file(f"{ns}/fresh") == b"A2"
    fs.mv(f"{ns}/fresh", f"{ns}/dir")  # into an existing directory
    assert fs.cat_file(f"{ns}/dir/fresh") == b"A2"
    fs.mv(f"{ns}/dir", f"{ns}/moved")  # a whole directory, one rename
    assert not fs.exists(f"{ns}/dir")
    assert fs.cat_file(f"{ns}/moved/sub/deep") == b"D"
    fs.mv(f"sos://{ns}/b", f"sos://{ns}/newdir/")  # trailing slash: into a new directory
    assert fs.cat_file(f"{ns}/newdir/b") == b"A"
    with pytest.raises(FileNotFoundError):
        fs.mv(f"{ns}/missing", f"{ns}/x")
    with pytest.raises(FileNotFoundError):
        fs.mv(f"{ns}/moved/in", f"{ns}/no/such/parent")
    with pytest.raises(OSError) as exc:
        fs.mv(f"{ns}/moved", f"{ns}/moved/sub/inside")
    assert exc.value.errno == errno.EINVAL
    fs.makedirs(f"{ns}/target/moved/nonempty")
    with pytest.raises(OSError) as exc:
        fs.mv(f"{ns}/moved", f"{ns}/target")
    assert exc.value.errno == errno.ENOTEMPTY
    fs.pipe_file(f"{ns}/target2/moved", b"file")
    with pytest.raises(NotADirectoryError):
        fs.mv(f"{ns}/moved", f"{ns}/target2/moved")
    assert fs.cat_file(f"{ns}/moved/in") == b"I"
    fs.fsync(ns)
    assert local_snapshot(env.restore()) == fs_snapshot(fs, ns)


# ------------------------------------------------------ trees and processes


def test_two_filesystems_share_one_tree(env):
    fs1 = env.fs()
    fs2 = env.fs(sync=False)  # a different fsspec token: a distinct instance
    assert fs1 is not fs2
    assert fs1._ns(env.ns) is fs2._ns(env.ns)
    # interleaved writes through both: neither fences the other
    fs1.pipe_file(f"{env.ns}/one", b"1")
    fs2.pipe_file(f"{env.ns}/two", b"2")
    fs1.pipe_file(f"{env.ns}/three", b"3")
    fs2.mv(f"{env.ns}/one", f"{env.ns}/uno")
    assert fs1.cat_file(f"{env.ns}/uno") == b"1"
    fs1.fsync(env.ns)
    assert local_snapshot(env.restore()) == {"uno": b"1", "two": b"2", "three": b"3"}


def test_fenced_filesystem_refuses_changes(env, tmp_path):
    fs = env.fs()
    fs.pipe_file(f"{env.ns}/f/first", b"1")
    # a second writer of the namespace (another cache directory: another tree)
    # fences the first one, as a restarted job on another machine would
    usurper = env.fs(cache_dir=str(tmp_path / "usurper"))
    assert usurper.cat_file(f"{env.ns}/f/first") == b"1"  # rebuilt from the server
    usurper.pipe_file(f"{env.ns}/f/second", b"2")
    with pytest.raises(PermissionError, match="fenced"):
        fs.pipe_file(f"{env.ns}/f/lost", b"refused")  # the close barrier cannot succeed
    with pytest.raises(PermissionError):
        fs.makedirs(f"{env.ns}/f/nope")
    assert fs.cat_file(f"{env.ns}/f/first") == b"1"  # reads still served from the cache
    usurper.fsync(env.ns)
    assert local_snapshot(env.restore()) == {"f": None, "f/first": b"1", "f/second": b"2"}


def test_async_mode_catches_up(env):
    fs = env.fs(sync=False)
    expected = {}
    for i in range(30):
        data = payload(i, 100 * i)
        fs.pipe_file(f"{env.ns}/as/{i}", data)
        expected[f"as/{i}"] = data
    fs.mv(f"{env.ns}/as/0", f"{env.ns}/as/zero")
    expected["as/zero"] = expected.pop("as/0")
    fs.fsync(env.ns)
    restored = local_snapshot(env.restore())
    assert {k: v for k, v in restored.items() if v is not None} == expected


def _run_child(code, *args):
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_close_returns_only_when_durable(env, tmp_path):
    # the child writes in sync mode and dies without any cleanup the moment
    # close() and mv() return: whatever they promised must be on the server
    _run_child(
        """
        import os, sys
        from spark_plugin.fsspec.filesystem import SOSFileSystem
        server, key, ns, cache = sys.argv[1:]
        fs = SOSFileSystem(server=server, key=key, cache_dir=cache)
        with fs.open(ns + "/chk/.1.tmp", "wb") as f:
            f.write(b"batch-1" * 1000)
        fs.mv(ns + "/chk/.1.tmp", ns + "/chk/1")
        with fs.open(ns + "/chk/last", "wb") as f:
            f.write(b"closed")
        os._exit(0)
        """,
        env.server.address,
        env.key,
        env.ns,
        str(tmp_path / "child-cache"),
    )
    restored = local_snapshot(env.restore())
    assert restored == {"chk": None, "chk/1": b"batch-1" * 1000, "chk/last": b"closed"}


def test_async_process_flushes_at_exit(env, tmp_path):
    # async mode: nothing waits for the server until the interpreter exits
    _run_child(
        """
        import sys
        from spark_plugin.fsspec.filesystem import SOSFileSystem
        server, key, ns, cache = sys.argv[1:]
        fs = SOSFileSystem(server=server, key=key, cache_dir=cache, sync=False)
        for i in range(20):
            fs.pipe_file(f"{ns}/async/{i}", str(i).encode() * 100)
        fs.rm(f"{ns}/async/0")
        """,
        env.server.address,
        env.key,
        env.ns,
        str(tmp_path / "child-cache"),
    )
    restored = local_snapshot(env.restore())
    expected = {f"async/{i}": str(i).encode() * 100 for i in range(1, 20)}
    assert restored == {"async": None, **expected}


def test_second_process_rebuilds_cache_from_server(env, tmp_path):
    fs = env.fs()
    files = {f"{env.ns}/data/{i}": payload(i, 1000 + i) for i in range(5)}
    fs.pipe(files)
    fs.makedirs(f"{env.ns}/empty/dir")
    fs.mv(f"{env.ns}/data/0", f"{env.ns}/data/zero")
    files[f"{env.ns}/data/zero"] = files.pop(f"{env.ns}/data/0")
    sosfs.close_all()  # this process is done writing
    child_cache = tmp_path / "reader-cache"
    out = _run_child(
        """
        import hashlib, json, sys
        import fsspec
        server, key, ns, cache = sys.argv[1:]
        fs = fsspec.filesystem("sos", server=server, key=key, cache_dir=cache)
        found = fs.find(ns, withdirs=True, detail=True)
        print(json.dumps({name: (info["type"], hashlib.sha256(fs.cat_file(name)).hexdigest()
                                 if info["type"] == "file" else None)
                          for name, info in found.items()}))
        """,
        env.server.address,
        env.key,
        env.ns,
        str(child_cache),
    )
    seen = json.loads(out.strip().splitlines()[-1])
    expected = {name: ["file", hashlib.sha256(data).hexdigest()] for name, data in files.items()}
    expected.update(
        {
            env.ns: ["directory", None],
            f"{env.ns}/data": ["directory", None],
            f"{env.ns}/empty": ["directory", None],
            f"{env.ns}/empty/dir": ["directory", None],
        }
    )
    assert seen == expected
    # the child's cache now holds the tree
    with open(child_cache / env.ns / "tree" / "data" / "zero", "rb") as f:
        assert f.read() == files[f"{env.ns}/data/zero"]


# ------------------------------------------------- generated op sequences

_SEGMENTS = ["a", "b", "c"]
_SIZES = [0, 1, 5, 300, 70_000]

# each depth equally likely, so short paths (which exist more often) dominate
_path = st.one_of(*(st.sampled_from(["/".join(p) for p in itertools.product(_SEGMENTS, repeat=n)]) for n in (1, 2, 3)))
_data = st.tuples(st.integers(0, 1000), st.sampled_from(_SIZES)).map(lambda t: payload(*t))
_write = st.tuples(st.just("write"), _path, _data)
_op = st.one_of(
    st.tuples(st.just("mkdir"), _path),
    _write,
    _write,
    st.tuples(st.just("append"), _path, _data),
    st.tuples(st.just("mv"), _path, _path, st.booleans()),
    st.tuples(st.just("rm"), _path, st.booleans()),
)


class Model:
    """What the tree must look like: directories and file contents."""

    def __init__(self):
        self.dirs: set[str] = set()
        self.files: dict[str, bytes] = {}

    def exists(self, p):
        return p == "" or p in self.dirs or p in self.files

    def is_dir(self, p):
        return p == "" or p in self.dirs

    @staticmethod
    def ancestors(p):
        parts = p.split("/")
        return ["/".join(parts[:i]) for i in range(1, len(parts))]

    def _ensure_parents(self, p):
        anc = self.ancestors(p)
        if any(a in self.files for a in anc):
            raise NotADirectoryError
        self.dirs.update(anc)

    def _subtree(self, p):
        pre = p + "/"
        return [x for x in (*self.dirs, *self.files) if x.startswith(pre)]

    def apply(self, op):
        kind = op[0]
        if kind == "mkdir":
            p = op[1]
            if self.exists(p):
                raise FileExistsError
            self._ensure_parents(p)
            self.dirs.add(p)
        elif kind in ("write", "append"):
            p, data = op[1], op[2]
            if self.is_dir(p):
                raise IsADirectoryError
            self._ensure_parents(p)
            self.files[p] = (self.files.get(p, b"") if kind == "append" else b"") + data
        elif kind == "rm":
            p, recursive = op[1], op[2]
            if not self.exists(p):
                raise FileNotFoundError
            if p in self.files:
                del self.files[p]
            elif not recursive:
                raise IsADirectoryError
            else:
                for x in self._subtree(p):
                    self.dirs.discard(x)
                    self.files.pop(x, None)
                self.dirs.discard(p)
        elif kind == "mv":
            self._mv(*op[1:])

    def _mv(self, src, dst, overwrite):
        if not self.exists(src):
            raise FileNotFoundError
        if src == dst:
            return
        if self.is_dir(dst):
            dst = f"{dst}/{src.rsplit('/', 1)[-1]}" if dst else src.rsplit("/", 1)[-1]
        if dst == src:
            return
        src_dir = self.is_dir(src)
        if src_dir and dst.startswith(src + "/"):
            raise OSError(errno.EINVAL, "into itself")
        parent = dst.rsplit("/", 1)[0] if "/" in dst else ""
        if parent in self.files:
            raise NotADirectoryError
        if not self.is_dir(parent):
            raise FileNotFoundError
        if self.exists(dst):
            if not overwrite:
                raise FileExistsError
            if src_dir and dst in self.files:
                raise NotADirectoryError
            if not src_dir and self.is_dir(dst):
                raise IsADirectoryError
            if self.is_dir(dst) and self._subtree(dst):
                raise OSError(errno.ENOTEMPTY, "not empty")
        if src_dir:
            self.dirs.discard(dst)
            moved = [(x, dst + x[len(src) :]) for x in [src, *self._subtree(src)]]
            for old, new in moved:
                if old in self.dirs:
                    self.dirs.discard(old)
                    self.dirs.add(new)
            for old, new in moved:
                if old in self.files:
                    self.files[new] = self.files.pop(old)
        else:
            self.files[dst] = self.files.pop(src)

    def snapshot(self):
        out = {d: None for d in self.dirs}
        out.update(self.files)
        return out


def _apply_fs(fs, top, op):
    kind = op[0]
    p = f"{top}/{op[1]}"
    if kind == "mkdir":
        fs.mkdir(p)
    elif kind == "write":
        with fs.open(p, "wb", block_size=64 << 10) as f:  # small blocks: several WRITEs
            f.write(op[2])
    elif kind == "append":
        with fs.open(p, "ab") as f:
            f.write(op[2])
    elif kind == "mv":
        fs.mv(p, f"{top}/{op[2]}", overwrite=op[3])
    elif kind == "rm":
        fs.rm(p, recursive=op[2])


@pytest.fixture(scope="module")
def generated_env(server, tmp_path_factory):
    e = _Env(server, tmp_path_factory, prefix="gen")
    yield e
    sosfs.close_all()


_example = itertools.count()


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(ops=st.lists(_op, min_size=1, max_size=15))
def test_generated_sequences_restore_equals_live_tree(generated_env, ops):
    env = generated_env
    fs = env.fs()
    top = f"{env.ns}/e{next(_example)}"
    fs.mkdir(top)
    model = Model()
    for op in ops:
        try:
            model.apply(op)
            expected = None
        except OSError as exc:
            expected = exc
        if expected is None:
            _apply_fs(fs, top, op)
        else:
            with pytest.raises(type(expected)) as got:
                _apply_fs(fs, top, op)
            if type(expected) is OSError:
                assert got.value.errno == expected.errno, op
    live = fs_snapshot(fs, top)
    assert live == model.snapshot()
    fs.fsync(env.ns)
    restored_root = env.restore()
    assert local_snapshot(os.path.join(restored_root, top.split("/", 1)[1])) == live
    # and the whole namespace, every earlier example included, byte for byte
    assert local_snapshot(restored_root) == fs_snapshot(fs, env.ns)


def test_fsspec_reads_a_server_and_key_as_the_clients_and_the_command_do(env, monkeypatch):
    """One resolver (sos_client.resolve_server/resolve_key) behind fsspec, the clients and
    `sos`: a bare host gets the default port everywhere, $SOS_SERVER is the default."""
    from sos_client import BadKey, resolve_server
    from sos_client.cli import build_parser

    monkeypatch.delenv("SOS_SERVER", raising=False)
    fs = SOSFileSystem(server="localhost", key=env.key, skip_instance_cache=True)
    assert fs.server == resolve_server("localhost") == "localhost:7070"
    assert build_parser().parse_args(["ls", "ns", "--server", "localhost"]).server == "localhost:7070"
    monkeypatch.setenv("SOS_SERVER", env.server.address)
    assert SOSFileSystem(key=env.key, skip_instance_cache=True).server == env.server.address
    assert build_parser().parse_args(["ls", "ns"]).server == env.server.address
    with pytest.raises(BadKey) as exc:  # a PermissionError for clients, a ValueError for fsspec
        SOSFileSystem(key="nope", skip_instance_cache=True)
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, PermissionError)
    assert "nope" not in str(exc.value)


def test_errors_the_tree_decides_name_the_fsspec_path(env):
    """mkdir, rmdir and rm_file leave the verdict to the journal tree (POSIX on the cache),
    no stat-then-raise of their own: the errors still name NS/path and change nothing."""
    import errno as _errno

    fs = env.fs()
    fs.pipe_file(f"{env.ns}/d/f", b"x")
    cases = [
        (fs.mkdir, f"{env.ns}/d", _errno.EEXIST),
        (fs.rmdir, f"{env.ns}/d", _errno.ENOTEMPTY),
        (fs.rmdir, f"{env.ns}/d/f", _errno.ENOTDIR),
        (fs.rmdir, f"{env.ns}/none", _errno.ENOENT),
        (fs.rm_file, f"{env.ns}/d", _errno.EISDIR),
        (fs.rm_file, f"{env.ns}/none", _errno.ENOENT),
        (lambda p: fs.mkdir(p, create_parents=False), f"{env.ns}/no/sub", _errno.ENOENT),
        (fs.mkdir, f"{env.ns}/d/f/sub", _errno.ENOTDIR),
    ]
    for call, path, code in cases:
        with pytest.raises(OSError) as info:
            call(path)
        assert (info.value.errno, info.value.filename) == (code, path), (path, info.value)
    assert local_snapshot(env.restore()) == {"d": None, "d/f": b"x"}
