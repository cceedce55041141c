"""``sos gateway``: the WebHDFS endpoint a Spark cluster's nodes write their checkpoint through
(protocol.md Part 3), one journal writer per namespace.

At this root, the command and its run: ``cli`` (the command, ``promote``), ``run`` (the active
gateway: namespace opened, served until SIGTERM, final flush), ``serving`` (the steps the
active and the standby share), ``options`` (``GatewayOptions``), ``process`` (a gateway as a
child process), ``client`` (a standard-library client for Spark jobs: token, exists, marker),
``workers`` (``--workers N``: processes that serve reads and tokens from the cache and relay
every change to the writer). ``http/``: the HTTP side (connections, routing, operations,
OAuth2 tokens, metrics); ``webhdfs/``: WebHDFS and HDFS semantics, no HTTP; ``pair/``: the
standby and the lease. May import: sos_journal, sos_client, sos_wire; never another face.
"""

from sos_wire.lazy import moved_modules

#: the gateway's modules before issue 27 put them in http/, webhdfs/ and pair/: their old paths
#: still import, each the very module of its new home (tests/project/test_moved_names.py)
MOVED = {
    "auth": "spark_plugin.gateway.http.auth",
    "hdfs": "spark_plugin.gateway.webhdfs.hdfs",
    "lease": "spark_plugin.gateway.pair.lease",
    "metrics": "spark_plugin.gateway.http.metrics",
    "operations": "spark_plugin.gateway.http.operations",
    "renames": "spark_plugin.gateway.webhdfs.renames",
    "server": "spark_plugin.gateway.http.server",
    "standby": "spark_plugin.gateway.pair.standby",
    "webhdfs_changes": "spark_plugin.gateway.webhdfs.changes",
    "webhdfs_core": "spark_plugin.gateway.webhdfs.core",
    "webhdfs_reads": "spark_plugin.gateway.webhdfs.reads",
}

__getattr__ = moved_modules(__name__, MOVED)
