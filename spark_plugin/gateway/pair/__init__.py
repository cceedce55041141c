"""A gateway pair (protocol.md §3.6): ``lease`` (``LeaseHolder``: the active renews
``lease/<epoch>`` and serves only while it holds it; ``LeaseWatcher``) and ``standby``
(``--standby``: tails the journal into its cache, answers StandbyException, promotes itself
when the lease lapses or on ``sos gateway promote``: FENCE, tail finished, serve).

May import: ``spark_plugin.gateway.http``, ``webhdfs``, ``serving``, ``options``, ``client``,
sos_journal, sos_client, sos_wire.
"""
