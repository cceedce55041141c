"""What a gateway's process imports to serve alone (issue 27 item 4): the tests start hundreds
of gateways, almost all with one process and no standby, so ``--workers N`` and the standby are
imported only when asked for (``run.py``, ``cli.py``). A fresh interpreter each; its
``sys.modules`` is checked. tests/gateway/test_workers.py and test_standby.py run both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_active_gateway_imports_neither_the_workers_nor_the_standby():
    code = (
        "import json, sys\n"
        "from spark_plugin.gateway.run import run_gateway\n"
        "from spark_plugin.gateway.cli import serve\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
        check=True,
    )
    modules = set(json.loads(r.stdout.splitlines()[-1]))
    assert "spark_plugin.gateway.http.server" in modules  # what serves is there
    for unwanted in (
        "spark_plugin.gateway.workers",
        "spark_plugin.gateway.pair.standby",
        "sos_journal.read.verify",
        "importlib.metadata",
        "crc32c",
        "boto3",
        "botocore",
        "pyspark",
    ):
        assert unwanted not in modules, unwanted
