"""What the faces (fsspec, the mount, the gateway) share when they call the journal:
``facade`` (a journal failure translated once into the OSError a filesystem reports; the
fence latch that turns a face read-only) and ``command`` (the journal options of ``sos mount``
and ``sos gateway``, the start and end of their runs, ``FaceChild`` for a face in a child
process).

May import: everything below it in ``sos_journal``, sos_client. Never a face itself.
"""
