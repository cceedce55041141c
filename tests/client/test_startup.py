"""What ``sos`` imports at its start (issue 27 item 4): the suite starts thousands of short
``sos`` processes on 2 busy cores, so each command imports what it runs and no more. Each
command runs in a fresh interpreter (as the console script does: ``sos_client.cli.main``), and
its ``sys.modules`` at the end is what is checked: a test here fails when an eager import comes
back. Costs are in docs/BENCHMARKS.md ("Start-up CPU of the commands", ``bench/startup.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEY = "70cb3ef3b083dc1c." + "5" * 64  # the form `sos-server keygen` prints

#: a child that runs ``main(argv)`` of *module* with its output discarded, then prints its modules
CHILD = """
import contextlib, io, json, sys
from {module} import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
    try:
        code = main({argv!r})
    except SystemExit as exc:
        code = exc.code
print(json.dumps({{"code": code, "stderr": err.getvalue(), "modules": sorted(sys.modules)}}))
"""

#: never imported by a command that does not use them: the tier's S3 SDK, Spark, FUSE, trio
#: (the faces' and the server's event loop), the progress bar, the test tools
NEVER = ("boto3", "botocore", "pyspark", "pyfuse3", "trio", "tqdm", "hypothesis", "moto", "sos_tier.s3")


def modules_after(argv: list[str], module: str = "sos_client.cli") -> tuple[int, str, set[str]]:
    """(exit status, stderr, the modules imported) of ``main(argv)`` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), SOS_KEY=KEY)
    env.pop("SOS_KEY_FILE", None)
    r = subprocess.run(
        [sys.executable, "-c", CHILD.format(module=module, argv=argv)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    out = json.loads(r.stdout.splitlines()[-1])
    return out["code"], out["stderr"], set(out["modules"])


def test_sos_help_lists_every_command_without_the_sdks():
    code, _err, modules = modules_after(["--help"])
    assert code == 0
    assert not modules & set(NEVER), modules & set(NEVER)
    # the plugged parsers are built, their implementations are not imported
    assert "sos_journal.cli" in modules and "spark_plugin.gateway.cli" in modules
    for heavy in ("sos_journal.rebuild.restore", "sos_journal.read.verify", "sos_journal.writer.writer"):
        assert heavy not in modules, heavy
    assert "sos_client.blocking" not in modules  # no connection for --help


def test_sos_ls_imports_neither_the_journal_nor_the_entry_points():
    """``sos ls`` (and put, cat, stat) is the client alone: no sos_journal, no spark_plugin, no
    importlib.metadata (neither the plugged commands' entry points nor crc32c's own version
    lookup), no humanfriendly (no size or duration to parse), no tenacity (no connection lost)."""
    code, err, modules = modules_after(["ls", "ns", "--server", "127.0.0.1:1", "--timeout", "1"])
    assert code == 1 and "cannot connect to 127.0.0.1:1" in err, err  # it got as far as connecting
    assert "sos_client.blocking" in modules and "sos_wire.crc" in modules
    unwanted = {
        m
        for m in modules
        if m.split(".")[0] in ("sos_journal", "spark_plugin", "humanfriendly", "crc32c", "tenacity")
        or m == "importlib.metadata"
    }
    assert not unwanted, sorted(unwanted)
    assert not modules & set(NEVER), modules & set(NEVER)


def test_sos_verify_runs_the_journal_reader_and_not_the_restore():
    code, err, modules = modules_after(["verify", "ns", "--server", "127.0.0.1:1", "--timeout", "1", "-q"])
    assert code == 1 and "127.0.0.1:1" in err, err
    assert "sos_journal.read.verify" in modules
    assert "sos_journal.rebuild.restore" not in modules
    assert not modules & set(NEVER), modules & set(NEVER)


def test_an_own_command_after_log_level_parses_as_before():
    """``sos --log-level debug stat`` skips the plugged commands as ``sos stat`` does, and a
    command after an option it cannot read the same way builds the whole parser."""
    from sos_client.cli import needs_plugged

    assert not needs_plugged(["--log-level", "debug", "stat", "ns/x"])
    assert not needs_plugged(["--log-level=debug", "ls", "ns"])
    assert not needs_plugged(["--log", "debug", "cat", "ns/x"])  # argparse's prefix of --log-level
    assert needs_plugged([])
    assert needs_plugged(["-h", "ls"])  # the top level's help lists every command
    assert needs_plugged(["--help", "ls"])
    assert needs_plugged(["gateway", "ns"])
    assert needs_plugged(["--log-level", "ls"])  # "ls" is the level here: no command yet
    assert needs_plugged(["lss"])  # argparse's "invalid choice" names every command
