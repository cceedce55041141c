"""Fixtures the gateway's test modules share: ``java_env``, Hadoop's own client (the harness
tests/java/HadoopHarness.java compiled against pyspark's jars) that tests/gateway/support.py's
hadoop_java runs."""

from __future__ import annotations

import pytest

from tests.gateway.support import compiled_harness


@pytest.fixture(scope="module")
def java_env(tmp_path_factory):
    """(classpath, env) to run Hadoop's client: the harness compiled with javac."""
    return compiled_harness(tmp_path_factory.mktemp("harness"), "HadoopHarness.java")
