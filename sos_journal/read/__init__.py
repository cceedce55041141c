"""Reading a journal back: the generations on the server listed and chained (``reading``),
segments read with salvage and read-ahead, every record checked; where to stop (``points``:
``--at`` times and ``--batch`` points; ``spark_log``: the record that commits a Spark batch);
``verify`` (every check, nothing written); ``bucket`` (``BucketSource``: the same reads
answered from the object-store tier's bucket alone, for ``--from URL``).

Reads only: nothing here writes a file or an object.
May import: ``sos_journal.format``, ``errors``, ``store``, sos_tier, sos_client.
"""
