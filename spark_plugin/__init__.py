"""spark_plugin: what Spark and Python users touch, the three faces of the journal and the
Spark helpers.

``fsspec/`` (the ``sos://`` filesystem), ``mount/`` (``sos mount``, FUSE) and ``gateway/``
(``sos gateway``, WebHDFS) each open a namespace through ``sos_journal`` and never import one
another; ``spark/`` (a checkpoint on a mount or through a gateway, batch markers, restore to
a batch) sits above them, ``mounttable`` (standard library only) below them. A name is
imported from the module that defines it (``spark_plugin.spark`` re-exports its own).
May import: sos_journal, sos_client, sos_wire (and sos_tier for ``--from`` reads); never
sos_server, never tools. ``spark/`` and ``mounttable`` import no sos package (the Spark job
ships them alone, docs/DEPLOY.md).
"""
