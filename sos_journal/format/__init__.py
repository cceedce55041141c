"""The journal's bytes: typed records (``records``: the codec's struct fast path), their
construct definition (``record_layout``: protocol.md §2.2 in machine-readable form, checked
against the fast path byte for byte) and the names of the objects a journal is made of
(``layout``: segments, ``ready`` objects, generations, batch markers).

No I/O and no state: bytes in, records out; records in, bytes out.
May import: ``sos_journal.errors`` and sos_wire. Imported by everything else in the journal.
"""
