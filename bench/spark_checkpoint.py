"""Micro-batch duration with the checkpoint on the SOS mount against a local directory.

The same stateful query (file source, maxFilesPerTrigger=1, dropDuplicates, foreachBatch
sink) runs in ONE Spark session, alternately with its checkpoint in a local directory and
on a journaled `sos mount` (sync mode: every checkpoint rename waits for the server's
fdatasync), over --batches batches each. Per-batch time is Spark's own
`durationMs.triggerExecution` (it includes the offsets and commits log writes and the
state store commit). Prints a table and a JSON line; exit 0.

    python3 bench/spark_checkpoint.py [--batches 60] [--rounds 2] [--records-per-batch 500]
                                      [--state-store hdfs|rocksdb] [--async]

bench/gateway.py runs the same measurement with a third side, the checkpoint on
`sos gateway` (webhdfs://), through :func:`alternate`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import doc_parser, remove_work
from spark_plugin.spark import NO_CRC_CONF, start_mount
from tools.demo import ROCKSDB_PROVIDER, LocalServer, keygen, make_input


class BatchTimer:
    """Per-batch ``durationMs`` of the queries of one session, by label (a listener).

    ``durations[label]``: triggerExecution of each batch run under ``label``;
    ``phases[side][phase]``: every phase's durations, by side (the label up to its first
    ``-``: "mount-0" and "mount-1" pool into "mount").
    """

    def __init__(self, spark) -> None:
        from pyspark.sql.streaming import StreamingQueryListener

        self.durations: dict[str, list[float]] = {}
        self.phases: dict[str, dict[str, list[float]]] = {}
        #: wall-clock seconds of each labelled run (query start to termination)
        self.wall: dict[str, float] = {}
        self.current: str | None = None
        timer = self

        class Recorder(StreamingQueryListener):
            def onQueryStarted(self, event):
                pass

            def onQueryProgress(self, event):
                ms = event.progress.durationMs.get("triggerExecution")
                if timer.current is not None and ms is not None:
                    timer.durations.setdefault(timer.current, []).append(float(ms))
                    where = timer.current.split("-")[0]
                    for k, v in event.progress.durationMs.items():
                        timer.phases.setdefault(where, {}).setdefault(k, []).append(float(v))

            def onQueryIdle(self, event):
                pass

            def onQueryTerminated(self, event):
                pass

        spark.streams.addListener(Recorder())

    def pooled(self, where: str) -> list[float]:
        return [d for k, v in self.durations.items() if k.startswith(where + "-") for d in v]


def open_session(
    state_store: str = "hdfs",
    no_crc: bool = False,
    app: str = "sos-bench",
    partitions: int = 2,
    changelog: bool = False,
):
    """The benchmark's Spark session: local[2], ``partitions`` shuffle partitions (default 2;
    Spark's own default is 200), otherwise Spark's defaults (``no_crc``: NO_CRC_CONF;
    ``state_store``: hdfs or rocksdb; ``changelog``: RocksDB's changelog checkpointing)."""
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.sql.shuffle.partitions", str(partitions))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    if no_crc:
        for k, v in NO_CRC_CONF.items():
            builder = builder.config("spark.hadoop." + k, v)
    if state_store == "rocksdb":
        builder = builder.config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
        if changelog:
            builder = builder.config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_query(
    spark, timer: BatchTimer, label: str, checkpoint: str, input_dir: str, out_dir: str, batches: int
) -> None:
    """The measured query (file source, maxFilesPerTrigger=1, dropDuplicates, foreachBatch)
    over ``input_dir`` until it is used up, its batches timed under ``label``."""
    timer.current = label
    os.makedirs(out_dir, exist_ok=True)

    def sink(df, batch_id):
        n = df.count()
        with open(os.path.join(out_dir, f"batch-{batch_id}"), "w") as f:
            f.write(str(n))

    t0 = time.monotonic()
    q = (
        spark.readStream.schema("id LONG, payload STRING")
        .option("maxFilesPerTrigger", 1)
        .json(input_dir)
        .dropDuplicates(["id"])
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    timer.wall[label] = time.monotonic() - t0
    deadline = time.monotonic() + 60  # progress events arrive asynchronously
    while len(timer.durations.get(label, [])) < batches and time.monotonic() < deadline:
        time.sleep(0.05)
    timer.current = None


def add_query_options(p: argparse.ArgumentParser, *, rounds: int, rounds_help: str) -> None:
    """The options of the query that alternate() runs and open_session() opens: --batches,
    --rounds (default *rounds*), --records-per-batch, --state-store."""
    p.add_argument("--batches", type=int, default=60, help="batches per run (default 60)")
    p.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    p.add_argument("--records-per-batch", type=int, default=500)
    p.add_argument("--state-store", choices=("hdfs", "rocksdb"), default="hdfs")
    p.add_argument(
        "--partitions", type=int, default=2, help="spark.sql.shuffle.partitions (default 2; Spark's default is 200)"
    )
    p.add_argument("--changelog", action="store_true", help="RocksDB's changelog checkpointing (with rocksdb)")


def local_and_mount(work: str, mnt: str) -> dict:
    """The two sides every run has, for alternate(): a local directory under *work* and the mount at *mnt*."""
    return {
        "local": lambda r: os.path.join(work, "local", f"chk-{r}"),
        "mount": lambda r: os.path.join(mnt, f"chk-{r}"),
    }


def alternate(
    spark, timer: BatchTimer, work: str, sides: dict, args: argparse.Namespace, *, rotate: bool = False
) -> float:
    """Warm up on a local checkpoint (not counted), then ``args.rounds`` times run the query on
    each side in turn: ``sides[name](round) -> checkpointLocation``; the same input (same
    records, same files: ``args.batches`` batches of ``args.records_per_batch``, the options of
    add_query_options) on every side. ``rotate``: round r starts with side r (mod the
    number of sides), so no side always runs first. Returns the elapsed seconds of the
    measured part."""
    batches, rounds, records_per_batch = args.batches, args.rounds, args.records_per_batch
    records = batches * records_per_batch
    make_input(os.path.join(work, "in-warm"), 5 * records_per_batch, 5)
    run_query(
        spark,
        timer,
        "warmup",
        os.path.join(work, "local-warm"),
        os.path.join(work, "in-warm"),
        os.path.join(work, "out", "warmup"),
        5,
    )
    t0 = time.monotonic()
    for r in range(rounds):
        order = list(sides.items())
        if rotate:
            order = order[r % len(order) :] + order[: r % len(order)]
        for where, checkpoint_of in order:
            inp = os.path.join(work, f"in-{where}-{r}")
            make_input(inp, records, batches)
            run_query(
                spark, timer, f"{where}-{r}", checkpoint_of(r), inp, os.path.join(work, "out", f"{where}-{r}"), batches
            )
    return time.monotonic() - t0


def side_figures(timer: BatchTimer, where: str) -> dict:
    """median, mean and p90 (ms) of one side's pooled batch durations."""
    values = timer.pooled(where)
    return {
        "n": len(values),
        "median_ms": statistics.median(values),
        "mean_ms": statistics.fmean(values),
        "p90_ms": statistics.quantiles(values, n=10)[-1],
    }


def flat_figures(fig: dict[str, dict], sides) -> dict[str, float]:
    """``{side}_median_ms``, ``{side}_mean_ms``, ``{side}_p90_ms`` of each side's side_figures, for the JSON line."""
    return {f"{w}_{k}": fig[w][k] for w in sides for k in ("median_ms", "mean_ms", "p90_ms")}


PHASES = ("walCommit", "addBatch", "commitOffsets", "latestOffset", "queryPlanning")


def main(argv=None) -> int:
    p = doc_parser(__doc__, epilog=False)
    add_query_options(p, rounds=2, rounds_help="alternations local/mount (default 2)")
    p.add_argument("--async", dest="async_", action="store_true", help="mount in async mode")
    p.add_argument(
        "--no-crc",
        action="store_true",
        help="both sides: Hadoop's raw local FS (no .crc sidecar files, half the "
        "renames; see spark_plugin.spark.NO_CRC_CONF)",
    )
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="sos-bench-spark-")
    server = LocalServer(os.path.join(work, "server"), os.path.join(work, "server.log"))
    mount = None
    try:
        key = keygen(os.path.join(work, "server"), "bench")
        server.start()
        mnt = os.path.join(work, "mnt")
        mount = start_mount(
            "bench",
            mnt,
            server=server.address,
            key=key,
            cache_dir=os.path.join(work, "cache"),
            sync=not args.async_,
            log_path=os.path.join(work, "mount.log"),
        )

        spark = open_session(args.state_store, args.no_crc, partitions=args.partitions, changelog=args.changelog)
        timer = BatchTimer(spark)
        sides = local_and_mount(work, mnt)
        elapsed = alternate(spark, timer, work, sides, args)
        spark.stop()

        fig = {w: side_figures(timer, w) for w in sides}
        res = {
            "batches_each": fig["local"]["n"],
            "batches_mount": fig["mount"]["n"],
            "no_crc": args.no_crc,
            "state_store": args.state_store,
            "mode": "async" if args.async_ else "sync",
            "records_per_batch": args.records_per_batch,
            "elapsed_s": elapsed,
        }
        res.update(flat_figures(fig, sides))
        res["ratio_median"] = res["mount_median_ms"] / res["local_median_ms"]
        res["ratio_mean"] = res["mount_mean_ms"] / res["local_mean_ms"]
        print(
            f"Spark micro-batch duration (triggerExecution), {res['state_store']} state store, "
            f"mount {res['mode']}, {'no .crc files, ' if args.no_crc else ''}"
            f"{res['batches_each']} batches each:"
        )
        print(f"  {'':8} {'median':>9} {'mean':>9} {'p90':>9}")
        for w in ("local", "mount"):
            print(f"  {w:8} {res[w + '_median_ms']:8.0f}ms {res[w + '_mean_ms']:8.0f}ms {res[w + '_p90_ms']:8.0f}ms")
        print(f"  ratio mount/local: median {res['ratio_median']:.3f}, mean {res['ratio_mean']:.3f} (target <= 1.10)")
        phases = timer.phases
        print(
            "  median per phase (ms): "
            + ", ".join(
                f"{k} {statistics.median(phases['local'].get(k, [0])):.0f}/"
                f"{statistics.median(phases['mount'].get(k, [0])):.0f}"
                for k in PHASES
            )
            + " (local/mount)"
        )
        res["phases_median_ms"] = {
            w: {k: statistics.median(v) for k, v in phases[w].items()} for w in ("local", "mount")
        }
        print(json.dumps(res, sort_keys=True))
        return 0
    finally:
        if mount is not None:
            mount.stop()
        server.stop()
        remove_work(work, args.keep)


if __name__ == "__main__":
    sys.exit(main())
