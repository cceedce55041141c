"""The gateway's ``--barrier commit`` rule (sos_journal.tree.barrier_rule.acknowledged_early,
in_flight, commit_of): which paths a gateway answers from its spool, and which batch of a
checkpoint is in flight. protocol.md 3.4."""

from __future__ import annotations

import pytest

from sos_journal.tree.barrier_rule import acknowledged_early, commit_of, in_flight, offsets_of

CHECKPOINTS = {"q", "jobs/a/chk", ""}


def is_checkpoint(d: str) -> bool:
    return d in CHECKPOINTS


@pytest.mark.parametrize(
    "path",
    [
        "q/state",
        "q/state/0/3/7.delta",
        "q/state/0/3/.7.delta.5a1c.tmp",
        "q/state/0/3/12.changelog",
        "q/state/0/3/SSTs/00012-uuid.sst",
        "q/state/0/_metadata/metadata",
        "q/offsets/.7.5a1c.tmp",
        "q/commits/.7.5a1c.tmp",
        "jobs/a/chk/state/1/199/4.zip",
        "state/0/0/1.delta",  # the root is a checkpoint too
    ],
)
def test_a_checkpoints_state_and_temp_files_are_answered_early(path):
    assert acknowledged_early(path, is_checkpoint)


@pytest.mark.parametrize(
    "path",
    [
        "q/offsets/7",
        "q/commits/7",
        "q/offsets",
        "q/commits",
        "q",
        "q/metadata",
        "q/.metadata.5a1c.tmp",
        "q/sources/0/7",
        "q/sources/0/.7.5a1c.tmp",
        "out/_spark_metadata/7",
        "out/part-00000-uuid.json",
        "data/state/file",  # "state" below a directory that is no checkpoint
        "jobs/a/state/0/1.delta",
        "x/offsets/.7.tmp",
    ],
)
def test_everything_else_waits(path):
    assert not acknowledged_early(path, is_checkpoint)


def test_commit_and_offsets_files():
    assert commit_of("q/commits/7") == ("q", 7)
    assert commit_of("commits/0") == ("", 0)
    assert commit_of("q/commits/.7.tmp") is None and commit_of("q/offsets/7") is None
    assert offsets_of("jobs/a/chk/offsets/12") == ("jobs/a/chk", 12)
    assert offsets_of("q/commits/12") is None


@pytest.mark.parametrize(
    ("offsets", "commits", "expected"),
    [
        (["0", "1", "2"], ["0", "1"], 2),
        (["0", "1", "2"], ["0", "1", "2"], None),
        ([], [], None),
        ([".3.uuid.tmp", "0"], [], 0),
        (["9", "10"], ["9"], 10),  # numbers, not names, are compared
    ],
)
def test_the_batch_in_flight(offsets, commits, expected):
    assert in_flight(offsets, commits) == expected
