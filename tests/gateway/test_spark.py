"""A real Spark query (local[2], stateful: dropDuplicates) checkpoints on webhdfs:// through
`sos gateway` with the OAuth2 and retry settings of `gateway_checkpoint`, runs 3 batches,
stops, and is started again (a new run of it, in the same driver) for 2 more; every id comes out exactly once, the batch markers are written, and
`sos restore` (also `--batch`) gives back a checkpoint with the committed batches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import traceback
from collections import Counter

import pytest

from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import restore_to_batch, sos_command
from tests.gateway.support import FILES, FIRST_RUN_FILES, RECORDS, CutProxy, TwoRuns, requests_by_op
from tests.support import output_ids
from tools.demo import committed_batches, kill_tree, make_input

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(1500)]

NS = "gwspark"


def test_spark_query_checkpoints_through_the_gateway_and_resumes(sos_server, tmp_path):
    key = sos_server.keygen(NS, "append")
    staging = tmp_path / "staging"
    make_input(str(staging), RECORDS, FILES)
    (tmp_path / "input").mkdir()
    names = sorted(os.listdir(staging))
    for name in names[:FIRST_RUN_FILES]:
        shutil.copy2(staging / name, tmp_path / "input" / name)

    gw = GatewayProcess(
        NS, str(tmp_path / "cache"), sos_server.address, key, debug=True, log_path=str(tmp_path / "gateway.log")
    ).start()
    try:
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
            assert first["location"].startswith("webhdfs://")
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

    # what Hadoop asked of the gateway (the lead's per-batch request count)
    ops = requests_by_op(gw.log())
    print("gateway requests for", FILES, "batches:", sum(ops.values()))
    for op, n in sorted(ops.items()):
        print(f"  {op}: {n}")
    assert not [op for op in ops if op.endswith((" 400", " 401", " 500"))], ops

    # the journal holds the checkpoint: a restore has every committed batch, and a restore
    # to batch 2 stops at its commit
    env = dict(os.environ, SOS_KEY=key)
    subprocess.run(
        [*sos_command(), "restore", "-q", "--server", sos_server.address, NS, str(tmp_path / "restored")],
        env=env,
        check=True,
        timeout=300,
    )
    assert committed_batches(str(tmp_path / "restored" / "queries" / "q1")) == set(range(FILES))
    at2 = restore_to_batch(NS, str(tmp_path / "at2"), "queries/q1", 2, server=sos_server.address, key=key)
    assert committed_batches(at2) == {0, 1, 2}


# ---------------------------------------------------------------------------- beyond the checkpoint
# (issue 20) Spark reads and writes data through the gateway, not only its checkpoint: a batch
# parquet dataset, and a streaming query whose file source, file sink (with _spark_metadata)
# and checkpoint are all on webhdfs://. The query rides through a SIGKILLed gateway restarted
# on the same cache (with the project's settings only), then its driver is SIGKILLed and a
# new one resumes it: every id comes out exactly once.

#: enough files for both restarts (a batch each 2 s: batch 0, two after each restart, the
#: cut one) and a resume that still has input left
STREAM_FILES = 10
STREAM_RECORDS = 100

FILES_DRIVER = textwrap.dedent('''
    import json, os, sys, time
    cfg = json.load(open(sys.argv[1]))
    from spark_plugin.spark import gateway_checkpoint, webhdfs_url
    from tests.support import spark_builder

    builder = spark_builder("sos-gateway-files")
    loc = gateway_checkpoint(builder, cfg["url"], cfg["ns"], os.environ["SOS_KEY"], "stream/ckpt")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    base = webhdfs_url(cfg["url"])
    result = {}

    def put(path, text):
        """A file written through Hadoop's client on the gateway, then renamed into place
        (what a producer of a file source's input does)."""
        jvm = spark._jvm
        tmp = jvm.org.apache.hadoop.fs.Path(base + "/stream/staging/" + path.rsplit("/", 1)[1])
        fs = tmp.getFileSystem(spark._jsc.hadoopConfiguration())
        out = fs.create(tmp, True)
        out.write(bytearray(text.encode()))
        out.close()
        fs.mkdirs(jvm.org.apache.hadoop.fs.Path(base + "/stream/in"))
        assert fs.rename(tmp, jvm.org.apache.hadoop.fs.Path(base + path))

    if cfg["phase"] == "first":
        per = cfg["records"] // cfg["files"]
        for f in range(cfg["files"]):
            put(f"/stream/in/part-{f:03d}.json",
                "".join(json.dumps({"id": i}) + "\\n" for i in range(f * per, (f + 1) * per)))
        # a batch job: a parquet dataset written through webhdfs:// and read back; the
        # text files just written, read back
        ds = base + "/batch/ids.parquet"
        spark.range(0, 1000, 1, 4).selectExpr("id", "id * 2 AS twice").write.parquet(ds)
        back = spark.read.parquet(ds)
        result["batch"] = [back.count(), back.selectExpr("sum(twice)").first()[0],
                           spark.read.text(base + "/stream/in").count()]
        with open(cfg["result"], "w") as fh:
            json.dump(result, fh)

    query = (spark.readStream.schema("id LONG").option("maxFilesPerTrigger", 1)
             .json(base + "/stream/in")
             .writeStream.format("parquet").option("path", base + "/stream/out")
             .option("checkpointLocation", str(loc)))
    if cfg["phase"] == "first":
        # a batch every 2 s (room to kill things mid-query) until the test kills this driver
        q = query.trigger(processingTime="2 seconds").start()
        q.awaitTermination()
    else:
        q = query.trigger(availableNow=True).start()
        q.awaitTermination()
        ids = [r.id for r in spark.read.parquet(base + "/stream/out").collect()]
        result["ids"] = ids
        result["sink_files"] = len(spark.read.parquet(base + "/stream/out").inputFiles())
        with open(cfg["result"], "w") as fh:
            json.dump(result, fh)
    spark.stop()
''')


#: What Hadoop's WebHDFS client reports when the connection of a body it sent is cut (the
#: gateway died while it read the body): the proxy below reads the whole body, so Hadoop is
#: waiting for the answer and sees the end of the stream; a reset or a broken pipe is what it
#: gives when it is still writing.


class _FilesQuery:
    """The files driver's query on a gateway behind a :class:`CutProxy` (the gateway
    advertises the proxy, so Hadoop's redirects come back through it too)."""

    def __init__(self, sos_server, tmp_path, ns):
        self.tmp_path, self.ns, self.server = tmp_path, ns, sos_server.address
        self.key = sos_server.keygen(ns, "append")
        self.cache = tmp_path / "cache"
        self.ckpt = self.cache / "tree" / "stream" / "ckpt"
        self.proxy = CutProxy()
        self.gateways = [self._gateway("gateway.log")]
        self.proxy.upstream = _host_port(self.gateways[0].url)
        (tmp_path / "files_driver.py").write_text(FILES_DRIVER)
        self.env = dict(
            os.environ,
            SOS_KEY=self.key,
            PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p),
        )
        self.cfg = {"url": f"http://{self.proxy.address}", "ns": ns, "records": STREAM_RECORDS, "files": STREAM_FILES}
        self.logs = []

    def _gateway(self, log_name):
        return GatewayProcess(
            self.ns,
            str(self.cache),
            self.server,
            self.key,
            debug=True,
            extra_args=("--advertise", self.proxy.address),
            log_path=str(self.tmp_path / log_name),
        ).start()

    def restart_gateway(self):
        """SIGKILL the gateway and start a new one on the same cache (the project's settings
        only); the proxy sends what comes next to it."""
        self.gateways[-1].kill()
        self.gateways.append(self._gateway(f"gateway{len(self.gateways) + 1}.log"))
        return _host_port(self.gateways[-1].url)

    def start(self, phase):
        path = self.tmp_path / f"{phase}.json"
        path.write_text(json.dumps(dict(self.cfg, phase=phase, result=str(self.tmp_path / f"{phase}-result.json"))))
        log = open(self.tmp_path / f"{phase}.log", "wb")  # noqa: SIM115 - closed in close()
        self.logs.append(log)
        return subprocess.Popen(
            [sys.executable, str(self.tmp_path / "files_driver.py"), str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )

    def log(self, phase):
        return (self.tmp_path / f"{phase}.log").read_text(errors="replace")

    def committed(self):
        return committed_batches(str(self.ckpt))

    def wait(self, pred, what, proc, timeout=300.0):
        deadline = time.monotonic() + timeout
        while not pred():
            assert proc.poll() is None, f"{what}: the driver died first\n" + self.log("first")[-6000:]
            assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f} s"
            time.sleep(0.1)

    def first_batch(self, first):
        self.wait(lambda: 0 in self.committed(), "batch 0 committed", first)
        batch = json.loads((self.tmp_path / "first-result.json").read_text())["batch"]
        assert batch == [1000, 999000, STREAM_RECORDS], batch  # parquet and text read back

    def resume_exactly_once(self):
        """A new driver resumes the query (availableNow): every id exactly once, the batches
        0..N with no gap, the file sink's log in place."""
        done_before = self.committed()
        assert len(done_before) < STREAM_FILES, "the first driver ended before the end"
        second = self.start("second")
        try:
            assert second.wait(timeout=600) == 0, self.log("second")[-6000:]
        finally:
            kill_tree(second)
        result = json.loads((self.tmp_path / "second-result.json").read_text())
        ids = Counter(result["ids"])
        assert sorted(ids) == list(range(STREAM_RECORDS)) and set(ids.values()) == {1}, "exactly once"
        # one file per trigger, but a run cut while writing its file-source log resumes with the
        # files of two triggers in one batch: the batches stay 0..N with no gap
        done = self.committed()
        assert done == set(range(len(done))) and len(done) >= STREAM_FILES - 1, done
        assert (self.cache / "tree" / "stream" / "out" / "_spark_metadata").is_dir()

    def stop_gateway(self):
        """A clean stop of the gateway that serves now (it flushes): exit code 0."""
        gw = self.gateways[-1]
        assert gw.stop() == 0, gw.log()[-4000:]

    def close(self):
        self.proxy.close()
        for log in self.logs:
            log.close()
        for gw in self.gateways:
            gw.kill()  # a no-op for those already stopped


def _host_port(url):
    host, port = url.rsplit("/", 1)[-1].rsplit(":", 1)
    return host, int(port)


def _phase(step, *args):
    """Run one step of the shared run: None if it held, else what failed (the test of that
    step reports it)."""
    try:
        step(*args)
    except Exception as exc:
        return "".join(traceback.format_exception(exc))[-8000:]
    return None


def _restart_between_two_requests(q, first):
    """The gateway is SIGKILLed at a moment when no request is in flight (the proxy holds the
    next ones until then; Hadoop's idle connections are closed as a dead gateway's are) and
    comes back on the same cache; the waiting requests reach the new gateway, which serves
    them, and two more batches commit."""
    q.proxy.hold()
    q.proxy.wait_quiet()
    q.proxy.drop_idle()
    served = len(q.proxy.requests)
    upstream = q.restart_gateway()  # between two requests: the gateway has none
    q.proxy.release(upstream)
    before = q.committed()
    q.wait(lambda: len(q.committed() - before) >= 2, "two more batches after the gateway restart", first)
    assert len(q.proxy.requests) > served
    assert " -> 2" in q.gateways[-1].log(), "the restarted gateway served the query"
    assert first.poll() is None, "the query stopped after the restart\n" + q.log("first")[-6000:]


def _restart_inside_a_file_body(q, first):
    """The gateway is SIGKILLed while it reads a file body (the data PUT after CREATE's
    redirect), with no other request in flight; the query carries on with the same driver:
    two more batches commit."""
    q.proxy.arm_cut(lambda r: r.method == b"PUT" and b"data=true" in r.target and b"/stream/" in r.target)
    q.cut = q.proxy.wait_cut()
    upstream = q.restart_gateway()  # inside that body, with no other request in flight
    q.proxy.finish_cut()
    q.proxy.release(upstream)
    before = q.committed()
    q.wait(lambda: len(q.committed() - before) >= 2, "two more batches after the cut body", first)
    assert first.poll() is None, "the query stopped after its body was cut\n" + q.log("first")[-6000:]


def _resume(q):
    """The first driver SIGKILLed mid-query (its JVM too); a new one resumes: every id
    exactly once; then a clean stop of the last gateway."""
    q.resume_exactly_once()
    q.stop_gateway()


@pytest.fixture(scope="module")
def restarts(server, tmp_path_factory):
    """One query (the files driver's, on a gateway behind a :class:`CutProxy`) through both
    gateway restarts, each kill placed where it means to be: first between two requests,
    then, once two more batches committed, inside a file body; then its driver is SIGKILLed
    and a new one resumes it. One driver JVM for both placements (and one for the resume)
    instead of two each: {step: None if it held, else what failed}."""
    q = _FilesQuery(server, tmp_path_factory.mktemp("restarts"), "gwfiles")
    out: dict[str, str | None] = {}
    try:
        first = q.start("first")
        try:
            q.first_batch(first)
            out["between"] = _phase(_restart_between_two_requests, q, first)
            out["cut"] = (
                _phase(_restart_inside_a_file_body, q, first)
                if out["between"] is None
                else "not run: the restart between two requests failed first"
            )
        finally:
            kill_tree(first)  # the driver dies mid-query (SIGKILL, its JVM too)
        out["resume"] = _phase(_resume, q)
        print("cut:", getattr(q, "cut", None))
    finally:
        q.close()
    return out


def test_spark_file_stream_rides_a_gateway_restart_between_two_requests(restarts):
    """The gateway is SIGKILLed at a moment when no request is in flight (the proxy holds the
    next ones until then; Hadoop's idle connections are closed as a dead gateway's are) and
    comes back on the same cache with the project's settings only; the waiting requests reach
    the new gateway: the query carries on with no error, two more batches commit, and a driver
    that resumes it after a SIGKILL of the first gives every id exactly once."""
    assert restarts["between"] is None, restarts["between"]
    assert restarts["resume"] is None, restarts["resume"]


def test_spark_file_stream_rides_a_gateway_restart_that_cuts_a_file_body(restarts):
    """The gateway is SIGKILLed while it reads a file body (the data PUT after CREATE's
    redirect). Hadoop's own WebHDFS output stream does not resend a body, so before issue 30
    the query stopped ("Unexpected end of file from server", "Connection reset"); with the
    settings of `gateway_checkpoint` (the gateway's Hadoop FileSystem, which keeps the body
    and resends it whole) the query carries on: two more batches commit with the same driver,
    and a driver that resumes it after a SIGKILL of the first gives every id exactly once."""
    assert restarts["cut"] is None, restarts["cut"]
    assert restarts["resume"] is None, restarts["resume"]
