"""Spark helpers: a journaled checkpointLocation, batch markers, restore to a batch.

Spark (the JVM) cannot call a Python filesystem, so the checkpoint goes through a FUSE
mount of the namespace (``sos mount``, :class:`spark_plugin.mount.process.MountProcess`). Every
file operation Spark makes there becomes a journal record shipped to the SOS server; in
sync mode the rename that creates ``commits/N`` returns only once the journal up to it is
durable on the server, so a committed batch survives the loss of the whole worker.

- :func:`journaled_checkpoint` mounts the namespace if needed (it reuses a live mount of the
  same namespace, e.g. a sidecar's) and returns a checkpointLocation on it.
- :class:`MarkerListener` writes a MARKER record ``spark.batch`` after each committed batch:
  it names the query and the batch in the journal (``sos restore`` lists them when asked
  for a batch it cannot find). Restoring to a batch does not depend on markers: it stops
  at the journal record that made ``commits/N`` exist.
- :func:`restore_to_batch` rebuilds a checkpoint as it was when batch N committed.
- :func:`gateway_checkpoint` gives a session its checkpoint through ``sos gateway``
  instead (a cluster of any size, no FUSE): a ``webhdfs://`` checkpointLocation, the
  Hadoop OAuth2 and retry settings (:func:`gateway_conf`) and a
  :class:`GatewayMarkerListener` that writes the same batch markers; :func:`start_gateway`
  starts one (as :func:`start_mount` starts a mount).
- ``durability="tier"`` (:func:`journaled_checkpoint`, :func:`start_mount`,
  :func:`start_gateway`): a batch's commit returns once the SOS server's object-store tier
  (its bucket) holds it too, and :func:`restore_to_batch` (``from_url=``) restores from that
  bucket alone when the server and its disk are gone.
"""

from __future__ import annotations

import atexit
import errno
import functools
import json
import logging
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from .mounttable import mount_fstype

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.listener import (
        QueryIdleEvent,
        QueryProgressEvent,
        QueryStartedEvent,
        QueryTerminatedEvent,
    )

    from .gateway.client import GatewayClient
    from .gateway.process import GatewayProcess
    from .mount.process import MountProcess

log = logging.getLogger(__name__)

#: control file on the mount: a JSON document written there becomes a MARKER record
MARKER_CONTROL = os.path.join(".sos", "marker")
#: read-only control file on the mount: the mounted namespace's name and a newline
NAMESPACE_CONTROL = os.path.join(".sos", "namespace")
#: file system type of an SOS mount in /proc/self/mountinfo (fsname/subtype sos)
SOS_FSTYPE = "fuse.sos"
MARKER_LABEL = "spark.batch"  # = sos_journal.format.layout.BATCH_LABEL (this module imports no sos package)
DEFAULT_CHECKPOINT = "checkpoint"

#: Hadoop settings that make Spark write local (file://) checkpoints without the ``.crc``
#: sidecar files: half the files and half the renames, so half the journal barriers per
#: batch. Spark resumes from checkpoints without ``.crc`` files (restores have none).
#: Give them as ``spark.hadoop.<key>`` when building the session (they apply to every
#: file:// path of the session).
NO_CRC_CONF = {
    "fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
    "fs.AbstractFileSystem.file.impl": "org.apache.hadoop.fs.local.RawLocalFs",
}

_ListenerBase: type
try:  # pyspark is an optional extra; the helpers that do not need it work without it
    from pyspark.sql.streaming import StreamingQueryListener

    _ListenerBase = StreamingQueryListener
except ImportError:  # pragma: no cover - exercised only without the spark extra
    _ListenerBase = object


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
    # needs sos_client: the Spark job ships spark.py without it (docs/DEPLOY.md)
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


def start_gateway(
    namespace: str,
    *,
    server: str,
    key: str,
    cache_dir: str,
    listen: str = "127.0.0.1:0",
    sync: bool = True,
    durability: str = "server",
    tier_patience: float | None = None,
    timeout: float = 180.0,
    log_path: str | None = None,
    extra_args: Sequence[str] = (),
) -> GatewayProcess:
    """Start ``sos gateway`` for ``namespace`` and wait until it serves; ``.url`` is its
    ``http(s)://HOST:PORT`` (what :func:`gateway_checkpoint` takes), ``.stop()`` stops it.

    ``durability``/``tier_patience``: as :func:`start_mount`'s (``--durability tier``: every
    RENAME, DELETE and file body replies once the server's bucket holds it). ``extra_args``:
    more ``sos gateway`` options (``--tls-cert``, ``--advertise``, ...). The one place that
    knows the :class:`spark_plugin.gateway.process.GatewayProcess` API for the helpers.
    """
    # needs sos_client: the Spark job ships spark.py without it (docs/DEPLOY.md)
    from spark_plugin.gateway.process import GatewayProcess  # noqa: PLC0415

    gateway = GatewayProcess(
        namespace,
        cache_dir,
        server,
        str(key),
        listen=listen,
        sync=sync,
        log_path=log_path,
        extra_args=list(extra_args),
        start_timeout=timeout,
        durability=durability,
        tier_patience=tier_patience,
    )
    gateway.start()
    return gateway


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


def marker_payload(checkpoint_relpath: str, query_id: object, batch_id: int) -> bytes:
    """The MARKER payload for a committed batch (names the query and batch in the journal)."""
    return json.dumps(
        {"checkpoint": checkpoint_relpath, "query_id": str(query_id), "batch_id": int(batch_id)}, sort_keys=True
    ).encode()


def write_marker(mountpoint: str, checkpoint_relpath: str, query_id: object, batch_id: int) -> bool:
    """Write a ``spark.batch`` marker through the mount's control file.

    Returns False (and writes nothing) when the mount offers no control file.
    """
    control = os.path.join(mountpoint, MARKER_CONTROL)
    if not os.path.exists(control):
        return False
    doc = {"label": MARKER_LABEL, "payload": json.loads(marker_payload(checkpoint_relpath, query_id, batch_id))}
    data = json.dumps(doc, sort_keys=True).encode()
    fd = os.open(control, os.O_WRONLY)
    try:
        os.write(fd, data)
        os.fsync(fd)  # the mount makes the marker durable before fsync returns (sync mode)
    finally:
        os.close(fd)
    return True


class _BatchMarkerListener(_ListenerBase):
    """What both marker listeners share: after each progress event of the query (or of
    ``query_name`` only), if ``commits/N`` exists (:meth:`_committed`), write the batch's
    MARKER (:meth:`_write_marker`) and note N in ``written``; a failure goes to ``errors``
    (and :meth:`_failed`), never to the query. Subclasses set ``relpath`` and say where
    the checkpoint lives (a mount or a gateway)."""

    def __init__(self, *, query_name: str | None) -> None:
        super().__init__()
        self.query_name = query_name
        self.written: list[int] = []
        self.errors: list[str] = []

    def _committed(self, batch_id: int) -> bool:
        raise NotImplementedError

    def _write_marker(self, query_id: object, batch_id: int) -> bool:
        """Write the marker; False when it could not be written (and that is no error)."""
        raise NotImplementedError

    def _failed(self, exc: BaseException) -> None:
        """Say that a marker failed (it is already in ``errors``)."""

    def onQueryStarted(self, event: QueryStartedEvent) -> None:
        pass

    def onQueryProgress(self, event: QueryProgressEvent) -> None:
        try:
            progress = event.progress
            if self.query_name is not None and progress.name != self.query_name:
                return
            batch_id = int(progress.batchId)
            if self._committed(batch_id) and self._write_marker(progress.id, batch_id):
                self.written.append(batch_id)
        except Exception as exc:  # noqa: BLE001 - a listener must never break the query
            self.errors.append(repr(exc))
            self._failed(exc)

    def onQueryIdle(self, event: QueryIdleEvent) -> None:
        pass

    def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
        pass


class MarkerListener(_BatchMarkerListener):
    """Writes a MARKER ``spark.batch`` record after each committed micro-batch.

    ``checkpoint``: the query's checkpointLocation on a mount (a :class:`CheckpointLocation`
    from :func:`journaled_checkpoint`, or a path with ``mountpoint=`` given). Spark calls
    ``onQueryProgress`` after ``commits/N`` exists; the listener checks that file before
    writing, so a marker never names an uncommitted batch. ``query_name`` restricts it to
    one query when the session runs several.
    """

    def __init__(self, checkpoint: str, *, mountpoint: str | None = None, query_name: str | None = None) -> None:
        super().__init__(query_name=query_name)
        mountpoint = mountpoint or getattr(checkpoint, "mountpoint", "")
        if not mountpoint:
            raise ValueError("MarkerListener needs the mount point of the checkpoint")
        self.checkpoint = os.path.abspath(str(checkpoint))
        self.mountpoint = os.path.abspath(mountpoint)
        rel = os.path.relpath(self.checkpoint, self.mountpoint)
        if rel.startswith(".."):
            raise ValueError(f"checkpoint {checkpoint} is not under {mountpoint}")
        self.relpath = "" if rel == "." else rel
        self._missing_control_logged = False

    def _committed(self, batch_id: int) -> bool:
        return os.path.exists(os.path.join(self.checkpoint, "commits", str(batch_id)))

    def _write_marker(self, query_id: object, batch_id: int) -> bool:
        if write_marker(self.mountpoint, self.relpath, query_id, batch_id):
            return True
        if not self._missing_control_logged:
            self._missing_control_logged = True
            log.warning("mount %s has no %s: batch markers are not written", self.mountpoint, MARKER_CONTROL)
        return False

    def _failed(self, exc: BaseException) -> None:
        log.exception("writing the batch marker failed")


def sos_command() -> list[str]:
    """argv prefix that runs the ``sos`` command with this interpreter."""
    return [sys.executable, "-c", "import sys; from sos_client.cli import main; sys.exit(main())"]


def restore_to_batch(
    namespace: str,
    target: str | os.PathLike[str],
    checkpoint: str,
    batch_id: int,
    *,
    server: str | None = None,
    key: str | None = None,
    from_url: str | None = None,
    force: bool = False,
    timeout: float = 900,
    tls_ca: str | None = None,
    tls: bool = False,
) -> str:
    """Rebuild ``namespace`` into ``target`` as it was when batch ``batch_id`` committed.

    ``checkpoint`` is the checkpoint's path inside the namespace (``location.relpath``).
    Runs ``sos restore NAMESPACE TARGET --batch CHECKPOINT:N`` (it stops right after the
    record that made ``CHECKPOINT/commits/N`` exist) against the server (``server`` and
    ``key``), or with ``from_url`` (``s3://bucket/prefix``, ``file:///dir``: the server's
    ``--tier``) from the bucket alone, no server needed (``sos restore --from URL``; the
    store's credentials and endpoint come from the environment, as boto3 reads them).
    Returns the restored checkpoint directory, ready to be copied or mounted for the query
    to resume from. ``tls_ca``: the CA file that verifies a TLS server (``--tls-ca``;
    ``$SOS_TLS_CA`` when not given), ``tls=True``: TLS trusting the system CAs. Raises
    RuntimeError with sos's one-line message and exit code (4: no
    journal in the namespace, 1: batch N not in the journal, the target not empty or the
    bucket unreachable, 3: corrupt or missing data).
    """
    rel = str(getattr(checkpoint, "relpath", checkpoint)).strip("/")
    if from_url is not None:
        if server is not None or key is not None:
            raise ValueError("restore_to_batch: from_url reads the bucket alone: give it without server= and key=")
        source = ["--from", str(from_url)]
        # neither the server nor a key plays a part (sos refuses --key-file with --from)
        env = {k: v for k, v in os.environ.items() if k not in ("SOS_KEY", "SOS_KEY_FILE")}
    else:
        if not server or key is None:
            raise ValueError("restore_to_batch: server= and key= are needed (or from_url=)")
        source = ["--server", server]
        env = dict(os.environ, SOS_KEY=str(key))  # the key stays off the command line
    cmd = [*sos_command(), "restore", "-q", *source, namespace, str(target), "--batch", f"{rel}:{int(batch_id)}"]
    if force:
        cmd.append("--force")
    if from_url is None and tls_ca:
        cmd += ["--tls-ca", os.fspath(tls_ca)]
    elif from_url is None and tls:
        cmd.append("--tls")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"sos restore failed ({proc.returncode}): {proc.stderr.strip()}")
    return os.path.join(str(target), rel)


# ---------------------------------------------------------------------------
# Through the gateway (`sos gateway`): webhdfs:// checkpoints
# ---------------------------------------------------------------------------

#: Hadoop's retry policy for gateway requests that fail without an answer (connection
#: refused or reset while the gateway restarts): "sleep ms, retries" pairs, so about 2 s
#: of quick retries, then 20 s of slower ones. Refusals (RemoteException) are not retried.
GATEWAY_RETRY_SPEC = "200,10,2000,10"
#: Spark's redaction pattern plus "credential", so the key in
#: spark.hadoop.dfs.webhdfs.oauth2.credential is hidden in the UI and event logs
GATEWAY_REDACTION_REGEX = "(?i)secret|password|token|access[.]key|credential"
#: the Builder config that would carry the namespace key: never set on a Builder (PySpark puts
#: every Builder config on the driver JVM's command line), only on the live session's Hadoop
#: configuration (GatewayCheckpoint.attach, or the Builder's getOrCreate() wrapped)
CREDENTIAL_CONF = "spark.hadoop.dfs.webhdfs.oauth2.credential"
#: a marker listener that cannot reach the gateway warns once, then at most this often (s)
MARKER_WARN_INTERVAL = 60.0


#: password of a truststore :func:`make_truststore` makes from a PEM file. It protects
#: nothing (a truststore holds only public certificates), but Java 17 needs the right one to
#: read a PKCS12 store's certificates: without it, "the trustAnchors parameter must be
#: non-empty"
TRUSTSTORE_PASSWORD = "changeit"
_PEM_CERT = ("-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----")


def keytool() -> str:
    """The JDK's ``keytool`` ($JAVA_HOME/bin first, then $PATH)."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "keytool"), os.X_OK):
        return os.path.join(home, "bin", "keytool")
    found = shutil.which("keytool")
    if not found:
        raise FileNotFoundError(
            "keytool (of a Java runtime) is needed to turn a PEM CA file into the "
            "PKCS12 truststore the Spark JVMs read: set JAVA_HOME, or pass "
            "truststore= a PKCS12 file made once with keytool -importcert"
        )
    return found


def pem_certificates(text: str) -> list[str]:
    """The PEM certificate blocks of ``text`` (a CA file, or ``keytool -list -rfc``'s output)."""
    begin, end = _PEM_CERT
    certs, at = [], 0
    while (i := text.find(begin, at)) >= 0:
        j = text.find(end, i)
        if j < 0:
            break
        certs.append(text[i : j + len(end)] + "\n")
        at = j + len(end)
    return certs


def _run_keytool(tool: str, store: str, password: str, *command: str) -> subprocess.CompletedProcess[str]:
    """``keytool COMMAND... -keystore STORE -storetype PKCS12 -storepass PASSWORD``, its
    output captured (the caller reads the return code)."""
    return subprocess.run(
        [tool, *command, "-keystore", store, "-storetype", "PKCS12", "-storepass", password],
        capture_output=True,
        text=True,
        timeout=120,
    )


def make_truststore(
    cafile: str | os.PathLike[str], path: str | os.PathLike[str] | None = None, *, password: str = TRUSTSTORE_PASSWORD
) -> str:
    """A PKCS12 truststore holding every certificate of the PEM file ``cafile`` (keytool
    -importcert, one alias per certificate); ``path`` default: a new file in a private
    temporary directory. Returns its path."""
    with open(cafile, encoding="ascii", errors="replace") as f:
        certs = pem_certificates(f.read())
    if not certs:
        raise ValueError(f"{cafile} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    work = tempfile.mkdtemp(prefix="sos-trust-")
    store = os.fspath(path) if path is not None else os.path.join(work, "truststore.p12")
    tool = keytool()
    for n, cert in enumerate(certs):
        one = os.path.join(work, f"ca-{n}.pem")
        with open(one, "w", encoding="ascii") as f:
            f.write(cert)
        proc = _run_keytool(tool, store, password, "-importcert", "-noprompt", "-alias", f"sos-ca-{n}", "-file", one)
        if proc.returncode != 0:
            raise RuntimeError(f"keytool -importcert of {cafile} failed: {(proc.stderr or proc.stdout).strip()}")
    return store


def truststore_certificates(truststore: str | os.PathLike[str], password: str) -> str:
    """The certificates of a PKCS12 truststore as PEM text (``keytool -list -rfc``): what
    Python's ssl module can load (``cadata=``)."""
    proc = _run_keytool(keytool(), os.fspath(truststore), password, "-list", "-rfc")
    certs = pem_certificates(proc.stdout)
    if proc.returncode != 0 or not certs:
        raise ValueError(
            f"cannot read the certificates of truststore {truststore} (is "
            f"truststore_password= right?): {(proc.stderr or proc.stdout).strip()}"
        )
    return "".join(certs)


def java_trust_options(truststore: str | os.PathLike[str], password: str) -> str:
    """The JVM options that make every HTTPS client of a JVM (Hadoop's WebHdfsFileSystem, its
    OAuth2 token fetch) trust the certificates of a PKCS12 truststore."""
    return " ".join(
        shlex.quote(o)
        for o in (
            f"-Djavax.net.ssl.trustStore={os.path.abspath(os.fspath(truststore))}",
            "-Djavax.net.ssl.trustStoreType=PKCS12",
            f"-Djavax.net.ssl.trustStorePassword={password}",
        )
    )


class GatewayTrust:
    """Trust in a gateway's TLS certificate, for both sides of a Spark application: the JVMs
    (``.java_options``: javax.net.ssl.trustStore, trustStoreType=PKCS12, trustStorePassword,
    for spark.driver.extraJavaOptions and spark.executor.extraJavaOptions) and Python (the
    marker listener's ``.context``).

    ``cafile``: a PEM file of the gateway's certificate or its CA (what ``--tls-ca`` takes);
    without ``truststore`` a PKCS12 truststore is made from it on this machine
    (:func:`make_truststore`, keytool), which the executors of a cluster find only if they
    run here or see the same path: give ``truststore=`` a file at the same path on every
    node for them (e.g. baked into the image or mounted from a Secret).
    ``truststore`` + ``truststore_password``: a PKCS12 truststore; without ``cafile`` its
    certificates are read back for Python (``keytool -list -rfc``)."""

    def __init__(
        self,
        *,
        cafile: str | os.PathLike[str] | None = None,
        truststore: str | os.PathLike[str] | None = None,
        truststore_password: str | None = None,
    ) -> None:
        if cafile is None and truststore is None:
            raise ValueError("GatewayTrust needs cafile= (PEM) or truststore= (PKCS12)")
        if truststore is not None and truststore_password is None:
            raise ValueError(
                "truststore= needs truststore_password=: Java 17 cannot read the "
                'certificates of a PKCS12 truststore without it ("the trustAnchors '
                'parameter must be non-empty")'
            )
        self.password = truststore_password if truststore_password is not None else TRUSTSTORE_PASSWORD
        self.truststore = (
            os.path.abspath(os.fspath(truststore))
            if truststore is not None
            else make_truststore(cast("str", cafile), password=self.password)
        )
        if cafile is not None:
            self.context = ssl.create_default_context(cafile=os.fspath(cafile))
        else:
            self.context = ssl.create_default_context(cadata=truststore_certificates(self.truststore, self.password))
        self.java_options = java_trust_options(self.truststore, self.password)


def _with_java_options(current: str | None, options: str) -> str:
    return f"{current} {options}" if current and options not in current else (current or options)


#: Hadoop's HA client (a ``webhdfs://<nameservice>`` over a gateway pair) uses these instead
#: of the retry policy above: a request that finds a gateway unreachable or a standby
#: (StandbyException) goes to the other one; 20 attempts (the default is 10), the sleeps
#: between them from 0.5 s doubling up to 5 s (jittered; the default cap is 15 s), so the
#: client outlasts a promotion (the standby's --lease, 10 s by default) with room to spare
GATEWAY_FAILOVER = {
    "dfs.http.client.retry.max.attempts": "20",
    "dfs.http.client.failover.sleep.base.millis": "500",
    "dfs.http.client.failover.sleep.max.millis": "5000",
}
#: what makes Hadoop's client treat a nameservice as HA (it only checks that it is set)
FAILOVER_PROXY_PROVIDER = "org.apache.hadoop.hdfs.server.namenode.ha.ConfiguredFailoverProxyProvider"


def gateway_urls(url: str | Sequence[str]) -> list[str]:
    """One gateway's ``http(s)://HOST:PORT``, or a pair's (a sequence, or comma-separated)."""
    urls = url.split(",") if isinstance(url, str) else list(url)
    out = [u.strip().rstrip("/") for u in urls if u.strip()]
    if not out:
        raise ValueError("no gateway url")
    if len({urllib.parse.urlsplit(u).scheme for u in out}) > 1:
        raise ValueError(f"gateways of one nameservice all speak http or all https: {out}")
    return out


def nameservice_for(namespace: str) -> str:
    """The default nameservice (the host of ``webhdfs://<nameservice>/``) of a namespace."""
    return "sos-" + (re.sub(r"[^a-z0-9-]+", "-", namespace.lower()).strip("-") or "ns")


def nameservice_conf(urls: Sequence[str], nameservice: str) -> dict[str, str]:
    """The plain Hadoop settings of a nameservice over gateways (docs/SPARK.md): the logical
    URI ``webhdfs://<nameservice>/`` then reaches whichever of them is active."""
    urls = gateway_urls(urls)
    https = urllib.parse.urlsplit(urls[0]).scheme == "https"
    ids = [f"gw{i + 1}" for i in range(len(urls))]
    conf = {
        "dfs.nameservices": nameservice,
        f"dfs.ha.namenodes.{nameservice}": ",".join(ids),
        f"dfs.client.failover.proxy.provider.{nameservice}": FAILOVER_PROXY_PROVIDER,
    }
    for gid, u in zip(ids, urls, strict=True):
        parsed = urllib.parse.urlsplit(u)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"gateway url must be http(s)://HOST:PORT, not {u!r}")
        kind = "https-address" if https else "http-address"
        conf[f"dfs.namenode.{kind}.{nameservice}.{gid}"] = parsed.netloc
    return conf | GATEWAY_FAILOVER


#: the gateway's Hadoop FileSystem (spark_plugin/jvm/src, built by scripts/build-jar): a
#: WebHdfsFileSystem whose output stream keeps a copy of the file's bytes and resends them when
#: the gateway dies (or fails over) while the body is in flight (docs/SPARK.md)
RIDE_THROUGH_JAR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jvm", "sos-webhdfs-ride.jar")
RIDE_THROUGH_CLASS = "sos.hadoop.RideThroughWebHdfsFileSystem"


def ride_through_jar() -> str | None:
    """The path of the shipped ``sos-webhdfs-ride.jar``, None when it was not built."""
    return RIDE_THROUGH_JAR if os.path.isfile(RIDE_THROUGH_JAR) else None


def ride_through_conf(authorities: Sequence[str]) -> dict[str, str]:
    """Hadoop settings (keys without ``spark.hadoop.``) that make ``webhdfs://`` and
    ``swebhdfs://`` paths of ``authorities`` (``HOST:PORT`` of a gateway, or a nameservice)
    resend a file body lost with its gateway; other authorities of those schemes keep
    WebHdfsFileSystem's behaviour. The jar (:func:`ride_through_jar`) must be on the JVMs'
    classpath (``spark.jars``: :func:`gateway_checkpoint` adds it)."""
    return {
        "fs.webhdfs.impl": RIDE_THROUGH_CLASS,
        "fs.swebhdfs.impl": "sos.hadoop.RideThroughSWebHdfsFileSystem",
        # Spark's checkpoint file manager writes through FileContext, whose webhdfs is its own
        "fs.AbstractFileSystem.webhdfs.impl": "sos.hadoop.RideThroughWebHdfs",
        "fs.AbstractFileSystem.swebhdfs.impl": "sos.hadoop.RideThroughWebHdfs$Secure",
        "sos.webhdfs.ride.authorities": ",".join(authorities),
        # the resends outlast a restart or a promotion; each waits in Hadoop's own policy too
        "sos.webhdfs.ride.attempts": "10",
    }


def _with_jar(current: str | None, jar: str) -> str:
    jars = [j for j in (current or "").split(",") if j.strip()]
    return ",".join([*jars, jar]) if jar not in jars else ",".join(jars)


def gateway_conf(
    url: str | Sequence[str],
    namespace: str,
    key: str,
    *,
    retry_spec: str = GATEWAY_RETRY_SPEC,
    nameservice: str | None = None,
    token_url: str | None = None,
    ride_through: bool = False,
) -> dict[str, str]:
    """Hadoop settings (keys without ``spark.hadoop.``) for ``webhdfs://`` paths served by
    the gateway at ``url`` (``http(s)://HOST:PORT``): OAuth2 client credentials against its
    ``/oauth2/token`` (client id: the namespace, credential: ``key``) and the HTTP retry
    policy that rides through a gateway restart.

    Several URLs (a gateway pair: an active ``sos gateway --lease`` and a ``--standby``):
    the nameservice settings of :func:`nameservice_conf` (``nameservice``, default
    :func:`nameservice_for`) and Hadoop's failover settings instead of the retry policy. The
    token endpoint is one URL (Hadoop's token provider knows one; every JVM fetches a token at
    its first request and before the last one expires): ``token_url`` (``http(s)://HOST:PORT``),
    best a name that resolves to every gateway's address (a headless Kubernetes Service over
    both pods, DNS with both records: Hadoop's token client tries each address in turn), which
    survives the loss of either gateway; else the **last** URL, the standby in the documented
    order (active first), so that the loss the pair exists for, the active's, leaves every JVM
    able to fetch tokens (docs/SPARK.md, "A gateway pair"). Both gateways issue tokens and
    accept each other's.

    ``ride_through``: also :func:`ride_through_conf` for these gateways (their authorities,
    or the nameservice), so a file whose body was in flight when its gateway died is resent;
    the caller puts :func:`ride_through_jar` on the classpath (:func:`gateway_checkpoint`
    does both)."""
    urls = gateway_urls(url)
    ride: dict[str, str] = {}
    if ride_through:
        names = [nameservice or nameservice_for(namespace)] if len(urls) > 1 else []
        ride = ride_through_conf(names + [urllib.parse.urlsplit(u).netloc for u in urls])
    conf = ride | {
        "dfs.webhdfs.oauth2.enabled": "true",
        "dfs.webhdfs.oauth2.access.token.provider": "org.apache.hadoop.hdfs.web.oauth2.ConfCredentialBasedAccessTokenProvider",
        "dfs.webhdfs.oauth2.client.id": namespace,
        "dfs.webhdfs.oauth2.credential": str(key),
        "dfs.webhdfs.oauth2.refresh.url": (token_url or urls[-1]).rstrip("/") + "/oauth2/token",
    }
    if len(urls) > 1:
        return conf | nameservice_conf(urls, nameservice or nameservice_for(namespace))
    return conf | {"dfs.http.client.retry.policy.enabled": "true", "dfs.http.client.retry.policy.spec": retry_spec}


def webhdfs_url(url: str | Sequence[str], path: str = "", *, nameservice: str | None = None) -> str:
    """``http://H:P`` -> ``webhdfs://H:P/path`` (``https`` -> ``swebhdfs``); several URLs (a
    gateway pair) -> ``webhdfs://<nameservice>/path`` (``nameservice`` required then)."""
    urls = gateway_urls(url)
    parsed = urllib.parse.urlsplit(urls[0])
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"gateway url must be http(s)://HOST:PORT, not {urls[0]!r}")
    scheme = "swebhdfs" if parsed.scheme == "https" else "webhdfs"
    if len(urls) > 1:
        if not nameservice:
            raise ValueError("several gateways: give the nameservice")
        return f"{scheme}://{nameservice}/{path.strip('/')}"
    return f"{scheme}://{parsed.netloc}/{path.strip('/')}"


def _driver_has_ride_through(spark: SparkSession) -> bool:
    jvm = spark.sparkContext._jvm
    try:
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()  # type: ignore[union-attr]
        jvm.java.lang.Class.forName(RIDE_THROUGH_CLASS, False, loader)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001  # py4j's error for ClassNotFoundException
        return False
    return True


class GatewayCheckpoint(str):
    """A ``webhdfs://`` checkpointLocation (a plain ``str`` for Spark) on a gateway.

    ``.relpath``: the checkpoint's path inside the namespace (what ``sos restore --batch
    RELPATH:N`` takes); ``.namespace``; ``.gateway_url``; ``.conf``: the session settings
    (``spark.hadoop.*`` keys) it needs, the credential (:data:`CREDENTIAL_CONF`) included:
    given to spark-submit, every one but the credential may be a ``--conf``; the credential
    goes in a ``--properties-file`` (or ``spark-defaults.conf``) that only its user can
    read, never a ``--conf``, which every local user reads on the JVM's command line
    (docs/SPARK.md); ``.listener``: the registered
    :class:`GatewayMarkerListener` (None before :meth:`attach`); ``.trust``: the
    :class:`GatewayTrust` of an https gateway given ``cafile=``/``truststore=`` (None: the
    JVM's and Python's default trust)."""

    relpath: str = ""
    namespace: str = ""
    gateway_url: str = ""
    conf: dict[str, str]
    listener: GatewayMarkerListener | None = None
    trust: GatewayTrust | None = None
    _key: str

    def __new__(
        cls,
        location: str,
        *,
        relpath: str,
        namespace: str,
        gateway_url: str,
        conf: dict[str, str],
        key: str,
        trust: GatewayTrust | None = None,
    ) -> GatewayCheckpoint:
        self = super().__new__(cls, location)
        self.relpath = relpath
        self.namespace = namespace
        self.gateway_url = gateway_url
        self.conf = conf
        self.trust = trust
        self._key = key
        return self

    def attach(self, spark: SparkSession, *, listener: bool = True, query_name: str | None = None) -> GatewayCheckpoint:
        """Apply the Hadoop settings, the credential included, to a live session's Hadoop
        configuration and register the marker listener (``gateway_checkpoint`` calls it when
        given a session; the ``getOrCreate()`` of a Builder given to it applies the settings,
        so after it ``attach`` is needed for the batch markers only). The driver's tasks and
        every executor's get the settings with each task (Spark ships the session's Hadoop
        configuration to them), never on a command line."""
        self._set_hadoop_conf(spark)
        if self.trust is not None:
            self._trust_driver(spark)
        if listener and self.listener is None:
            self.listener = GatewayMarkerListener(self, query_name=query_name)
            spark.streams.addListener(self.listener)
        return self

    def _set_hadoop_conf(self, spark: SparkSession) -> None:
        """Every setting of ``.conf`` (the credential too) on the session's Hadoop
        configuration, which the session's jobs copy (``sessionState.newHadoopConf()``)."""
        hconf = spark.sparkContext._jsc.hadoopConfiguration()
        conf = self.conf
        if "spark.hadoop.fs.webhdfs.impl" in conf and not _driver_has_ride_through(spark):
            log.warning(
                "this session's driver has no %s (give gateway_checkpoint the SparkSession.Builder): "
                "a gateway that dies while a file's body is in flight stops the query",
                RIDE_THROUGH_JAR,
            )
            ride = ride_through_conf([])
            conf = {k: v for k, v in conf.items() if k.removeprefix("spark.hadoop.") not in ride}
        for k, v in conf.items():
            hconf.set(k.removeprefix("spark.hadoop."), v)

    def _trust_driver(self, spark: SparkSession) -> None:
        """The driver JVM's trust, before its first https request (it is read once);
        executors started elsewhere need the options at launch: pass the Builder."""
        trust = cast("GatewayTrust", self.trust)
        system = spark.sparkContext._jvm.java.lang.System  # type: ignore[union-attr]
        system.setProperty("javax.net.ssl.trustStore", trust.truststore)
        system.setProperty("javax.net.ssl.trustStoreType", "PKCS12")
        system.setProperty("javax.net.ssl.trustStorePassword", trust.password)
        if not str(spark.sparkContext.master).startswith("local"):
            log.warning(
                "gateway_checkpoint on a live session: the driver trusts %s now, but "
                "executors on other nodes need spark.executor.extraJavaOptions %s when "
                "they start: give gateway_checkpoint the SparkSession.Builder",
                trust.truststore,
                trust.java_options,
            )

    def client(self) -> GatewayClient:
        """A :class:`~spark_plugin.gateway.client.GatewayClient` of this gateway."""
        # the mount's Spark job ships spark.py without it (deploy/k8s/spark-driver.yaml)
        from spark_plugin.gateway.client import GatewayClient  # noqa: PLC0415

        return GatewayClient(
            self.gateway_url, self.namespace, self._key, context=self.trust.context if self.trust is not None else None
        )


def _ride_jar() -> str | None:
    jar = ride_through_jar()
    if jar is None:
        log.warning(
            "%s is not built (scripts/build-jar): a gateway that dies while a file's body is in flight stops the query",
            RIDE_THROUGH_JAR,
        )
    return jar


def _configure_builder(
    builder: SparkSession.Builder, loc: GatewayCheckpoint, jar: str | None, trust: GatewayTrust | None
) -> None:
    """Every setting but the credential as a Builder config (PySpark starts the driver JVM
    with each one as a ``--conf`` argument, which every local user reads in ``ps``); the
    credential goes on the session's Hadoop configuration when the Builder's
    ``getOrCreate()`` returns (:func:`_credential_after_create`)."""
    for k, v in loc.conf.items():
        if k != CREDENTIAL_CONF:
            builder.config(k, v)
    builder.config("spark.redaction.regex", GATEWAY_REDACTION_REGEX)
    options: dict[str, str] = getattr(builder, "_options", {})
    if jar is not None:
        builder.config("spark.jars", _with_jar(options.get("spark.jars"), jar))
    if trust is not None:
        for name in ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"):
            builder.config(name, _with_java_options(options.get(name), trust.java_options))
    _credential_after_create(builder, loc)


def _credential_after_create(builder: SparkSession.Builder, loc: GatewayCheckpoint) -> None:
    """Wrap this Builder's ``getOrCreate()``: the session it returns gets ``loc``'s settings,
    the credential included, on its Hadoop configuration, so a job that never calls
    ``loc.attach(spark)`` still authenticates (several locations on one Builder: each wraps
    the last)."""
    create = getattr(builder, "getOrCreate", None)
    if create is None:  # not a PySpark Builder (a stand-in that only takes config())
        return

    @functools.wraps(create)
    def get_or_create() -> SparkSession:
        spark = create()
        if getattr(spark, "_jsc", None) is None:  # Spark Connect: no JVM of this process
            log.warning(
                "a Spark Connect session: the server's Spark configuration needs %s (the "
                "client cannot set a Hadoop configuration)",
                CREDENTIAL_CONF,
            )
        else:
            loc._set_hadoop_conf(spark)
        return spark

    setattr(builder, "getOrCreate", get_or_create)  # noqa: B010  # an instance attribute


def gateway_checkpoint(
    spark_or_builder: SparkSession | SparkSession.Builder | None,
    url: str | Sequence[str],
    namespace: str,
    key: str,
    checkpoint: str = DEFAULT_CHECKPOINT,
    *,
    listener: bool = True,
    retry_spec: str = GATEWAY_RETRY_SPEC,
    cafile: str | os.PathLike[str] | None = None,
    truststore: str | os.PathLike[str] | None = None,
    truststore_password: str | None = None,
    nameservice: str | None = None,
    token_url: str | None = None,
    ride_through: bool = True,
) -> GatewayCheckpoint:
    """The checkpointLocation of ``checkpoint`` in ``namespace`` through the gateway at
    ``url`` (``http(s)://HOST:PORT`` of ``sos gateway NAMESPACE``), with ``key`` a key of
    the namespace (its role decides what the session may do).

    ``url`` may name several gateways (a sequence, or comma-separated: an active ``sos
    gateway --lease`` and its ``--standby``): the location is then
    ``webhdfs://<nameservice>/CHECKPOINT`` (``nameservice``, default ``sos-<namespace>``)
    with Hadoop's nameservice settings (:func:`gateway_conf`, ``token_url``), so the
    session follows whichever is active; the marker listener does too.

    ``spark_or_builder``: a ``SparkSession.Builder`` (``spark.hadoop.*`` configs but the
    credential, which its ``getOrCreate()`` sets on the session: never on a command line;
    ``location.attach(spark)`` after it for the batch markers), a live
    ``SparkSession`` (settings applied to its Hadoop configuration before any webhdfs
    path of that gateway is used, and a :class:`GatewayMarkerListener` registered unless
    ``listener=False``), or None (just compute; ``.conf`` holds the settings).

    An ``https://`` gateway whose certificate no default trust holds: ``cafile=`` (PEM: its
    certificate or CA, what ``--tls-ca`` takes) and/or ``truststore=`` +
    ``truststore_password=`` (PKCS12) set both sides (:class:`GatewayTrust`): the JVMs'
    ``-Djavax.net.ssl.trustStore``/``trustStoreType=PKCS12``/``trustStorePassword`` (added to
    spark.driver.extraJavaOptions and spark.executor.extraJavaOptions of a Builder; on a
    live session the driver's system properties) and the marker listener's HTTPS context.

    ``ride_through`` (default): the shipped ``sos-webhdfs-ride.jar`` goes on ``spark.jars``
    (a Builder) and ``webhdfs://`` paths of these gateways use its FileSystem
    (:func:`ride_through_conf`), so a query does not stop when its gateway dies or fails over
    while a file's body is in flight (docs/SPARK.md). A live session can only use it when
    its driver already has the jar (else a warning: the body is not resent).
    """
    relpath = checkpoint.strip("/")
    urls = gateway_urls(url)
    nameservice = (nameservice or nameservice_for(namespace)) if len(urls) > 1 else None
    jar = _ride_jar() if ride_through else None
    conf = {
        f"spark.hadoop.{k}": v
        for k, v in gateway_conf(
            urls,
            namespace,
            key,
            retry_spec=retry_spec,
            nameservice=nameservice,
            token_url=token_url,
            ride_through=jar is not None,
        ).items()
    }
    trust = None
    if cafile is not None or truststore is not None:
        trust = GatewayTrust(cafile=cafile, truststore=truststore, truststore_password=truststore_password)
    loc = GatewayCheckpoint(
        webhdfs_url(urls, relpath, nameservice=nameservice),
        relpath=relpath,
        namespace=namespace,
        gateway_url=",".join(urls),
        conf=conf,
        key=str(key),
        trust=trust,
    )
    if spark_or_builder is None:
        return loc
    if hasattr(spark_or_builder, "streams"):  # a live session
        return loc.attach(cast("SparkSession", spark_or_builder), listener=listener)
    _configure_builder(spark_or_builder, loc, jar, trust)
    return loc


class GatewayMarkerListener(_BatchMarkerListener):
    """:class:`MarkerListener` for a checkpoint on the gateway: after each committed batch
    (``commits/N`` exists on the gateway) it appends the same ``spark.batch`` MARKER record
    through ``POST /sos/v1/marker``, durable when the gateway answers (sync mode)."""

    def __init__(
        self, checkpoint: GatewayCheckpoint, *, query_name: str | None = None, client: GatewayClient | None = None
    ) -> None:
        super().__init__(query_name=query_name)
        self.relpath = checkpoint.relpath
        self._client = client or checkpoint.client()
        self._warned_at: float | None = None
        self._unreported = 0

    def _committed(self, batch_id: int) -> bool:
        commit = f"{self.relpath}/commits/{batch_id}" if self.relpath else f"commits/{batch_id}"
        return self._client.exists(commit)

    def _write_marker(self, query_id: object, batch_id: int) -> bool:
        self._client.marker(MARKER_LABEL, marker_payload(self.relpath, query_id, batch_id))
        return True

    def _failed(self, exc: BaseException) -> None:
        self._warn(exc)

    def _warn(self, exc: BaseException) -> None:
        """One warning line, then at most one per MARKER_WARN_INTERVAL (with the count of
        failures since), never a traceback per batch: the markers only label batches, and
        restoring to a batch does not need them."""
        now = time.monotonic()
        self._unreported += 1
        if self._warned_at is not None and now - self._warned_at < MARKER_WARN_INTERVAL:
            return
        since = f" ({self._unreported} failures since the last warning)" if self._warned_at is not None else ""
        log.warning(
            "batch markers are not being written through the gateway %s: %s%s; the query "
            "goes on (sos restore --batch works without markers; they only label batches)",
            self._client.url,
            exc,
            since,
        )
        self._warned_at = now
        self._unreported = 0
