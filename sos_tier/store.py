"""The object-store interface of the tier, its typed errors, and the local-directory backend.

A store holds immutable *keys* (relative to the root the store's URL names) whose content is
written once. The engine and the layout (``layout.py``) talk only to :class:`Store`, as
Litestream's replication engine talks only to its ``ReplicaClient`` and Gazette's persister
to its fragment store; each backend is its own module (``LocalStore`` here, ``S3Store`` in
``s3.py``) and one conformance suite (``tests/tier/test_store.py``) runs against each.

Every call is synchronous and may block on the network or the disk: the server calls them
from trio worker threads. A store object is safe to use from several threads at once.

The contract every backend keeps:

- ``put_once(key, data)`` creates *key* with *data* unless *key* exists (a conditional
  create, never a replace). It answers :attr:`PutOutcome.CREATED`, or, when the key exists,
  reads it and answers :attr:`PutOutcome.ALREADY_SAME` (same bytes: a retry that had landed)
  or :attr:`PutOutcome.CONFLICT` (other bytes: a zombie writer or damage; nothing written).
- ``get(key, start, end)`` returns the bytes ``[start, end)`` of *key* (``None``: from 0, to
  the end), fewer if the key is shorter, ``b""`` from at or past its end.
- ``list(prefix)`` yields every key that starts with *prefix* with its size, in ascending
  byte order of the UTF-8 keys, fetching pages as it goes.
- ``delete(keys)`` removes keys; a key that does not exist is not an error.
- A key that does not exist is :class:`TierNotFound` in ``get``, in every backend. Any other
  failure (network, permissions, a full disk) is :class:`TierError` with the backend's cause
  chained; callers retry those. Its subclasses here say what it is where a backend can tell
  (:class:`TierDenied`; :class:`TierBusy` once ``put_once``'s own retries are spent;
  :class:`TierExists` and :class:`TierBadRange` never leave ``put_once`` and ``get``); S3's
  errors are mapped to them by one table (``errors.py``).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote, urlsplit

from sos_tier.files import DIR_MODE, FILE_MODE, fsync_dir

__all__ = [
    "LocalStore",
    "PutOutcome",
    "Store",
    "StoredKey",
    "TierBadRange",
    "TierBusy",
    "TierDenied",
    "TierError",
    "TierExists",
    "TierNotFound",
]


class TierError(Exception):
    """A store operation failed (network, credentials, permissions, disk); retryable unless
    the message says otherwise. The backend's exception is chained as ``__cause__``."""


class TierNotFound(TierError):
    """The key does not exist (S3 ``NoSuchKey``, a missing file): the same in every backend."""

    def __init__(self, key: str) -> None:
        super().__init__(f"no such key: {key}")
        self.key = key


class TierExists(TierError):
    """A conditional create found the key there already (S3 ``412 PreconditionFailed`` on
    ``If-None-Match: *``): the write-once conflict. ``put_once`` never raises it: it reads the
    key and answers :attr:`PutOutcome.ALREADY_SAME` or :attr:`PutOutcome.CONFLICT`."""


class TierBusy(TierError):
    """Another conditional write of the key is in flight (S3 ``409 ConditionalRequestConflict``):
    try again shortly. ``put_once`` does, a few times (:func:`sos_tier.retry.busy_retrying`),
    before it lets this reach the caller like any other TierError."""


class TierBadRange(TierError):
    """A ranged read starts at or past the end of the key (S3 ``416 InvalidRange``): there is
    nothing there; ``get`` answers ``b""``, never raises it."""


class TierDenied(TierError):
    """The store refused the credentials or the request (S3 ``403 AccessDenied``, a bad key or
    signature, an expired token, no credentials at all). Retried like any TierError: a
    credential renewed or a policy fixed while the server runs heals it."""


class PutOutcome(enum.Enum):
    CREATED = "created"
    ALREADY_SAME = "already-same"  # the key existed with exactly these bytes
    CONFLICT = "conflict"  # the key existed with other bytes; nothing was written


@dataclass(frozen=True, slots=True)
class StoredKey:
    key: str
    size: int


class Store(Protocol):
    url: str

    def put_once(self, key: str, data: bytes) -> PutOutcome: ...

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes: ...

    def list(self, prefix: str = "") -> Iterator[StoredKey]: ...

    def delete(self, keys: Iterable[str]) -> None: ...

    def close(self) -> None: ...


def check_key(key: str) -> str:
    """Keys are relative paths: no leading or trailing ``/``, no empty, ``.`` or ``..``
    segment, no NUL, at most 1024 bytes (S3's limit, minus nothing: the store's own prefix is
    checked by the layout)."""
    if not key or len(key.encode()) > 1024 or "\0" in key:
        raise ValueError(f"bad store key {key!r}")
    for seg in key.split("/"):
        if seg in ("", ".", "..") or seg.startswith(_TMP):
            raise ValueError(f"bad store key {key!r}")
    return key


def byte_range(start: int | None, end: int | None) -> tuple[int, int | None]:
    s = 0 if start is None else start
    if s < 0 or (end is not None and end < s):
        raise ValueError(f"bad range [{start}, {end})")
    return s, end


# ---------------------------------------------------------------------------------------------
# file:///path: a second local disk

_TMP = "#tmp."  # temp files of put_once; '#' is in no key the layout makes (check_key refuses it)


class LocalStore:
    """A directory as a store: key ``a/b/c`` is the file ``ROOT/a/b/c``.

    ``put_once`` writes a temp file in the key's directory, fsyncs it, then ``link()``s it to
    the key's name: link never replaces an existing name (EEXIST), so two writers racing for
    one key cannot overwrite each other and a reader never sees a partial file; then the
    directory is fsynced (and each directory the put created, in its parent). Files are 0600,
    directories 0700. Temp files a crash left behind (``#tmp.*``) are never listed."""

    def __init__(self, url: str, *, page_size: int = 1000) -> None:
        parts = urlsplit(url)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"bad local tier URL {url!r}: file:///ABSOLUTE/PATH")
        self.url = url
        self.root = os.path.normpath(unquote(parts.path))
        self.page_size = page_size  # unused: a directory listing has no pages; kept for the common signature
        try:
            _makedirs(self.root)
        except OSError as exc:
            raise TierError(f"cannot create the tier directory {self.root}: {exc}") from exc

    def __repr__(self) -> str:
        return f"LocalStore({self.url!r})"

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def put_once(self, key: str, data: bytes) -> PutOutcome:
        path = self._path(key)
        d = os.path.dirname(path)
        tmp = os.path.join(d, f"{_TMP}{os.getpid()}.{secrets.token_hex(6)}")
        try:
            _makedirs(d)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    pass
                else:
                    fsync_dir(d)
                    return PutOutcome.CREATED
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        except OSError as exc:
            raise TierError(f"cannot write {key} in {self.root}: {exc}") from exc
        return PutOutcome.ALREADY_SAME if self.get(key) == bytes(data) else PutOutcome.CONFLICT

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        s, e = byte_range(start, end)
        try:
            with open(self._path(key), "rb") as f:
                f.seek(s)
                return f.read() if e is None else f.read(e - s)
        except FileNotFoundError as exc:
            raise TierNotFound(key) from exc
        except NotADirectoryError as exc:  # a key's "directory" is a file: no such key either
            raise TierNotFound(key) from exc
        except OSError as exc:
            raise TierError(f"cannot read {key} in {self.root}: {exc}") from exc

    def list(self, prefix: str = "") -> Iterator[StoredKey]:
        # Start at the deepest directory the prefix names; S3 sorts whole keys byte-wise,
        # which a directory walk does not (``a!x`` < ``a/y``), so collect, then sort.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if base:
            check_key(base)  # no '..' walking out of the root
        top = os.path.join(self.root, *base.split("/")) if base else self.root
        found: list[StoredKey] = []
        if not os.path.isdir(top):
            return
        try:
            for dirpath, _dirs, files in os.walk(top, onerror=_raise_unless_gone):
                rel = os.path.relpath(dirpath, self.root)
                rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
                for name in files:
                    if name.startswith(_TMP):
                        continue
                    key = rel + name
                    if key.startswith(prefix):
                        try:
                            size = os.stat(os.path.join(dirpath, name)).st_size
                        except FileNotFoundError:  # deleted while we list: gone
                            continue
                        found.append(StoredKey(key, size))
        except OSError as exc:
            raise TierError(f"cannot list {prefix!r} in {self.root}: {exc}") from exc
        found.sort(key=lambda k: k.key.encode())
        yield from found

    def delete(self, keys: Iterable[str]) -> None:
        dirs: set[str] = set()
        for key in keys:
            path = self._path(key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise TierError(f"cannot delete {key} in {self.root}: {exc}") from exc
            dirs.add(os.path.dirname(path))
        for d in sorted(dirs, reverse=True):  # then drop the directories left empty
            try:
                fsync_dir(d)
                while d != self.root and not os.listdir(d):
                    os.rmdir(d)
                    d = os.path.dirname(d)
                    fsync_dir(d)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise TierError(f"cannot tidy {d} in {self.root}: {exc}") from exc

    def close(self) -> None:
        pass


def _raise_unless_gone(exc: OSError) -> None:
    if not isinstance(exc, FileNotFoundError):  # a directory deleted while we list is just gone
        raise exc


def _makedirs(path: str) -> None:
    """mkdir -p with mode 0700, fsyncing each parent whose entry was created."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent != path:
        _makedirs(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path) from None
        return
    fsync_dir(parent)
