"""Unit tests of the FUSE layer alone: a real FUSE mount served in-process by
SOSOperations over a recording stand-in for JournaledTree.

They pin which tree call (and so which journal record) each POSIX operation
produces, and the errno contract (EEXIST for RENAME_NOREPLACE, ENOTEMPTY,
EROFS after fencing). The end-to-end tests with a real server and the real
journal are in test_mount_e2e.py.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import threading

import pytest

pyfuse3 = pytest.importorskip("pyfuse3")
import trio  # noqa: E402

from sos_client.errors import Fenced  # noqa: E402 - the client's error the stand-in tree raises
from spark_plugin.mount.inodes import InodeTable  # noqa: E402
from spark_plugin.mount.ops import SOSOperations, errno_for  # noqa: E402
from spark_plugin.mount.process import is_mounted  # noqa: E402
from spark_plugin.mount.run import fuse_options  # noqa: E402
from tests.mount.support import RENAME_NOREPLACE, renameat2  # noqa: E402

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing: no FUSE"),
    pytest.mark.timeout(120),
]


class RecordingTree:
    """Applies every change to the cache directory and records the call."""

    def __init__(self, root):
        self.root = root
        self.calls = []
        self.syncs = 0
        self.fenced = False
        self.lock = threading.Lock()

    def local_path(self, path):
        return os.path.join(self.root, path)

    def _record(self, *call):
        if self.fenced:
            raise Fenced("fenced by epoch 7")
        with self.lock:
            self.calls.append(call)

    def mkdir(self, path, mode=0o755):
        self._record("mkdir", path, mode)
        os.mkdir(self.local_path(path), mode)

    def rmdir(self, path):
        os.rmdir(self.local_path(path)) if not self.fenced else None
        self._record("rmdir", path)

    def create(self, path, mode=0o644):
        self._record("create", path, mode)
        fd = os.open(self.local_path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        os.close(fd)

    def write(self, path, offset, data):
        self._record("write", path, offset, bytes(data))
        fd = os.open(self.local_path(path), os.O_WRONLY)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def truncate(self, path, size):
        self._record("truncate", path, size)
        os.truncate(self.local_path(path), size)

    def rename(self, src, dst, *, overwrite):
        if not overwrite and os.path.lexists(self.local_path(dst)):
            raise FileExistsError(errno.EEXIST, "exists", dst)
        os.rename(self.local_path(src), self.local_path(dst)) if not self.fenced else None
        self._record("rename", src, dst, overwrite)

    def unlink(self, path):
        os.unlink(self.local_path(path)) if not self.fenced else None
        self._record("unlink", path)

    def marker(self, label, payload):
        self._record("marker", label, payload)
        return len(self.calls)

    def sync(self, wait=None):
        if self.fenced:
            raise Fenced("fenced by epoch 7")
        self.syncs += 1

    def close(self):
        pass

    def names(self):
        return [c[0] for c in self.calls]


@pytest.fixture
def mounted(tmp_path):
    """(mountpoint, tree, ops): a live mount served by a trio loop in a thread."""
    cache = tmp_path / "cache"
    mnt = tmp_path / "mnt"
    cache.mkdir()
    mnt.mkdir()
    tree = RecordingTree(str(cache))
    ops = SOSOperations(tree, str(cache), sync=True, namespace="unit")
    pyfuse3.init(ops, str(mnt), fuse_options("unit"))
    errors = []

    def serve():
        try:
            trio.run(pyfuse3.main)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        os.stat(mnt)  # answered only once the loop serves, so trio_token is set from here on
        assert pyfuse3.trio_token is not None
        yield str(mnt), tree, ops
    finally:
        try:
            if pyfuse3.trio_token is not None:
                trio.from_thread.run_sync(pyfuse3.terminate, trio_token=pyfuse3.trio_token)
            thread.join(60)
        finally:
            pyfuse3.close(unmount=True)
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
    assert not errors, errors
    assert not thread.is_alive()


def test_mount_is_listed_with_fsname_sos(mounted):
    mnt, _, _ = mounted
    assert is_mounted(mnt)
    with open("/proc/self/mountinfo") as f:
        line = next(line for line in f if line.split()[4] == mnt)
    assert " sos " in line and "fuse.sos" in line


def test_spark_temp_then_rename_is_create_write_rename(mounted):
    mnt, tree, _ = mounted
    os.mkdir(os.path.join(mnt, "offsets"))
    tmp = os.path.join(mnt, "offsets", ".0.1234.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"v1\n{}")
    syncs_before_close = tree.syncs
    os.close(fd)
    # a temp file's close does not wait: the barrier of the rename onto offsets/0 (the
    # tree's, by sos_journal.tree.barrier_rule) carries its records
    assert tree.syncs == syncs_before_close
    renameat2(tmp, os.path.join(mnt, "offsets", "0"), RENAME_NOREPLACE)
    assert tree.calls == [
        ("mkdir", "offsets", 0o755 & ~_umask()),
        ("create", "offsets/.0.1234.tmp", 0o644 & ~_umask()),
        ("write", "offsets/.0.1234.tmp", 0, b"v1\n{}"),
        ("rename", "offsets/.0.1234.tmp", "offsets/0", False),
    ]
    with open(os.path.join(mnt, "offsets", "0"), "rb") as f:
        assert f.read() == b"v1\n{}"
    assert os.listdir(os.path.join(mnt, "offsets")) == ["0"]


def _umask():
    old = os.umask(0)
    os.umask(old)
    return old


def test_rename_noreplace_refuses_existing_target(mounted):
    mnt, tree, _ = mounted
    for name, body in (("a", b"A"), ("b", b"B")):
        with open(os.path.join(mnt, name), "wb") as f:
            f.write(body)
    with pytest.raises(OSError) as info:
        renameat2(os.path.join(mnt, "a"), os.path.join(mnt, "b"), RENAME_NOREPLACE)
    assert info.value.errno == errno.EEXIST
    with open(os.path.join(mnt, "b"), "rb") as f:
        assert f.read() == b"B"
    os.rename(os.path.join(mnt, "a"), os.path.join(mnt, "b"))  # plain rename replaces
    with open(os.path.join(mnt, "b"), "rb") as f:
        assert f.read() == b"A"
    assert ("rename", "a", "b", True) in tree.calls
    assert sorted(os.listdir(mnt)) == ["b"]


def test_inodes_follow_directory_renames(mounted):
    mnt, _, ops = mounted
    os.makedirs(os.path.join(mnt, "d1", "sub"))
    with open(os.path.join(mnt, "d1", "sub", "f"), "wb") as f:
        f.write(b"x")
    st_before = os.stat(os.path.join(mnt, "d1", "sub", "f"))
    os.rename(os.path.join(mnt, "d1"), os.path.join(mnt, "d2"))
    st_after = os.stat(os.path.join(mnt, "d2", "sub", "f"))
    assert st_after.st_ino == st_before.st_ino
    with open(os.path.join(mnt, "d2", "sub", "f"), "rb") as f:
        assert f.read() == b"x"
    assert not os.path.exists(os.path.join(mnt, "d1"))
    assert ops.inodes.known("d2/sub/f") == st_before.st_ino


def test_truncate_chmod_utime_and_errors(mounted):
    mnt, tree, _ = mounted
    p = os.path.join(mnt, "f")
    with open(p, "wb") as f:
        f.write(b"0123456789")
    os.truncate(p, 4)
    assert ("truncate", "f", 4) in tree.calls
    os.chmod(p, 0o600)
    os.utime(p, ns=(1_000_000_000, 2_000_000_000))
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_mtime_ns == 2_000_000_000
    assert os.stat(tree.local_path("f")).st_mtime_ns == 2_000_000_000
    with open(p, "rb") as f:
        assert f.read() == b"0123"
    os.mkdir(os.path.join(mnt, "d"))
    open(os.path.join(mnt, "d", "x"), "wb").close()
    with pytest.raises(OSError) as info:
        os.rmdir(os.path.join(mnt, "d"))
    assert info.value.errno == errno.ENOTEMPTY
    with pytest.raises(FileNotFoundError):
        os.unlink(os.path.join(mnt, "missing"))


def test_fenced_mount_turns_read_only(mounted, caplog):
    mnt, tree, ops = mounted
    with open(os.path.join(mnt, "before"), "wb") as f:
        f.write(b"ok")
    tree.fenced = True
    with pytest.raises(OSError) as info:
        with open(os.path.join(mnt, "after"), "wb") as f:
            f.write(b"lost")
    assert info.value.errno == errno.EROFS  # sos_client.errors.to_oserror of a fenced writer
    assert ops.fenced is not None
    with pytest.raises(OSError) as info:
        os.mkdir(os.path.join(mnt, "dir"))
    assert info.value.errno == errno.EROFS
    with open(os.path.join(mnt, "before"), "rb") as f:  # reads still work
        assert f.read() == b"ok"
    assert any("FENCED" in r.getMessage() for r in caplog.records)


def test_unlinked_open_file_stays_readable(mounted):
    mnt, tree, _ = mounted
    p = os.path.join(mnt, "f")
    with open(p, "wb") as f:
        f.write(b"payload")
    with open(p, "rb") as f:
        os.unlink(p)
        assert f.read() == b"payload"
    assert ("unlink", "f") in tree.calls
    assert os.listdir(mnt) == []


def test_errno_mapping():
    assert errno_for(FileExistsError()) == errno.EEXIST
    assert errno_for(OSError(errno.ENOTEMPTY, "x")) == errno.ENOTEMPTY
    assert errno_for(Fenced("x")) == errno.EROFS  # as sos_client.errors.to_oserror: read-only from now on
    assert errno_for(ValueError("bad name")) == errno.EINVAL
    assert errno_for(RuntimeError("?")) == errno.EIO


def test_inode_table_orphans_and_forget():
    t = InodeTable()
    a = t.ino("a")
    t.lookup(a)
    t.opened(a)
    t.removed("a")
    assert t.path(a) is None  # orphan while open / known to the kernel
    t.closed(a)
    assert t.path(a) is None
    t.forget(a, 1)
    with pytest.raises(FileNotFoundError):
        t.path(a)
    assert t.ino("a") != a


def test_marker_control_file_becomes_a_marker_record(mounted):
    mnt, tree, _ = mounted
    control = os.path.join(mnt, ".sos", "marker")
    assert os.path.exists(control)
    assert os.listdir(mnt) == []  # the control directory is not listed
    assert sorted(os.listdir(os.path.join(mnt, ".sos"))) == ["marker", "namespace"]
    doc = b'{"label": "spark.batch", "payload": {"batch_id": 3, "query_id": "q"}}'
    fd = os.open(control, os.O_WRONLY)
    try:
        os.write(fd, doc)
        syncs = tree.syncs
        os.fsync(fd)
        assert tree.syncs > syncs
    finally:
        os.close(fd)
    assert tree.calls == [("marker", "spark.batch", b'{"batch_id": 3, "query_id": "q"}')]
    fd = os.open(control, os.O_WRONLY)
    os.write(fd, b"not json")
    with pytest.raises(OSError) as info:
        os.close(fd)
    assert info.value.errno == errno.EINVAL
    with pytest.raises(OSError) as info:
        os.mkdir(os.path.join(mnt, ".sos", "x"))
    assert info.value.errno == errno.EPERM
    with pytest.raises(OSError):
        os.rename(os.path.join(mnt, ".sos"), os.path.join(mnt, "y"))
    assert len(tree.calls) == 1


def test_namespace_control_file_is_read_only(mounted):
    mnt, tree, _ = mounted
    path = os.path.join(mnt, ".sos", "namespace")
    with open(path, "rb") as f:
        assert f.read() == b"unit\n"
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o444 and st.st_size == len(b"unit\n")
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC):
        with pytest.raises(OSError) as info:
            os.open(path, flags)
        assert info.value.errno in (errno.EACCES, errno.EPERM)
    with pytest.raises(OSError) as info:
        os.unlink(path)
    assert info.value.errno == errno.EPERM
    assert tree.calls == []


def test_inode_table_rename_undo_restores_both_paths():
    t = InodeTable()
    d = t.ino("d")
    t.mark_dir(d, True)
    f = t.ino("d/f")
    old = t.ino("e")
    t.lookup(old)
    undo = t.renamed("d", "e")
    assert (t.path(d), t.path(f), t.path(old)) == ("e", "e/f", None)
    undo()
    assert (t.path(d), t.path(f), t.path(old)) == ("d", "d/f", "e")
    assert t.known("e") == old and t.known("d/f") == f


def test_failed_rename_keeps_inodes(mounted):
    mnt, _, ops = mounted
    for name in ("a", "b"):
        with open(os.path.join(mnt, name), "wb") as f:
            f.write(name.encode())
    ino_a, ino_b = os.stat(os.path.join(mnt, "a")).st_ino, os.stat(os.path.join(mnt, "b")).st_ino
    with pytest.raises(FileExistsError):
        renameat2(os.path.join(mnt, "a"), os.path.join(mnt, "b"), RENAME_NOREPLACE)
    assert ops.inodes.known("a") == ino_a and ops.inodes.known("b") == ino_b
    with open(os.path.join(mnt, "b"), "rb") as f:
        assert f.read() == b"b"


def test_close_waits_for_the_server_only_for_a_barrier_file_fsync_always(mounted):
    """Sync mode: closing a changed file is a barrier only for a path the policy names (a
    batch file of offsets/, commits/ or _spark_metadata/, written in place) and for the
    marker control file; an explicit fsync always is one (POSIX's promise)."""
    mnt, tree, _ = mounted
    for d in ("chk/state/0/0", "chk/commits", "chk/offsets"):
        os.makedirs(os.path.join(mnt, d))
    cases = [
        ("chk/state/0/0/.1.delta.77.tmp", False),
        ("chk/state/0/0/1.delta", False),
        ("chk/commits/..0.77.tmp.crc", False),
        ("chk/commits/.0.crc", False),
        ("chk/offsets/.0.77.tmp", False),
        ("chk/metadata", False),
        ("chk/offsets/0", True),
        ("chk/commits/0", True),
    ]
    for rel, waits in cases:
        before = tree.syncs
        with open(os.path.join(mnt, rel), "wb") as f:
            f.write(b"x")
        assert tree.syncs == before + waits, rel
    before = tree.syncs
    with open(os.path.join(mnt, "chk/state/0/0/1.delta"), "r+b") as f:
        f.write(b"y")
        os.fsync(f.fileno())
    assert tree.syncs == before + 1
    before = tree.syncs
    with open(os.path.join(mnt, ".sos", "marker"), "wb") as f:
        f.write(b'{"label": "l", "payload": "p"}')
    assert tree.syncs == before + 1 and tree.calls[-1] == ("marker", "l", b"p")


def test_fsync_of_a_directory_is_a_barrier(mounted):
    mnt, tree, _ = mounted
    os.mkdir(os.path.join(mnt, "d"))
    syncs = tree.syncs
    fd = os.open(os.path.join(mnt, "d"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    assert tree.syncs == syncs + 1


def test_the_one_mount_table_reader_sees_names_with_spaces(tmp_path):
    """spark.mount_fstype (the one /proc/self/mountinfo reader, used by the mount too): a
    tmpfs mounted on a directory whose name has a space is seen with its type, and gone after
    the unmount."""
    import subprocess

    from spark_plugin.spark import mount_fstype

    where = tmp_path / "a b"
    where.mkdir()
    assert mount_fstype(str(where)) is None and not is_mounted(str(where))
    subprocess.run(["mount", "-t", "tmpfs", "none", str(where)], check=True)
    try:
        assert mount_fstype(str(where)) == "tmpfs" and is_mounted(str(where))
    finally:
        subprocess.run(["umount", str(where)], check=True)
    assert mount_fstype(str(where)) is None


def test_the_batch_marker_label_is_the_journals():
    """spark.py imports no sos package (the Spark image has none): its label must equal
    the journal's, which `sos restore --batch` looks for."""
    from sos_journal.format.layout import BATCH_LABEL
    from spark_plugin.spark import MARKER_LABEL

    assert MARKER_LABEL == BATCH_LABEL == "spark.batch"
