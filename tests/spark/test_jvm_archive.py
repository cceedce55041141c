"""The class-data archive of Spark's classes (tools/jvm.py): scripts/setup made it; a driver
and an executor started with the options the demo, the soak and the tests use map Spark's
classes from it instead of reading them from the jars; an archive that does not fit (another
JDK, damaged) is ignored without a word on the JVM's stdout."""

import os
import subprocess
import sys
import textwrap

import pytest

from tools import child_env
from tools.jvm import LIGHT_JVM_OPTIONS, archive_path, options_with_archive, spark_jvm_options

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_JOB = textwrap.dedent(
    """
    import sys
    from pyspark.sql import SparkSession

    opts, driver_log, executor_log = sys.argv[1:]
    spark = (
        SparkSession.builder.master("local-cluster[1,1,1024]")
        .config("spark.ui.enabled", "false")
        .config("spark.executor.memory", "512m")
        .config("spark.driver.extraJavaOptions", f"{opts} -Xlog:class+load=info:file={driver_log}")
        .config("spark.executor.extraJavaOptions", f"{opts} -Xlog:class+load=info:file={executor_log}")
        .getOrCreate()
    )
    rows = spark.range(100).selectExpr("id % 3 AS k").groupBy("k").count().collect()
    print(sorted((r.k, r["count"]) for r in rows))
    spark.stop()
    """
)


def _from_archive(log: str) -> tuple[int, int]:
    """(classes mapped from the archive, classes read from jars or directories)."""
    with open(log) as f:
        lines = f.read().splitlines()
    shared = sum(1 for ln in lines if "source: shared objects file (top)" in ln)
    read = sum(1 for ln in lines if "source: jar:" in ln or "source: file:" in ln)
    return shared, read


@pytest.mark.spark
@pytest.mark.slow
def test_a_driver_and_an_executor_map_sparks_classes_from_the_archive(tmp_path):
    pytest.importorskip("pyspark")
    assert os.path.isfile(archive_path()), f"scripts/setup makes {archive_path()}"
    opts = spark_jvm_options()
    assert opts == options_with_archive(archive_path()) and f"-XX:SharedArchiveFile={archive_path()}" in opts
    driver_log, executor_log = tmp_path / "driver.log", tmp_path / "executor.log"
    job = tmp_path / "job.py"
    job.write_text(_JOB)
    proc = subprocess.run(
        [sys.executable, str(job), opts, str(driver_log), str(executor_log)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[(0, 34), (1, 33), (2, 33)]" in proc.stdout, proc.stdout[-2000:]
    # a JVM that could not use the archive reads every class from the jars: thousands
    for log in (driver_log, executor_log):
        shared, read = _from_archive(str(log))
        assert shared > 3000 and read < shared / 5, (log.name, shared, read)
    with open(driver_log) as f:
        assert any("org.apache.spark.SparkContext source: shared objects file (top)" in ln for ln in f)


def test_without_an_archive_the_options_are_the_light_ones(monkeypatch, tmp_path):
    import tools.jvm

    monkeypatch.setattr(tools.jvm, "archive_path", lambda: str(tmp_path / "none.jsa"))
    assert tools.jvm.spark_jvm_options() == LIGHT_JVM_OPTIONS


@pytest.mark.parametrize("content", [b"", b"not an archive" * 1000])
def test_an_archive_that_does_not_fit_is_ignored_silently(tmp_path, content):
    bad = tmp_path / "bad.jsa"
    bad.write_bytes(content)
    opts = options_with_archive(str(bad)).split()
    proc = subprocess.run(["java", *opts, "-version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "", proc.stdout  # nothing on a driver's stdout
    assert "version" in proc.stderr
