"""The ride-through FileSystem: the shipped ``sos-webhdfs-ride.jar`` and the Hadoop settings
that make ``webhdfs://`` paths of a gateway use it, so a file body in flight when the gateway
dies (or fails over) is resent instead of stopping the query (docs/SPARK.md)."""

from __future__ import annotations

import os
from collections.abc import Sequence

#: the gateway's Hadoop FileSystem (spark_plugin/jvm/src, built by scripts/build-jar): a
#: WebHdfsFileSystem whose output stream keeps a copy of the file's bytes and resends them when
#: the gateway dies (or fails over) while the body is in flight (docs/SPARK.md)
RIDE_THROUGH_JAR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jvm", "sos-webhdfs-ride.jar"
)
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
