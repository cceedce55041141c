"""Open a namespace's cache, writer and tree: the one opener of the fsspec filesystem,
the FUSE mount and the WebHDFS gateway.

A namespace's cache directory holds::

    <cache>/tree/        the live tree (every read is served from here)
    <cache>/spool/       the journal writer's spool (records not yet on the server)
    <cache>/read-tree/   a read-role key's private copy of the tree (no spool)

:func:`open_namespace` connects once to learn the key's role (a refused or malformed key
fails here, at once: it is not retryable, :func:`sos_client.errors.is_retryable`), then

* append role: opens a :class:`~sos_journal.writer.writer.JournalWriter` (fencing every
  older writer of the namespace) and a :class:`~sos_journal.tree.tree.JournaledTree`
  over ``tree/``; an empty (or crash-dirty) cache is first rebuilt from the server to the
  journal's end (:func:`~sos_journal.rebuild.finish.rebuild_journal_end`: restore's code, and a
  newest generation that is not complete is finished from its records, never skipped);
* read role (only with ``allow_read_only=True``): rebuilds ``read-tree/`` from the
  server and returns a :class:`ReadOnlyTree` whose mutations raise PermissionError;
  nothing is fenced.

It lives in the journal package (not in spark_plugin) because it only wires journal
parts together and must not depend on any of its three users.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import ssl
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from sos_client.blocking import Client
from sos_client.errors import token_key_message
from sos_client.retry import retrying
from sos_journal.errors import SpoolStale
from sos_journal.format.auth import JournalKeys, resolve_journal_keys
from sos_journal.format.records import Record, validate_path
from sos_journal.rebuild.finish import rebuild_journal_end
from sos_journal.store import StoreClient
from sos_journal.tree.tree import JournaledTree, RebuildCache
from sos_journal.writer.writer import JournalWriter
from sos_wire.auth import Key
from sos_wire.events import KeyRole

__all__ = ["OpenNamespace", "ReadOnlyTree", "client_factory_for", "default_cache_dir", "key_role", "open_namespace"]

log = logging.getLogger(__name__)


class RoleClient(StoreClient, Protocol):
    """A connected client of the server: the journal's slice, and the role the server granted the key."""

    @property
    def role(self) -> KeyRole | None: ...


ClientFactory = Callable[[], RoleClient]


def default_cache_dir(namespace: str) -> str:
    """``$XDG_CACHE_HOME/sos/NAMESPACE`` (``~/.cache/sos/NAMESPACE`` without it)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sos", namespace)


def client_factory_for(
    server: str | None,
    key: str | Key | None,
    namespace: str,
    *,
    timeout: float = 30.0,
    tls: ssl.SSLContext | bool | None = None,
) -> ClientFactory:
    """A factory of connected blocking clients (TLS and timeouts included)."""

    def factory() -> Client:
        return Client(server, key, namespace, timeout=timeout, tls=tls)

    return factory


def key_role(factory: ClientFactory, patience: float) -> KeyRole | None:
    """Connect once and return the key's KeyRole. A refused or malformed key raises
    PermissionError at once; an unreachable or busy server (a retryable error,
    :func:`sos_client.errors.is_retryable`) is retried for ``patience`` seconds (a server
    restarting)."""
    for attempt in retrying(patience):
        with attempt:
            client = factory()
    try:
        return client.role
    finally:
        client.close()


class ReadOnlyTree:
    """Stands in for the JournaledTree when the key has the read role: the cache was
    rebuilt from the server, no writer exists (nothing is fenced), mutations raise
    PermissionError."""

    rebuilt = True

    def __init__(self, tree_dir: str, namespace: str) -> None:
        self.cache_dir = tree_dir
        self.namespace = namespace

    def local_path(self, path: str) -> str:
        if path in ("", "."):
            return self.cache_dir
        return os.path.join(self.cache_dir, validate_path(path))

    def _refuse(self, path: str = "", *args: object, **kwargs: object) -> NoReturn:
        raise PermissionError(
            errno.EACCES,
            f"read-only key: namespace {self.namespace!r} can be read, not written",
            f"{self.namespace}/{path}" if path else self.namespace,
        )

    mkdir = rmdir = create = write = truncate = rename = unlink = marker = _refuse

    def sync(self, wait: bool | None = None) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class OpenNamespace:
    """What :func:`open_namespace` opened. ``tree`` serves reads from ``tree_dir``;
    ``writer`` is None for a read-only view. ``close(timeout)`` flushes the journal (up to
    ``timeout`` seconds, None = until done) and stops the writer."""

    namespace: str
    cache_dir: str
    tree_dir: str
    spool_dir: str
    tree: JournaledTree | ReadOnlyTree
    writer: JournalWriter | None = None
    client_factory: ClientFactory | None = None
    read_only: bool = False
    rebuilt: bool = False
    closed: bool = field(default=False, init=False)

    def close(self, timeout: float | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.writer is not None:
                self.writer.close(timeout=timeout)  # flush (bounded), stop the replicator
        finally:
            self.tree.close()


def private_cache_dir(cache_dir: str, subdirs: dict[str, int] | None = None) -> None:
    """Make ``cache_dir`` private to this process's user: a real directory (not a link), owned
    by it (a root mount takes over one owned by someone else) with mode 0700, holding the
    real directories ``subdirs`` (name: mode for a new one). Only the opener (mount, gateway, fsspec) can then reach the cache: whoever the
    entries inside belong to (``--owner``) cannot plant links in it (a root mount would
    otherwise create, open and chown through them) nor change the tree behind the journal.
    PermissionError if a non-root process finds another user's directory."""
    os.makedirs(os.path.dirname(os.path.abspath(cache_dir)), exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(cache_dir, 0o700)
    try:
        fd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotADirectoryError(
                errno.ENOTDIR, "a namespace's cache must be a directory, not a symbolic link or a file", cache_dir
            ) from None
        raise
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid != me:
            if me != 0:
                raise PermissionError(
                    errno.EPERM,
                    f"the cache directory belongs to uid {st.st_uid}, not to this process's user {me}",
                    cache_dir,
                )
            os.fchown(fd, 0, 0)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
        for name, mode in (subdirs or {}).items():
            try:
                os.mkdir(name, mode, dir_fd=fd)
            except FileExistsError:
                if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise NotADirectoryError(
                        errno.ENOTDIR, "not a directory (a link?) in the cache", os.path.join(cache_dir, name)
                    ) from None
    finally:
        os.close(fd)


def open_namespace(
    namespace: str,
    cache_dir: str,
    *,
    server: str | None = None,
    key: str | Key | None = None,
    timeout: float = 30.0,
    tls: ssl.SSLContext | bool | None = None,
    client_factory: ClientFactory | None = None,
    sync: bool = True,
    max_lag_bytes: int | None = None,
    generation_bytes: int | None = None,
    allow_read_only: bool = False,
    durability: str = "server",
    tier_patience: float | None = None,
    rebuild: RebuildCache | None = None,
    replayed_to: int | None = None,
    journal_key: JournalKeys | str | None = None,
    observe_rebuild: Callable[[Record], None] | None = None,
) -> OpenNamespace:
    """Open ``namespace`` with its cache in ``cache_dir`` (see the module docstring).

    Connection: ``client_factory`` (a callable returning a connected client), or one built
    from ``server``/``key``/``timeout``/``tls`` by :func:`client_factory_for`. ``sync``,
    ``max_lag_bytes`` and ``generation_bytes`` go to the writer (None: its defaults).

    ``durability``: "server" (a barrier, e.g. the rename onto a Spark ``commits/N``, returns
    once its records are durable on the SOS server) or "tier" (once the server's object-store
    tier, the bucket, holds them too: RPO 0 for committed batches even when the server and its
    disk are lost; ``tier_patience``: seconds a barrier waits for the bucket before it fails
    with JournalTierBehind, None: until it holds them). Every face passes it here
    (``sos gateway``/``sos mount`` ``--durability``, fsspec's ``durability=``). With "tier" a
    server without a tier is refused here (JournalTierUnavailable): the opener fails before
    anything is served.

    ``rebuild``: what fills an empty cache (default: :func:`~sos_journal.rebuild.finish.rebuild_journal_end`,
    the journal's end, a generation that is not complete finished, protocol.md 2.1;
    ``sos gateway --restore-batch`` gives :func:`~sos_journal.rebuild.rollback.rollback_rebuild`).
    ``observe_rebuild``: called with each record the default rebuild applies after its
    snapshot, in journal order (the gateway's memory of recent RENAMEs is rebuilt from them).

    ``replayed_to``: the cache's tree is the journal replayed up to that record (a standby
    gateway's tail, taken after its FENCE): the writer continues the generation from there
    instead of starting a new one from a snapshot of the tree (JournaledTree).

    ``journal_key``: the namespace's journal key ring (protocol.md 2.5): the writer authenticates
    its records with it and a rebuild of the cache verifies every record under it (default:
    ``$SOS_JOURNAL_KEY``, else the file ``$SOS_JOURNAL_KEY_FILE``; none: unauthenticated).

    Raises PermissionError for a refused key (or a read key without ``allow_read_only``),
    RuntimeError for a stale spool (another writer took the namespace over since this
    cache was last used), ConnectionError if the server stays unreachable.
    """
    cache_dir = os.path.abspath(cache_dir)
    keys = resolve_journal_keys(journal_key)
    rebuild = rebuild or functools.partial(rebuild_journal_end, journal_key=keys, observe=observe_rebuild)
    if client_factory is None:
        factory = client_factory_for(server, key, namespace, timeout=timeout, tls=tls)
    else:
        factory = client_factory
    if not _may_write(factory, namespace, timeout, allow_read_only):
        return _open_read_only(factory, namespace, cache_dir, keys)
    writer_kwargs: dict[str, Any] = {
        "sync": sync,
        "durability": durability,
        "tier_patience": tier_patience,
        "journal_key": keys,
    }
    if max_lag_bytes is not None:
        writer_kwargs["max_lag_bytes"] = max_lag_bytes
    if generation_bytes is not None:
        writer_kwargs["generation_bytes"] = generation_bytes
    return _open_writer(
        factory, namespace, cache_dir, writer_kwargs, timeout=timeout, rebuild=rebuild, replayed_to=replayed_to
    )


def _may_write(factory: ClientFactory, namespace: str, timeout: float, allow_read_only: bool) -> bool:
    """Connect once to learn the key's role: True for the append role, False for the read role
    with ``allow_read_only``; PermissionError for a token key or a read key without it."""
    role = key_role(factory, timeout)
    if role == KeyRole.TOKEN:
        raise PermissionError(errno.EACCES, token_key_message(namespace), namespace)
    if role != KeyRole.READ:
        return True
    if allow_read_only:
        return False
    raise PermissionError(
        errno.EACCES,
        f"the key has the read role: writing namespace {namespace!r} needs a key with the append role",
        namespace,
    )


def _open_writer(
    factory: ClientFactory,
    namespace: str,
    cache_dir: str,
    writer_kwargs: dict[str, Any],
    *,
    timeout: float,
    rebuild: RebuildCache,
    replayed_to: int | None,
) -> OpenNamespace:
    """An append-role key: the writer (fencing older epochs) and the tree over ``tree/``, rebuilt
    from the server first if the cache is empty; a stale spool is a RuntimeError."""
    tree_dir = os.path.join(cache_dir, "tree")
    spool_dir = os.path.join(cache_dir, "spool")
    # tree/ is a mount's root directory as users see it (0755 by default)
    private_cache_dir(cache_dir, {"tree": 0o755, "spool": 0o700})
    writer = JournalWriter(factory, namespace, spool_dir, **writer_kwargs)
    try:
        # opens the writer (fencing older epochs) and, if the cache is empty, rebuilds it
        # from the server by the same code as restore
        tree = JournaledTree(tree_dir, writer, rebuild=rebuild, replayed_to=replayed_to).open()
        try:
            writer.check_tier(timeout)  # durability "tier" on a server without one: refused now
        except BaseException:
            tree.close()
            raise
    except BaseException as exc:
        try:
            writer.close()
        except Exception as close_exc:  # noqa: BLE001 - the original error is what matters
            log.debug("closing the writer after a failed open: %r", close_exc)
        if isinstance(exc, SpoolStale):
            raise RuntimeError(
                f"{exc}. The cache {cache_dir} is stale: remove it (or use "
                f"another cache directory) to start from the server's state"
            ) from exc
        raise
    if tree.rebuilt:
        log.info("cache %s was rebuilt from the server", tree_dir)
    return OpenNamespace(
        namespace, cache_dir, tree_dir, spool_dir, tree, writer, factory, read_only=False, rebuilt=tree.rebuilt
    )


def _open_read_only(factory: ClientFactory, namespace: str, cache_dir: str, keys: JournalKeys | None) -> OpenNamespace:
    """A read-role key: rebuild a private copy of the tree from the server."""
    tree_dir = os.path.join(cache_dir, "read-tree")
    private_cache_dir(cache_dir, {"read-tree": 0o755})
    # replaces an older copy; the journal's end, as a writer would continue it (an empty tree
    # rather than a refusal when no generation's snapshot is whole: a reader changes nothing)
    rebuild_journal_end(factory, namespace, tree_dir, refuse=False, journal_key=keys)
    return OpenNamespace(
        namespace,
        cache_dir,
        tree_dir,
        "",
        ReadOnlyTree(tree_dir, namespace),
        None,
        factory,
        read_only=True,
        rebuilt=True,
    )
