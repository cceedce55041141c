"""FUSE adapter over the journal core: what the JVM (Spark) writes through.

`SOSOperations` is a thin pyfuse3 (trio) adapter over `JournaledTree`:

* reads and attributes are served straight from the tree's cache directory;
* every file-altering operation (create, write, truncate, rename, unlink, mkdir,
  rmdir) goes through the tree, so it becomes a journal record;
* blocking tree calls (barrier waits) run in worker threads
  (`trio.to_thread.run_sync`) so the FUSE loop keeps serving other requests;
* in sync mode (the default) fsync, fsyncdir, the close of `.sos/marker` and a
  rename onto, or the close (flush/release) of a written file at, a path that
  `sos_client.journal.barriers.needs_barrier` names (Spark's `offsets/N` and
  `commits/N`) return only after every record so far is durable on the server;
  other renames and closes are carried by the next such barrier (one ordered
  journal). In async mode only fsync and fsyncdir wait (explicit requests for
  durability) and the writer bounds the lag;
* once the writer reports that a newer writer fenced it, the mount turns
  read-only: every later change fails with EROFS (the first failure with EIO)
  and the reason is logged once.

chmod, chown and utimens are applied to the cache only (the journal has no
record for them; Hadoop's local filesystem calls chmod and must not fail).

Ownership: the kernel checks permissions (`default_permissions`) against the
cache entries' owners and modes. When the mount runs as root (the sidecar), a
file or directory created through it is chowned to the calling process (uid,
and gid unless the parent directory is setgid), as a local filesystem does;
`owner=(uid, gid)` (`sos mount --owner`) gives the root directory, and every
entry rebuilt from the server (the journal records no owners), to that user, so
a non-root Spark can create its checkpoint directory. Other users reach a mount
only with allow_other (implied by an owner other than the mount's own user).

`.sos/marker` at the root is a virtual control file (not listed, not journaled
as a file): a JSON document {"label": str, "payload": any} written to it
becomes a MARKER record (JournaledTree.marker), durable when fsync or close
returns (sync mode). The Spark batch listener writes its batch markers there.
`.sos/namespace` (read-only) holds the mounted namespace's name and a newline.

`run_mount()` wires server connection, writer, tree and mount together (the
`sos mount` command calls it); `MountProcess` runs `sos mount` in a child
process for tests, the Spark demo and the crash-loop harness.
"""

from __future__ import annotations

from .inodes import InodeTable
from .ops import SOSOperations, errno_for
from .process import READY_MARKER, MountProcess, is_mounted, lazy_unmount
from .run import MountedTree, default_cache_dir, fuse_options, give_tree_to, run_mount

__all__ = ["READY_MARKER", "InodeTable", "MountProcess", "MountedTree", "SOSOperations", "default_cache_dir",
           "errno_for", "fuse_options", "give_tree_to", "is_mounted", "lazy_unmount", "run_mount"]
