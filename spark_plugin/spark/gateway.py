"""A checkpoint through ``sos gateway`` (a cluster of any size, no FUSE):
:func:`gateway_checkpoint` computes a ``webhdfs://`` checkpointLocation
(:class:`GatewayCheckpoint`) and puts its Hadoop settings, trust and ride-through jar on a
``SparkSession.Builder`` or a live session, the credential never on a command line;
:func:`start_gateway` starts a gateway (the one place that knows
:class:`~spark_plugin.gateway.process.GatewayProcess` for the helpers)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from .ha import gateway_urls, nameservice_for
from .hadoop import CREDENTIAL_CONF, GATEWAY_REDACTION_REGEX, GATEWAY_RETRY_SPEC, gateway_conf, webhdfs_url
from .markers import GatewayMarkerListener
from .names import DEFAULT_CHECKPOINT
from .ride import RIDE_THROUGH_CLASS, RIDE_THROUGH_JAR, ride_through_conf, ride_through_jar
from .tls import GatewayTrust

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from spark_plugin.gateway.client import GatewayClient
    from spark_plugin.gateway.process import GatewayProcess

log = logging.getLogger(__name__)


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
    # needs sos_client: the Spark job ships spark_plugin/spark/ without it (docs/DEPLOY.md)
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


def _with_java_options(current: str | None, options: str) -> str:
    return f"{current} {options}" if current and options not in current else (current or options)


def _with_jar(current: str | None, jar: str) -> str:
    jars = [j for j in (current or "").split(",") if j.strip()]
    return ",".join([*jars, jar]) if jar not in jars else ",".join(jars)


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
        # the mount's Spark job ships spark_plugin/spark/ without it (deploy/k8s/spark-driver.yaml)
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
