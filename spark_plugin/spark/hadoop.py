"""The Hadoop settings of a checkpoint through ``sos gateway``: OAuth2 against its token
endpoint, the retry policy that rides through a restart (or, for a pair, the HA settings of
:mod:`.ha`), the ride-through FileSystem (:mod:`.ride`), the ``webhdfs://`` URL; and the
settings of a local checkpoint without ``.crc`` files (``NO_CRC_CONF``)."""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence

from .ha import gateway_urls, nameservice_conf, nameservice_for
from .ride import ride_through_conf

#: Hadoop settings that make Spark write local (file://) checkpoints without the ``.crc``
#: sidecar files: half the files and half the renames, so half the journal barriers per
#: batch. Spark resumes from checkpoints without ``.crc`` files (restores have none).
#: Give them as ``spark.hadoop.<key>`` when building the session (they apply to every
#: file:// path of the session).
NO_CRC_CONF = {
    "fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
    "fs.AbstractFileSystem.file.impl": "org.apache.hadoop.fs.local.RawLocalFs",
}

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
