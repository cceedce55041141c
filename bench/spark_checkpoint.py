"""Micro-batch duration with the checkpoint on the SOS mount against a local directory.

The same stateful query (file source, maxFilesPerTrigger=1, dropDuplicates, foreachBatch
sink) runs in ONE Spark session, alternately with its checkpoint in a local directory and
on a journaled `sos mount` (sync mode: every checkpoint rename waits for the server's
fdatasync), over --batches batches each. Per-batch time is Spark's own
`durationMs.triggerExecution` (it includes the offsets and commits log writes and the
state store commit). Prints a table and a JSON line; exit 0.

    python3 bench/spark_checkpoint.py [--batches 60] [--rounds 2] [--records-per-batch 500]
                                      [--state-store hdfs|rocksdb] [--async]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.demo import (ROCKSDB_PROVIDER, LocalServer, keygen,  # noqa: E402
                               make_input)
from spark_plugin.spark import NO_CRC_CONF, start_mount  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=60, help="batches per run (default 60)")
    p.add_argument("--rounds", type=int, default=2,
                   help="alternations local/mount (default 2)")
    p.add_argument("--records-per-batch", type=int, default=500)
    p.add_argument("--state-store", choices=("hdfs", "rocksdb"), default="hdfs")
    p.add_argument("--async", dest="async_", action="store_true", help="mount in async mode")
    p.add_argument("--no-crc", action="store_true",
                   help="both sides: Hadoop's raw local FS (no .crc sidecar files, half the "
                        "renames; see spark_plugin.spark.NO_CRC_CONF)")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="sos-bench-spark-")
    server = LocalServer(os.path.join(work, "server"), os.path.join(work, "server.log"))
    mount = None
    try:
        key = keygen(os.path.join(work, "server"), "bench")
        server.start()
        mnt = os.path.join(work, "mnt")
        mount = start_mount("bench", mnt, server=server.address, key=key,
                            cache_dir=os.path.join(work, "cache"), sync=not args.async_,
                            log_path=os.path.join(work, "mount.log"))

        from pyspark.sql import SparkSession
        from pyspark.sql.streaming import StreamingQueryListener

        builder = (SparkSession.builder.master("local[2]").appName("sos-bench")
                   .config("spark.sql.shuffle.partitions", "2")
                   .config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false"))
        if args.no_crc:
            for k, v in NO_CRC_CONF.items():
                builder = builder.config("spark.hadoop." + k, v)
        if args.state_store == "rocksdb":
            builder = builder.config("spark.sql.streaming.stateStore.providerClass",
                                     ROCKSDB_PROVIDER)
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")

        durations: dict[str, list[float]] = {}
        phases: dict[str, dict[str, list[float]]] = {}  # where the time goes, per phase

        class Recorder(StreamingQueryListener):
            def __init__(self):
                self.current = None

            def onQueryStarted(self, event):
                pass

            def onQueryProgress(self, event):
                ms = event.progress.durationMs.get("triggerExecution")
                if self.current is not None and ms is not None:
                    durations.setdefault(self.current, []).append(float(ms))
                    where = self.current.split("-")[0]
                    for k, v in event.progress.durationMs.items():
                        phases.setdefault(where, {}).setdefault(k, []).append(float(v))

            def onQueryIdle(self, event):
                pass

            def onQueryTerminated(self, event):
                pass

        recorder = Recorder()
        spark.streams.addListener(recorder)

        def run(label, checkpoint, input_dir):
            recorder.current = label
            out = os.path.join(work, "out", label)
            os.makedirs(out, exist_ok=True)

            def sink(df, batch_id):
                n = df.count()
                with open(os.path.join(out, f"batch-{batch_id}"), "w") as f:
                    f.write(str(n))

            q = (spark.readStream.schema("id LONG, payload STRING")
                 .option("maxFilesPerTrigger", 1).json(input_dir).dropDuplicates(["id"])
                 .writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint)
                 .trigger(availableNow=True).start())
            q.awaitTermination()
            deadline = time.monotonic() + 60  # progress events arrive asynchronously
            while len(durations.get(label, [])) < args.batches and time.monotonic() < deadline:
                time.sleep(0.05)
            recorder.current = None

        records = args.batches * args.records_per_batch
        # warm-up (JIT, class loading) on a local checkpoint, not counted
        make_input(os.path.join(work, "in-warm"), 5 * args.records_per_batch, 5)
        run("warmup", os.path.join(work, "local-warm"), os.path.join(work, "in-warm"))
        t0 = time.monotonic()
        for r in range(args.rounds):
            for where in ("local", "mount"):
                inp = os.path.join(work, f"in-{where}-{r}")
                make_input(inp, records, args.batches)
                base = mnt if where == "mount" else os.path.join(work, "local")
                run(f"{where}-{r}", os.path.join(base, f"chk-{r}"), inp)
        elapsed = time.monotonic() - t0
        spark.stop()

        def pooled(where):
            return [d for k, v in durations.items() if k.startswith(where + "-") for d in v]

        local, mounted = pooled("local"), pooled("mount")
        res = {"batches_each": len(local), "batches_mount": len(mounted), "no_crc": args.no_crc,
               "state_store": args.state_store, "mode": "async" if args.async_ else "sync",
               "records_per_batch": args.records_per_batch,
               "local_median_ms": statistics.median(local),
               "mount_median_ms": statistics.median(mounted),
               "local_mean_ms": statistics.fmean(local),
               "mount_mean_ms": statistics.fmean(mounted),
               "local_p90_ms": statistics.quantiles(local, n=10)[-1],
               "mount_p90_ms": statistics.quantiles(mounted, n=10)[-1],
               "elapsed_s": elapsed}
        res["ratio_median"] = res["mount_median_ms"] / res["local_median_ms"]
        res["ratio_mean"] = res["mount_mean_ms"] / res["local_mean_ms"]
        print(f"Spark micro-batch duration (triggerExecution), {res['state_store']} state store, "
              f"mount {res['mode']}, {'no .crc files, ' if args.no_crc else ''}"
              f"{len(local)} batches each:")
        print(f"  {'':8} {'median':>9} {'mean':>9} {'p90':>9}")
        for w in ("local", "mount"):
            print(f"  {w:8} {res[w + '_median_ms']:8.0f}ms {res[w + '_mean_ms']:8.0f}ms "
                  f"{res[w + '_p90_ms']:8.0f}ms")
        print(f"  ratio mount/local: median {res['ratio_median']:.3f}, "
              f"mean {res['ratio_mean']:.3f} (target <= 1.10)")
        keys = ("walCommit", "addBatch", "commitOffsets", "latestOffset", "queryPlanning")
        print("  median per phase (ms): " + ", ".join(
            f"{k} {statistics.median(phases['local'].get(k, [0])):.0f}/"
            f"{statistics.median(phases['mount'].get(k, [0])):.0f}" for k in keys)
            + " (local/mount)")
        res["phases_median_ms"] = {w: {k: statistics.median(v) for k, v in phases[w].items()}
                                   for w in ("local", "mount")}
        print(json.dumps(res, sort_keys=True))
        return 0
    finally:
        if mount is not None:
            mount.stop()
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


if __name__ == "__main__":
    sys.exit(main())
