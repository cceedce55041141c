"""The Spark job side: a long-lived driver process running the demo's query on whatever
mount or gateway the harness names (``python -m tools.soak _driver CONFIG``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

from tools.demo_common import CHECKPOINT, ROCKSDB_PROVIDER, write_batch_output
from tools.soak.common import DRIVER_JAVA_OPTIONS, TRIGGER, _read_json, _write_json_atomic


def driver_main(cfg_path: str) -> int:
    """A long-lived Spark driver: runs the demo's query on whatever mount the harness names.

    Commands come from ``control/cmd.json`` ({"seq", "action": run|stop|exit, "checkpoint",
    "mountpoint"}); the state goes to ``control/status.json`` ({"seq", "state", "error",
    "pid"}). A query that fails (its mount died) is reported and left stopped until the next
    command, so one JVM survives any number of mount and server crashes. Batches seen
    committed (progress events with data, ``commits/N`` present) are appended to the
    ``acked`` file: the harness's RPO-0 baseline.
    """
    t_start = time.monotonic()
    with open(cfg_path) as f:
        cfg = json.load(f)
    from pyspark.sql import SparkSession

    from spark_plugin.spark import MarkerListener

    def note(msg):
        print(f"soak driver [{time.monotonic() - t_start:6.1f}s]: {msg}", file=sys.stderr, flush=True)

    gw = cfg.get("gateway")  # cluster mode: {"url", "namespace"}; the key in $SOS_KEY
    builder = SparkSession.builder.appName("sos-soak-cluster" if gw else "sos-soak")
    if cfg.get("spark_conf"):  # the cluster's master, executors, local dirs
        for k, v in cfg["spark_conf"].items():
            builder = builder.config(k, v)
    else:
        builder = builder.master("local[2]")
    builder = (
        builder.config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", DRIVER_JAVA_OPTIONS)
        .config("spark.sql.streaming.stateStore.maintenanceInterval", cfg.get("maintenance_interval", "10s"))
    )
    if cfg.get("state_store") == "rocksdb":
        builder = builder.config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
    location = None
    if gw:
        from spark_plugin.spark import gateway_checkpoint

        location = gateway_checkpoint(builder, gw["url"], gw["namespace"], os.environ["SOS_KEY"], CHECKPOINT)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    note("Spark session up")

    control = cfg["control"]
    cmd_path = os.path.join(control, "cmd.json")
    status_path = os.path.join(control, "status.json")
    out_dir = cfg["out"]
    acked_path = cfg["acked"]
    os.makedirs(out_dir, exist_ok=True)
    pid = os.getpid()

    def status(seq, state, error=None, unreadable=False):
        _write_json_atomic(
            status_path, {"seq": seq, "state": state, "error": error, "pid": pid, "checkpoint_unreadable": unreadable}
        )

    def record_ack(listener, event, committed) -> None:
        """A batch with data whose ``commits/N`` is there (``committed(N)``): append it and its
        source's end offset to the ``acked`` file; a failure goes to ``listener.errors``."""
        try:
            p = event.progress
            if int(p.numInputRows) > 0 and committed(int(p.batchId)):
                try:
                    log_offset = int(json.loads(p.sources[0].endOffset)["logOffset"])
                except Exception:
                    log_offset = -1
                with open(acked_path, "a") as f:
                    f.write(f"{int(p.batchId)} {log_offset}\n")
        except Exception as exc:
            listener.errors.append(repr(exc))

    class AckListener(MarkerListener):
        """Records committed batches for the harness, then writes the batch marker."""

        def onQueryProgress(self, event):
            record_ack(self, event, lambda batch: os.path.exists(os.path.join(self.checkpoint, "commits", str(batch))))
            super().onQueryProgress(event)

    if gw:
        from spark_plugin.spark import GatewayMarkerListener

        class GatewayAckListener(GatewayMarkerListener):
            """AckListener through the gateway: ``commits/N`` checked with a GETFILESTATUS."""

            def committed(self, batch: int) -> bool:
                """Does ``commits/<batch>`` exist? Asked again while the gateway is down
                (a restart takes a second or two) so an acknowledgement is not lost."""
                from spark_plugin.gateway.client import GatewayError

                deadline = time.monotonic() + 60
                while True:
                    try:
                        return self._client.exists(f"{self.relpath}/commits/{batch}")
                    except GatewayError:
                        raise
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)

            def onQueryProgress(self, event):
                record_ack(self, event, self.committed)
                super().onQueryProgress(event)

    def sink(df, batch_id):  # the demo's sink, without its hang hook
        write_batch_output(out_dir, df, batch_id)

    # the demo's query (same source, dedup and sink); a processing-time trigger instead of
    # availableNow because the input keeps coming
    stream = (
        spark.readStream.schema("id LONG, payload STRING")
        .option("maxFilesPerTrigger", 1)
        .json(cfg["input"])
        .dropDuplicates(["id"])
    )

    handled = -1
    query = None
    listener = None
    while True:
        cmd = _read_json(cmd_path)
        if cmd is not None and cmd["seq"] > handled:
            handled = cmd["seq"]
            if query is not None:
                with contextlib.suppress(Exception):
                    query.stop()
                query = None
            if listener is not None:
                with contextlib.suppress(Exception):
                    spark.streams.removeListener(listener)
                listener = None
            action = cmd["action"]
            if action == "exit":
                status(handled, "exited")
                break
            if action == "stop":
                status(handled, "stopped")
                continue
            mnt, chk = cmd["mountpoint"], cmd["checkpoint"]
            if location is None and not os.path.ismount(mnt):
                status(handled, "failed", f"{mnt} is not a mount point")
                continue
            try:
                listener = GatewayAckListener(location) if location is not None else AckListener(chk, mountpoint=mnt)
                spark.streams.addListener(listener)
                query = (
                    stream.writeStream.foreachBatch(sink)
                    .option("checkpointLocation", chk)
                    .trigger(processingTime=TRIGGER)
                    .start()
                )
            except Exception as exc:
                status(handled, "failed", f"start: {type(exc).__name__}: {str(exc)[:400]}")
                query = None
                continue
            status(handled, "running")
            note(f"query started on {chk}")
        if query is not None and not query.isActive:
            unreadable = False
            try:
                exc = query.exception()
                full = str(exc) if exc is not None else "terminated"
                err = full[:600]
                # the committed checkpoint's state cannot be loaded (a delta or snapshot
                # file of a committed version is missing, empty or truncated)
                unreadable = "CANNOT_LOAD_STATE_STORE" in full
                if unreadable:
                    i = full.index("CANNOT_LOAD_STATE_STORE")
                    err = full[max(0, i - 40) : i + 500]
            except Exception as e:
                err = repr(e)[:600]
            status(handled, "failed", err, unreadable)
            note(f"query failed: {err[:200]}")
            query = None
        time.sleep(0.1)
    spark.stop()
    return 0
