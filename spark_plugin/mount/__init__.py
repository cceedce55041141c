"""``sos mount``: the FUSE mount one JVM writes its checkpoint through: ``ops`` (the pyfuse3
operations over ``JournaledTree``), ``inodes`` (the inode table and the virtual ``.sos``
entries), ``run`` (what the command runs: namespace opened, FUSE session, final flush),
``process`` (a mount as a child process), ``cli`` (the command).

May import: sos_journal, sos_client, sos_wire, ``spark_plugin.mounttable``. Never another face.
"""
