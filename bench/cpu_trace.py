"""A pytest plugin that writes, per test, its wall time and the CPU of everything its xdist
worker started (the worker's own cgroup v1 ``cpuacct`` group, so orphaned servers and JVMs
count too), one JSON line per test: what docs/BENCHMARKS.md's "Fifth round" of CI time read.

    PYTHONPATH=bench TRACE_OUT=/tmp/trace.jsonl ./scripts/test -p cpu_trace

Needs root and cgroup v1's cpuacct at /sys/fs/cgroup/cpuacct (this machine). Idle time of the
machine beside it: ``while :; do echo "$(date +%s) $(head -1 /proc/stat)"; sleep 1; done``.
"""

from __future__ import annotations

import json
import os
import time

import pytest

OUT = os.environ.get("TRACE_OUT", "/tmp/trace.jsonl")
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
GROUP = f"/sys/fs/cgroup/cpuacct/sos-trace-{WORKER}"
os.makedirs(GROUP, exist_ok=True)
with open(f"{GROUP}/cgroup.procs", "w") as f:  # this worker and all it starts from now on
    f.write(str(os.getpid()))


def _cpu_seconds() -> float:
    with open(f"{GROUP}/cpuacct.usage") as f:
        return int(f.read()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t0, c0 = time.time(), _cpu_seconds()
    yield
    t1, c1 = time.time(), _cpu_seconds()
    with open(OUT, "a") as f:
        f.write(json.dumps({"worker": WORKER, "id": item.nodeid, "t0": t0, "t1": t1, "cpu": c1 - c0}) + "\n")
