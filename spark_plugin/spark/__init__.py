"""The Spark helpers: a journaled checkpointLocation on a mount or through a gateway, batch
markers, restore to a batch (docs/SPARK.md). Every name is importable from here, as before.

Its parts, by role: ``mount`` (``journaled_checkpoint``, ``start_mount``), ``gateway``
(``gateway_checkpoint``, ``start_gateway``), ``restore`` (``restore_to_batch``) over
``markers`` (the listeners) and ``hadoop`` (``gateway_conf``, ``webhdfs_url``) and ``tls``
(keytool, truststores) over ``ha`` (a gateway pair's nameservice) and ``ride`` (the
ride-through jar) over ``names`` (what the mount and the journal name the same way).
May import: the standard library, pyspark, ``spark_plugin.mounttable``, and in a function
body the faces' process wrappers and ``spark_plugin.gateway.client``; never a sos package:
the Spark job ships this folder alone (docs/DEPLOY.md). Names load on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spark_plugin.mounttable import mount_fstype
    from spark_plugin.spark.gateway import GatewayCheckpoint, gateway_checkpoint, start_gateway
    from spark_plugin.spark.ha import (
        FAILOVER_PROXY_PROVIDER,
        GATEWAY_FAILOVER,
        gateway_urls,
        nameservice_conf,
        nameservice_for,
    )
    from spark_plugin.spark.hadoop import (
        CREDENTIAL_CONF,
        GATEWAY_REDACTION_REGEX,
        GATEWAY_RETRY_SPEC,
        NO_CRC_CONF,
        gateway_conf,
        webhdfs_url,
    )
    from spark_plugin.spark.markers import (
        MARKER_WARN_INTERVAL,
        GatewayMarkerListener,
        MarkerListener,
        marker_payload,
        write_marker,
    )
    from spark_plugin.spark.mount import CheckpointLocation, journaled_checkpoint, mounted_namespace, start_mount
    from spark_plugin.spark.names import DEFAULT_CHECKPOINT, MARKER_CONTROL, MARKER_LABEL, NAMESPACE_CONTROL, SOS_FSTYPE
    from spark_plugin.spark.restore import restore_to_batch, sos_command
    from spark_plugin.spark.ride import RIDE_THROUGH_CLASS, RIDE_THROUGH_JAR, ride_through_conf, ride_through_jar
    from spark_plugin.spark.tls import (
        TRUSTSTORE_PASSWORD,
        GatewayTrust,
        java_trust_options,
        keytool,
        make_truststore,
        pem_certificates,
        truststore_certificates,
    )

__all__ = [
    "CREDENTIAL_CONF",
    "DEFAULT_CHECKPOINT",
    "FAILOVER_PROXY_PROVIDER",
    "GATEWAY_FAILOVER",
    "GATEWAY_REDACTION_REGEX",
    "GATEWAY_RETRY_SPEC",
    "MARKER_CONTROL",
    "MARKER_LABEL",
    "MARKER_WARN_INTERVAL",
    "NAMESPACE_CONTROL",
    "NO_CRC_CONF",
    "RIDE_THROUGH_CLASS",
    "RIDE_THROUGH_JAR",
    "SOS_FSTYPE",
    "TRUSTSTORE_PASSWORD",
    "CheckpointLocation",
    "GatewayCheckpoint",
    "GatewayMarkerListener",
    "GatewayTrust",
    "MarkerListener",
    "gateway_checkpoint",
    "gateway_conf",
    "gateway_urls",
    "java_trust_options",
    "journaled_checkpoint",
    "keytool",
    "make_truststore",
    "marker_payload",
    "mount_fstype",
    "mounted_namespace",
    "nameservice_conf",
    "nameservice_for",
    "pem_certificates",
    "restore_to_batch",
    "ride_through_conf",
    "ride_through_jar",
    "sos_command",
    "start_gateway",
    "start_mount",
    "truststore_certificates",
    "webhdfs_url",
    "write_marker",
]

#: module -> the names this package re-exports from it (sos_wire.lazy's table; that module is
#: not imported here: the Spark job has no sos package)
EXPORTS: dict[str, tuple[str, ...]] = {
    "spark_plugin.mounttable": ("mount_fstype",),
    "spark_plugin.spark.gateway": ("GatewayCheckpoint", "gateway_checkpoint", "start_gateway"),
    "spark_plugin.spark.ha": (
        "FAILOVER_PROXY_PROVIDER",
        "GATEWAY_FAILOVER",
        "gateway_urls",
        "nameservice_conf",
        "nameservice_for",
    ),
    "spark_plugin.spark.hadoop": (
        "CREDENTIAL_CONF",
        "GATEWAY_REDACTION_REGEX",
        "GATEWAY_RETRY_SPEC",
        "NO_CRC_CONF",
        "gateway_conf",
        "webhdfs_url",
    ),
    "spark_plugin.spark.markers": (
        "MARKER_WARN_INTERVAL",
        "GatewayMarkerListener",
        "MarkerListener",
        "marker_payload",
        "write_marker",
    ),
    "spark_plugin.spark.mount": ("CheckpointLocation", "journaled_checkpoint", "mounted_namespace", "start_mount"),
    "spark_plugin.spark.names": (
        "DEFAULT_CHECKPOINT",
        "MARKER_CONTROL",
        "MARKER_LABEL",
        "NAMESPACE_CONTROL",
        "SOS_FSTYPE",
    ),
    "spark_plugin.spark.restore": ("restore_to_batch", "sos_command"),
    "spark_plugin.spark.ride": ("RIDE_THROUGH_CLASS", "RIDE_THROUGH_JAR", "ride_through_conf", "ride_through_jar"),
    "spark_plugin.spark.tls": (
        "TRUSTSTORE_PASSWORD",
        "GatewayTrust",
        "java_trust_options",
        "keytool",
        "make_truststore",
        "pem_certificates",
        "truststore_certificates",
    ),
}
_WHERE = {name: module for module, names in EXPORTS.items() for name in names}


def __getattr__(name: str) -> object:
    """A re-exported name, imported from its module on first use (then kept here); else a
    submodule (``spark_plugin.spark.markers``), as ``sos_wire.lazy.lazy_exports`` does."""
    module = _WHERE.get(name)
    if module is None:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
