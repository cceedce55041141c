"""WebHDFS semantics over a journaled namespace, without HTTP: what `sos gateway` serves.

:class:`WebHdfsNamespace` answers the WebHDFS operations Hadoop's ``WebHdfsFileSystem``
uses (paths, JSON documents and exceptions as HDFS's NameNode and DataNode produce them)
on top of an opened namespace (:func:`sos_journal.tree.open.open_namespace`). Every
method is blocking: the HTTP layer (:mod:`spark_plugin.gateway`) runs them in worker
threads. Failures are :class:`~spark_plugin.gateway.webhdfs.hdfs.WebHdfsError` with the HTTP
status, the Java exception class and a message, exactly as HDFS reports them
(``{"RemoteException": {...}}``).

Concurrency: compound metadata operations (MKDIRS, RENAME, DELETE, the start of a CREATE
or APPEND) hold :attr:`WebHdfsNamespace.lock` for their check-then-change, never while a
request body streams nor while waiting for the server. A file being written (CREATE or
APPEND body streaming) holds a lease: a second writer of the same path is refused with
AlreadyBeingCreatedException, as HDFS does.

Durability (protocol.md 3.4): in sync mode RENAME, DELETE, a marker, TRUNCATE, MKDIRS and
the body of a CREATE or APPEND return only once their records (and every record before
them) are durable on the SOS server, except, with ``--barrier commit`` (the default of a
lone gateway), the changes of a checkpoint's state files and of its logs' temp files, which
a re-run of the batch writes again: those return once in the local spool, and the batch's
commit carries them. A gateway whose cache was rebuilt without its predecessor's spool
refuses the commit of the batches that were in flight
(:mod:`spark_plugin.gateway.webhdfs.inflight`): the lost gateway may have acknowledged
state files it never shipped. In async mode nothing waits; the writer bounds the lag.

Quota (protocol.md 3.4, 3.5): while the SOS server refuses the journal for the namespace's
quota, every change is refused before it touches the tree, and a barrier fails promptly,
both as HDFS's DSQuotaExceededException (403); reads never wait for the writer.

Durability "tier" (``sos gateway --durability tier``, protocol.md 3.4): every barrier above
also waits until the server's object-store tier (the bucket) holds the records; one that the
bucket did not reach within ``--tier-patience`` answers 403 RetriableException (HDFS's class
for "try again later", at the status HDFS gives every IOException): the change was applied and
is durable on the SOS server, only the bucket is behind.

The cache is only reached through descriptors (:class:`sos_journal.beneath.Beneath`):
no request follows a symbolic link planted in it (reads, SETPERMISSION and SETTIMES
included), and entries that are neither directories nor regular files are not shown.

Where each part lives: HDFS's vocabulary (errors, paths, FileStatus) in
:mod:`spark_plugin.gateway.webhdfs.hdfs`; the state and plumbing (cache, journal, barrier, observer)
in :mod:`spark_plugin.gateway.webhdfs.core`; the read-only answers in
:mod:`spark_plugin.gateway.webhdfs.reads`; the changes in
:mod:`spark_plugin.gateway.webhdfs.changes` (the memory of recent RENAMEs in
:mod:`spark_plugin.gateway.webhdfs.renames`). This module composes them.
"""

from __future__ import annotations

from spark_plugin.gateway.webhdfs.changes import ChangeOperations
from spark_plugin.gateway.webhdfs.reads import ReadOperations

__all__ = ["WebHdfsNamespace"]


class WebHdfsNamespace(ReadOperations, ChangeOperations):
    """The WebHDFS view of one opened namespace (see the module docstring).

    ``opened``: what :func:`sos_journal.tree.open.open_namespace` returned (its writer in
    async mode: this class places the barriers itself, outside its lock). ``sync``: wait
    for the server on RENAME, DELETE and markers. ``owner``/``group``: what FileStatus
    reports (the journal records no owners). ``observer``: a
    :class:`~spark_plugin.gateway.webhdfs.core.NamespaceObserver` told of barriers and renames.
    """
