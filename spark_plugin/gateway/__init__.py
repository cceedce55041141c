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
