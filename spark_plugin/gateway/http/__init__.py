"""The gateway's HTTP side: ``connection`` (h11 under trio: keep-alive, bounded heads and
bodies, deadlines, connection slots; ``Reply``/``Drop``), ``server`` (``Gateway``: the accept
loop, routing, per-operation statistics, the gate a pair puts in front), ``operations`` (the
WebHDFS operations as one table from (method, op) to a handler; bodies streamed into the
journal), ``auth`` (OAuth2 client-credentials tokens and the bearer check) and ``metrics``
(the ``--metrics`` endpoint).

May import: ``spark_plugin.gateway.webhdfs``, sos_journal, sos_client, sos_wire.
"""
