"""The names the helpers share with the mount and the journal: the mount's control files, its
file system type, the batch marker's label and the checkpoint's default path.

They are spelled out here rather than imported: the Spark job ships this package without any
sos package (docs/DEPLOY.md), so each must equal its twin there (the mount's ``.sos/`` files,
``sos_journal.format.layout.BATCH_LABEL``: tests/mount/test_unit.py checks the label).
"""

from __future__ import annotations

import os

#: control file on the mount: a JSON document written there becomes a MARKER record
MARKER_CONTROL = os.path.join(".sos", "marker")
#: read-only control file on the mount: the mounted namespace's name and a newline
NAMESPACE_CONTROL = os.path.join(".sos", "namespace")
#: file system type of an SOS mount in /proc/self/mountinfo (fsname/subtype sos)
SOS_FSTYPE = "fuse.sos"
MARKER_LABEL = "spark.batch"  # = sos_journal.format.layout.BATCH_LABEL (this module imports no sos package)
DEFAULT_CHECKPOINT = "checkpoint"
