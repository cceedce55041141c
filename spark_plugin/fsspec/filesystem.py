"""fsspec filesystem for protocol ``sos``: a thin layer over the journal core.

Paths are ``sos://NAMESPACE/path/inside/namespace``. Every mutation goes through
:class:`sos_journal.tree.tree.JournaledTree`, which applies it to a local cache
directory (where every read is served from) and appends a journal record that a
replicator ships to the SOS server. When the cache is empty the journal core
rebuilds it from the server first (the same replay code as ``sos restore``).

Storage options:

``server``     ``host:port`` of the SOS server (default ``$SOS_SERVER``, else
               ``127.0.0.1:7070``).
``key``        ``<key_id>.<secret>`` for the namespace (default ``$SOS_KEY``).
``cache_dir``  base directory of the local caches; namespace ``ns`` lives in
               ``<cache_dir>/<ns>/`` (``tree/`` holds the live tree, ``spool/``
               the writer's spool: the same layout as ``sos mount``). Default
               ``$XDG_CACHE_HOME/sos`` or ``~/.cache/sos``.
``timeout``    socket timeout of the client connections (seconds, default 30).
``generation_bytes``  journal bytes after which a new generation starts with a
               snapshot of the tree (compaction: the server's retention can then
               drop older generations). Default None: the writer's, 1 GiB.
               Like ``max_lag_bytes``, it is read by the first filesystem object
               that opens the namespace in the process (they share one writer).
``tls``        None/False (plain TCP), True (TLS with the default context) or
               an ``ssl.SSLContext``.
``sync``       True (default): closing a written file, ``mv``, ``cp_file``,
               ``commit`` of a transaction file and :meth:`SOSFileSystem.fsync`
               return only once their records are durable on the server.
               False: closing a file (and cp, rm, mkdir) returns at once; the
               replicator ships in the background, its lag bounded by
               ``max_lag_bytes`` (writes block beyond it). ``mv`` still waits
               (see the note in ``open_shared``).
``durability`` "server" (default): those waits end once the records are durable on
               the SOS server. "tier": once the server's object-store tier (the
               bucket of ``sos-server serve --tier URL``) holds them too, so a
               committed batch survives the loss of the server and its disk; the
               first use of a namespace fails (JournalTierUnavailable) if the server
               has no tier. A wait the bucket did not answer within ``tier_patience``
               seconds (default 30; None: no bound) raises TimeoutError (ETIMEDOUT):
               the change stays applied and durable on the server, nothing is lost.
               One writer serves a namespace per process: a second filesystem object
               asking for the other durability on the same namespace and cache is
               refused (ValueError), never silently given the first one's.

A key with the read role gets a read-only view: the tree is rebuilt from the
server into ``<cache_dir>/<ns>/read-tree`` when the namespace is first used in
the process, nothing is fenced, and every mutation raises PermissionError.

One JournaledTree (and so one journal writer, one fencing epoch) exists per
(server, namespace, cache directory) in a process: every filesystem object
addressing that namespace shares it, so two objects never fence each other.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import posixpath
import ssl
import stat as stat_mod
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from glob import has_magic
from typing import Any, Literal, overload

from fsspec.spec import AbstractFileSystem
from fsspec.utils import stringify_path

from sos_client import resolve_key, resolve_server
from sos_journal.faces.facade import DEFAULT_TIER_PATIENCE, DURABILITIES
from sos_journal.format.auth import load_journal_keys, resolve_journal_keys
from sos_journal.format.records import validate_path
from sos_wire.names import validate_namespace

from .files import READ_CHUNK, RECORD_DATA_MAX, SOSReadFile, SOSWriteFile, os_error, pread_all
from .namespaces import SharedNamespace, close_all, open_shared


@contextlib.contextmanager
def _named(name: str) -> Iterator[None]:
    """Where the journal tree decides an error (it applies each operation to the cache as
    POSIX does), re-raise it naming the fsspec path ``NS/...`` rather than the tree's."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None:
            raise
        raise os_error(exc.errno, name) from None


__all__ = ["SOSFileSystem", "SOSReadFile", "SOSWriteFile", "close_all"]

# --------------------------------------------------------------------------


class SOSFileSystem(AbstractFileSystem):
    """fsspec filesystem over a journaled, replicated tree (protocol ``sos``)."""

    protocol = ("sos",)
    root_marker = ""
    cachable = True

    def __init__(
        self,
        server: str | None = None,
        key: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        sync: bool = True,
        max_lag_bytes: int | None = None,
        timeout: float = 30,
        tls: ssl.SSLContext | bool | None = None,
        generation_bytes: int | None = None,
        durability: str = "server",
        tier_patience: float | None = DEFAULT_TIER_PATIENCE,
        journal_key_file: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # the journal key (protocol.md 2.5): the file, else $SOS_JOURNAL_KEY / $SOS_JOURNAL_KEY_FILE
        self.journal_key = (
            load_journal_keys(os.fspath(journal_key_file)) if journal_key_file else resolve_journal_keys()
        )
        self.server = resolve_server(server)  # what the clients and `sos` accept, the same way
        self.key = str(resolve_key(key))
        if cache_dir is None:
            cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            cache_dir = os.path.join(cache_home, "sos")
        self.cache_dir = os.fspath(cache_dir)
        self.sync_mode = bool(sync)
        self.max_lag_bytes = max_lag_bytes
        self.timeout = timeout
        self.tls = tls
        if generation_bytes is not None and (
            isinstance(generation_bytes, bool) or not isinstance(generation_bytes, int) or generation_bytes < 1
        ):
            raise ValueError(f"sos: generation_bytes must be a positive int, got {generation_bytes!r}")
        self.generation_bytes = generation_bytes
        if durability not in DURABILITIES:
            raise ValueError(f"sos: durability must be one of {', '.join(DURABILITIES)}, got {durability!r}")
        if tier_patience is not None and (
            isinstance(tier_patience, bool) or not isinstance(tier_patience, (int, float)) or tier_patience < 0
        ):
            raise ValueError(f"sos: tier_patience must be seconds >= 0 or None, got {tier_patience!r}")
        self.durability = durability
        self.tier_patience = tier_patience
        self._handles: dict[str, SharedNamespace] = {}  # namespace -> shared SharedNamespace (see open_shared)

    # ---------------------------------------------------------------- paths

    @overload
    @classmethod
    def _strip_protocol(cls, path: str | os.PathLike[str]) -> str: ...
    @overload
    @classmethod
    def _strip_protocol(cls, path: list[str] | tuple[str, ...]) -> list[str]: ...
    @classmethod
    def _strip_protocol(cls, path: str | os.PathLike[str] | list[str] | tuple[str, ...]) -> str | list[str]:
        if isinstance(path, (list, tuple)):
            return [cls._strip_protocol(p) for p in path]
        text: str = stringify_path(path)
        if text.startswith("sos://"):
            text = text[len("sos://") :]
        parts = [p for p in text.split("/") if p]
        return "/".join(parts)

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        return {}

    def _split(self, path: str | os.PathLike[str]) -> tuple[str, str]:
        """'ns/a/b' -> ('ns', 'a/b'); validates both parts."""
        p = self._strip_protocol(path)
        if not p:
            raise ValueError("sos: path must name a namespace: sos://NAMESPACE/path")
        ns, _, rel = p.partition("/")
        validate_namespace(ns)  # BadName (a ValueError) with the rule in its message
        if rel:
            validate_path(rel)  # ValueError: '.', '..', NUL, too long
        return ns, rel

    def _ns(self, namespace: str) -> SharedNamespace:
        h = self._handles.get(namespace)
        if h is not None and not h.closed and h.pid == os.getpid():
            return h
        h = open_shared(
            self.server,
            self.key,
            namespace,
            self.cache_dir,
            self.max_lag_bytes,
            self.timeout,
            self.tls,
            self.generation_bytes,
            durability=self.durability,
            tier_patience=self.tier_patience,
            journal_key=self.journal_key,
        )
        self._handles[namespace] = h
        return h

    def _resolve(self, path: str | os.PathLike[str]) -> tuple[SharedNamespace, str, str, str]:
        ns, rel = self._split(path)
        h = self._ns(ns)
        return h, rel, h.local(rel), f"{ns}/{rel}" if rel else ns

    @staticmethod
    def _stat(local: str) -> os.stat_result | None:
        try:
            return os.stat(local)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _barrier(self, h: SharedNamespace) -> None:
        if self.sync_mode:
            h.tree.sync(wait=True)

    def fsync(self, path: str) -> None:
        """Block until everything written so far to ``path``'s namespace is
        durable on the server (regardless of ``sync``)."""
        h, _, _, _ = self._resolve(path)
        h.tree.sync(wait=True)

    # ------------------------------------------------------------ metadata

    def _info_from_stat(self, name: str, st: os.stat_result) -> dict[str, Any]:
        is_dir = stat_mod.S_ISDIR(st.st_mode)
        return {
            "name": name,
            "size": 0 if is_dir else st.st_size,
            "type": "directory" if is_dir else "file",
            "mtime": st.st_mtime,
            "mode": stat_mod.S_IMODE(st.st_mode),
        }

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        _, _, local, name = self._resolve(path)
        st = self._stat(local)
        if st is None:
            raise os_error(errno.ENOENT, name)
        return self._info_from_stat(name, st)

    @overload
    def ls(self, path: str, detail: Literal[True] = ..., **kwargs: Any) -> list[dict[str, Any]]: ...
    @overload
    def ls(self, path: str, detail: Literal[False], **kwargs: Any) -> list[str]: ...
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[dict[str, Any]] | list[str]:
        _, _, local, name = self._resolve(path)
        try:
            with os.scandir(local) as it:
                entries = []
                for entry in it:
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue  # removed while listing
                    entries.append(self._info_from_stat(f"{name}/{entry.name}", st))
        except NotADirectoryError:
            file_st = self._stat(local)
            if file_st is None:
                raise os_error(errno.ENOENT, name) from None
            entries = [self._info_from_stat(name, file_st)]
        except FileNotFoundError:
            raise os_error(errno.ENOENT, name) from None
        entries.sort(key=lambda e: e["name"])
        if detail:
            return entries
        return [e["name"] for e in entries]

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.info(path)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    def isdir(self, path: str) -> bool:
        try:
            return self.info(path)["type"] == "directory"
        except (FileNotFoundError, NotADirectoryError):
            return False

    def isfile(self, path: str) -> bool:
        try:
            return self.info(path)["type"] == "file"
        except (FileNotFoundError, NotADirectoryError):
            return False

    def modified(self, path: str) -> datetime:
        return datetime.fromtimestamp(self.info(path)["mtime"], tz=UTC)

    def ukey(self, path: str) -> str:
        info = self.info(path)
        return f"{info['name']}:{info['size']}:{info['mtime']}"

    # ----------------------------------------------------------- directories

    def _ensure_dirs(self, h: SharedNamespace, rel: str, mode: int = 0o755) -> None:
        """Create ``rel`` and its missing ancestors as directories; a file in
        the way raises NotADirectoryError. Caller holds ``h.lock``."""
        parts = rel.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            st = self._stat(h.local(sub))
            if st is None:
                h.tree.mkdir(sub, mode)
            elif not stat_mod.S_ISDIR(st.st_mode):
                raise os_error(errno.ENOTDIR, f"{h.namespace}/{sub}")

    def makedirs(self, path: str, exist_ok: bool = False, mode: int = 0o755) -> None:
        h, rel, local, name = self._resolve(path)
        if rel == "":
            if not exist_ok:
                raise os_error(errno.EEXIST, name)
            return
        with h.lock:
            st = self._stat(local)
            if st is not None:
                if stat_mod.S_ISDIR(st.st_mode) and exist_ok:
                    return
                raise os_error(errno.EEXIST, name)
            self._ensure_dirs(h, rel, mode)

    def mkdirs(self, path: str, exist_ok: bool = False) -> None:
        return self.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, mode: int = 0o755, **kwargs: Any) -> None:
        h, rel, _, name = self._resolve(path)
        if rel == "":
            raise os_error(errno.EEXIST, name)
        with h.lock, _named(name):
            parent = posixpath.dirname(rel)
            if parent and create_parents and self._stat(h.local(parent)) is None:
                self._ensure_dirs(h, parent, mode)
            h.tree.mkdir(rel, mode)  # the tree decides: EEXIST, ENOENT, ENOTDIR

    def rmdir(self, path: str) -> None:
        h, rel, _, name = self._resolve(path)
        if rel == "":
            raise os_error(errno.EPERM, name, "cannot remove a namespace root")
        with h.lock, _named(name):
            h.tree.rmdir(rel)  # the tree decides: ENOENT, ENOTDIR, ENOTEMPTY

    # --------------------------------------------------------------- removal

    def rm_file(self, path: str) -> None:
        h, rel, _, name = self._resolve(path)
        with h.lock, _named(name):
            h.tree.unlink(rel)  # the tree decides: ENOENT, EISDIR

    _rm = rm_file

    def rm(self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        for p in reversed(paths):
            h, rel, local, name = self._resolve(p)
            with h.lock:
                st = self._stat(local)
                if st is None:
                    raise os_error(errno.ENOENT, name)
                if not stat_mod.S_ISDIR(st.st_mode):
                    h.tree.unlink(rel)
                    continue
                if not recursive:
                    raise os_error(errno.EISDIR, name, "is a directory (use recursive=True)")
                if rel == "":
                    continue  # a namespace root is emptied, never removed
                if maxdepth is not None and os.listdir(local):
                    continue  # deeper entries were left alone
                h.tree.rmdir(rel)

    # ----------------------------------------------------------------- files

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> SOSReadFile | SOSWriteFile:
        h, rel, local, name = self._resolve(path)
        if mode == "rb":
            return SOSReadFile(
                self,
                name,
                local,
                block_size=block_size,
                cache_type=kwargs.pop("cache_type", "none"),
                cache_options=cache_options,
            )
        if mode not in ("wb", "xb", "ab"):
            raise ValueError(f"sos: unsupported mode {mode!r}")
        if rel == "":
            raise os_error(errno.EISDIR, name)
        with h.lock:
            st = self._stat(local)
            if st is not None and stat_mod.S_ISDIR(st.st_mode):
                raise os_error(errno.EISDIR, name)
            if mode == "xb" and st is not None:
                raise os_error(errno.EEXIST, name)
            parent = posixpath.dirname(rel)
            if parent:
                self._ensure_dirs(h, parent)
            if not autocommit:
                # transaction: write a temp file, rename onto `rel` at commit
                base = posixpath.basename(rel)
                target = posixpath.join(parent, f".{base}.{uuid.uuid4().hex}.sos-tmp")
                h.tree.create(target)
                offset = 0
                if mode == "ab" and st is not None:  # append: start from the old content
                    offset = self._copy_into(h, local, target)
            elif mode == "ab" and st is not None:
                target, offset = rel, st.st_size
            else:
                target, offset = rel, 0
                h.tree.create(rel)
        return SOSWriteFile(
            self,
            name,
            mode,
            h,
            functools.partial(self._barrier, h),
            target,
            rel,
            offset,
            block_size=block_size,
            autocommit=autocommit,
        )

    @staticmethod
    def _copy_into(h: SharedNamespace, local_src: str, target: str) -> int:
        """Append the bytes of a cached file to ``target`` (WRITE records)."""
        fd = os.open(local_src, os.O_RDONLY)
        try:
            offset = 0
            while True:
                chunk = os.pread(fd, RECORD_DATA_MAX, offset)
                if not chunk:
                    return offset
                h.tree.write(target, offset, chunk)
                offset += len(chunk)
        finally:
            os.close(fd)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        _, _, local, name = self._resolve(path)
        try:
            fd = os.open(local, os.O_RDONLY)
        except FileNotFoundError:
            raise os_error(errno.ENOENT, name) from None
        except NotADirectoryError:
            raise os_error(errno.ENOENT, name) from None
        try:
            st = os.fstat(fd)
            if stat_mod.S_ISDIR(st.st_mode):
                raise os_error(errno.EISDIR, name)
            size = st.st_size
            start = 0 if start is None else (start if start >= 0 else max(0, size + start))
            end = size if end is None else (end if end >= 0 else max(0, size + end))
            end = min(end, size)
            if end <= start:
                return b""
            return pread_all(fd, start, end)
        finally:
            os.close(fd)

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        if mode not in ("overwrite", "create"):
            raise ValueError(f"sos: pipe_file mode must be 'overwrite' or 'create', got {mode!r}")
        with self.open(path, "xb" if mode == "create" else "wb", **kwargs) as f:
            f.write(value)

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        if truncate or not self.exists(path):
            with self.open(path, "wb", **kwargs):
                pass
        elif self.isdir(path):
            return
        # truncate=False on an existing file: content stays; the journal has no
        # timestamp record, so the mtime is left as it is.

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        src_info = self.info(path1)
        if src_info["type"] == "directory":
            self.makedirs(path2, exist_ok=True)
            return
        _, _, local1, name1 = self._resolve(path1)
        if self._strip_protocol(path2) == name1:
            return  # copying a file onto itself must not truncate it
        try:
            fd = os.open(local1, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise os_error(errno.ENOENT, name1) from None
        try:
            with self.open(path2, "wb", block_size=RECORD_DATA_MAX) as out:
                offset = 0
                while True:
                    chunk = os.pread(fd, READ_CHUNK, offset)
                    if not chunk:
                        break
                    out.write(chunk)
                    offset += len(chunk)
        finally:
            os.close(fd)

    # ----------------------------------------------------------------- rename

    def mv(
        self,
        path1: str | os.PathLike[str] | list[str],
        path2: str | os.PathLike[str] | list[str],
        recursive: bool = False,
        maxdepth: int | None = None,
        overwrite: bool = True,
        **kwargs: Any,
    ) -> None:
        """Atomic rename (one RENAME record; directories move whole).

        ``path2`` naming an existing directory (or ending in ``/``) moves
        ``path1`` into it, as ``mv`` does. ``overwrite=False`` refuses an
        existing target with FileExistsError. Lists, globs and moves between
        namespaces fall back to copy + delete.
        """
        if (
            not isinstance(path1, (str, os.PathLike))
            or not isinstance(path2, (str, os.PathLike))
            or has_magic(stringify_path(path1))
        ):
            return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        raw2 = stringify_path(path2)
        ns1, rel1 = self._split(path1)
        ns2, rel2 = self._split(path2)
        if ns1 != ns2:
            return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        h = self._ns(ns1)
        name1 = f"{ns1}/{rel1}" if rel1 else ns1
        with h.lock:
            if rel1 == "":
                raise os_error(errno.EPERM, name1, "cannot move a namespace root")
            st1 = self._stat(h.local(rel1))
            if st1 is None:
                raise os_error(errno.ENOENT, name1)
            src_is_dir = stat_mod.S_ISDIR(st1.st_mode)
            if rel2 == rel1:
                return
            st2 = self._stat(h.local(rel2))
            if raw2.endswith("/") and st2 is None:
                self._ensure_dirs(h, rel2)
                st2 = self._stat(h.local(rel2))
            if st2 is not None and stat_mod.S_ISDIR(st2.st_mode):
                rel2 = posixpath.join(rel2, posixpath.basename(rel1)) if rel2 else posixpath.basename(rel1)
            name2 = f"{ns2}/{rel2}"
            if rel2 == rel1:
                return
            if src_is_dir and (rel2 + "/").startswith(rel1 + "/"):
                raise os_error(errno.EINVAL, name2, "cannot move a directory into itself")
            # The tree decides the rest as rename(2) does: a missing parent (ENOENT), a file
            # as parent (ENOTDIR), an existing target without overwrite (EEXIST), a file onto
            # a directory (EISDIR), a directory onto a file (ENOTDIR) or onto a non-empty
            # directory (ENOTEMPTY).
            with _named(name2):
                h.tree.rename(rel1, rel2, overwrite=overwrite)
        self._barrier(h)

    rename = mv
    move = mv
