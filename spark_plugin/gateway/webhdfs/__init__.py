"""WebHDFS semantics over an opened namespace, with no HTTP in it: ``namespace``
(``WebHdfsNamespace``) composed of ``core`` (the cache reached through descriptors, quota
admission, the barrier), ``reads`` (FileStatus, listings, block locations, checksums, OPEN)
and ``changes`` (HDFS's rename and rename2, recursive delete, per-path leases); ``hdfs``
(HDFS's vocabulary: ``WebHdfsError``, paths, permissions, the FileStatus JSON) and
``renames`` (the memory that answers a RENAME resent after a crash).

May import: sos_journal, sos_client, sos_wire. Never the HTTP side.
"""
