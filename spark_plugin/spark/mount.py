"""A checkpoint on a FUSE mount of the namespace (``sos mount``), for one JVM.

Spark (the JVM) cannot call a Python filesystem, so the checkpoint goes through the mount:
every file operation Spark makes there becomes a journal record shipped to the SOS server; in
sync mode the rename that creates ``commits/N`` returns only once the journal up to it is
durable on the server (``durability="tier"``: in its bucket too). :func:`journaled_checkpoint`
mounts the namespace if needed (or reuses a live mount of it, e.g. a sidecar's) and returns a
:class:`CheckpointLocation`; :func:`start_mount` is the one place that knows the
:class:`~spark_plugin.mount.process.MountProcess` API; mounts started here stop at exit."""

from __future__ import annotations

import atexit
import errno
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from spark_plugin.mounttable import mount_fstype

from .markers import MarkerListener
from .names import DEFAULT_CHECKPOINT, NAMESPACE_CONTROL, SOS_FSTYPE

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from spark_plugin.mount.process import MountProcess

log = logging.getLogger(__name__)


class CheckpointLocation(str):
    """A checkpointLocation (a plain ``str`` for Spark) that remembers its mount.

    ``.mountpoint``: root of the mounted namespace; ``.relpath``: the checkpoint's path
    inside the namespace (what ``sos restore --batch RELPATH:N`` takes); ``.mount``: the
    :class:`~spark_plugin.mount.process.MountProcess` (``.stop()`` to unmount cleanly), or None when
    an existing mount was reused (``.reused`` True; ``.stop()`` then leaves it alone).
    """

    mount: MountProcess | None = None
    mountpoint: str = ""
    relpath: str = ""
    namespace: str = ""

    @property
    def reused(self) -> bool:
        return self.mount is None

    def __new__(
        cls,
        path: str,
        *,
        mount: MountProcess | None = None,
        mountpoint: str = "",
        relpath: str = "",
        namespace: str = "",
    ) -> CheckpointLocation:
        self = super().__new__(cls, path)
        self.mount = mount
        self.mountpoint = mountpoint
        self.relpath = relpath
        self.namespace = namespace
        return self

    def stop(self) -> None:
        """Unmount (flushes the journal first)."""
        if self.mount is not None:
            self.mount.stop()


_mounts_lock = threading.Lock()
_mounts: list[MountProcess] = []


def _stop_all_mounts() -> None:
    with _mounts_lock:
        mounts = list(_mounts)
        _mounts.clear()
    for m in mounts:
        try:
            m.stop()
        except Exception:
            log.exception("unmount at exit failed")


atexit.register(_stop_all_mounts)


def start_mount(
    namespace: str,
    mountpoint: str,
    *,
    server: str,
    key: str,
    cache_dir: str,
    sync: bool = True,
    timeout: float = 180.0,
    log_path: str | None = None,
    extra_args: Sequence[str] = (),
    durability: str = "server",
    tier_patience: float | None = None,
) -> MountProcess:
    """Start ``sos mount`` for ``namespace`` on ``mountpoint`` and wait until it serves.

    ``extra_args``: more ``sos mount`` options (``--tls-ca FILE``, ``--owner 185``, ...).
    ``durability``: "server" (default) or "tier" (``--durability tier``: the rename onto
    ``commits/N`` returns once the server's bucket holds it; the server needs ``--tier``);
    ``tier_patience``: seconds such a barrier waits for the bucket (None: the mount's default).
    The one place that knows the :class:`spark_plugin.mount.process.MountProcess` API.
    """
    # needs sos_client: the Spark job ships spark_plugin/spark/ without it (docs/DEPLOY.md)
    from spark_plugin.mount.process import MountProcess  # noqa: PLC0415

    mount = MountProcess(
        namespace,
        mountpoint,
        cache_dir,
        server,
        str(key),
        sync,
        log_path=log_path,
        start_timeout=timeout,
        extra_args=list(extra_args),
        durability=durability,
        tier_patience=tier_patience,
    )
    mount.start()
    return mount


def mounted_namespace(mountpoint: str) -> str | None:
    """The namespace a live SOS mount at ``mountpoint`` serves.

    None when nothing is mounted there, or only a dead mount (its daemon died: a new
    mount detaches it). ValueError when something else is mounted there, or an SOS mount
    too old to say its namespace.
    """
    fstype = mount_fstype(mountpoint)
    if fstype is None:
        return None
    if fstype != SOS_FSTYPE:
        raise ValueError(
            f"{mountpoint} is already a mount point, but not an SOS mount ({fstype}); give another mountpoint"
        )
    try:
        with open(os.path.join(mountpoint, NAMESPACE_CONTROL), encoding="utf-8") as f:
            return f.read().rstrip("\n")
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:  # a dead mount: its daemon died
            return None
        raise ValueError(
            f"{mountpoint} is an SOS mount that does not say its namespace "
            f"({exc.strerror} for {NAMESPACE_CONTROL}: an older sos mount?); "
            f"unmount it first"
        ) from None


def journaled_checkpoint(
    spark_or_none: SparkSession | None,
    namespace: str,
    *,
    server: str | None = None,
    key: str | None = None,
    mountpoint: str | None = None,
    cache_dir: str | None = None,
    sync: bool = True,
    checkpoint: str = DEFAULT_CHECKPOINT,
    listener: bool = True,
    mount_args: Sequence[str] = (),
    timeout: float = 180.0,
    durability: str = "server",
    tier_patience: float | None = None,
    tls_ca: str | None = None,
) -> CheckpointLocation:
    """Mount ``namespace`` if needed and return a checkpointLocation on the mount.

    If ``mountpoint`` already is a live SOS mount of ``namespace`` (a sidecar, or the
    mount a killed driver left running), it is reused as it is: nothing is started,
    ``server``/``key``/``cache_dir``/``sync``/``mount_args``/``durability`` are not used, and
    the mount is not stopped at exit. A mount of another namespace, or anything else mounted there,
    is a ValueError. Otherwise ``sos mount`` is started (``server`` and ``key`` needed;
    ``mount_args``: more ``sos mount`` options; ``tls_ca``: the CA file of a TLS server, the
    same as ``mount_args=["--tls-ca", FILE]``) and stopped at interpreter exit or by
    ``location.stop()``. ``durability="tier"`` (and
    ``tier_patience``, see :func:`start_mount`): a batch's commit returns once the server's
    object-store tier holds it, so it survives the loss of the server and its disk too.

    ``mountpoint``/``cache_dir`` default to fresh temporary directories. An empty cache is
    rebuilt from the server by the mount, so the same call after losing the worker brings
    the checkpoint back. With a SparkSession, a :class:`MarkerListener` for this
    checkpoint is registered on it (``listener=False`` to skip).
    """
    relpath = checkpoint.strip("/")
    mount = None
    current = mounted_namespace(mountpoint) if mountpoint is not None else None
    if current is not None and current != namespace:
        raise ValueError(f"{mountpoint} is a mount of namespace {current!r}, not {namespace!r}")
    if current is None:
        if not server or not key:
            raise ValueError(
                f"nothing serves namespace {namespace!r} at {mountpoint}: server= and key= are needed to mount it"
            )
        if mountpoint is None:
            mountpoint = tempfile.mkdtemp(prefix=f"sos-mnt-{namespace}-")
        if cache_dir is None:
            cache_dir = tempfile.mkdtemp(prefix=f"sos-cache-{namespace}-")
        if mount_fstype(mountpoint) is None:  # a dead mount there: the mount detaches it
            os.makedirs(mountpoint, exist_ok=True)
        os.makedirs(cache_dir, exist_ok=True)
        extra = [*mount_args, *(["--tls-ca", os.fspath(tls_ca)] if tls_ca else [])]
        mount = start_mount(
            namespace,
            mountpoint,
            server=server,
            key=key,
            cache_dir=cache_dir,
            sync=sync,
            extra_args=extra,
            timeout=timeout,
            durability=durability,
            tier_patience=tier_patience,
        )
        with _mounts_lock:
            _mounts.append(mount)
    else:
        assert mountpoint is not None  # current was read from it
        log.info("reusing the live SOS mount of namespace %r at %s", namespace, mountpoint)
    path = os.path.join(os.path.abspath(mountpoint), relpath)
    os.makedirs(path, exist_ok=True)
    loc = CheckpointLocation(
        path, mount=mount, mountpoint=os.path.abspath(mountpoint), relpath=relpath, namespace=namespace
    )
    if spark_or_none is not None and listener:
        spark_or_none.streams.addListener(MarkerListener(loc))
    return loc
