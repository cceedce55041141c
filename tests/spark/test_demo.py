"""The single-JVM disaster-recovery demo (``./scripts/demo --mount``) end to end: real
sos-server, real FUSE mount, real Spark driver process, the mount SIGKILLed mid-batch,
worker's local files deleted, restore, resume; the committed output must equal the input
exactly once. Plus the checker's own negatives. (The cluster demo, ``./scripts/demo``
without ``--mount``, runs in tests/spark/test_cluster.py.)"""

import json
import os
import subprocess
import sys

import pytest

from tools.demo import check_output, fmt, make_input

pytestmark = [pytest.mark.spark, pytest.mark.fuse, pytest.mark.slow, pytest.mark.timeout(1500)]

RECORDS = 600
BATCHES = 4
CRASH_AFTER = 2


def run_demo(tmp_path, *extra):
    cmd = [
        sys.executable,
        "-m",
        "tools.demo",
        "--mount",
        "--records",
        str(RECORDS),
        "--batches",
        str(BATCHES),
        "--crash-after",
        str(CRASH_AFTER),
        "--workdir",
        str(tmp_path / "work"),
        "--json",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    result = next((json.loads(line) for line in lines if line.startswith("{")), None)
    return proc, lines, result


def assert_exactly_once(proc, lines, result, *, driver_markers=True):
    assert proc.returncode == 0, "\n".join(lines[-30:]) + proc.stderr[-3000:]
    assert lines[-1].startswith("VERDICT: PASS"), lines[-1]  # the verdict comes last
    assert result["ok"] is True
    # RPO 0: every batch committed before the crash came back from the server
    assert result["committed_before_crash"] == list(range(CRASH_AFTER))
    assert result["restored_committed"] == list(range(CRASH_AFTER))
    # the restart ran on what `sos restore` produced: the mount served that tree and began
    # a new journal generation with its snapshot (a mount that rebuilt its cache itself
    # would not)
    before, after = result["generations"]
    assert before >= 1 and after == before + 1
    assert result["committed_final"] == list(range(BATCHES))
    assert result["records_in"] == RECORDS
    assert result["records_out"] == RECORDS
    for k in ("lost", "doubled", "corrupted", "unknown", "committed_without_output"):
        assert result[k] == [], k
    if driver_markers:
        # the restarted driver's MarkerListener marked the batches it committed
        assert sorted(set(result["markers_written"])) == list(range(CRASH_AFTER, BATCHES))


def test_demo_rocksdb_state_store_with_the_mount_killed_mid_batch(tmp_path):
    # RocksDB state store, and only the mount dies: the live driver then fails to commit
    # on the dead mount; the worker's disks are wiped; restore + resume must still be
    # exactly once
    proc, lines, result = run_demo(tmp_path, "--state-store", "rocksdb", "--kill", "mount")
    assert_exactly_once(proc, lines, result)
    assert result["state_store"] == "rocksdb"
    assert result["driver1_exit"] not in (None, 0)  # it could not commit on the dead mount
    assert any("driver failed on the dead mount" in line for line in lines), lines


# ---- the checker itself must catch each kind of failure (no Spark needed)


def _write_batch(out, bid, recs):
    with open(os.path.join(out, f"batch-{bid:06d}.jsonl"), "w") as f:
        for rid, payload in recs:
            f.write(json.dumps({"id": rid, "payload": payload}) + "\n")


def test_checker_catches_lost_doubled_corrupted(tmp_path):
    expected = make_input(str(tmp_path / "in"), 20, 2)
    out = tmp_path / "out"
    out.mkdir()
    good = sorted(expected.items())
    _write_batch(out, 0, good[:10])
    _write_batch(out, 1, [*good[9:18], (18, "not-the-payload")])  # 9 doubled, 19 lost
    _write_batch(out, 2, good[:5])  # batch 2 never committed: ignored, not doubled
    with open(out / "batch-000001.jsonl", "a") as f:
        f.write("{garbage\n")
    r = check_output(str(out), {0, 1}, expected)
    assert r["lost"] == [19]
    assert r["doubled"] == [9]
    assert len(r["corrupted"]) == 2
    assert r["uncommitted_output_ignored"] == [2]
    r_ok = check_output(str(out), {0}, {k: v for k, v in good[:10]})
    assert r_ok["lost"] == r_ok["doubled"] == r_ok["corrupted"] == []
    assert check_output(str(out), {0, 3}, expected)["committed_without_output"] == [3]


def test_input_sends_every_id_twice_across_batches(tmp_path):
    expected = make_input(str(tmp_path / "in"), 100, 4)
    seen = {}
    for i, name in enumerate(sorted(os.listdir(tmp_path / "in"))):
        for line in (tmp_path / "in" / name).read_text().splitlines():
            seen.setdefault(json.loads(line)["id"], []).append(i)
    assert set(seen) == set(expected) == set(range(100))
    twice = [r for r, files in seen.items() if len(files) == 2]
    assert twice and all(seen[r][1] == seen[r][0] + 1 for r in twice)
    assert fmt({0, 1, 2}) == "0..2" and fmt({0, 2}) == "0,2" and fmt(set()) == "(none)"
