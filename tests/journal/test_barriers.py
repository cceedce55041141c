"""The barrier policy (sos_journal.tree.barrier_rule.needs_barrier): which renames and closes
of a sync-mode tree wait for the server. The mount's and the tree's use of it are tested in
test_mount_unit.py, test_mount_e2e.py and below with a real server."""

from __future__ import annotations

import pytest

from sos_journal.tree.barrier_rule import needs_barrier


@pytest.mark.parametrize(
    "path",
    [
        "offsets/0",
        "commits/0",
        "chk/offsets/17",
        "chk/commits/123456789",
        "a/b/q/commits/3",
        "out/_spark_metadata/4",
        "out/_spark_metadata/9.compact",
    ],
)
def test_batch_files_of_the_commit_logs_are_barriers(path):
    assert needs_barrier(path)


@pytest.mark.parametrize(
    "path",
    [
        "chk/offsets/.0.8f2c.tmp",
        "chk/commits/.0.crc",
        "chk/commits/..0.8f2c.tmp.crc",
        "chk/state/0/1/3.delta",
        "chk/state/0/1/.3.delta.8f2c.tmp",
        "chk/state/0/1/10.snapshot",
        "chk/state/0/0/4.zip",
        "chk/sources/0/3",
        "chk/metadata",
        "chk/offsets",
        "chk/commits",
        "commits",
        "3",
        "chk/commits/3.tmp",
        "chk/commits/-1",
        "chk/commits/",
        "chk/commits/\u0663",  # ARABIC-INDIC DIGIT THREE: a digit to str.isdigit, not a batch
        "chk/offsets.bak/3",
        "chk/my-commits/3",
        "chk/commits/3/x",
        "chk/state/0/7.compact",
    ],
)
def test_other_files_are_carried_by_the_next_barrier(path):
    assert not needs_barrier(path)
