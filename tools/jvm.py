"""The JVM options of the Spark processes (drivers, masters, workers, executors) that the demo,
the soak, the benches and the tests start.

A short-lived local driver starts and runs ~2x faster on 2 busy cores with the C1 JIT only
and the serial GC (measured: 44-50 s against 113-118 s for the same 4 batches). A driver
also spends about a third of its CPU loading and verifying Spark's ~15,000 classes: a
class-data-sharing archive (JDK CDS, a dynamic archive) of the classes a streaming driver
loads, made once per virtual environment by ``python -m tools.jvm`` (scripts/setup runs it),
maps them instead (a small stateful query: 21 -> 13.5 s of CPU). A master, a worker and an
executor have the driver's class path, so they map the same archive (a master: all of its
~4,500 classes; an executor: ~6,100 of its ~6,700).

The archive is only ever read: the JVM checks it against its own build and against every jar
of the class path (size and time) and, finding any difference (another JDK, a pyspark
upgraded, a class path that is not the driver's), ignores it silently (``-Xlog:cds=off``:
its warnings would go to the driver's stdout) and loads the classes as usual. A missing
archive is ignored the same way, so the options are right on any machine.

``$SOS_SPARK_JVM_EXTRA`` (options, e.g. ``-Xlog:class+load=info:file=DIR/%p.log``) is added
to them, for a test that looks into the JVMs a run starts (tests/spark/test_cluster.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

#: C1 JIT only, serial GC: what every short-lived JVM of the demo and the tests runs with
LIGHT_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
_QUIET_CDS = "-Xlog:cds=off,cds+dynamic=off"


def archive_path() -> str:
    """Where this virtual environment's archive lives (named after the pyspark
    version: an upgrade makes a new one rather than reading a stale one)."""
    return os.path.join(sys.prefix, "share", "sos", f"spark-driver-{_pyspark_version()}.jsa")


def _pyspark_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pyspark")
    except PackageNotFoundError:  # no pyspark: no archive either
        return "none"


def spark_jvm_options() -> str:
    """LIGHT_JVM_OPTIONS, plus the class-data archive when this environment has one (and
    ``$SOS_SPARK_JVM_EXTRA``, when set)."""
    path = archive_path()
    opts = options_with_archive(path) if os.path.isfile(path) else LIGHT_JVM_OPTIONS
    extra = os.environ.get("SOS_SPARK_JVM_EXTRA", "").strip()
    return f"{opts} {extra}" if extra else opts


def options_with_archive(path: str) -> str:
    """LIGHT_JVM_OPTIONS mapping the archive at *path*, its warnings kept off stdout."""
    return f"{LIGHT_JVM_OPTIONS} -XX:SharedArchiveFile={path} {_QUIET_CDS}"


def _run_driver(dump_to: str) -> None:
    """A driver that loads what a streaming driver of the demo loads (a file stream, a
    stateful aggregation on both state stores, a Python foreachBatch, a checkpoint), then
    exits: its JVM writes the classes it loaded to ``dump_to``."""
    from pyspark.sql import SparkSession

    work = tempfile.mkdtemp(prefix="sos-cds-")
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("sos-cds")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", f"{LIGHT_JVM_OPTIONS} -XX:ArchiveClassesAtExit={dump_to}")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    os.makedirs(os.path.join(work, "in"))
    with open(os.path.join(work, "in", "0.json"), "w") as f:
        f.writelines(f'{{"id": {i}, "k": {i % 5}}}\n' for i in range(50))
    for store in ("", "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"):
        if store:
            spark.conf.set("spark.sql.streaming.stateStore.providerClass", store)
        stream = spark.readStream.schema("id LONG, k LONG").json(os.path.join(work, "in"))
        query = (
            stream.groupBy("k")
            .count()
            .writeStream.outputMode("update")
            .option("checkpointLocation", os.path.join(work, f"chk{bool(store)}"))
            .foreachBatch(lambda df, _batch: df.collect())
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(300)
    spark.stop()


def make_archive(path: str) -> bool:
    """Write the driver archive to ``path`` (atomically: a temporary name, renamed once the
    driver that wrote it exited cleanly). False, with the reason on stderr, if it failed."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tools.jvm", "--driver", tmp],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        if proc.returncode != 0 or not os.path.isfile(tmp):
            sys.stderr.write(proc.stderr[-3000:])
            return False
        os.replace(tmp, path)
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.jvm",
        description="Make this environment's class-data archive of a Spark driver (once; "
        "the drivers of the demo and the tests then start with a third less CPU).",
    )
    p.add_argument("--force", action="store_true", help="make it again even if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="say nothing when it is already there")
    p.add_argument("--driver", metavar="DUMP", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.driver:
        _run_driver(args.driver)
        return 0
    path = archive_path()
    if os.path.isfile(path) and not args.force:
        if not args.quiet:
            print(f"{path}: present")
        return 0
    print(f"{path}: running a small Spark driver to make it (~30 s, once)", file=sys.stderr, flush=True)
    if not make_archive(path):
        print("the archive could not be made: Spark's JVMs start without it", file=sys.stderr)
        return 1
    print(f"{path}: {os.path.getsize(path) // 2**20} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
