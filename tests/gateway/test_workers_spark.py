"""A small Spark streaming query checkpoints through ``sos gateway --workers 2`` (a real
sos-server, real Spark, Hadoop's stock WebHdfsFileSystem), stops, resumes (a new run of the
query, in the same driver), and its output holds every record exactly once; the journal on the
server holds every committed batch (issue 28 item 3). The query and its helpers are
test_spark's."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import sos_command
from tests.gateway.support import FILES, FIRST_RUN_FILES, RECORDS, TwoRuns, requests_by_op, workers_of
from tests.support import output_ids
from tools.demo import committed_batches, make_input

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(1500)]

NS = "gwworkers"


def test_spark_query_through_two_processes_is_exactly_once_and_resumes(sos_server, tmp_path):
    key = sos_server.keygen(NS, "append")
    staging = tmp_path / "staging"
    make_input(str(staging), RECORDS, FILES)
    (tmp_path / "input").mkdir()
    names = sorted(os.listdir(staging))
    for name in names[:FIRST_RUN_FILES]:
        shutil.copy2(staging / name, tmp_path / "input" / name)
    gw = GatewayProcess(
        NS,
        str(tmp_path / "cache"),
        sos_server.address,
        key,
        debug=True,
        extra_args=["--workers", "2"],
        log_path=str(tmp_path / "gateway.log"),
    ).start()
    try:
        assert len(workers_of(gw.proc.pid)) == 1
        cfg = {
            "url": gw.url,
            "ns": NS,
            "checkpoint": "queries/q1",
            "input": str(tmp_path / "input"),
            "out": str(tmp_path / "out"),
        }
        driver = TwoRuns(tmp_path, cfg, key)
        try:
            first = driver.first()
            assert first["batches"] == list(range(FIRST_RUN_FILES))
            for name in names[FIRST_RUN_FILES:]:
                shutil.copy2(staging / name, tmp_path / "input" / name)
            second = driver.second()  # the query started again: it resumes from the checkpoint
            assert second["batches"] == list(range(FIRST_RUN_FILES, FILES))
        finally:
            driver.kill()
    finally:
        assert gw.stop() == 0, gw.log()[-4000:]
    for run in (first, second):
        assert run["errors"] == []
        assert sorted(run["markers"]) == run["batches"]
    ids = output_ids(tmp_path / "out")
    assert sorted(ids) == list(range(RECORDS)) and set(ids.values()) == {1}, "exactly once"
    ops = requests_by_op(gw.log())
    assert not [op for op in ops if op.endswith((" 400", " 401", " 500"))], ops
    assert "worker 1 stopped; requests served" in gw.log()
    env = dict(os.environ, SOS_KEY=key)
    subprocess.run(
        [*sos_command(), "restore", "-q", "--server", sos_server.address, NS, str(tmp_path / "restored")],
        env=env,
        check=True,
        timeout=300,
    )
    assert committed_batches(str(tmp_path / "restored" / "queries" / "q1")) == set(range(FILES))
