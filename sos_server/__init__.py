"""``sos-server``: the append-only object store (trio), in layers: ``listener`` (TCP/TLS accept,
connection caps) -> ``session`` (one connection: frames in, engine calls, frames out) ->
``engine`` (the append-only rules, fencing, roles, quotas, group commit, retention) ->
``storage`` (the data directory: ``stored_object``, ``recovery``, ``objfile``, ``wal``,
``durable``, ``keys``). Beside them: ``tiering`` and ``tier_bootstrap`` (the object-store
tier), ``serve`` and ``cli`` (the command), ``metrics``, ``logs``.

It knows nothing of journals or Spark: objects are byte streams that only grow.
May import: sos_tier, sos_wire. Never sos_client, sos_journal or a face.
"""
