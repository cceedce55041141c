"""MarkerListener writes a `spark.batch` MARKER after each committed batch (through the
mount's control file), and restore_to_batch brings back the checkpoint as it was when
that batch committed - one Spark can resume from."""

import json
import os
import subprocess

import pytest

from spark_plugin.spark import (
    MARKER_CONTROL,
    CheckpointLocation,
    MarkerListener,
    journaled_checkpoint,
    marker_payload,
    restore_to_batch,
)
from tools.demo import committed_batches, make_input, start_driver, tail

pytestmark = [pytest.mark.spark, pytest.mark.fuse, pytest.mark.slow, pytest.mark.timeout(1500)]

NS = "markers"
RECORDS = 400
FILES = 4


def _run_driver(cfg, work, name):
    proc = start_driver(cfg, str(work / f"{name}.log"), str(work / f"{name}.json"))
    try:
        rc = proc.wait(900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, tail(str(work / f"{name}.log"), 60)


def _read_out(out_dir):
    batches = {}
    for name in sorted(os.listdir(out_dir)):
        bid = int(name.split("-")[1].split(".")[0])
        with open(os.path.join(out_dir, name)) as f:
            batches[bid] = [json.loads(line)["id"] for line in f]
    return batches


def test_markers_then_restore_to_batch_and_resume(sos_server, tmp_path):
    key = sos_server.keygen(NS, "append")
    make_input(str(tmp_path / "input"), RECORDS, FILES)
    (tmp_path / "flags").mkdir()
    loc = journaled_checkpoint(
        None,
        NS,
        server=sos_server.address,
        key=key,
        mountpoint=str(tmp_path / "mnt"),
        cache_dir=str(tmp_path / "cache"),
    )
    try:
        assert isinstance(loc, CheckpointLocation)
        assert loc.relpath == "checkpoint" and os.path.isdir(loc)
        assert os.path.exists(os.path.join(loc.mountpoint, MARKER_CONTROL))
        cfg = {
            "input": str(tmp_path / "input"),
            "out": str(tmp_path / "out1"),
            "flags": str(tmp_path / "flags"),
            "checkpoint": str(loc),
            "mountpoint": loc.mountpoint,
            "markers": True,
        }
        _run_driver(cfg, tmp_path, "driver1")
        assert committed_batches(loc) == set(range(FILES))
    finally:
        loc.stop()
    markers = json.loads((tmp_path / "flags" / "markers.json").read_text())
    assert markers["errors"] == []
    assert markers["written"] == list(range(FILES))

    # the checkpoint as it was when batch 1 committed, and as at the end
    chk1 = restore_to_batch(NS, str(tmp_path / "at1"), loc.relpath, 1, server=sos_server.address, key=key)
    assert committed_batches(chk1) == {0, 1}
    chk3 = restore_to_batch(NS, str(tmp_path / "at3"), loc, 3, server=sos_server.address, key=key)
    assert committed_batches(chk3) == {0, 1, 2, 3}

    # Spark resumes from the batch-1 checkpoint (a plain local copy now). It redoes what
    # came after batch 1 only (Spark may fold files 2 and 3 into one batch when the
    # restored file-source log already lists file 2), and its restored dedup state still
    # drops the ids of file 1 that file 2 sends again: exactly ids 200..399, once each
    cfg2 = dict(cfg, checkpoint=chk1, out=str(tmp_path / "out2"), mountpoint=None, markers=False)
    _run_driver(cfg2, tmp_path, "driver2")
    after = committed_batches(chk1)
    assert {0, 1} < after
    out = _read_out(tmp_path / "out2")
    assert set(out) == after - {0, 1}
    ids = [i for b in out.values() for i in b]
    assert sorted(ids) == list(range(RECORDS * 2 // FILES, RECORDS))


def test_journaled_checkpoint_registers_listener_and_survives_the_loss(sos_server, tmp_path):
    """No Spark: what a checkpoint writer does on the location is on the server once the
    rename returns, and comes back after the mount and its cache are gone."""
    import shutil

    from spark_plugin.spark import sos_command

    key = sos_server.keygen("jc", "append")
    added = []

    class FakeSpark:
        class streams:
            @staticmethod
            def addListener(listener):
                added.append(listener)

    loc = journaled_checkpoint(
        FakeSpark(),
        "jc",
        server=sos_server.address,
        key=key,
        mountpoint=str(tmp_path / "mnt"),
        cache_dir=str(tmp_path / "cache"),
        checkpoint="q1/chk",
    )
    try:
        assert [type(listener) for listener in added] == [MarkerListener]
        assert added[0].relpath == "q1/chk" and added[0].checkpoint == str(loc)
        os.makedirs(os.path.join(loc, "commits"))
        tmp = os.path.join(loc, "commits", ".0.tmp")
        with open(tmp, "w") as f:
            f.write("v1\n{}")
        os.rename(tmp, os.path.join(loc, "commits", "0"))  # Spark's commit point
    finally:
        loc.mount.kill()  # a crash right after the rename returned
    shutil.rmtree(tmp_path / "cache")
    env = dict(os.environ, SOS_KEY=key)
    proc = subprocess.run(
        [*sos_command(), "restore", "-q", "--server", sos_server.address, "jc", str(tmp_path / "restored")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "restored" / "q1" / "chk" / "commits" / "0").read_text() == "v1\n{}"


def test_restore_to_batch_without_such_batch_fails_clearly(sos_server, tmp_path):
    key = sos_server.keygen("nobatch", "append")
    with pytest.raises(RuntimeError, match="sos restore failed"):
        restore_to_batch("nobatch", str(tmp_path / "t"), "checkpoint", 5, server=sos_server.address, key=key)


def test_marker_payload_and_listener_without_control_file(tmp_path):
    doc = json.loads(marker_payload("a/chk", "qid", 7))
    assert doc == {"checkpoint": "a/chk", "query_id": "qid", "batch_id": 7}
    chk = tmp_path / "mnt" / "chk"
    (chk / "commits").mkdir(parents=True)
    (chk / "commits" / "0").write_text("v1\n{}")
    listener = MarkerListener(str(chk), mountpoint=str(tmp_path / "mnt"))
    assert listener.relpath == "chk"

    class P:  # the shape of a QueryProgressEvent
        def __init__(self, bid):
            self.progress = type("Prog", (), {"batchId": bid, "id": "q", "name": None})()

    listener.onQueryProgress(P(0))  # no control file: nothing written, no error
    assert listener.written == [] and listener.errors == []
    (tmp_path / "mnt" / ".sos").mkdir()
    (tmp_path / "mnt" / ".sos" / "marker").write_text("")
    listener.onQueryProgress(P(0))
    listener.onQueryProgress(P(1))  # commits/1 does not exist: no marker for it
    assert listener.written == [0]
    written = json.loads((tmp_path / "mnt" / ".sos" / "marker").read_text())
    assert written == {"label": "spark.batch", "payload": {"checkpoint": "chk", "query_id": "q", "batch_id": 0}}
    with pytest.raises(ValueError):
        MarkerListener(str(tmp_path / "elsewhere"), mountpoint=str(tmp_path / "mnt"))
