"""`run_mount()`: what `sos mount` runs: the namespace opened (server, writer, tree),
the FUSE session started on the mountpoint, signals, the final flush and unmount."""

from __future__ import annotations

import errno
import logging
import os
import signal
import ssl
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING

import trio

from sos_client.errors import is_fenced
from sos_client.serving import serve_until_signal
from sos_journal.beneath import Beneath
from sos_journal.faces.facade import FENCE_CHECK, FenceWatch
from sos_journal.tree.open import ClientFactory, open_namespace
from sos_journal.tree.open import default_cache_dir as _journal_cache_dir
from sos_journal.tree.tree import JournaledTree

if TYPE_CHECKING:
    import pyfuse3

    from sos_journal.writer.writer import JournalWriter
else:
    try:  # pyfuse3 is an optional dependency (extra "mount")
        import pyfuse3
    except ImportError:  # pragma: no cover - exercised only where pyfuse3 is missing
        pyfuse3 = None

from .ops import SOSOperations
from .process import READY_MARKER, is_mounted, lazy_unmount

log = logging.getLogger(__name__)

#: exit code of a mount that stopped because a newer writer fenced it (as the gateway's)
EXIT_FENCED = 3

# ---------------------------------------------------------------------------
# Running a mount: server connection -> writer -> tree -> FUSE
# ---------------------------------------------------------------------------


def default_cache_dir(namespace: str) -> str:
    return _journal_cache_dir(namespace)


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
    opened by `sos_journal.tree.open.open_namespace` (the opener fsspec and the gateway use).

    The writer fences every older writer first, then an empty (or crash-dirty) cache is
    rebuilt from the server by the same code as `sos restore`. A spool that the server has
    moved past (another writer took over since) is refused with a hint to drop the cache.
    A refused key fails at once; a read key is refused (a mount writes).
    """

    def __init__(
        self,
        namespace: str,
        server: str,
        key: str,
        cache_dir: str,
        *,
        sync: bool = True,
        max_lag_bytes: int = 64 << 20,
        generation_bytes: int | None = None,
        client_factory: ClientFactory | None = None,
        timeout: float = 30.0,
        tls: ssl.SSLContext | bool | None = None,
        durability: str = "server",
        tier_patience: float | None = None,
    ) -> None:
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
        self.durability = durability
        self.tier_patience = tier_patience
        self.writer: JournalWriter | None = None
        self.tree: JournaledTree | None = None

    def open(self) -> tuple[JournaledTree, JournalWriter]:
        """Open the writer and the tree (see the class docstring); returns them."""
        opened = open_namespace(
            self.namespace,
            self.cache_dir,
            server=self.server,
            key=self.key,
            timeout=self.timeout,
            tls=self.tls,
            client_factory=self._client_factory,
            sync=self.sync,
            max_lag_bytes=self.max_lag_bytes,
            generation_bytes=self.generation_bytes,
            durability=self.durability,
            tier_patience=self.tier_patience,
        )
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


async def _serve(ops: SOSOperations, namespace: str, mountpoint: str, watch: FenceWatch | None = None) -> None:
    """Serve the FUSE session until SIGTERM/SIGINT (or an external unmount); a signal that
    came between the mount and this loop (``_early_signals``) counts as one that comes now.
    With ``watch``, a mount that a newer writer fenced unmounts itself (:func:`_watch_fence`)."""
    mode = "sync" if ops.sync_mode else "async"
    if ops.durability == "tier":
        mode += ", durability tier"
    if ops.enable_writeback_cache:
        mode += ", writeback cache"

    async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if watch is not None:
                nursery.start_soon(_watch_fence, ops, watch)
            task_status.started()
            await pyfuse3.main()
            nursery.cancel_scope.cancel()  # unmounted: the fence watch ends too

    def unmount(name: str) -> None:
        log.info("%s: unmounting", name)
        pyfuse3.terminate()

    await serve_until_signal(
        serve,
        lambda _: f"{READY_MARKER}: namespace {namespace} mounted at {mountpoint} ({mode})",
        stop=unmount,
        pending=_early_signals,
    )


async def _watch_fence(ops: SOSOperations, watch: FenceWatch) -> None:
    """Check every 0.5 s; once fenced, make the mount read-only, say who fenced it, unmount
    (run_mount then exits with EXIT_FENCED)."""
    while True:
        reason = ops.fenced or await trio.to_thread.run_sync(watch.check, abandon_on_cancel=True)
        if reason is not None:
            if ops.fenced is None:
                ops._fence.fenced = reason
            log.error(
                "FENCED: %s; this mount of namespace %r can no longer change it: unmounting (exit code %d)",
                reason,
                watch.namespace,
                EXIT_FENCED,
            )
            pyfuse3.terminate()
            return
        await trio.sleep(0.5)


_early_signals: list[int] = []


_Handler = Callable[[int, FrameType | None], object] | int | None  # what signal.signal returns


def _restore_signals(previous: Mapping[signal.Signals, _Handler]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _record_early_signal(signum: int, frame: FrameType | None) -> None:
    _early_signals.append(signum)


def give_tree_to(tree_dir: str, owner: tuple[int, int], *, everything: bool) -> None:
    """chown the cache's root directory (and, with ``everything``, all below it) to owner
    (no recursion; a link is never followed)."""
    uid, gid = owner
    with Beneath(tree_dir) as at:
        at.chown("", uid, gid)
        if not everything:
            return
        for d, dirs, entries in at.walk():
            pre = f"{d}/" if d else ""
            for name in dirs + [n for n, _st in entries]:
                at.chown(pre + name, uid, gid)


def run_mount(
    namespace: str,
    mountpoint: str,
    *,
    server: str,
    key: str,
    cache_dir: str | None = None,
    sync: bool = True,
    max_lag_bytes: int = 64 << 20,
    allow_other: bool = False,
    debug: bool = False,
    client_factory: ClientFactory | None = None,
    flush_timeout: float = 120.0,
    writeback_cache: bool = False,
    owner: tuple[int, int] | None = None,
    generation_bytes: int | None = None,
    durability: str = "server",
    tier_patience: float | None = None,
    fence_check: float = FENCE_CHECK,
) -> int:
    """Mount `namespace` at `mountpoint` until SIGTERM/SIGINT or an external unmount.

    Returns the process exit code (0 after a clean unmount with everything
    flushed, 1 if the final flush failed, EXIT_FENCED (3) when a newer writer fenced it: seen
    by its writer or by a FENCE(0) check every ``fence_check`` s (:class:`FenceWatch`, the
    gateway's), it then unmounts itself and says why).
    `client_factory` (optional) returns a connected client for the namespace
    (TLS, timeouts); by default `sos_client.Client(server, key, namespace)`.
    After the unmount the journal gets `flush_timeout` seconds to reach the
    server; what does not stays in the spool and the next mount ships it.
    `owner` (uid, gid): owner of the mount's root directory and of everything rebuilt
    from the server (needs root unless it is the mount's own user); implies allow_other
    when it is another user. `generation_bytes`: journal bytes after which a new
    generation starts with a snapshot of the tree (default: the writer's, 1 GiB).
    `durability` ("server" or "tier") and `tier_patience` go to `open_namespace`: with
    "tier" each barrier (a rename onto `commits/N`...) also waits for the server's bucket,
    failing with ETIMEDOUT after `tier_patience` seconds, and a server without a tier is
    refused before anything is mounted (JournalTierUnavailable).
    """
    if pyfuse3 is None:
        raise RuntimeError("pyfuse3 is not installed (pip install 'sos[mount]')")
    mountpoint = free_mountpoint(mountpoint)
    if owner is not None:
        allow_other = check_owner(owner, allow_other)
    journal = MountedTree(
        namespace,
        server,
        key,
        cache_dir or default_cache_dir(namespace),
        sync=sync,
        max_lag_bytes=max_lag_bytes,
        generation_bytes=generation_bytes,
        client_factory=client_factory,
        durability=durability,
        tier_patience=tier_patience,
    )
    tree, writer = journal.open()
    if owner is not None:
        try:  # rebuilt entries have no owner in the journal: they are the owner's
            give_tree_to(journal.tree_dir, owner, everything=tree.rebuilt)
        except BaseException:
            journal.close()
            raise
    ops = SOSOperations(tree, journal.tree_dir, sync=sync, namespace=namespace, writeback_cache=writeback_cache)
    ops.durability = durability
    code = 0
    try:
        watch = FenceWatch(namespace, writer, client_factory or writer.client_factory, fence_check, who="this mount")
        serve_mounted(ops, mountpoint, fuse_options(namespace, allow_other=allow_other, debug=debug), watch)
        code = final_flush(ops, writer, journal.spool_dir, flush_timeout)
    finally:
        try:
            journal.close()
        except Exception as exc:  # noqa: BLE001
            if ops.fenced is None and not is_fenced(exc):
                log.error("closing the journal failed: %r", exc)
                code = 1
    return code


def free_mountpoint(mountpoint: str) -> str:
    """``mountpoint`` as an absolute path, a dead mount there (its daemon died) detached;
    RuntimeError if something live is mounted there, FileNotFoundError if it is no directory."""
    mountpoint = os.path.abspath(mountpoint)
    if is_mounted(mountpoint):
        try:  # OPENDIR always asks the daemon; a stat may be answered from cached attributes
            with os.scandir(mountpoint):
                pass
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise
            log.warning("%s is a dead mount (its daemon died): detaching it", mountpoint)
            lazy_unmount(mountpoint)
        else:
            raise RuntimeError(f"{mountpoint} is already a mount point")
    if not os.path.isdir(mountpoint):
        raise FileNotFoundError(errno.ENOENT, "mountpoint is not a directory", mountpoint)
    return mountpoint


def check_owner(owner: tuple[int, int], allow_other: bool) -> bool:
    """``--owner`` checked (root, unless it is the mount's own user); returns ``allow_other``,
    True when the owner is another user (it must reach the mount)."""
    if os.geteuid() != 0 and tuple(owner) != (os.geteuid(), os.getegid()):
        raise PermissionError(errno.EPERM, "--owner needs the mount to run as root")
    if owner[0] != os.geteuid() and not allow_other:
        log.info("--owner %d:%d is another user: mounting with allow_other", *owner)
        return True
    return allow_other


def serve_mounted(ops: SOSOperations, mountpoint: str, options: set[str], watch: FenceWatch) -> None:
    """Mount ``ops`` at ``mountpoint``, serve until SIGTERM/SIGINT, an external unmount or a
    fence (``watch``), unmount. From the mount on, SIGTERM/SIGINT must unmount, never kill
    the process outright; once unmounted, a second signal may interrupt the final flush (the
    spool keeps whatever is not on the server yet; the next mount ships it)."""
    previous = {s: signal.signal(s, _record_early_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        pyfuse3.init(ops, mountpoint, options)
        try:
            trio.run(_serve, ops, watch.namespace, mountpoint, watch)
        finally:
            pyfuse3.close(unmount=True)
    finally:
        watch.close()
        _restore_signals(previous)
    log.info("unmounted %s", mountpoint)


def final_flush(ops: SOSOperations, writer: JournalWriter, spool_dir: str, flush_timeout: float) -> int:
    """After the unmount: EXIT_FENCED when a newer writer fenced the mount (nothing to flush),
    else 0 once the journal reached the server, 1 (logged) if it did not within
    ``flush_timeout`` s (the spool keeps it; the next mount ships it)."""
    if ops.fenced is not None:
        return EXIT_FENCED
    try:
        writer.barrier(timeout=flush_timeout)
    except Exception as exc:  # noqa: BLE001 - reported, exit code says it
        ops._note_failure(exc)
        log.error(
            "final flush failed (the spool in %s keeps the journal; the next mount ships it): %r",
            spool_dir,
            exc,
        )
        return 1
    return 0
