"""The fsspec filesystem's namespaces: one journaled tree per (server, namespace, cache
directory) per process, shared by every SOSFileSystem instance addressing it (so two
instances never fence each other), opened through sos_journal.tree.open, flushed at exit."""

from __future__ import annotations

import atexit
import contextlib
import os
import ssl
import threading
from collections.abc import Callable
from typing import Any, Protocol

from sos_journal.faces.facade import call_journal
from sos_journal.format.auth import JournalKeys
from sos_journal.tree.open import OpenNamespace, client_factory_for, key_role, open_namespace
from sos_wire.events import KeyRole

# --------------------------------------------------------------------------
# One journaled tree per (server, namespace, cache directory) per process.


class FsTree(Protocol):
    """What the filesystem calls on a namespace's tree: the JournaledTree's operations, as
    the JournaledTree itself, :class:`_GuardedTree` or a read-only key's ReadOnlyTree has them."""

    def local_path(self, path: str) -> str: ...
    def mkdir(self, path: str, mode: int = 0o755) -> None: ...
    def rmdir(self, path: str) -> None: ...
    def create(self, path: str, mode: int = 0o644) -> None: ...
    def write(self, path: str, offset: int, data: bytes | bytearray | memoryview) -> int: ...
    def rename(self, src: str, dst: str, /, *, overwrite: bool) -> None: ...
    def unlink(self, path: str) -> None: ...
    def sync(self, wait: bool | None = None) -> None: ...
    def close(self) -> None: ...


class SharedNamespace:
    """A shared opened namespace (:func:`sos_journal.tree.open.open_namespace`) plus the
    lock that makes compound operations (exclusive create, checked rename, makedirs)
    atomic within the process. Other processes cannot write the namespace without
    fencing this one."""

    def __init__(self, opened: OpenNamespace, tree: FsTree, durability: str = "server") -> None:
        self.pid = os.getpid()
        self.durability = durability
        self.opened = opened
        self.tree = tree
        self.writer = opened.writer
        self.tree_dir = opened.tree_dir  # the live tree; every read is served from here
        self.namespace = opened.namespace
        self.lock = threading.RLock()

    @property
    def closed(self) -> bool:
        return self.opened.closed

    def local(self, rel: str) -> str:
        return self.tree.local_path(rel) if rel else self.tree_dir

    def close(self, timeout: float | None = None) -> None:
        self.opened.close(timeout)


class _GuardedTree:
    """The JournaledTree as the filesystem sees it: journal failures become the
    built-in exceptions fsspec users expect (:func:`sos_journal.faces.facade.journal_error`,
    as the mount and the gateway map them). Fenced (another writer took the
    namespace over) -> PermissionError (errno EROFS); any other journal failure
    -> OSError EIO. The original error is chained. Reads keep working from the cache."""

    _MUTATIONS = ("mkdir", "rmdir", "create", "write", "truncate", "rename", "unlink", "marker", "sync")

    def __init__(self, tree: FsTree, namespace: str) -> None:
        self._tree = tree
        self._namespace = namespace

    def local_path(self, path: str) -> str:
        return self._tree.local_path(path)

    def close(self) -> None:
        self._tree.close()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in self._MUTATIONS:
            raise AttributeError(name)
        method = getattr(self._tree, name)

        def guarded(*args: Any, **kwargs: Any) -> Any:
            return call_journal(self._namespace, method, *args, **kwargs)

        return guarded


_REGISTRY: dict[tuple[str, str, str, str], SharedNamespace] = {}
_REGISTRY_LOCK = threading.Lock()
_REGISTRY_PID = os.getpid()


def open_shared(
    server: str,
    key: str,
    namespace: str,
    base_dir: str,
    max_lag_bytes: int | None,
    timeout: float,
    tls: ssl.SSLContext | bool | None = None,
    generation_bytes: int | None = None,
    *,
    durability: str = "server",
    tier_patience: float | None = None,
    journal_key: JournalKeys | None = None,
) -> SharedNamespace:
    """The process-wide tree of (server, namespace, cache dir) for this key's role.

    ``durability`` is the writer's (one per namespace and cache): a second filesystem object
    asking for the other one while the namespace is open is refused with ValueError rather
    than silently given weaker (or costlier) barriers than it asked for. A read-only view has
    no writer and no barrier: any durability shares it."""
    global _REGISTRY_PID

    root = os.path.realpath(os.path.join(base_dir, namespace))
    # one connection tells the role (and fails fast on a refused key); the
    # caller remembers the result, so this runs once per filesystem object
    role = key_role(client_factory_for(server, key, namespace, timeout=timeout, tls=tls), timeout)
    ident = (server, namespace, root, "read" if role == KeyRole.READ else "append")
    with _REGISTRY_LOCK:
        if os.getpid() != _REGISTRY_PID:
            # a forked child inherits the dict but not the replicator threads
            _REGISTRY.clear()
            _REGISTRY_PID = os.getpid()
        ns = _REGISTRY.get(ident)
        if ns is not None and not ns.closed:
            if ident[3] == "append" and ns.durability != durability:
                raise ValueError(
                    f"sos: namespace {namespace!r} (cache {root}) is already open in this process "
                    f"with durability {ns.durability!r}; one writer serves it, so a filesystem "
                    f"with durability {durability!r} cannot share it: give every filesystem "
                    f"object of the namespace the same durability (or close_all() first)"
                )
            return ns
        # One writer serves every filesystem object of this namespace in the
        # process, whatever each object's ``sync``, so it runs in sync mode:
        # the tree's rename (mv) always waits for the server. Objects with
        # sync=True also wait on close, cp and commit (tree.sync(wait=True));
        # objects with sync=False do not.
        opened = open_namespace(
            namespace,
            root,
            server=server,
            key=key,
            timeout=timeout,
            tls=tls,
            sync=True,
            max_lag_bytes=max_lag_bytes,
            generation_bytes=generation_bytes,
            allow_read_only=True,
            durability=durability,
            tier_patience=tier_patience,
            journal_key=journal_key,
        )
        tree: FsTree = opened.tree if opened.read_only else _GuardedTree(opened.tree, namespace)
        ns = SharedNamespace(opened, tree, durability)
        _REGISTRY[ident] = ns
        return ns


def close_all(timeout: float | None = None) -> None:
    """Close every journaled tree this process opened, first waiting (up to
    ``timeout`` seconds, None = until done) for their journals to be shipped.

    Runs at interpreter exit; tests call it to start from scratch.
    """
    with _REGISTRY_LOCK:
        items = list(_REGISTRY.values())
        _REGISTRY.clear()
    first: Exception | None = None
    for ns in items:
        try:
            ns.close(timeout)
        except Exception as exc:  # noqa: BLE001 - keep closing the others; the first is raised at the end
            first = first or exc
    if first is not None:
        raise first


#: At interpreter exit, wait this long for unshipped records (async mode, or
#: deletions) to reach the server; what is left stays in the spool and is
#: shipped by the next process that opens the same cache directory.
EXIT_FLUSH_TIMEOUT = 60.0


def _close_at_exit() -> None:
    with contextlib.suppress(Exception):  # at interpreter exit: no one left to tell
        close_all(timeout=EXIT_FLUSH_TIMEOUT)


atexit.register(_close_at_exit)
