"""FUSE adapter over the journal core: what the JVM (Spark) writes through.

`SOSOperations` is a thin pyfuse3 (trio) adapter over `JournaledTree`:

* reads and attributes are served straight from the tree's cache directory;
* every file-altering operation (create, write, truncate, rename, unlink, mkdir,
  rmdir) goes through the tree, so it becomes a journal record;
* blocking tree calls (barrier waits) run in worker threads
  (`trio.to_thread.run_sync`) so the FUSE loop keeps serving other requests;
* in sync mode (the default) rename, fsync, flush/release of a written file
  return only after their records are durable on the server; in async mode only
  fsync and fsyncdir wait (explicit requests for durability) and the writer
  bounds the lag;
* once the writer reports that a newer writer fenced it, the mount turns
  read-only: every later change fails with EROFS (the first failure with EIO)
  and the reason is logged once.

chmod, chown and utimens are applied to the cache only (the journal has no
record for them; Hadoop's local filesystem calls chmod and must not fail).

Ownership: the kernel checks permissions (`default_permissions`) against the
cache entries' owners and modes. When the mount runs as root (the sidecar), a
file or directory created through it is chowned to the calling process (uid,
and gid unless the parent directory is setgid), as a local filesystem does;
`owner=(uid, gid)` (`sos mount --owner`) gives the root directory, and every
entry rebuilt from the server (the journal records no owners), to that user, so
a non-root Spark can create its checkpoint directory. Other users reach a mount
only with allow_other (implied by an owner other than the mount's own user).

`.sos/marker` at the root is a virtual control file (not listed, not journaled
as a file): a JSON document {"label": str, "payload": any} written to it
becomes a MARKER record (JournaledTree.marker), durable when fsync or close
returns (sync mode). The Spark batch listener writes its batch markers there.
`.sos/namespace` (read-only) holds the mounted namespace's name and a newline.

`run_mount()` wires server connection, writer, tree and mount together (the
`sos mount` command calls it); `MountProcess` runs `sos mount` in a child
process for tests, the Spark demo and the crash-loop harness.
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import os
import signal
import ssl
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from sos_client.errors import is_fenced, to_oserror

from .spark import mount_fstype

if TYPE_CHECKING:
    import pyfuse3
    from pyfuse3 import Operations as _OperationsBase

    from sos_client.journal.tree import JournaledTree
    from sos_client.journal.writer import JournalWriter
else:
    try:  # pyfuse3 is an optional dependency (extra "mount")
        import pyfuse3
        from pyfuse3 import Operations as _OperationsBase
    except ImportError:  # pragma: no cover - exercised only where pyfuse3 is missing
        pyfuse3 = None
        _OperationsBase = object

log = logging.getLogger("sos.mount")

#: The mount prints this (plus namespace and mountpoint) on stderr once mounted.
READY_MARKER = "sos mount: ready"

ROOT_INODE = 1
#: `.sos/` at the root is a virtual control directory (never journaled, not listed);
#: writing a JSON document {"label": str, "payload": any} to `.sos/marker` appends a
#: MARKER record (tree.marker); fsync/close of it waits until the marker is durable.
CONTROL_DIR = ".sos"
CONTROL_DIR_INO = 1 << 62
MARKER_FILE = "marker"
MARKER_INO = CONTROL_DIR_INO + 1
#: `.sos/namespace`: read-only, the mounted namespace's name and a newline (what
#: `journaled_checkpoint` reads to reuse a live mount of the same namespace).
NAMESPACE_FILE = "namespace"
NAMESPACE_INO = CONTROL_DIR_INO + 2
_VIRTUAL = (CONTROL_DIR_INO, MARKER_INO, NAMESPACE_INO)
_CONTROL_FILES = {MARKER_FILE.encode(): MARKER_INO, NAMESPACE_FILE.encode(): NAMESPACE_INO}
_ATTR_TIMEOUT = 1.0
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def errno_for(exc: BaseException) -> int:
    """The errno FUSE returns for an exception from the tree (or the OS): the one of
    :func:`sos_client.errors.to_oserror` (a fenced writer: EROFS)."""
    if pyfuse3 is not None and isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    return to_oserror(exc).errno or errno.EIO


class InodeTable:
    """Inode number <-> tree path, with kernel lookup counts and open counts.

    Paths are relative POSIX paths inside the namespace ("" is the root).
    A path that is unlinked or replaced while the kernel still knows its inode
    becomes an orphan (path None) until the kernel forgets it and it is closed.
    """

    def __init__(self) -> None:
        self._paths: dict[int, str | None] = {ROOT_INODE: ""}
        self._inos: dict[str, int] = {"": ROOT_INODE}
        self._lookups: collections.Counter[int] = collections.Counter()
        self._opens: collections.Counter[int] = collections.Counter()
        self._dirs: set[int] = {ROOT_INODE}
        self._next = ROOT_INODE + 1

    def __len__(self) -> int:
        return len(self._paths)

    def path(self, ino: int) -> str | None:
        """The path of `ino`; None for an orphan; FileNotFoundError if unknown."""
        try:
            return self._paths[ino]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "stale inode", str(ino)) from None

    def live_path(self, ino: int) -> str:
        path = self.path(ino)
        if path is None:
            raise FileNotFoundError(errno.ENOENT, "file was removed", str(ino))
        return path

    def ino(self, path: str) -> int:
        """The inode number of `path`, allocating one if it has none yet."""
        ino = self._inos.get(path)
        if ino is None:
            ino = self._next
            self._next += 1
            self._inos[path] = ino
            self._paths[ino] = path
        return ino

    def known(self, path: str) -> int | None:
        return self._inos.get(path)

    def lookup(self, ino: int, n: int = 1) -> None:
        self._lookups[ino] += n

    def forget(self, ino: int, n: int) -> None:
        self._lookups[ino] -= n
        self._maybe_drop(ino)

    def opened(self, ino: int) -> None:
        self._opens[ino] += 1

    def closed(self, ino: int) -> None:
        self._opens[ino] -= 1
        self._maybe_drop(ino)

    def removed(self, path: str) -> None:
        ino = self._inos.pop(path, None)
        if ino is not None:
            self._paths[ino] = None
            self._maybe_drop(ino)

    def renamed(self, src: str, dst: str):
        """Move `src` (and, for a directory, everything below it) to `dst`.

        Returns an undo callable that puts the table back (for a rename that
        turned out not to happen).
        """
        if src == dst:
            return lambda: None
        old_dst = self._inos.pop(dst, None)
        if old_dst is not None:
            self._paths[old_dst] = None
        ino = self._inos.get(src)
        moves = []
        if ino is not None:
            if ino in self._dirs:  # a directory moves everything the table knows below it
                prefix = src + "/"
                moves = [(p, i) for p, i in self._inos.items() if p == src or p.startswith(prefix)]
            else:
                moves = [(src, ino)]
        for old, moved in moves:
            new = dst + old[len(src):]
            del self._inos[old]
            self._inos[new] = moved
            self._paths[moved] = new

        def undo() -> None:
            for old, moved in moves:
                new = dst + old[len(src):]
                if self._paths.get(moved) == new:
                    self._inos.pop(new, None)
                    self._inos[old] = moved
                    self._paths[moved] = old
            if old_dst is not None and old_dst in self._paths and self._paths[old_dst] is None:
                self._paths[old_dst] = dst
                self._inos[dst] = old_dst

        if old_dst is not None:
            self._maybe_drop(old_dst)
        return undo

    def mark_dir(self, ino: int, is_dir: bool) -> None:
        if is_dir:
            self._dirs.add(ino)
        else:
            self._dirs.discard(ino)

    def _maybe_drop(self, ino: int) -> None:
        if ino == ROOT_INODE or self._lookups[ino] > 0 or self._opens[ino] > 0:
            return
        path = self._paths.pop(ino, None)
        if path is not None and self._inos.get(path) == ino:
            del self._inos[path]
        self._lookups.pop(ino, None)
        self._opens.pop(ino, None)
        self._dirs.discard(ino)


@dataclass
class _Handle:
    ino: int
    fd: int
    writable: bool
    dirty: bool = False
    marker: bytearray | None = None  # the control file's pending document
    content: bytes | None = None  # a read-only virtual file's content (fd is -1)


def _guard(fn):
    """Turn every exception of a handler into a FUSEError (pyfuse3 dies on others)."""

    @functools.wraps(fn)
    async def wrapper(self, *args):
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to an errno, logged if unexpected
            code = errno_for(exc)
            if code == errno.EIO:
                log.error("%s failed: %r", fn.__name__, exc)
            else:
                log.debug("%s: %r -> %s", fn.__name__, exc, errno.errorcode.get(code, code))
            raise pyfuse3.FUSEError(code) from None

    return wrapper


class SOSOperations(_OperationsBase):
    """pyfuse3 operations over a `JournaledTree`."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, tree, cache_root: str, *, sync: bool = True, namespace: str = "",
                 writeback_cache: bool = False, chown_to_caller: bool | None = None) -> None:
        super().__init__()
        # Kernel writeback cache (read by pyfuse3 at FUSE INIT): write(2) lands in the page
        # cache and reaches us in large WRITEs, at the latest when close(2) flushes (before
        # FLUSH, so the close barrier still covers the data). Far fewer round trips for
        # small writes (Hadoop writes 4 KiB at a time); write errors surface at close/fsync.
        self.enable_writeback_cache = writeback_cache
        self.tree = tree
        self.cache_root = os.path.abspath(cache_root)
        self.sync_mode = sync
        self.namespace = namespace
        self.inodes = InodeTable()
        self._handles: dict[int, _Handle] = {}
        self._dirs: dict[int, tuple[int, list[str]]] = {}
        self._next_fh = 1
        self.fenced: str | None = None
        # Only root can give a new cache entry to the caller; other mounts own everything.
        self.chown_to_caller = (os.geteuid() == 0) if chown_to_caller is None else chown_to_caller

    # ------------------------------------------------------------------ helpers
    def _local(self, path: str) -> str:
        return self.cache_root if path == "" else self.tree.local_path(path)

    @staticmethod
    def _join(parent: str, name: bytes) -> str:
        text = os.fsdecode(name)
        text.encode("utf-8")  # surrogates (undecodable names) -> UnicodeError -> EINVAL
        if text in ("", ".", "..") or "/" in text:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return text if parent == "" else parent + "/" + text

    def _child(self, parent_ino: int, name: bytes) -> str:
        """The tree path of `name` in a directory; EPERM inside/onto the control directory."""
        if parent_ino in _VIRTUAL or (parent_ino == ROOT_INODE and name == CONTROL_DIR.encode()):
            raise pyfuse3.FUSEError(errno.EPERM)
        return self._join(self.inodes.live_path(parent_ino), name)

    def _virtual_entry(self, ino: int) -> "pyfuse3.EntryAttributes":
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.generation = 0
        e.entry_timeout = _ATTR_TIMEOUT
        e.attr_timeout = _ATTR_TIMEOUT
        root = os.stat(self.cache_root)
        e.st_size = 0
        if ino == CONTROL_DIR_INO:
            e.st_mode = stat.S_IFDIR | 0o755
            e.st_nlink = 2
        elif ino == NAMESPACE_INO:
            e.st_mode = stat.S_IFREG | 0o444
            e.st_nlink = 1
            e.st_size = len(self._namespace_bytes())
        else:
            e.st_mode = stat.S_IFREG | 0o200
            e.st_nlink = 1
        e.st_uid, e.st_gid = root.st_uid, root.st_gid
        e.st_blksize = 4096
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = root.st_mtime_ns
        return e

    def _namespace_bytes(self) -> bytes:
        return self.namespace.encode("utf-8") + b"\n"

    def _entry(self, ino: int, st: os.stat_result) -> "pyfuse3.EntryAttributes":
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.generation = 0
        e.entry_timeout = _ATTR_TIMEOUT
        e.attr_timeout = _ATTR_TIMEOUT
        e.st_mode = st.st_mode
        e.st_nlink = st.st_nlink
        e.st_uid = st.st_uid
        e.st_gid = st.st_gid
        e.st_rdev = st.st_rdev
        e.st_size = st.st_size
        e.st_blksize = st.st_blksize
        e.st_blocks = st.st_blocks
        e.st_atime_ns = st.st_atime_ns
        e.st_mtime_ns = st.st_mtime_ns
        e.st_ctime_ns = st.st_ctime_ns
        return e

    def _stat_path(self, path: str) -> tuple[int, os.stat_result]:
        st = os.lstat(self._local(path))
        ino = self.inodes.ino(path)
        self.inodes.mark_dir(ino, stat.S_ISDIR(st.st_mode))
        return ino, st

    def _give_to_caller(self, path: str, ctx) -> None:
        """A new entry belongs to the process that created it (as on a local filesystem):
        its uid, and its gid unless the parent directory is setgid (then the cache entry
        already has the parent's group, and a new directory its setgid bit)."""
        if not self.chown_to_caller or ctx is None:
            return
        local = self._local(path)
        parent = os.lstat(os.path.dirname(local))
        gid = -1 if parent.st_mode & stat.S_ISGID else ctx.gid
        os.chown(local, ctx.uid, gid, follow_symlinks=False)

    def _open_fd(self, ino: int) -> int | None:
        for h in self._handles.values():
            if h.ino == ino:
                return h.fd
        return None

    def _check_writable(self) -> None:
        if self.fenced is not None:
            raise pyfuse3.FUSEError(errno.EROFS)

    def _note_failure(self, exc: BaseException) -> None:
        if self.fenced is None and is_fenced(exc):
            self.fenced = str(exc) or type(exc).__name__
            log.error(
                "sos mount: FENCED: a newer writer took over namespace %r (%s); this mount is "
                "read-only from now on, its later changes fail; unmount and remount to continue",
                self.namespace, self.fenced,
            )

    async def _call(self, fn, *args, **kwargs):
        """Run a (possibly blocking) tree call in a worker thread."""
        self._check_writable()
        try:
            return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
        except Exception as exc:
            self._note_failure(exc)
            raise

    async def _barrier(self) -> None:
        """Wait until every record so far is durable on the server (in both modes)."""
        await self._call(self.tree.sync, wait=True)

    # ------------------------------------------------------------ attributes
    @_guard
    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode == ROOT_INODE and name == CONTROL_DIR.encode():
            return self._virtual_entry(CONTROL_DIR_INO)
        if parent_inode == CONTROL_DIR_INO:
            if name in _CONTROL_FILES:
                return self._virtual_entry(_CONTROL_FILES[name])
            raise pyfuse3.FUSEError(errno.ENOENT)
        path = self._child(parent_inode, name)
        ino, st = self._stat_path(path)
        self.inodes.lookup(ino)
        return self._entry(ino, st)

    @_guard
    async def getattr(self, inode, ctx=None):
        if inode in _VIRTUAL:
            return self._virtual_entry(inode)
        path = self.inodes.path(inode)
        if path is None:
            fd = self._open_fd(inode)
            if fd is None:
                raise FileNotFoundError(errno.ENOENT, "removed")
            return self._entry(inode, os.fstat(fd))
        return self._entry(inode, os.lstat(self._local(path)))

    @_guard
    async def setattr(self, inode, attr, fields, fh, ctx):
        if inode in _VIRTUAL:
            if fields.update_size and inode == MARKER_INO and attr.st_size == 0:
                return self._virtual_entry(inode)
            raise pyfuse3.FUSEError(errno.EPERM)
        path = self.inodes.path(inode)
        if path is None:  # an open file that was unlinked: not part of the tree any more
            fd = self._handles[fh].fd if fh in self._handles else self._open_fd(inode)
            if fd is None:
                raise FileNotFoundError(errno.ENOENT, "removed")
            if fields.update_size:
                os.ftruncate(fd, attr.st_size)
            return self._entry(inode, os.fstat(fd))
        changing = (fields.update_size or fields.update_mode or fields.update_uid
                    or fields.update_gid or fields.update_atime or fields.update_mtime)
        if changing:
            self._check_writable()
        local = self._local(path)
        if fields.update_size:
            await self._call(self.tree.truncate, path, attr.st_size)
            if fh in self._handles:
                self._handles[fh].dirty = True
        if fields.update_mode:
            os.chmod(local, stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            os.chown(local, attr.st_uid if fields.update_uid else -1,
                     attr.st_gid if fields.update_gid else -1, follow_symlinks=False)
        if fields.update_atime or fields.update_mtime:
            st = os.lstat(local)
            atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
            os.utime(local, ns=(atime, mtime), follow_symlinks=False)
        return self._entry(inode, os.lstat(local))

    async def forget(self, inode_list):
        for ino, n in inode_list:
            if ino not in _VIRTUAL:
                self.inodes.forget(ino, n)

    @_guard
    async def statfs(self, ctx):
        sv = os.statvfs(self.cache_root)
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                     "f_files", "f_ffree", "f_favail"):
            setattr(out, name, getattr(sv, name))
        out.f_namemax = min(sv.f_namemax, 255)
        return out

    @_guard
    async def access(self, inode, mode, ctx):
        path = None if inode in _VIRTUAL else self.inodes.path(inode)
        if path is not None:
            os.lstat(self._local(path))
        if mode & os.W_OK and self.fenced is not None:
            return False
        return True

    # ------------------------------------------------------------ directories
    @_guard
    async def mkdir(self, parent_inode, name, mode, ctx):
        path = self._child(parent_inode, name)
        await self._call(self.tree.mkdir, path, stat.S_IMODE(mode))
        self._give_to_caller(path, ctx)
        ino, st = self._stat_path(path)
        self.inodes.lookup(ino)
        return self._entry(ino, st)

    @_guard
    async def rmdir(self, parent_inode, name, ctx):
        path = self._child(parent_inode, name)
        await self._call(self.tree.rmdir, path)
        self.inodes.removed(path)

    @_guard
    async def opendir(self, inode, ctx):
        if inode == CONTROL_DIR_INO:
            names = [MARKER_FILE, NAMESPACE_FILE]
        else:
            path = self.inodes.live_path(inode)
            names = sorted(os.listdir(self._local(path)))
            if path == "" and CONTROL_DIR in names:  # shadowed by the control directory
                names.remove(CONTROL_DIR)
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = (inode, names)
        return fh

    @_guard
    async def readdir(self, fh, start_id, token):
        dir_ino, names = self._dirs[fh]
        if dir_ino == CONTROL_DIR_INO:
            for index in range(start_id, len(names)):
                name = names[index].encode()
                if not pyfuse3.readdir_reply(token, name,
                                             self._virtual_entry(_CONTROL_FILES[name]), index + 1):
                    break
            return
        for index in range(start_id, len(names)):
            name = names[index]
            # Looked up per entry: the directory may be renamed while it is listed.
            parent = self.inodes.live_path(dir_ino)
            path = name if parent == "" else parent + "/" + name
            try:
                ino, st = self._stat_path(path)
            except FileNotFoundError:
                continue  # removed since opendir
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._entry(ino, st), index + 1):
                break
            self.inodes.lookup(ino)  # readdirplus counts as a lookup

    async def releasedir(self, fh):
        self._dirs.pop(fh, None)

    @_guard
    async def fsyncdir(self, fh, datasync):
        await self._barrier()

    # ------------------------------------------------------------ files
    def _new_handle(self, ino: int, path: str, writable: bool) -> int:
        local = self._local(path)
        try:
            fd = os.open(local, os.O_RDWR | os.O_CLOEXEC)
        except IsADirectoryError:
            raise
        except OSError:
            fd = os.open(local, os.O_RDONLY | os.O_CLOEXEC)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _Handle(ino=ino, fd=fd, writable=writable)
        self.inodes.opened(ino)
        return fh

    @_guard
    async def create(self, parent_inode, name, mode, flags, ctx):
        path = self._child(parent_inode, name)
        existed = os.path.lexists(self._local(path))  # CREATE of an existing name: open it
        await self._call(self.tree.create, path, stat.S_IMODE(mode))
        if not existed:
            self._give_to_caller(path, ctx)
        ino, st = self._stat_path(path)
        fh = self._new_handle(ino, path, writable=True)
        self._handles[fh].dirty = True
        self.inodes.lookup(ino)
        return pyfuse3.FileInfo(fh=fh), self._entry(ino, st)

    @_guard
    async def open(self, inode, flags, ctx):
        if inode == CONTROL_DIR_INO:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if inode == MARKER_INO:
            self._check_writable()
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = _Handle(ino=inode, fd=-1, writable=True, marker=bytearray())
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        if inode == NAMESPACE_INO:
            if (flags & os.O_ACCMODE) != os.O_RDONLY:
                raise pyfuse3.FUSEError(errno.EACCES)
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = _Handle(ino=inode, fd=-1, writable=False,
                                        content=self._namespace_bytes())
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        path = self.inodes.live_path(inode)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if writable:
            self._check_writable()
        dirty = False
        if writable and flags & os.O_TRUNC:
            if os.lstat(self._local(path)).st_size != 0:
                await self._call(self.tree.truncate, path, 0)
                dirty = True
        fh = self._new_handle(inode, path, writable)
        self._handles[fh].dirty = dirty
        return pyfuse3.FileInfo(fh=fh)

    @_guard
    async def read(self, fh, off, size):
        h = self._handles[fh]
        if h.marker is not None:
            return b""
        if h.content is not None:
            return h.content[off:off + size]
        return os.pread(h.fd, size, off)

    @_guard
    async def write(self, fh, off, buf):
        h = self._handles[fh]
        self._check_writable()
        if h.marker is not None:
            if off > len(h.marker) + (1 << 20):
                raise pyfuse3.FUSEError(errno.EFBIG)
            h.marker[off:off + len(buf)] = buf
            return len(buf)
        path = self.inodes.path(h.ino)
        if path is None:  # unlinked while open: the tree no longer has it
            return os.pwrite(h.fd, buf, off)
        await self._call(self.tree.write, path, off, bytes(buf))
        h.dirty = True
        return len(buf)

    async def _emit_marker(self, h: _Handle) -> None:
        """Turn the control file's pending JSON document into a MARKER record."""
        import json

        if h.marker is None:  # not the control file
            return
        doc_bytes = bytes(h.marker)
        h.marker.clear()
        try:
            doc = json.loads(doc_bytes)
            label = doc["label"]
            payload = doc.get("payload", "")
            if not isinstance(label, str) or not label:
                raise ValueError("label must be a non-empty string")
        except (ValueError, KeyError, TypeError) as exc:
            log.error("ignoring a bad marker document %r: %s", doc_bytes[:200], exc)
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        if isinstance(payload, str):
            data = payload.encode("utf-8")
        else:
            data = json.dumps(payload, sort_keys=True).encode("utf-8")
        await self._call(self.tree.marker, label, data)
        h.dirty = True

    async def _settle(self, h: _Handle) -> None:
        """Sync mode: a written file's records are durable before close returns."""
        if h.marker:
            await self._emit_marker(h)
        if h.dirty and self.sync_mode:
            if self.fenced is not None:
                raise pyfuse3.FUSEError(errno.EIO)
            await self._barrier()
        h.dirty = False

    @_guard
    async def flush(self, fh):
        # flush is what close(2) waits for (release is sent asynchronously).
        await self._settle(self._handles[fh])

    @_guard
    async def fsync(self, fh, datasync):
        # An explicit fsync waits for the server in both modes.
        h = self._handles[fh]
        if self.fenced is not None and (h.dirty or h.marker):
            raise pyfuse3.FUSEError(errno.EIO)
        if h.marker:
            await self._emit_marker(h)
        await self._barrier()
        h.dirty = False

    async def release(self, fh):
        h = self._handles.pop(fh, None)
        if h is None:
            return
        try:
            if h.marker and self.fenced is None:
                try:
                    await self._emit_marker(h)
                except Exception as exc:  # noqa: BLE001 - release cannot report errors
                    log.error("release: marker lost: %r", exc)
            if h.dirty and self.sync_mode and self.fenced is None:
                try:
                    await self._barrier()
                except Exception as exc:  # noqa: BLE001 - release cannot report errors
                    log.error("release: barrier failed: %r", exc)
        finally:
            if h.fd >= 0:
                os.close(h.fd)
                self.inodes.closed(h.ino)

    # ------------------------------------------------------------ namespace changes
    @_guard
    async def unlink(self, parent_inode, name, ctx):
        path = self._child(parent_inode, name)
        await self._call(self.tree.unlink, path)
        self.inodes.removed(path)

    @_guard
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags & _RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        src = self._child(parent_inode_old, name_old)
        dst = self._child(parent_inode_new, name_new)
        overwrite = not (flags & _RENAME_NOREPLACE)
        # The table moves first: in sync mode the tree returns only after the barrier,
        # and the moved inode must resolve to its new path meanwhile (fstat of an open fd).
        undo = self.inodes.renamed(src, dst)
        try:
            await self._call(self.tree.rename, src, dst, overwrite=overwrite)
        except BaseException:
            if os.path.lexists(self._local(src)):  # the cache rename did not happen
                undo()
            raise


# ---------------------------------------------------------------------------
# Running a mount: server connection -> writer -> tree -> FUSE
# ---------------------------------------------------------------------------

def default_cache_dir(namespace: str) -> str:
    from sos_client.journal.open import default_cache_dir as default

    return default(namespace)


def _dir_is_empty(path: str) -> bool:
    return not os.path.isdir(path) or not os.listdir(path)


def fuse_options(namespace: str, *, allow_other: bool = False, debug: bool = False) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts |= {"fsname=sos", "subtype=sos", "default_permissions"}
    if allow_other:
        opts.add("allow_other")
    if debug:
        opts.add("debug")
    return opts


class MountedTree:
    """The journal side of a mount: writer + tree over `<cache>/tree`, spool in `<cache>/spool`,
    opened by `sos_client.journal.open.open_namespace` (the opener fsspec and the gateway use).

    The writer fences every older writer first, then an empty (or crash-dirty) cache is
    rebuilt from the server by the same code as `sos restore`. A spool that the server has
    moved past (another writer took over since) is refused with a hint to drop the cache.
    A refused key fails at once; a read key is refused (a mount writes).
    """

    def __init__(self, namespace: str, server: str, key: str, cache_dir: str, *,
                 sync: bool = True, max_lag_bytes: int = 64 << 20,
                 generation_bytes: int | None = None, client_factory: Callable[[], Any] | None = None,
                 timeout: float = 30.0, tls: ssl.SSLContext | bool | None = None) -> None:
        self.namespace = namespace
        self._client_factory = client_factory
        self.server = server
        self.key = key
        self.timeout = timeout
        self.tls = tls
        self.cache_dir = os.path.abspath(cache_dir)
        self.tree_dir = os.path.join(self.cache_dir, "tree")
        self.spool_dir = os.path.join(self.cache_dir, "spool")
        self.sync = sync
        self.max_lag_bytes = max_lag_bytes
        self.generation_bytes = generation_bytes
        self.writer: JournalWriter | None = None
        self.tree: JournaledTree | None = None

    def open(self) -> tuple[JournaledTree, JournalWriter]:
        """Open the writer and the tree (see the class docstring); returns them."""
        from sos_client.journal.open import open_namespace
        from sos_client.journal.tree import JournaledTree

        opened = open_namespace(self.namespace, self.cache_dir, server=self.server, key=self.key,
                                timeout=self.timeout, tls=self.tls,
                                client_factory=self._client_factory, sync=self.sync,
                                max_lag_bytes=self.max_lag_bytes,
                                generation_bytes=self.generation_bytes)
        tree, writer = opened.tree, opened.writer
        if not isinstance(tree, JournaledTree) or writer is None:  # pragma: no cover - read keys are refused
            opened.close()
            raise PermissionError(errno.EACCES, "a mount needs a key with the append role", self.namespace)
        self.writer, self.tree = writer, tree
        return tree, writer

    def close(self) -> None:
        if self.tree is not None:
            tree, self.tree = self.tree, None
            if self.writer is not None:
                self.writer.close(timeout=0)  # flushed (or given up) by the caller already
            tree.close()
        elif self.writer is not None:
            self.writer.close()


async def _serve(ops: SOSOperations, namespace: str, mountpoint: str) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals)
        mode = "sync" if ops.sync_mode else "async"
        if ops.enable_writeback_cache:
            mode += ", writeback cache"
        print(f"{READY_MARKER}: namespace {namespace} mounted at {mountpoint} ({mode})",
              file=sys.stderr, flush=True)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


_early_signals: list[int] = []


def _restore_signals(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _record_early_signal(signum, frame) -> None:
    _early_signals.append(signum)


async def _watch_signals(task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        if _early_signals:  # arrived between mounting and this receiver
            log.info("%s: unmounting", signal.Signals(_early_signals[0]).name)
            pyfuse3.terminate()
            return
        async for signum in signals:
            log.info("%s: unmounting", signal.Signals(signum).name)
            pyfuse3.terminate()
            return


def give_tree_to(tree_dir: str, owner: tuple[int, int], *, everything: bool) -> None:
    """chown the cache's root directory (and, with ``everything``, all below it) to owner
    (no recursion; a link is never followed)."""
    from sos_client.journal.beneath import Beneath

    uid, gid = owner
    with Beneath(tree_dir) as at:
        at.chown("", uid, gid)
        if not everything:
            return
        for d, dirs, entries in at.walk():
            pre = f"{d}/" if d else ""
            for name in dirs + [n for n, _st in entries]:
                at.chown(pre + name, uid, gid)


def run_mount(namespace: str, mountpoint: str, *, server: str, key: str,
              cache_dir: str | None = None, sync: bool = True, max_lag_bytes: int = 64 << 20,
              allow_other: bool = False, debug: bool = False, client_factory=None,
              flush_timeout: float = 120.0, writeback_cache: bool = False,
              owner: tuple[int, int] | None = None,
              generation_bytes: int | None = None) -> int:
    """Mount `namespace` at `mountpoint` until SIGTERM/SIGINT or an external unmount.

    Returns the process exit code (0 after a clean unmount with everything
    flushed, 1 if the final flush failed, e.g. because the mount was fenced).
    `client_factory` (optional) returns a connected client for the namespace
    (TLS, timeouts); by default `sos_client.Client(server, key, namespace)`.
    After the unmount the journal gets `flush_timeout` seconds to reach the
    server; what does not stays in the spool and the next mount ships it.
    `owner` (uid, gid): owner of the mount's root directory and of everything rebuilt
    from the server (needs root unless it is the mount's own user); implies allow_other
    when it is another user. `generation_bytes`: journal bytes after which a new
    generation starts with a snapshot of the tree (default: the writer's, 1 GiB).
    """
    if pyfuse3 is None:
        raise RuntimeError("pyfuse3 is not installed (pip install 'sos[mount]')")
    mountpoint = os.path.abspath(mountpoint)
    if is_mounted(mountpoint):
        try:
            os.stat(mountpoint)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise
            log.warning("%s is a dead mount (its daemon died): detaching it", mountpoint)
            lazy_unmount(mountpoint)
        else:
            raise RuntimeError(f"{mountpoint} is already a mount point")
    if not os.path.isdir(mountpoint):
        raise FileNotFoundError(errno.ENOENT, "mountpoint is not a directory", mountpoint)
    if owner is not None:
        if os.geteuid() != 0 and tuple(owner) != (os.geteuid(), os.getegid()):
            raise PermissionError(errno.EPERM, "--owner needs the mount to run as root")
        if owner[0] != os.geteuid() and not allow_other:
            log.info("--owner %d:%d is another user: mounting with allow_other", *owner)
            allow_other = True
    journal = MountedTree(namespace, server, key, cache_dir or default_cache_dir(namespace),
                          sync=sync, max_lag_bytes=max_lag_bytes,
                          generation_bytes=generation_bytes, client_factory=client_factory)
    tree, writer = journal.open()
    if owner is not None:
        try:  # rebuilt entries have no owner in the journal: they are the owner's
            give_tree_to(journal.tree_dir, owner, everything=tree.rebuilt)
        except BaseException:
            journal.close()
            raise
    ops = SOSOperations(tree, journal.tree_dir, sync=sync, namespace=namespace,
                        writeback_cache=writeback_cache)
    code = 0
    # From the mount on, SIGTERM/SIGINT must unmount, never kill the process outright.
    previous = {s: signal.signal(s, _record_early_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        pyfuse3.init(ops, mountpoint, fuse_options(namespace, allow_other=allow_other,
                                                   debug=debug))
        try:
            trio.run(_serve, ops, namespace, mountpoint)
        finally:
            pyfuse3.close(unmount=True)
            # Unmounted: a second signal may now interrupt the final flush (the spool keeps
            # whatever is not on the server yet; the next mount ships it).
            _restore_signals(previous)
        log.info("unmounted %s", mountpoint)
        if ops.fenced is None:
            try:
                writer.barrier(timeout=flush_timeout)
            except Exception as exc:  # noqa: BLE001 - reported, exit code says it
                ops._note_failure(exc)
                log.error("final flush failed (the spool in %s keeps the journal; the next "
                          "mount ships it): %r", journal.spool_dir, exc)
                code = 1
        else:
            code = 1
    finally:
        _restore_signals(previous)
        try:
            journal.close()
        except Exception as exc:  # noqa: BLE001
            if ops.fenced is None and not is_fenced(exc):
                log.error("closing the journal failed: %r", exc)
                code = 1
    return code


# ---------------------------------------------------------------------------
# MountProcess: `sos mount` in a child process (tests, Spark demo, crash loops)
# ---------------------------------------------------------------------------

def lazy_unmount(mountpoint: str) -> None:
    """`fusermount3 -u -z`: detach a (possibly dead) mount; quiet if nothing is mounted."""
    subprocess.run(["fusermount3", "-u", "-z", mountpoint], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)


def is_mounted(mountpoint: str) -> bool:
    """True if the kernel lists ``mountpoint`` as a mount, live or dead (no stat of it)."""
    return mount_fstype(mountpoint) is not None


class MountProcess:
    """Run `sos mount NAMESPACE MOUNTPOINT` as a child process.

    ``start()`` (or ``with``) returns once the mount is live: the child printed
    its readiness line and MOUNTPOINT is a mount point. ``stop()`` sends SIGTERM
    and waits (clean unmount, returns the exit code); ``kill()`` sends SIGKILL
    and lazily unmounts the dead mount. The child's stderr goes to
    ``log_path`` (a temp file by default); ``log()`` returns it.
    The key is passed through the environment, never on the command line.
    """

    def __init__(self, namespace: str, mountpoint: str, cache_dir: str, server: str, key: str,
                 sync: bool = True, *, log_path: str | None = None, extra_args=(),
                 env: dict | None = None, start_timeout: float = 120.0) -> None:
        self.namespace = namespace
        self.mountpoint = os.path.abspath(mountpoint)
        self.cache_dir = cache_dir
        self.server = server
        self.key = key
        self.sync = sync
        self.extra_args = list(extra_args)
        self.env = env
        self.start_timeout = start_timeout
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sos-mount-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "spark_plugin.cli_mount", self.namespace, self.mountpoint,
               "--cache", self.cache_dir, "--server", self.server]
        if not self.sync:
            cmd.append("--async")
        return cmd + self.extra_args

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def start(self) -> "MountProcess":
        if self.proc is not None:
            raise RuntimeError("already started")
        if not is_mounted(self.mountpoint):  # a dead mount left here is detached by the child
            os.makedirs(self.mountpoint, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env["SOS_KEY"] = self.key
        env["SOS_SERVER"] = self.server
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=logf, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                lazy_unmount(self.mountpoint)
                raise RuntimeError(f"sos mount exited with {self.proc.returncode} before it was "
                                   f"ready:\n{self.log()}")
            if READY_MARKER in self.log() and os.path.ismount(self.mountpoint):
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"sos mount not ready after {self.start_timeout}s:\n"
                                   f"{self.log()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the mount (a crash), then lazily unmount what it leaves behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        lazy_unmount(self.mountpoint)

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM: clean unmount with everything flushed; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("sos mount did not stop within %ss; killing it", timeout)
                self.kill()
        if is_mounted(self.mountpoint):
            lazy_unmount(self.mountpoint)
        return self.proc.returncode

    def __enter__(self) -> "MountProcess":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if is_mounted(self.mountpoint):
                lazy_unmount(self.mountpoint)
