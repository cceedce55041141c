"""The Spark job side: a long-lived driver process running the demo's query on whatever
mount or gateway the harness names (``python -m tools.soak _driver CONFIG``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable

from tools.demo_common import CHECKPOINT, ROCKSDB_PROVIDER, write_batch_output
from tools.soak.common import DRIVER_JAVA_OPTIONS, TRIGGER, read_json, write_json_atomic


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

    def note(msg: str) -> None:
        print(f"soak driver [{time.monotonic() - t_start:6.1f}s]: {msg}", file=sys.stderr, flush=True)

    spark, location = _session(cfg)
    note("Spark session up")
    _QueryRunner(spark, cfg, location, note).serve()
    spark.stop()
    return 0


def _session(cfg: dict):
    """The SparkSession (``local[2]``, or the cluster's ``spark_conf``) and, in cluster mode
    (``cfg["gateway"]`` = {"url", "namespace"}, the key in ``$SOS_KEY``), the checkpoint's
    location on the gateway (else None)."""
    from pyspark.sql import SparkSession

    gw = cfg.get("gateway")
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
    return spark, location


# --------------------------------------------------------------------------- acknowledgements


def record_ack(acked_path: str, listener, event, committed: Callable[[int], bool]) -> None:
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


def ack_listener(acked_path: str, location, checkpoint: str, mountpoint: str):
    """The listener of a query run: it records committed batches for the harness
    (:func:`record_ack`), then writes the batch marker; through the gateway when
    ``location`` (a gateway checkpoint) is given, else on the mount."""
    from spark_plugin.spark import GatewayMarkerListener, MarkerListener

    class AckListener(MarkerListener):
        """Records committed batches for the harness, then writes the batch marker."""

        def onQueryProgress(self, event):
            record_ack(
                acked_path,
                self,
                event,
                lambda batch: os.path.exists(os.path.join(self.checkpoint, "commits", str(batch))),
            )
            super().onQueryProgress(event)

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
            record_ack(acked_path, self, event, self.committed)
            super().onQueryProgress(event)

    if location is not None:
        return GatewayAckListener(location)
    return AckListener(checkpoint, mountpoint=mountpoint)


# --------------------------------------------------------------------------- the command loop


class _QueryRunner:
    """The driver's command loop: runs, stops and restarts the demo's query as the harness's
    commands say, and reports its state (``control/status.json``)."""

    def __init__(self, spark, cfg: dict, location, note: Callable[[str], None]) -> None:
        self.spark = spark
        self.location = location
        self.note = note
        control = cfg["control"]
        self.cmd_path = os.path.join(control, "cmd.json")
        self.status_path = os.path.join(control, "status.json")
        self.out_dir = cfg["out"]
        self.acked_path = cfg["acked"]
        os.makedirs(self.out_dir, exist_ok=True)
        self.pid = os.getpid()
        # the demo's query (same source, dedup and sink); a processing-time trigger instead
        # of availableNow because the input keeps coming
        self.stream = (
            spark.readStream.schema("id LONG, payload STRING")
            .option("maxFilesPerTrigger", 1)
            .json(cfg["input"])
            .dropDuplicates(["id"])
        )
        self.handled = -1
        self.query = None
        self.listener = None

    def status(self, seq: int, state: str, error: str | None = None, unreadable: bool = False) -> None:
        write_json_atomic(
            self.status_path,
            {"seq": seq, "state": state, "error": error, "pid": self.pid, "checkpoint_unreadable": unreadable},
        )

    def sink(self, df, batch_id) -> None:  # the demo's sink, without its hang hook
        write_batch_output(self.out_dir, df, batch_id)

    def serve(self) -> None:
        """Until the ``exit`` command: obey each new command, report a query that ended."""
        while True:
            cmd = read_json(self.cmd_path)
            if cmd is not None and cmd["seq"] > self.handled:
                self.handled = cmd["seq"]
                if not self.obey(cmd):
                    break
            if self.query is not None and not self.query.isActive:
                self.report_failure()
            time.sleep(0.1)

    def stop_query(self) -> None:
        if self.query is not None:
            with contextlib.suppress(Exception):
                self.query.stop()
            self.query = None
        if self.listener is not None:
            with contextlib.suppress(Exception):
                self.spark.streams.removeListener(self.listener)
            self.listener = None

    def obey(self, cmd: dict) -> bool:
        """Stop the running query, then do what ``cmd`` says; False on ``exit``."""
        self.stop_query()
        action = cmd["action"]
        if action == "exit":
            self.status(self.handled, "exited")
            return False
        if action == "stop":
            self.status(self.handled, "stopped")
            return True
        self.start_query(cmd["mountpoint"], cmd["checkpoint"])
        return True

    def start_query(self, mnt: str, chk: str) -> None:
        if self.location is None and not os.path.ismount(mnt):
            self.status(self.handled, "failed", f"{mnt} is not a mount point")
            return
        try:
            self.listener = ack_listener(self.acked_path, self.location, chk, mnt)
            self.spark.streams.addListener(self.listener)
            self.query = (
                self.stream.writeStream.foreachBatch(self.sink)
                .option("checkpointLocation", chk)
                .trigger(processingTime=TRIGGER)
                .start()
            )
        except Exception as exc:
            self.status(self.handled, "failed", f"start: {type(exc).__name__}: {str(exc)[:400]}")
            self.query = None
            return
        self.status(self.handled, "running")
        self.note(f"query started on {chk}")

    def report_failure(self) -> None:
        """The query ended without being told: say why (and whether the committed
        checkpoint's state could not be loaded) and leave it stopped."""
        unreadable = False
        try:
            exc = self.query.exception()
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
        self.status(self.handled, "failed", err, unreadable)
        self.note(f"query failed: {err[:200]}")
        self.query = None
