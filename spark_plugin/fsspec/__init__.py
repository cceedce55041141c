"""fsspec's ``sos://`` filesystem (entry point ``fsspec.specs``): ``filesystem`` (``SOSFileSystem``,
errors mapped to the built-in OSErrors at the edge), ``namespaces`` (one opened namespace per
server, namespace and cache directory in a process) and ``files`` (the read and write file
objects; a write is journaled as WRITE records and durable at close in sync mode).

May import: sos_journal, sos_client, sos_wire. Never another face.
"""
