"""What ``sos-server`` imports at its start (issue 27 item 4): the suite starts a server, and
runs keygen, quota and the like, thousands of times. Each run is a fresh interpreter whose
``sys.modules`` is read at its end (tests/client/test_startup.py does the same for ``sos``):
the commands that do not serve load neither trio nor the engine, and a server without
``--tier`` loads none of the tier's uploader, its bootstrap nor an S3 SDK.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TIER_MODULES = (
    "sos_server.tiering",
    "sos_server.tier_bootstrap",
    "sos_tier.uploader",
    "sos_tier.layout",
    "sos_tier.log",
)
NEVER = ("boto3", "botocore", "pyspark", "sos_tier.s3", "importlib.metadata", "crc32c")


def _modules(code: str) -> set[str]:
    r = subprocess.run(
        [sys.executable, "-c", code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=120,
        check=True,
    )
    return set(json.loads(r.stdout.splitlines()[-1]))


def test_keygen_loads_neither_trio_nor_the_engine_nor_the_tier(tmp_path):
    modules = _modules(
        "import contextlib, io\nfrom sos_server.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        f"    code = main(['keygen', '--data', {str(tmp_path)!r}, '--role', 'append', 'ns'])\n"
        "assert code in (0, None) and out.getvalue().strip(), (code, out.getvalue())"
    )
    assert (tmp_path / "ns").exists() or any(tmp_path.iterdir())  # it did create the key
    for unwanted in ("trio", "sos_server.engine", "sos_server.serve", *TIER_MODULES, *NEVER):
        assert unwanted not in modules, unwanted


def test_a_server_without_tier_loads_none_of_the_tier():
    """``sos_server.serve`` is what ``sos-server serve`` runs; the tier's modules come with
    ``--tier`` only (serve.py imports them where the store is given)."""
    modules = _modules("import sos_server.serve")
    assert "trio" in modules and "sos_server.engine" in modules
    for unwanted in (*TIER_MODULES, *NEVER):
        assert unwanted not in modules, unwanted
