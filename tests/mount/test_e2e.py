"""End-to-end tests of `sos mount`: a real sos-server process, a real mount
process (MountProcess -> `python -m spark_plugin.mount.cli`), real files.

After each sequence of operations the namespace is restored from the server
(the journal core's restore) into a fresh directory and compared with what was
written through the mount. Nothing here depends on timing: every wait is for
a condition, with a generous deadline.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import signal
import stat
import subprocess
import sys
import textwrap
import uuid

import pytest

pytest.importorskip("pyfuse3")

from spark_plugin.mount.process import MountProcess, is_mounted
from tests.mount.support import as_user, durable, renameat2, stop_mounts
from tests.support import tree_snapshot as snapshot

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing: no FUSE"),
    pytest.mark.timeout(240),
]


# --------------------------------------------------------------------------- fixtures


_namespaces = itertools.count()


@pytest.fixture
def server(server, request):
    """The module's shared sos-server (conftest); a test marked ``own_server`` (it kills its
    server) gets one of its own."""
    if request.node.get_closest_marker("own_server"):
        return request.getfixturevalue("sos_server")
    return server


@pytest.fixture
def ns():
    """A namespace of this test's own on the module's shared server (conftest ``server``)."""
    return f"mnt{next(_namespaces)}-{os.getpid()}"


@pytest.fixture
def key(server, ns):
    return server.keygen(ns, "append")


@pytest.fixture
def mounts(tmp_path, server, key, ns):
    """Factory of MountProcess objects; every mount is stopped and unmounted at teardown."""
    started = []

    def make(name="m", cache=None, sync=True, start=True, writeback=False, extra_args=()):
        mp = MountProcess(
            ns,
            str(tmp_path / f"mnt-{name}"),
            str(cache or tmp_path / f"cache-{name}"),
            server.address,
            key,
            sync=sync,
            log_path=str(tmp_path / f"mount-{name}-{len(started)}.log"),
            extra_args=(["--writeback-cache"] if writeback else []) + list(extra_args),
        )
        started.append(mp)
        if start:
            mp.start()
        return mp

    yield make
    stop_mounts(started)


# --------------------------------------------------------------------------- helpers


def restored(server, key, tmp_path, ns):
    """Restore the namespace from the server into a fresh directory; return its snapshot."""
    from sos_client import Client
    from sos_journal.rebuild.restore import restore

    target = tmp_path / f"restored-{uuid.uuid4().hex[:8]}"
    restore(lambda: Client(server.address, key, ns), ns, str(target))
    return snapshot(target)


def write_file(path, data, chunk=64 << 10):
    with open(path, "wb") as f:
        for i in range(0, len(data), chunk):
            f.write(data[i : i + chunk])


def read_file(path):
    with open(path, "rb") as f:
        return f.read()


def spark_write(root, rel, data, *, overwrite):
    """Spark's CheckpointFileManager: temp file `.<name>.<uuid>.tmp`, then rename."""
    d, name = os.path.split(os.path.join(root, rel))
    tmp = os.path.join(d, f".{name}.{uuid.uuid4()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    if overwrite:
        os.rename(tmp, os.path.join(d, name))
    else:
        renameat2(tmp, os.path.join(d, name))


# --------------------------------------------------------------------------- FUSE semantics


@pytest.mark.parametrize("writeback", [False, True], ids=["direct", "writeback"])
def test_create_write_read_back_then_restore(mounts, server, key, tmp_path, writeback, ns):
    mp = mounts(writeback=writeback)
    assert ("writeback cache" in mp.log()) == writeback
    m = mp.mountpoint
    big = os.urandom(3 * (1 << 20) + 12345)  # > one WRITE record, many FUSE writes
    expected = {
        "empty": b"",
        "small": b"hello sos\n",
        "dir": None,
        "dir/sub": None,
        "dir/sub/big.bin": big,
    }
    os.makedirs(os.path.join(m, "dir", "sub"))
    for rel, data in expected.items():
        if data is not None:
            write_file(os.path.join(m, rel), data)
    # random-offset write inside an existing file (pwrite), read back
    with open(os.path.join(m, "small"), "r+b") as f:
        f.seek(6)
        f.write(b"SOS")
    expected["small"] = b"hello SOS\n"
    assert read_file(os.path.join(m, "dir", "sub", "big.bin")) == big
    assert snapshot(m) == expected
    durable(m)
    assert restored(server, key, tmp_path, ns) == expected


def test_rename_replace_and_noreplace(mounts, server, key, tmp_path, ns):
    m = mounts().mountpoint
    write_file(os.path.join(m, "a"), b"AAA")
    write_file(os.path.join(m, "b"), b"BBB")
    with pytest.raises(OSError) as info:
        renameat2(os.path.join(m, "a"), os.path.join(m, "b"))
    assert info.value.errno == errno.EEXIST
    assert read_file(os.path.join(m, "b")) == b"BBB"
    renameat2(os.path.join(m, "a"), os.path.join(m, "c"))  # no target: allowed
    os.rename(os.path.join(m, "c"), os.path.join(m, "b"))  # replaces
    os.makedirs(os.path.join(m, "d1", "x"))
    write_file(os.path.join(m, "d1", "x", "f"), b"F")
    os.rename(os.path.join(m, "d1"), os.path.join(m, "d2"))  # directory with content
    assert read_file(os.path.join(m, "d2", "x", "f")) == b"F"
    expected = {"b": b"AAA", "d2": None, "d2/x": None, "d2/x/f": b"F"}
    assert snapshot(m) == expected
    durable(m)
    assert restored(server, key, tmp_path, ns) == expected


def test_unlink_mkdir_rmdir_readdir(mounts, server, key, tmp_path, ns):
    m = mounts().mountpoint
    os.mkdir(os.path.join(m, "d"))
    for i in range(50):
        write_file(os.path.join(m, "d", f"f{i:03d}"), str(i).encode())
    assert sorted(os.listdir(os.path.join(m, "d"))) == [f"f{i:03d}" for i in range(50)]
    with pytest.raises(OSError) as info:
        os.rmdir(os.path.join(m, "d"))
    assert info.value.errno == errno.ENOTEMPTY
    with pytest.raises(FileExistsError):
        os.mkdir(os.path.join(m, "d"))
    for i in range(0, 50, 2):
        os.unlink(os.path.join(m, "d", f"f{i:03d}"))
    os.mkdir(os.path.join(m, "gone"))
    os.rmdir(os.path.join(m, "gone"))
    with pytest.raises(FileNotFoundError):
        os.unlink(os.path.join(m, "d", "f000"))
    names = sorted(e.name for e in os.scandir(os.path.join(m, "d")))
    assert names == [f"f{i:03d}" for i in range(1, 50, 2)]
    expected = {"d": None, **{f"d/f{i:03d}": str(i).encode() for i in range(1, 50, 2)}}
    assert snapshot(m) == expected
    durable(m)
    assert restored(server, key, tmp_path, ns) == expected


def test_chmod_utime_truncate_statfs_fsync(mounts, server, key, tmp_path, ns):
    m = mounts().mountpoint
    p = os.path.join(m, "f")
    write_file(p, b"0123456789")
    os.chmod(p, 0o640)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    os.utime(p, ns=(1_500_000_000_000_000_000, 1_600_000_000_000_000_000))
    assert os.stat(p).st_mtime_ns == 1_600_000_000_000_000_000
    os.truncate(p, 4)  # setattr size -> TRUNCATE record
    with open(p, "r+b") as f:
        f.truncate(6)  # ftruncate, grows with zeros
        f.seek(0, os.SEEK_END)
        f.write(b"!")
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(os.path.join(m, "g"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, b"x" * 100)
    os.fsync(fd)
    os.close(fd)
    fd = os.open(os.path.join(m, "g"), os.O_WRONLY | os.O_TRUNC)  # open(O_TRUNC) truncates
    os.write(fd, b"y")
    os.close(fd)
    sv = os.statvfs(m)
    assert sv.f_bsize > 0 and sv.f_blocks > 0 and sv.f_namemax >= 255
    assert os.access(p, os.R_OK | os.W_OK)
    expected = {"f": b"0123\0\0!", "g": b"y"}
    assert snapshot(m) == expected
    durable(m)
    assert restored(server, key, tmp_path, ns) == expected


def test_spark_checkpoint_pattern_many_files(mounts, server, key, tmp_path, ns):
    """Metadata logs rename without overwrite, state files with overwrite, old files deleted."""
    m = mounts().mountpoint
    chk = os.path.join(m, "chk")
    for d in ("offsets", "commits", "sources/0", "state/0/0", "state/0/1"):
        os.makedirs(os.path.join(chk, d), exist_ok=True)
    spark_write(chk, "metadata", b'{"id":"q"}', overwrite=False)
    expected_files = {"chk/metadata": b'{"id":"q"}'}
    for batch in range(25):
        spark_write(chk, f"sources/0/{batch}", b"v1\n%d" % batch, overwrite=False)
        spark_write(chk, f"offsets/{batch}", b"v1\noffset %d" % batch, overwrite=False)
        for part in (0, 1):
            spark_write(chk, f"state/0/{part}/{batch + 1}.delta", os.urandom(300), overwrite=True)
        spark_write(chk, f"commits/{batch}", b"v1\n{}", overwrite=False)
        with pytest.raises(FileExistsError):  # a second query on the same checkpoint
            spark_write(chk, f"commits/{batch}", b"other", overwrite=False)
        if batch >= 10:  # maintenance deletes old deltas
            for part in (0, 1):
                os.unlink(os.path.join(chk, f"state/0/{part}/{batch - 9}.delta"))
    # every leftover temp file of the refused renames is still there: clean them like Spark
    for dirpath, _, files in os.walk(chk):
        for f in files:
            if f.endswith(".tmp"):
                os.unlink(os.path.join(dirpath, f))
    got = snapshot(m)
    assert not any(k.endswith(".tmp") for k in got)
    for batch in range(25):
        expected_files[f"chk/commits/{batch}"] = b"v1\n{}"
        expected_files[f"chk/offsets/{batch}"] = b"v1\noffset %d" % batch
    for rel, data in expected_files.items():
        assert got[rel] == data
    assert sorted(os.listdir(os.path.join(chk, "state/0/0"))) == sorted(f"{v}.delta" for v in range(16, 26))
    durable(m)
    assert restored(server, key, tmp_path, ns) == got


# --------------------------------------------------------------------------- process life


def test_sigterm_unmounts_cleanly_and_remount_resumes(mounts, server, key, tmp_path, ns):
    mp = mounts("a")
    write_file(os.path.join(mp.mountpoint, "one"), b"1")
    busy = os.open(os.path.join(mp.mountpoint, "one"), os.O_RDONLY)  # still open at SIGTERM
    try:
        assert mp.stop() == 0  # a busy mount is detached (lazy) all the same
    finally:
        with contextlib.suppress(OSError):  # ENOTCONN: its daemon is gone
            os.close(busy)
    assert not is_mounted(mp.mountpoint)
    assert "unmounted" in mp.log()
    again = mounts("a", cache=mp.cache_dir)  # same, non-empty cache
    assert read_file(os.path.join(again.mountpoint, "one")) == b"1"
    write_file(os.path.join(again.mountpoint, "two"), b"2")
    again.proc.send_signal(signal.SIGINT)
    assert again.proc.wait(120) == 0
    assert not is_mounted(again.mountpoint)
    assert restored(server, key, tmp_path, ns) == {"one": b"1", "two": b"2"}


def test_sigkill_then_remount_on_empty_cache_restores(mounts, server, key, tmp_path, ns):
    mp = mounts("a")
    m = mp.mountpoint
    os.makedirs(os.path.join(m, "chk", "commits"))
    data = {f"chk/commits/{i}": os.urandom(1000 + i) for i in range(20)}
    for rel, body in data.items():
        spark_write(m, rel, body, overwrite=False)
    # written in place, no rename, no fsync: its close waits (a batch file of commits/)
    data["chk/commits/20"] = b"no rename, no fsync: close alone waits for commits/N"
    write_file(os.path.join(m, "chk", "commits", "20"), data["chk/commits/20"])
    mp.proc.kill()  # a crash: nothing gets a chance to flush; the mount is left dead
    mp.proc.wait()
    assert is_mounted(m)
    with pytest.raises(OSError) as info:
        os.listdir(m)
    assert info.value.errno == errno.ENOTCONN
    mp.kill()  # MountProcess.kill: lazy unmount of the dead mount
    assert not is_mounted(m)
    fresh = mounts("b")  # empty cache: restored from the server before mounting
    got = snapshot(fresh.mountpoint)
    assert got == {"chk": None, "chk/commits": None, **data}
    write_file(os.path.join(fresh.mountpoint, "chk", "after"), b"after the crash")
    assert fresh.stop() == 0
    assert restored(server, key, tmp_path, ns) == {**got, "chk/after": b"after the crash"}


def test_mount_over_a_tree_made_by_sos_restore(mounts, server, key, tmp_path, ns):
    """What the demo's new worker does: `sos restore` into its empty cache's tree
    directory, then `sos mount` on that cache. The tree is served as restored, the mount
    starts a new generation whose snapshot is that tree, and the journal goes on from it."""
    from sos_client import Client
    from sos_journal.rebuild.restore import list_generations
    from spark_plugin.spark import sos_command

    first = mounts("a")
    os.makedirs(os.path.join(first.mountpoint, "chk", "commits"))
    for i in range(3):
        spark_write(first.mountpoint, f"chk/commits/{i}", f"c{i}".encode(), overwrite=False)
    before = snapshot(first.mountpoint)
    first.kill()  # the worker is lost (its cache is simply not used again)

    cache = tmp_path / "cache-b"
    proc = subprocess.run(
        [*sos_command(), "restore", "-q", "--server", server.address, ns, str(cache / "tree")],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, SOS_KEY=key),
    )
    assert proc.returncode == 0, proc.stderr
    assert snapshot(cache / "tree") == before
    with Client(server.address, key, ns) as client:
        gens_before = max(list_generations(client))
    second = mounts("b", cache=cache)
    assert "rebuilt from the server" not in second.log()  # served as restored, not rebuilt
    assert snapshot(second.mountpoint) == before
    with Client(server.address, key, ns) as client:
        gens = list_generations(client)
    assert max(gens) == gens_before + 1 and gens[max(gens)].ready
    spark_write(second.mountpoint, "chk/commits/3", b"c3", overwrite=False)
    assert second.stop() == 0
    assert restored(server, key, tmp_path, ns) == {**before, "chk/commits/3": b"c3"}


def test_generation_bytes_option_starts_new_generations(mounts, server, key, tmp_path, ns):
    """--generation-bytes 64K: writing ~300 KB makes several generations, every one ready;
    the restore (from the newest, a snapshot plus what followed) equals the tree."""
    from sos_client import Client
    from sos_journal.rebuild.restore import list_generations

    m = mounts(extra_args=["--generation-bytes", "64K"]).mountpoint
    os.makedirs(os.path.join(m, "chk", "offsets"))
    for i in range(15):
        spark_write(m, f"chk/offsets/{i}", os.urandom(20_000), overwrite=False)
        if i >= 3:
            os.unlink(os.path.join(m, "chk", "offsets", str(i - 3)))
    expected = snapshot(m)
    durable(m)
    with Client(server.address, key, ns) as client:
        gens = list_generations(client)
    assert len(gens) >= 4 and all(g.ready for g in gens.values())
    assert restored(server, key, tmp_path, ns) == expected
    assert sorted(expected) == ["chk", "chk/offsets"] + [f"chk/offsets/{i}" for i in range(12, 15)]


def test_cli_generation_bytes_must_be_a_positive_size(tmp_path, server, ns):
    env = dict(os.environ, SOS_KEY="k")
    for bad in ("0", "lots"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "spark_plugin.mount.cli",
                ns,
                str(tmp_path),
                "--server",
                server.address,
                "--generation-bytes",
                bad,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert proc.returncode == 2 and "--generation-bytes" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- owners

SPARK_UID = 185  # the official Spark image's user
OTHER_UID = 186


def owner(path):
    st = os.lstat(path)
    return st.st_uid, st.st_gid


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the sidecar's situation)")
def test_non_root_user_owns_what_it_creates_and_others_are_refused(mounts, server, key, tmp_path, ns):
    """The sidecar runs as root, Spark as uid 185: --owner gives 185 the root directory;
    what 185 creates is 185's (cache too); another user is refused by the kernel's
    permission checks; an empty cache rebuilt from the server is 185's again."""
    spark = f"{SPARK_UID}:{SPARK_UID}"
    mp = mounts("a", extra_args=["--owner", spark])
    m = mp.mountpoint
    assert owner(m) == (SPARK_UID, SPARK_UID)
    out = as_user(
        SPARK_UID,
        m,
        ["mkdir", "checkpoint"],
        ["mkdir", "checkpoint/offsets"],
        ["write", "checkpoint/offsets/.0.tmp", "offsets of batch 0"],
        ["rename", "checkpoint/offsets/.0.tmp", "checkpoint/offsets/0"],
        ["write", "checkpoint/metadata", "{}"],
        ["chmod", "checkpoint/metadata", 0o640],
        ["read", "checkpoint/offsets/0"],
        ["write", ".sos/marker", '{"label": "spark.batch", "payload": {"batch_id": 0}}'],
        ["chown", "checkpoint/metadata", 0],
    )  # only root may give files away
    assert out["data:checkpoint/offsets/0"] == "offsets of batch 0"
    assert out["chown:checkpoint/metadata:0"] == errno.EPERM
    assert all(v == "ok" for k, v in out.items() if k.split(":")[0] in ("mkdir", "write", "rename", "chmod"))
    assert len([k for k in out if k.startswith("write:.sos/marker")]) == 1  # the listener's
    cache_tree = os.path.join(mp.cache_dir, "tree")
    for rel in ("checkpoint", "checkpoint/offsets", "checkpoint/offsets/0", "checkpoint/metadata"):
        assert owner(os.path.join(m, rel)) == (SPARK_UID, SPARK_UID), rel
        assert owner(os.path.join(cache_tree, rel)) == (SPARK_UID, SPARK_UID), rel
    assert stat.S_IMODE(os.stat(os.path.join(m, "checkpoint/metadata")).st_mode) == 0o640
    # a process of root creates root's files (root may write anywhere)
    write_file(os.path.join(m, "checkpoint", "by-root"), b"r")
    assert owner(os.path.join(m, "checkpoint", "by-root")) == (0, 0)
    # another user: default_permissions refuses writes into 185's 0755 directories and files
    other = as_user(
        OTHER_UID,
        m,
        ["mkdir", "checkpoint/commits"],
        ["write", "checkpoint/offsets/1", "x"],
        ["write", "checkpoint/offsets/0", "overwritten"],
        ["rename", "checkpoint/offsets/0", "checkpoint/offsets/9"],
        ["unlink", "checkpoint/offsets/0"],
        ["read", "checkpoint/offsets/0"],
        ["read", "checkpoint/metadata"],
        ["write", ".sos/marker", "{}"],
    )
    for step in (
        "write:.sos/marker:{}",
        "mkdir:checkpoint/commits",
        "write:checkpoint/offsets/1:x",
        "write:checkpoint/offsets/0:overwritten",
        "rename:checkpoint/offsets/0:checkpoint/offsets/9",
        "unlink:checkpoint/offsets/0",
        "read:checkpoint/metadata",
    ):
        assert other[step] == errno.EACCES, step
    assert other["data:checkpoint/offsets/0"] == "offsets of batch 0"  # 0644: readable
    expected = {
        "checkpoint": None,
        "checkpoint/offsets": None,
        "checkpoint/offsets/0": b"offsets of batch 0",
        "checkpoint/metadata": b"{}",
        "checkpoint/by-root": b"r",
    }
    assert snapshot(m) == expected
    durable(m)
    assert restored(server, key, tmp_path, ns) == expected
    # the worker is lost: a mount on an empty cache rebuilds the tree, all of it 185's
    mp.kill()
    fresh = mounts("b", extra_args=["--owner", spark])
    f = fresh.mountpoint
    assert snapshot(f) == expected
    for rel in ("", *expected):
        assert owner(os.path.join(f, rel)) == (SPARK_UID, SPARK_UID), rel
    out = as_user(SPARK_UID, f, ["mkdir", "checkpoint/commits"], ["write", "checkpoint/commits/0", "c0"])
    assert out["mkdir:checkpoint/commits"] == out["write:checkpoint/commits/0:c0"] == "ok"
    assert fresh.stop() == 0
    assert restored(server, key, tmp_path, ns) == {
        **expected,
        "checkpoint/commits": None,
        "checkpoint/commits/0": b"c0",
    }


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the sidecar's situation)")
def test_without_owner_the_root_directory_is_the_mounts_and_setgid_is_inherited(mounts, tmp_path):
    mp = mounts("a", extra_args=["--allow-other"])
    m = mp.mountpoint
    assert owner(m) == (0, 0)
    assert as_user(SPARK_UID, m, ["mkdir", "checkpoint"])["mkdir:checkpoint"] == errno.EACCES
    # root prepares a group-writable setgid directory: new entries keep its group
    os.mkdir(os.path.join(m, "shared"))
    os.chown(os.path.join(m, "shared"), 0, 4242)
    os.chmod(os.path.join(m, "shared"), 0o2777)
    out = as_user(SPARK_UID, m, ["mkdir", "shared/d"], ["write", "shared/f", "x"])
    assert out["mkdir:shared/d"] == out["write:shared/f:x"] == "ok"
    assert owner(os.path.join(m, "shared", "f")) == (SPARK_UID, 4242)
    assert owner(os.path.join(m, "shared", "d")) == (SPARK_UID, 4242)
    assert os.stat(os.path.join(m, "shared", "d")).st_mode & stat.S_ISGID


def test_cli_owner_option_is_checked(tmp_path, server, ns):
    env = dict(os.environ, SOS_KEY="k")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_plugin.mount.cli",
            ns,
            str(tmp_path),
            "--server",
            server.address,
            "--owner",
            "no-such-user-sos",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2 and "unknown user or group" in proc.stderr


# --------------------------------------------------------------------------- reuse a mount


class FakeSpark:
    """The shape of SparkSession.streams.addListener, recording the listeners."""

    def __init__(self):
        self.listeners = []
        outer = self

        class Streams:
            @staticmethod
            def addListener(listener):
                outer.listeners.append(listener)

        self.streams = Streams()


def test_journaled_checkpoint_mounts_if_needed_and_reuses_a_live_mount(server, key, tmp_path, ns):
    """A live SOS mount of the namespace (a sidecar's) is reused: only the listener is
    registered; another namespace or another file system there is a clear error."""
    from spark_plugin.spark import MarkerListener, journaled_checkpoint, mounted_namespace

    mnt = str(tmp_path / "mnt")
    spark = FakeSpark()
    first = journaled_checkpoint(
        spark, ns, server=server.address, key=key, mountpoint=mnt, cache_dir=str(tmp_path / "cache")
    )
    try:
        assert not first.reused and first.mount.pid is not None
        assert mounted_namespace(mnt) == ns
        with open(os.path.join(mnt, ".sos", "namespace")) as f:
            assert f.read() == ns + "\n"
        write_file(os.path.join(first, "metadata"), b"{}")
        again = journaled_checkpoint(spark, ns, mountpoint=mnt)  # no server, no key needed
        assert again.reused and again.mount is None
        assert str(again) == str(first) and again.relpath == "checkpoint"
        assert [type(x) for x in spark.listeners] == [MarkerListener, MarkerListener]
        assert spark.listeners[1].mountpoint == os.path.abspath(mnt)
        assert read_file(os.path.join(again, "metadata")) == b"{}"
        again.stop()  # not ours: left alone
        assert is_mounted(mnt) and mounted_namespace(mnt) == ns
        with pytest.raises(ValueError, match=f"namespace '{ns}', not 'other'"):
            journaled_checkpoint(spark, "other", server=server.address, key=key, mountpoint=mnt)
        # what deploy/spark_job.py does in the Spark image: neither pyfuse3, trio nor the
        # sos packages are there, only spark_plugin/spark.py
        code = textwrap.dedent(f"""
            import sys
            for name in ("trio", "pyfuse3", "sos_client", "sos_wire", "sos_server",
                         "spark_plugin.mount"):
                sys.modules[name] = None  # importing it fails
            from spark_plugin.spark import journaled_checkpoint
            loc = journaled_checkpoint(None, {ns!r}, mountpoint={mnt!r})
            print(loc.reused, loc)
            """)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["True", str(first)]
    finally:
        assert first.mount.stop() == 0
    with pytest.raises(ValueError, match="server= and key= are needed"):
        journaled_checkpoint(spark, ns, mountpoint=mnt)
    assert len(spark.listeners) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_journaled_checkpoint_refuses_a_mount_that_is_not_sos(tmp_path, ns):
    from spark_plugin.spark import journaled_checkpoint

    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "none", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr!r}")
    try:
        with pytest.raises(ValueError, match=r"not an SOS mount \(tmpfs\)"):
            journaled_checkpoint(None, ns, server="127.0.0.1:1", key="k", mountpoint=str(mnt))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


_KILLED_DRIVER = r"""
import os, signal, sys
from spark_plugin.spark import journaled_checkpoint
loc = journaled_checkpoint(None, sys.argv[4], server=sys.argv[1], key=os.environ["SOS_KEY"],
                           mountpoint=sys.argv[2], cache_dir=sys.argv[3])
os.makedirs(os.path.join(loc, "commits"))
with open(os.path.join(loc, "commits", ".0.tmp"), "w") as f:
    f.write("v1")
os.rename(os.path.join(loc, "commits", ".0.tmp"), os.path.join(loc, "commits", "0"))
print(loc.mount.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the driver dies; its mount lives on (own session)
"""


def _wait_gone(pid, deadline=120.0):
    """Wait until `pid` (not our child) has exited; SIGTERM it if it outlives the deadline."""
    import time

    end = time.monotonic() + deadline
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except FileNotFoundError:
            return
        if time.monotonic() > end:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            return
        time.sleep(0.05)


def test_journaled_checkpoint_reuses_the_mount_a_killed_driver_left(server, key, tmp_path, ns):
    from spark_plugin.spark import journaled_checkpoint

    mnt = str(tmp_path / "mnt")
    env = dict(os.environ, SOS_KEY=key)
    orphan = None
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _KILLED_DRIVER, server.address, mnt, str(tmp_path / "cache"), ns],
            capture_output=True,
            text=True,
            env=env,
            timeout=180,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        orphan = int(proc.stdout.split()[0])
        assert is_mounted(mnt)
        loc = journaled_checkpoint(
            FakeSpark(), ns, server=server.address, key=key, mountpoint=mnt, cache_dir=str(tmp_path / "other-cache")
        )
        assert loc.reused  # not a second mount (that would fence the first)
        assert read_file(os.path.join(loc, "commits", "0")) == b"v1"
        spark_write(mnt, "checkpoint/commits/1", b"v1 again", overwrite=False)
        assert not os.path.exists(tmp_path / "other-cache" / "tree")
    finally:
        subprocess.run(["fusermount3", "-u", mnt], capture_output=True)  # the orphan exits
        if orphan is not None:
            _wait_gone(orphan)
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
    assert restored(server, key, tmp_path, ns) == {
        "checkpoint": None,
        "checkpoint/commits": None,
        "checkpoint/commits/0": b"v1",
        "checkpoint/commits/1": b"v1 again",
    }


def test_journaled_checkpoint_replaces_a_dead_mount(mounts, server, key, tmp_path, ns):
    from spark_plugin.spark import journaled_checkpoint, mounted_namespace

    mp = mounts("a")
    write_file(os.path.join(mp.mountpoint, "kept"), b"k")
    durable(mp.mountpoint)  # the replacement below has another (empty) cache
    mp.proc.kill()  # the mount dies, its mount point stays (ENOTCONN)
    mp.proc.wait()
    assert is_mounted(mp.mountpoint) and mounted_namespace(mp.mountpoint) is None
    loc = journaled_checkpoint(
        None, ns, server=server.address, key=key, mountpoint=mp.mountpoint, cache_dir=str(tmp_path / "cache-b")
    )
    try:
        assert not loc.reused
        assert read_file(os.path.join(mp.mountpoint, "kept")) == b"k"
    finally:
        assert loc.mount.stop() == 0


@pytest.mark.parametrize("writeback", [False, True], ids=["direct", "writeback"])
def test_second_mount_fences_the_first(mounts, server, key, tmp_path, writeback, ns):
    first = mounts("a", writeback=writeback)
    write_file(os.path.join(first.mountpoint, "shared"), b"from first")
    second = mounts("b")  # same namespace, its own (empty) cache: restores, then fences
    assert read_file(os.path.join(second.mountpoint, "shared")) == b"from first"
    with pytest.raises(OSError) as info:  # the first barrier (fsync) finds it fenced
        with open(os.path.join(first.mountpoint, "late"), "wb") as f:
            f.write(b"must not land")
            f.flush()
            os.fsync(f.fileno())
    assert info.value.errno in (errno.EIO, errno.EROFS)
    with pytest.raises(OSError) as info:
        os.mkdir(os.path.join(first.mountpoint, "late-dir"))
    assert info.value.errno in (errno.EIO, errno.EROFS)
    assert "FENCED" in first.log()
    write_file(os.path.join(second.mountpoint, "winner"), b"from second")
    assert second.stop() == 0
    first.stop()
    assert restored(server, key, tmp_path, ns) == {"shared": b"from first", "winner": b"from second"}
    # The fenced mount's cache diverged ("late" exists only there): it is never used again.
    stale = mounts("a", cache=first.cache_dir, start=False)
    with pytest.raises(RuntimeError):
        stale.start()
    assert "stale" in stale.log() and not is_mounted(stale.mountpoint)
    assert restored(server, key, tmp_path, ns) == {"shared": b"from first", "winner": b"from second"}


def test_async_mode_flushes_on_sigterm(mounts, server, key, tmp_path, ns):
    mp = mounts("a", sync=False)
    assert "(async)" in mp.log()
    expected = {}
    for i in range(30):
        expected[f"f{i}"] = os.urandom(5000)
        spark_write(mp.mountpoint, f"f{i}", expected[f"f{i}"], overwrite=True)
    assert mp.stop() == 0
    assert restored(server, key, tmp_path, ns) == expected


def test_remount_over_a_dead_mount_detaches_it(mounts, server, key, tmp_path):
    mp = mounts("a")
    write_file(os.path.join(mp.mountpoint, "kept"), b"synced")
    mp.proc.kill()
    mp.proc.wait()
    assert is_mounted(mp.mountpoint)  # dead: ENOTCONN
    again = mounts("a", cache=mp.cache_dir)  # same mountpoint: the dead mount is detached first
    assert read_file(os.path.join(again.mountpoint, "kept")) == b"synced"
    assert "dead mount" in again.log()
    assert again.stop() == 0
    assert not is_mounted(again.mountpoint)


def test_cli_refuses_missing_key_and_bad_mountpoint(tmp_path, server, ns):
    env = {k: v for k, v in os.environ.items() if k != "SOS_KEY"}
    out = subprocess.run(
        [sys.executable, "-m", "spark_plugin.mount.cli", ns, str(tmp_path), "--server", server.address],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and out.stderr.startswith("sos: no key given")
    keyed = dict(env, SOS_KEY="0" * 16 + "." + "0" * 64)
    out = subprocess.run(
        [sys.executable, "-m", "sos_client.cli", "mount", "Bad/ns", str(tmp_path), "--server", server.address],
        env=keyed,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "sos:" in out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_plugin.mount.cli",
            ns,
            str(tmp_path / "missing"),
            "--server",
            server.address,
            "--cache",
            str(tmp_path / "c"),
        ],
        env=keyed,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith("sos:")
    assert not is_mounted(str(tmp_path / "missing"))


def test_marker_control_file_then_restore_to_batch(mounts, server, key, tmp_path, ns):
    """`.sos/marker` appends MARKER records; restore(batch=...) stops at one of them."""
    import json

    from sos_client import Client
    from sos_journal.rebuild.restore import restore

    m = mounts().mountpoint
    os.makedirs(os.path.join(m, "chk", "commits"))
    for batch in range(5):
        spark_write(m, f"chk/commits/{batch}", b"v1\n{}", overwrite=False)
        doc = {"label": "spark.batch", "payload": {"checkpoint": "chk", "query_id": "q", "batch_id": batch}}
        fd = os.open(os.path.join(m, ".sos", "marker"), os.O_WRONLY)
        try:
            os.write(fd, json.dumps(doc).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    assert "marker" not in str(sorted(os.listdir(m)))  # nothing visible in the tree
    target = tmp_path / "at-batch-2"
    restore(lambda: Client(server.address, key, ns), ns, str(target), batch=("chk", 2))
    assert snapshot(target) == {"chk": None, "chk/commits": None, **{f"chk/commits/{b}": b"v1\n{}" for b in range(3)}}


def test_second_mount_on_the_same_cache_is_refused(mounts, server, key, tmp_path, ns):
    first = mounts("a")
    write_file(os.path.join(first.mountpoint, "f"), b"1")
    second = mounts("b", cache=first.cache_dir, start=False)
    with pytest.raises(RuntimeError):
        second.start()
    assert not is_mounted(second.mountpoint)
    assert "sos: mount failed" in second.log()
    write_file(os.path.join(first.mountpoint, "g"), b"2")  # the first one is unaffected
    assert first.stop() == 0
    assert restored(server, key, tmp_path, ns) == {"f": b"1", "g": b"2"}


# --------------------------------------------------------------------------- model and concurrency

_DIRS = ["d1", "d1/d2", "d3"]
_PATHS = _DIRS + [f"{d}/{n}" if d else n for d in ["", *_DIRS] for n in ("x", "y")]


def _apply(root, op, a):
    """Apply one operation under root; the outcome is "ok" or the errno name."""
    p = [os.path.join(root, x) for x in a if isinstance(x, str)]
    try:
        if op == "mkdir":
            os.mkdir(p[0])
        elif op == "rmdir":
            os.rmdir(p[0])
        elif op == "unlink":
            os.unlink(p[0])
        elif op == "write_whole":
            write_file(p[0], a[1])
        elif op == "pwrite":
            fd = os.open(p[0], os.O_WRONLY)
            try:
                os.pwrite(fd, a[2], a[1])
            finally:
                os.close(fd)
        elif op == "truncate":
            os.truncate(p[0], a[1])
        elif op == "rename":
            os.rename(p[0], p[1])
        elif op == "rename_noreplace":
            renameat2(p[0], p[1])
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]


@pytest.mark.parametrize("seed,writeback", [(1, False), (2, False), (3, True)])
def test_random_operations_behave_like_a_local_directory(mounts, server, key, tmp_path, seed, writeback, ns):
    """Seeded random sequences: every outcome (errno included) equals a plain directory's;
    the final tree, and its restore from the server, equal the plain directory."""
    import random

    rng = random.Random(seed)
    m = mounts(writeback=writeback).mountpoint
    ref = str(tmp_path / "reference")
    os.mkdir(ref)
    ops = [
        "mkdir",
        "mkdir",
        "rmdir",
        "unlink",
        "write_whole",
        "write_whole",
        "pwrite",
        "truncate",
        "rename",
        "rename_noreplace",
    ]
    for step in range(150):
        op = rng.choice(ops)
        if op in ("mkdir", "rmdir", "unlink"):
            args = (rng.choice(_PATHS),)
        elif op == "write_whole":
            args = (rng.choice(_PATHS), rng.randbytes(rng.randrange(0, 3000)))
        elif op == "pwrite":
            args = (rng.choice(_PATHS), rng.randrange(0, 4000), rng.randbytes(rng.randrange(1, 500)))
        elif op == "truncate":
            args = (rng.choice(_PATHS), rng.randrange(0, 4000))
        else:  # mostly an existing source, so that renames succeed as well as fail
            existing = sorted(snapshot(ref))
            src = rng.choice(existing) if existing and rng.random() < 0.8 else rng.choice(_PATHS)
            args = (src, rng.choice(_PATHS))
        got, want = _apply(m, op, args), _apply(ref, op, args)
        assert got == want, (step, op, args[:2] if op != "write_whole" else args[:1])
    assert snapshot(m) == snapshot(ref)
    durable(m)
    assert restored(server, key, tmp_path, ns) == snapshot(ref)


def test_concurrent_writers_all_land(mounts, server, key, tmp_path, ns):
    """Driver and executors write at once: every file is there, locally and after restore."""
    import threading

    m = mounts().mountpoint
    errors = []
    expected = {}

    def worker(w):
        try:
            os.makedirs(os.path.join(m, "state", str(w)))
            for v in range(15):
                body = (b"%d:%d;" % (w, v)) * (50 + v)
                spark_write(m, f"state/{w}/{v}.delta", body, overwrite=True)
                expected[f"state/{w}/{v}.delta"] = body
        except BaseException as exc:
            errors.append(exc)

    os.mkdir(os.path.join(m, "state"))
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and not any(t.is_alive() for t in threads)
    want = {"state": None, **{f"state/{w}": None for w in range(4)}, **expected}
    assert snapshot(m) == want
    durable(m)
    assert restored(server, key, tmp_path, ns) == want


@pytest.mark.own_server
def test_server_crash_while_mounted_blocks_then_completes(mounts, server, key, tmp_path, ns):
    """Sync mode: a rename onto commits/N issued while the server is down returns once it
    is back, and carries what was written before it."""
    import threading

    m = mounts().mountpoint
    os.makedirs(os.path.join(m, "commits"))
    write_file(os.path.join(m, "before"), b"written before the crash")
    server.kill()
    errors = []

    def commit():
        try:
            spark_write(m, "commits/0", b"written while the server was down", overwrite=False)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=commit)
    t.start()
    server.restart()
    t.join(180)
    assert not t.is_alive() and not errors
    assert read_file(os.path.join(m, "commits/0")) == b"written while the server was down"
    assert restored(server, key, tmp_path, ns) == {
        "before": b"written before the crash",
        "commits": None,
        "commits/0": b"written while the server was down",
    }


# --------------------------------------------------------------------------- barriers
# sos_journal.tree.barrier_rule: in sync mode only a rename onto (or the close of) a batch
# file of offsets/ or commits/ waits for the server; everything before it is carried by it.

SPARK_WRITER = r'''
import os, sys, uuid

root = sys.argv[1]


def atomic(rel, data, overwrite):
    """Hadoop's checksummed local FS under Spark's createAtomic: temp file and temp .crc,
    rename of the file, then of its .crc."""
    d, name = os.path.split(os.path.join(root, rel))
    tmp = f".{name}.{uuid.uuid4()}.tmp"
    for n, body in ((tmp, data), (f".{tmp}.crc", b"crc" + data[:8])):
        with open(os.path.join(d, n), "wb") as f:
            f.write(body)
    if not overwrite and os.path.lexists(os.path.join(d, name)):
        raise FileExistsError(rel)
    os.rename(os.path.join(d, tmp), os.path.join(d, name))
    os.rename(os.path.join(d, f".{tmp}.crc"), os.path.join(d, f".{name}.crc"))


for sub in ("offsets", "commits", "state/0/0", "state/0/1"):
    os.makedirs(os.path.join(root, sub), exist_ok=True)
atomic("metadata", b'{"id":"q"}', False)
for n in range(10 ** 6):
    atomic(f"offsets/{n}", b"v1\noffsets of batch %d" % n, False)
    for part in (0, 1):
        atomic(f"state/0/{part}/{n + 1}.delta", b"delta %d of part %d " % (n + 1, part) * 50, True)
    atomic(f"commits/{n}", b"v1\n{}", False)
    print("committed", n, flush=True)
'''


def spark_files_up_to(batch):
    """What SPARK_WRITER has written once the rename onto commits/<batch> returned."""
    files = {"metadata": b'{"id":"q"}'}
    for n in range(batch + 1):
        files[f"offsets/{n}"] = b"v1\noffsets of batch %d" % n
        for part in (0, 1):
            files[f"state/0/{part}/{n + 1}.delta"] = b"delta %d of part %d " % (n + 1, part) * 50
        files[f"commits/{n}"] = b"v1\n{}"
    crcs = {}
    for rel, data in files.items():
        d, name = os.path.split(rel)
        crcs[os.path.join(d, f".{name}.crc")] = b"crc" + data[:8]
    crcs.pop(f"commits/.{batch}.crc")  # renamed after commits/<batch>: not promised
    return {**files, **crcs}


@pytest.mark.own_server
def test_sigkill_of_mount_and_writer_right_after_a_commit_keeps_the_batch(mounts, server, key, tmp_path, ns):
    """RPO 0 for committed batches with barriers only at offsets/N and commits/N: a
    Spark-like writer (state files, temp files and .crc files, renames onto offsets/N and
    commits/N) and the mount are SIGKILLed as soon as the rename onto commits/3 returned;
    the server alone (a restore, no local spool) has commits/3 and every file written
    before it."""
    mp = mounts()
    chk = os.path.join(mp.mountpoint, "chk")
    writer = subprocess.Popen([sys.executable, "-c", SPARK_WRITER, chk], stdout=subprocess.PIPE, text=True)
    try:
        for line in writer.stdout:
            if line.strip() == "committed 3":
                break
        else:
            pytest.fail(f"the writer ended before batch 3: rc={writer.wait(60)}")
        mp.proc.kill()  # the machine dies: the mount's spool never ships another record
        writer.kill()
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait(60)
        writer.stdout.close()
    mp.proc.wait(60)
    mp.kill()  # lazy unmount of the dead mount
    got = restored(server, key, tmp_path, ns)
    for rel, data in spark_files_up_to(3).items():
        assert got.get(f"chk/{rel}") == data, rel


@pytest.mark.own_server
def test_only_a_barrier_rename_waits_for_a_stopped_server(mounts, server, key, tmp_path, ns):
    """With the server stopped (SIGSTOP: connections stay open, nothing is answered), a
    state file's temp-file write, close and rename return; the rename onto commits/1
    returns only after the server is resumed, and then the restore has everything."""
    import threading

    mp = mounts()
    m = mp.mountpoint
    for d in ("chk/commits", "chk/state"):
        os.makedirs(os.path.join(m, d))
    spark_write(m, "chk/commits/0", b"c0", overwrite=False)  # everything so far is durable
    events = []
    server.proc.send_signal(signal.SIGSTOP)
    try:
        # none of these waits for the server: if one did, this test would hang here
        spark_write(m, "chk/state/1.delta", b"state 1", overwrite=True)
        write_file(os.path.join(m, "chk", "state", ".1.delta.crc"), b"crc 1")
        events.append("state file renamed")

        def commit():
            spark_write(m, "chk/commits/1", b"c1", overwrite=False)
            events.append("commit returned")

        t = threading.Thread(target=commit, daemon=True)
        t.start()
        cached = os.path.join(mp.cache_dir, "tree", "chk", "commits", "1")
        while not os.path.exists(cached) and t.is_alive():  # the rename reached the tree
            t.join(0.01)
        # more non-barrier work through the mount (another directory: the commit's rename
        # holds chk/commits locked in the kernel) returns while the commit still waits
        spark_write(m, "chk/state/2.delta", b"state 2", overwrite=True)
        assert os.path.exists(cached) and events == ["state file renamed"]
        events.append("server resumed")
    finally:
        server.proc.send_signal(signal.SIGCONT)
    t.join(180)
    assert not t.is_alive()
    assert events == ["state file renamed", "server resumed", "commit returned"]
    durable(m)  # state/2.delta came after the commit's record: its barrier does not carry it
    got = restored(server, key, tmp_path, ns)
    assert {k: v for k, v in got.items() if k.startswith("chk/state/")} == {
        "chk/state/1.delta": b"state 1",
        "chk/state/.1.delta.crc": b"crc 1",
        "chk/state/2.delta": b"state 2",
    }
    assert got["chk/commits/1"] == b"c1"
