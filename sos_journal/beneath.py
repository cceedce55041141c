"""File operations confined to one directory: no symbolic link is ever followed below it.

Replay (``sos restore`` and the mount's cache rebuild, often run as root) and the journaled
tree (the mount's cache) resolve every path component by component from a directory file
descriptor, each step an ``openat(O_PATH | O_DIRECTORY | O_NOFOLLOW)``, and create, open,
rename and remove the last component relative to its parent's descriptor (``dir_fd``) with
no-follow semantics: a symbolic link planted anywhere below the root (by a local user
racing a restore, or in a cache directory) makes the operation fail; it is never followed
out of the root. File contents are only opened with ``O_NOFOLLOW | O_NONBLOCK`` and must be
regular files (a FIFO or device planted under a journal path is refused, never opened for
writing or truncated).

Working from descriptors also means a path's length is bounded by the journal's own
limits (4096 bytes, 255 per component), not by PATH_MAX of root + path, and nothing here
recurses over the tree: :meth:`Beneath.walk` and :meth:`Beneath.clear` use explicit stacks.
"""

from __future__ import annotations

import errno
import os
import stat as _stat
from collections import OrderedDict
from collections.abc import Iterator

__all__ = ["O_WALK", "Beneath", "check_regular", "clear_directory"]

#: How each directory component is opened: a path handle, never through a symbolic link.
O_WALK = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_LIST = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_FILE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def check_regular(fd: int, path: str, *, single_link: bool = False) -> os.stat_result:
    """fstat ``fd``; OSError unless it is a regular file (and, with ``single_link``, has no
    other hard link: a journal never makes one, so another name means a planted link)."""
    st = os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file", path)
    if single_link and st.st_nlink > 1:
        raise OSError(errno.EMLINK, f"regular file with {st.st_nlink} hard links (refused)", path)
    return st


def _chmod_at(dfd: int, name: str, mode: int) -> None:
    """chmod ``name`` in ``dfd`` without following a link (a directory or a file)."""
    try:
        fd = os.open(name, os.O_RDONLY | _O_FILE, dir_fd=dfd)
    except PermissionError:  # no read permission (non-root): fchmodat, never following
        os.chmod(name, mode, dir_fd=dfd, follow_symlinks=False)
        return
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


class Beneath:
    """A directory, opened once, under which every path is resolved without following links.

    Paths are relative POSIX paths (``"a/b/c"``; ``""`` is the root itself). Directory
    descriptors of recently used parents are cached (at most ``max_dirs``); whoever
    renames or removes a directory calls :meth:`forget` for it (the cache maps paths to
    directories, so a moved directory's entries must go).
    """

    def __init__(self, root: str, *, max_dirs: int = 32):
        self.root = os.path.abspath(root)
        # The root itself is resolved normally: it is the caller's choice (it may be a link).
        self.fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.max_dirs = max(2, max_dirs)
        self._dirs: OrderedDict[str, int] = OrderedDict()

    # ------------------------------------------------------------------ descriptors
    def close(self) -> None:
        self.forget("")
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Beneath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def forget(self, rel: str) -> None:
        """Drop cached descriptors of ``rel`` and everything below it (``""``: all)."""
        if rel == "":
            doomed = list(self._dirs)
        else:
            pre = rel + "/"
            doomed = [p for p in self._dirs if p == rel or p.startswith(pre)]
        for p in doomed:
            os.close(self._dirs.pop(p))

    def dir_fd(self, rel: str) -> int:
        """A descriptor of directory ``rel`` (owned by this object: do not close it; valid
        until the next call that may evict it, i.e. at least across one more dir_fd call)."""
        if rel == "":
            return self.fd
        fd = self._dirs.get(rel)
        if fd is not None:
            self._dirs.move_to_end(rel)
            return fd
        # Start from the nearest cached ancestor (usually the parent: replay and walks go
        # down one level at a time), else from the root.
        base, rest = self.fd, rel
        pos = len(rel)
        while True:
            pos = rel.rfind("/", 0, pos)
            if pos < 0:
                break
            anc = self._dirs.get(rel[:pos])
            if anc is not None:
                base, rest = anc, rel[pos + 1 :]
                break
        cur = base
        try:
            for part in rest.split("/"):
                nxt = os.open(part, O_WALK, dir_fd=cur)
                if cur is not base:
                    os.close(cur)
                cur = nxt
        except BaseException:
            if cur is not base:
                os.close(cur)
            raise
        self._dirs[rel] = cur
        while len(self._dirs) > self.max_dirs:
            _old, old_fd = self._dirs.popitem(last=False)
            os.close(old_fd)
        return cur

    def parent(self, path: str) -> tuple[int, str]:
        """(descriptor of the parent directory, last component) of ``path``."""
        d, _, name = path.rpartition("/")
        return self.dir_fd(d), name

    # ------------------------------------------------------------------ operations
    def lstat(self, path: str) -> os.stat_result:
        if path == "":
            return os.fstat(self.fd)
        dfd, name = self.parent(path)
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)

    def exists(self, path: str) -> bool:
        try:
            self.lstat(path)
        except FileNotFoundError:
            return False
        return True

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        """``openat(parent, name, flags | O_NOFOLLOW | O_CLOEXEC, mode)``."""
        dfd, name = self.parent(path)
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)

    def open_file(self, path: str, flags: int, *, single_link: bool = False) -> int:
        """Open an existing regular file (O_NONBLOCK: a planted FIFO cannot block us; no
        O_TRUNC here, the caller truncates once it knows it is a regular file)."""
        dfd, name = self.parent(path)
        fd = os.open(name, (flags & ~os.O_TRUNC) | _O_FILE, dir_fd=dfd)
        try:
            check_regular(fd, path, single_link=single_link)
            if flags & os.O_TRUNC:
                os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def create_file(self, path: str, mode: int, *, exact: bool, single_link: bool = False) -> int:
        """O_CREAT|O_TRUNC without following links: a new file gets ``mode`` (exactly with
        ``exact``; else as _unmask: what the umask took is given back, what the kernel added
        stays); an existing regular file is truncated and keeps its mode. Returns a
        writable descriptor."""
        dfd, name = self.parent(path)
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_FILE, mode, dir_fd=dfd)
        except FileExistsError:
            fd = os.open(name, os.O_WRONLY | _O_FILE, dir_fd=dfd)
            try:
                check_regular(fd, path, single_link=single_link)
                os.ftruncate(fd, 0)
            except BaseException:
                os.close(fd)
                raise
            return fd
        try:
            cur = _stat.S_IMODE(os.fstat(fd).st_mode)
            want = mode if exact else cur | (mode & 0o777)
            if want != cur:
                os.fchmod(fd, want)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def mkdir(self, path: str, mode: int, *, exact: bool) -> None:
        """mkdirat; the new directory gets ``mode`` (exactly with ``exact``, clearing e.g.
        a setgid bit inherited from its parent; else what the umask took is given back)."""
        dfd, name = self.parent(path)
        os.mkdir(name, mode, dir_fd=dfd)
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        cur = _stat.S_IMODE(st.st_mode)
        want = mode if exact else cur | (mode & 0o777)
        if want != cur:
            _chmod_at(dfd, name, want)

    def rename(self, src: str, dst: str) -> None:
        sfd, sname = self.parent(src)
        dfd, dname = self.parent(dst)
        os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        self.forget(src)
        self.forget(dst)

    def unlink(self, path: str) -> None:
        dfd, name = self.parent(path)
        os.unlink(name, dir_fd=dfd)

    def rmdir(self, path: str) -> None:
        dfd, name = self.parent(path)
        self.forget(path)
        os.rmdir(name, dir_fd=dfd)

    def chown(self, path: str, uid: int, gid: int) -> None:
        """lchown (the root itself through a descriptor of it)."""
        if path == "":
            fd = os.open(".", _O_LIST, dir_fd=self.fd)
            try:
                os.fchown(fd, uid, gid)
            finally:
                os.close(fd)
            return
        dfd, name = self.parent(path)
        os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)

    def listdir(self, rel: str = "") -> list[str]:
        fd = os.open(".", _O_LIST, dir_fd=self.dir_fd(rel))
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ whole trees
    def walk(self, rel: str = "") -> Iterator[tuple[str, list[str], list[tuple[str, os.stat_result]]]]:
        """Top-down, like os.walk without recursion and without following links: yields
        (dir, sorted subdirectory names, sorted (name, lstat) of its other entries); the
        subdirectories are visited in that order after it. The caller may remove names
        from the list of subdirectories to skip them."""
        stack = [rel]
        while stack:
            d = stack.pop()
            dfd = self.dir_fd(d)
            dirs, others = [], []
            for name in sorted(self.listdir(d)):
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if _stat.S_ISDIR(st.st_mode):
                    dirs.append(name)
                else:
                    others.append((name, st))
            yield d, dirs, others
            pre = f"{d}/" if d else ""
            stack.extend(pre + name for name in reversed(dirs))

    def clear(self, rel: str = "") -> None:
        """Remove everything inside directory ``rel`` (not ``rel`` itself), bottom-up,
        without recursion and without following links (a link is removed, not its target)."""
        stack: list[tuple[str, bool]] = [(rel, False)]
        while stack:
            d, listed = stack[-1]
            if listed:
                stack.pop()
                if d != rel:
                    self.rmdir(d)
                continue
            stack[-1] = (d, True)
            dfd = self.dir_fd(d)
            pre = f"{d}/" if d else ""
            for name in self.listdir(d):
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if _stat.S_ISDIR(st.st_mode):
                    stack.append((pre + name, False))
                else:
                    os.unlink(name, dir_fd=dfd)


def clear_directory(directory: str) -> None:
    """Remove everything inside ``directory`` (not the directory itself): no recursion, and
    a symbolic link inside is removed, never followed."""
    with Beneath(directory) as at:
        at.clear()
