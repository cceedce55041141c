"""The journal writer: records spooled on local disk (``spool``), shipped in order by the
replicator thread (``replicator``: appends, seals, ``ready`` objects), reconciled with the
server after a crash on either side (``resume``: nothing missing, nothing doubled, older
epochs fenced), and the waits a barrier makes (``barrier_waits``: until the server holds the
records; ``tier_wait``: until its bucket does); ``loop_ship``: the same APPEND rounds shipped
from a trio event loop (the gateway's) instead of the thread. ``state`` is what these roles share under one
condition variable; ``writer`` is ``JournalWriter``, the public face.

May import: ``sos_journal.read`` (resume reads the server's tail), ``format``, ``store``,
``errors``, sos_client. Never the tree, the rebuild or a face.
"""
