"""Every command logs the same way (issue 27.6, 27.2): one JSON object per line on stderr, from
``--log-level`` up (debug, info, warning, error; default info), on ``sos-server`` and its admin
subcommands, ``sos`` put/cat/ls/stat, restore/verify, mount and gateway (and promote). The
messages for a person stay text: ``sos: ...`` errors, the ready lines tools wait for. And the
product's loggers follow one naming scheme: the module's ``__name__``.

Real processes: a real server, ``sos`` and ``sos-server`` run as commands, a real gateway on
127.0.0.1 and, where FUSE is there, a real mount."""

from __future__ import annotations

import argparse
import ast
import io
import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest

from sos_client.cli import build_parser as sos_parser
from sos_server.cli import build_parser as server_parser
from sos_wire.logs import LEVELS, PACKAGES, setup_logging
from spark_plugin.gateway.process import READY_MARKER as GATEWAY_READY
from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.mount.process import READY_MARKER as MOUNT_READY
from spark_plugin.spark import sos_command
from tools import child_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOS = sos_command()
SOS_SERVER = [sys.executable, "-m", "sos_server.cli"]
RANK = {"debug": 10, "info": 20, "warning": 30, "error": 40}
TIMEOUT = 120


def run(cmd: list[str], env: dict[str, str] | None = None, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=child_env(env), capture_output=True, text=True, timeout=TIMEOUT, **kw)  # type: ignore[call-overload]


def records(stderr: str, *text: str) -> list[dict[str, object]]:
    """The JSON records of ``stderr``; every other line must start with one of ``text``."""
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            assert {"ts", "level", "logger", "msg"} <= rec.keys(), rec
            assert rec["logger"].split(".")[0] in PACKAGES or rec["level"] in ("warning", "error"), rec
            out.append(rec)
        else:
            assert text and line.startswith(text), f"not a JSON line: {line!r}"
    return out


def at_level(recs: list[dict[str, object]], level: str) -> None:
    """Nothing below ``level``, and something at it."""
    assert all(RANK[str(r["level"])] >= RANK[level] for r in recs), recs
    assert any(r["level"] == level for r in recs), recs


def leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from leaf_parsers(child, (*path, name))


@pytest.mark.parametrize("build", [sos_parser, server_parser], ids=["sos", "sos-server"])
def test_every_command_takes_log_level(build):
    top = build()
    leaves = list(leaf_parsers(top))
    names = {" ".join(p) for p, _ in leaves}
    if build is sos_parser:
        assert {"put", "cat", "ls", "stat", "restore", "verify", "mount", "gateway"} <= names
    else:
        assert {"serve", "keygen", "keys list", "keys revoke", "quota", "reset-fence", "retention", "gc"} <= names
    for parser in [top, *(p for _, p in leaves)]:
        opt = next((a for a in parser._actions if "--log-level" in a.option_strings), None)
        assert opt is not None, parser.prog
        assert tuple(opt.choices) == LEVELS, parser.prog
    with pytest.raises(SystemExit):
        top.parse_args(["--log-level", "verbose", *leaves[0][0]])


@pytest.fixture
def env(server, tmp_path):
    key = server.keygen("logs", "append")
    return dict(os.environ, SOS_SERVER=server.address, SOS_KEY=key)


def test_put_cat_ls_stat_log_json_lines_at_the_level(env, tmp_path):
    src = tmp_path / "f"
    src.write_bytes(b"hello")
    steps = [["put", str(src), "logs/f"], ["cat", "logs/f"], ["ls", "logs"], ["stat", "logs/f"]]
    for args in steps:
        r = run([*SOS, *args, "--log-level", "debug"], env)
        assert r.returncode == 0, r.stderr
        recs = records(r.stderr)
        at_level(recs, "debug")
        assert any(x["msg"] == "connected" and x["namespace"] == "logs" for x in recs), recs
        assert all(str(x["logger"]).startswith("sos_client.") for x in recs), recs
    # before the subcommand too; info (the default) hides the debug records
    r = run([*SOS, "--log-level", "debug", "stat", "logs/f"], env)
    assert r.stdout == "5\n" and any(x["msg"] == "connected" for x in records(r.stderr))
    for extra in ([], ["--log-level", "info"], ["--log-level", "error"]):
        r = run([*SOS, "stat", "logs/f", *extra], env)
        assert (r.returncode, r.stdout, r.stderr) == (0, "5\n", "")


def test_an_error_stays_one_line_of_text_beside_the_json(env):
    r = run([*SOS, "cat", "logs/missing", "--log-level", "debug"], env)
    assert r.returncode == 1
    recs = records(r.stderr, "sos: ")
    at_level(recs, "debug")
    assert [ln for ln in r.stderr.splitlines() if not ln.startswith("{")] == [
        next(ln for ln in r.stderr.splitlines() if ln.startswith("sos: "))
    ]


@pytest.mark.parametrize("command", ["restore", "verify"])
def test_restore_and_verify_log_json_lines_at_the_level(env, tmp_path, command):
    target = [str(tmp_path / "out")] if command == "restore" else []
    r = run([*SOS, command, "logs", *target, "-q", "--log-level", "debug"], env)
    assert r.returncode == 4  # no journal in the namespace: said as text
    at_level(records(r.stderr, "sos: "), "debug")
    assert "sos: namespace 'logs' has no journal" in r.stderr
    r = run([*SOS, command, "logs", *target, "-q", "--log-level", "warning"], env)
    assert r.returncode == 4 and records(r.stderr, "sos: ") == []


def test_server_and_its_admin_commands_log_json_lines_at_the_level(sos_server_factory, tmp_path):
    data = tmp_path / "data"
    r = run([*SOS_SERVER, "keygen", "--data", str(data), "ns", "--role", "append", "--log-level", "debug"])
    assert r.returncode == 0 and r.stdout.strip()  # the key on stdout, as before
    recs = records(r.stderr, "key id")
    at_level(recs, "debug")
    assert {"msg": "command", "command": "keygen"}.items() <= recs[0].items()
    r = run([*SOS_SERVER, "--log-level", "debug", "keys", "list", "--data", str(data)])
    assert r.returncode == 0 and any(x["msg"] == "command" for x in records(r.stderr))
    r = run([*SOS_SERVER, "gc", "--data", str(data), "--keep-generations", "1", "--min-age", "1"])
    assert r.returncode == 0 and records(r.stderr, "0 objects removed") == []

    quiet = sos_server_factory(data, ["--log-level", "warning"])
    quiet.stop()
    assert records(quiet.log_text(), "sos-server ") == []  # "storage opened" and the like are info
    loud = sos_server_factory(data, ["--log-level", "debug"])
    loud.stop()
    recs = records(loud.log_text(), "sos-server ")
    assert any(x["msg"] == "storage opened" and x["logger"] == "sos_server.serve" for x in recs)
    assert all(str(x["logger"]).startswith(PACKAGES) for x in recs)


def _gateway(server, tmp_path, name, level):
    key = server.keygen("gwlogs", "append")
    return GatewayProcess(
        "gwlogs",
        str(tmp_path / f"{name}-cache"),
        server.address,
        key,
        extra_args=["--log-level", level],
        log_path=str(tmp_path / f"{name}.log"),
    )


def test_the_gateway_logs_json_lines_at_the_level(server, tmp_path):
    loud = _gateway(server, tmp_path, "loud", "debug").start()
    assert loud.url and loud.url.startswith("http://127.0.0.1:")
    assert loud.stop() == 0
    recs = records(loud.log(), GATEWAY_READY)
    at_level(recs, "debug")
    assert any(str(x["logger"]).startswith("spark_plugin.gateway.") for x in recs), recs
    assert GATEWAY_READY in loud.log()  # the ready line stays text: tools wait for it

    quiet = _gateway(server, tmp_path, "quiet", "error").start()
    assert quiet.stop() == 0
    assert [x for x in records(quiet.log(), GATEWAY_READY) if x["level"] != "error"] == []


def test_gateway_promote_takes_log_level(env):
    r = run([*SOS, "gateway", "promote", "logs", "http://192.0.2.1:9870", "--log-level", "debug"], env)
    assert r.returncode == 2  # plain http:// to another host: refused before anything is sent
    at_level(records(r.stderr, "sos: "), "debug")


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing: no FUSE")
def test_the_mount_logs_json_lines_at_the_level(server, tmp_path):
    pytest.importorskip("pyfuse3")
    from spark_plugin.mount.process import MountProcess

    (tmp_path / "mnt").mkdir()
    mp = MountProcess(
        "mountlogs",
        str(tmp_path / "mnt"),
        str(tmp_path / "cache"),
        server.address,
        server.keygen("mountlogs", "append"),
        extra_args=["--log-level", "debug"],
        log_path=str(tmp_path / "mount.log"),
    )
    mp.start()
    try:
        (tmp_path / "mnt" / "f").write_bytes(b"x")
    finally:
        mp.stop()
    recs = records(mp.log(), MOUNT_READY)
    at_level(recs, "debug")
    assert any(str(x["logger"]).startswith("spark_plugin.mount.") for x in recs), recs


def test_setup_logging_levels_the_product_and_keeps_others_at_warning():
    out = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level, {p: logging.getLogger(p).level for p in PACKAGES}
    try:
        setup_logging("debug", out)
        setup_logging("info", out)  # again: replaces its handler, one line per record
        logging.getLogger("sos_journal.writer.writer").debug("hidden")
        logging.getLogger("spark_plugin.gateway.http.connection").info("shown", extra={"n": 1})
        logging.getLogger("botocore.credentials").info("not ours")
        logging.getLogger("botocore.credentials").warning("theirs, as JSON")
    finally:
        root.handlers[:], level, levels = saved
        root.setLevel(level)
        for p, lv in levels.items():
            logging.getLogger(p).setLevel(lv)
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["logger"], r["level"], r["msg"]) for r in recs] == [
        ("spark_plugin.gateway.http.connection", "info", "shown"),
        ("botocore.credentials", "warning", "theirs, as JSON"),
    ]
    assert recs[0]["n"] == 1


def _get_logger_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "getLogger":
                yield node


def test_every_product_logger_is_named_by_its_module():
    """One scheme: ``logging.getLogger(__name__)``, under one of the packages whose level
    ``--log-level`` sets (sos_wire.logs sets up the package loggers themselves)."""
    found, wrong = 0, []
    packages = [p for p in PACKAGES if (ROOT / p).is_dir()]
    assert {"sos_wire", "sos_tier", "sos_server", "sos_client", "spark_plugin"} <= set(packages)
    assert not [p.name for p in ROOT.iterdir() if p.name.startswith("sos_") and p.is_dir() and p.name not in PACKAGES]
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for call in _get_logger_calls(ast.parse(path.read_text(), rel)):
                found += 1
                if rel == "sos_wire/logs.py":
                    continue  # the setup: the root and the package loggers
                args = call.args
                if not (len(args) == 1 and isinstance(args[0], ast.Name) and args[0].id == "__name__"):
                    wrong.append(f"{rel}:{call.lineno}: {ast.unparse(call)}")
    assert found > 20
    assert wrong == []
