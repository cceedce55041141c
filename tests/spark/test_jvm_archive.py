"""The class-data archive of Spark's classes (tools/jvm.py): scripts/setup made it; the
options the demo, the soak and the tests start Spark's JVMs with map it (that a driver and
an executor then map Spark's classes from it instead of reading them from the jars:
tests/spark/test_cluster.py, from the cluster demo's JVMs); an archive that does not fit
(another JDK, damaged) is ignored without a word on the JVM's stdout."""

import os
import subprocess

import pytest

from tools.jvm import LIGHT_JVM_OPTIONS, archive_path, options_with_archive, spark_jvm_options


@pytest.mark.spark
def test_setup_made_the_archive_and_the_options_map_it(monkeypatch):
    """scripts/setup made the archive; the options every Spark JVM of the demo, the soak and
    the tests starts with map it. (That a driver and an executor started with them load
    Spark's classes from it: tests/spark/test_cluster.py reads the class-loading logs of the
    cluster demo's JVMs.)"""
    pytest.importorskip("pyspark")
    monkeypatch.delenv("SOS_SPARK_JVM_EXTRA", raising=False)
    assert os.path.isfile(archive_path()), f"scripts/setup makes {archive_path()}"
    opts = spark_jvm_options()
    assert opts == options_with_archive(archive_path()) and f"-XX:SharedArchiveFile={archive_path()}" in opts


def test_extra_options_come_after_the_archive_ones(monkeypatch):
    monkeypatch.setenv("SOS_SPARK_JVM_EXTRA", " -Xlog:class+load=info:file=/x/%p.log ")
    assert spark_jvm_options().endswith(" -Xlog:class+load=info:file=/x/%p.log")
    assert spark_jvm_options().startswith(LIGHT_JVM_OPTIONS)


def test_without_an_archive_the_options_are_the_light_ones(monkeypatch, tmp_path):
    import tools.jvm

    monkeypatch.delenv("SOS_SPARK_JVM_EXTRA", raising=False)
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
