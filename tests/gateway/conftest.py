"""Fixtures the gateway's test modules share: ``java_env``, Hadoop's own client (the harness
tests/java/HadoopHarness.java compiled against pyspark's jars) that tests/gateway/support.py's
hadoop_java runs."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.support import hadoop_jars

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def java_env(tmp_path_factory):
    """(classpath, env) to run Hadoop's client: the harness compiled with javac."""
    if shutil.which("java") is None or shutil.which("javac") is None:
        pytest.skip("no JDK (java and javac) on this machine")
    jars = hadoop_jars()
    classes = tmp_path_factory.mktemp("harness")
    subprocess.run(
        [
            "javac",
            "-nowarn",
            "-d",
            str(classes),
            "-cp",
            os.path.join(jars, "*"),
            os.path.join(TESTS, "java", "HadoopHarness.java"),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    # UTF-8 arguments and output whatever the machine's locale
    env = dict(
        os.environ,
        LC_ALL="C.UTF-8",
        LANG="C.UTF-8",
        JAVA_TOOL_OPTIONS="-Dfile.encoding=UTF-8 -Dsun.stdout.encoding=UTF-8 -Dsun.stderr.encoding=UTF-8 -Xshare:auto",
    )
    return f"{classes}{os.pathsep}{os.path.join(jars, '*')}", env
