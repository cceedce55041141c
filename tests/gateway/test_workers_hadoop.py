"""Hadoop's own client (FsShell through ``java -cp <pyspark/jars/*>``, the harness of
test_hadoop_tools) through ``sos gateway --workers 2`` and through one process, each on a real
sos-server of its own: the same commands give the same answers (issue 28 item 3)."""

from __future__ import annotations

import re

import pytest

from spark_plugin.gateway.process import GatewayProcess
from tests.gateway.support import hadoop_shell

pytestmark = [pytest.mark.hadoop, pytest.mark.slow, pytest.mark.timeout(900)]

COMMANDS = [
    ["-mkdir", "-p", "{u}/w/a/b"],
    ["-touchz", "{u}/w/a/empty"],
    ["-appendToFile", "/etc/hostname", "{u}/w/a/b/host"],
    ["-cp", "{u}/w/a/b/host", "{u}/w/a/copy"],
    ["-mv", "{u}/w/a/copy", "{u}/w/a/moved"],
    ["-test", "-e", "{u}/w/a/copy"],
    ["-test", "-f", "{u}/w/a/moved"],
    ["-stat", "%n %b %F %r %o", "{u}/w/a/moved"],
    ["-ls", "-R", "{u}/w"],
    ["-count", "{u}/w"],
    ["-du", "-s", "{u}/w"],
    ["-cat", "{u}/w/a/moved"],
    ["-checksum", "{u}/w/a/moved"],
    ["-rm", "-r", "-skipTrash", "{u}/w/a/b"],
    ["-ls", "{u}/w/a"],
    ["-cat", "{u}/w/a/nothing"],
    ["-mkdir", "{u}/w/a/moved/sub"],
]

NS = "hadooptools"


def answers(java_env, server, base, workers: int) -> list[tuple[int, str, str]]:
    key = server.keygen(NS, "append")
    gw = GatewayProcess(
        NS,
        str(base / f"cache-{workers}"),
        server.address,
        key,
        extra_args=["--workers", str(workers)],
        log_path=str(base / f"gateway-{workers}.log"),
    ).start()
    try:
        got = hadoop_shell(java_env, (gw, key), *COMMANDS)
    finally:
        assert gw.stop() == 0, gw.log()[-4000:]
    host = gw.url.split("//", 1)[1]
    # the gateway's address, and the times of day, differ between the two runs
    return [
        (code, *(re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d", "DATE", s.replace(host, "GATEWAY")) for s in (out, err)))
        for code, out, err in got
    ]


def test_fs_shell_answers_the_same_through_two_processes(java_env, sos_server_factory, tmp_path):
    one = answers(java_env, sos_server_factory(), tmp_path, 1)
    two = answers(java_env, sos_server_factory(), tmp_path, 2)
    with open("/etc/hostname") as f:
        assert one[11] == (0, f.read(), "")  # -cat of the copy that was moved
    assert [c == 0 for c, _, _ in one] == [True] * 5 + [False, True] + [True] * 8 + [False, False]
    assert "/w/a/moved" in one[8][1] and "/w/a/b/host" in one[8][1]
    for command, a, b in zip(COMMANDS, one, two, strict=True):
        assert a == b, command
