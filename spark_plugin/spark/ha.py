"""Hadoop's HA settings of a gateway pair: a ``webhdfs://<nameservice>/`` that reaches
whichever of an active ``sos gateway --lease`` and its ``--standby`` is active (docs/SPARK.md,
"A gateway pair")."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Sequence

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
