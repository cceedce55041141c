"""Day two, the server's side (issue 23): key commands, per-namespace metrics, `sos put`
over quota, retention without a restart, defaults in --help, `sos verify` of an unknown
namespace. Real `sos-server` processes and the real commands throughout."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest

from sos_client import Client
from sos_client.cli import build_parser as sos_parser
from sos_server.cli import build_parser as server_parser
from sos_wire import events as ev
from sos_wire.errors import ErrorCode
from tests.conftest import RawClient
from tests.support import run_sos_as, scrape, server_cli, wait_for

pytestmark = [pytest.mark.day2]

TIMEOUT = 120  # generous: two shared cores


# -- item 3: keys ---------------------------------------------------------------------
def test_keys_list_revoke_and_keygen_out_against_a_running_server(sos_server, tmp_path):
    srv = sos_server
    data = srv.data_dir
    keyfile = tmp_path / "k"
    out = server_cli("keygen", "--data", data, "kns", "--role", "append", "--out", keyfile)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""  # the secret is in the file only
    assert stat.S_IMODE(os.stat(keyfile).st_mode) == 0o600
    key = keyfile.read_text().strip()
    key_id = key.partition(".")[0]
    assert key_id in out.stderr and key not in out.stderr
    again = server_cli("keygen", "--data", data, "kns", "--role", "append", "--out", keyfile)
    assert again.returncode == 1 and "exists" in again.stderr
    assert keyfile.read_text().strip() == key  # not overwritten
    printed = server_cli("keygen", "--data", data, "kns", "--role", "read")  # without --out: stdout as before
    assert printed.returncode == 0 and re.fullmatch(r"[0-9a-f]{16}\.[0-9a-f]{64}\n", printed.stdout)
    other = srv.keygen("other", "token")

    listed = server_cli("keys", "list", "--data", data)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split("\t") for line in listed.stdout.splitlines()]
    assert {(r[0], r[1], r[2]) for r in rows} == {
        ("kns", key_id, "append"),
        ("kns", printed.stdout.partition(".")[0], "read"),
        ("other", other.partition(".")[0], "token"),
    }
    for r in rows:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", r[3])
    for secret in (key, printed.stdout.strip(), other):
        assert secret.partition(".")[2] not in listed.stdout
    only = server_cli("keys", "list", "--data", data, "other")
    assert [line.split("\t")[0] for line in only.stdout.splitlines()] == ["other"]

    # a connection of the key, open before the revocation: its next request is refused
    with RawClient(srv.address) as c, Client(srv.address, printed.stdout.strip(), "kns") as reader:
        assert isinstance(c.login(key, "kns"), ev.AuthOk)
        assert isinstance(c.append("a", 0, b"before"), ev.AppendOk)
        bad = server_cli("keys", "revoke", "--data", data, "kns", key)  # the whole key: refused, nothing shown
        assert bad.returncode == 1 and key.partition(".")[2] not in bad.stderr
        gone = server_cli("keys", "revoke", "--data", data, "kns", key_id)
        assert gone.returncode == 0, gone.stderr
        r = c.stat("a")
        assert isinstance(r, ev.Error) and r.code is ErrorCode.AUTH_FAILED, r
        assert c.recv_raw_until_eof() == b""  # and closed
        assert reader.read("a") == b"before"  # another key of the namespace is untouched
    with RawClient(srv.address) as c:
        r = c.login(key, "kns")
        assert isinstance(r, ev.Error) and r.code is ErrorCode.AUTH_FAILED
    assert key_id not in server_cli("keys", "list", "--data", data).stdout
    again = server_cli("keys", "revoke", "--data", data, "kns", key_id)
    assert again.returncode == 1 and "no key" in again.stderr


# -- item 5: per-namespace metrics ------------------------------------------------------
def namespace_series(srv) -> dict[tuple[str, str], float]:
    """(series, namespace) -> value of the server's ``sos_namespace_*`` series."""
    out = {}
    for key, value in scrape(srv.metrics_address, timeout=TIMEOUT).items():
        m = re.fullmatch(r'(sos_namespace_\w+)\{namespace="([^"]+)"\}', key)
        if m:
            out[(m.group(1), m.group(2))] = value
    return out


def test_per_namespace_metrics(sos_server):
    srv = sos_server
    key = srv.keygen("met", "append")
    srv.keygen("idle", "append")
    assert server_cli("quota", "--data", srv.data_dir, "met", "1M").returncode == 0
    t0 = time.time()
    with Client(srv.address, key, "met") as c:
        c.append("a", 0, b"x" * 1000)
        c.append("a", 1000, b"y" * 500)
        c.append("b", 0, b"z" * 24)
        assert c.fence(3) == 3
    m = namespace_series(srv)
    assert m[("sos_namespace_bytes", "met")] == 1524
    assert m[("sos_namespace_objects", "met")] == 2
    assert m[("sos_namespace_quota_used_bytes", "met")] == 1524 + 2 * 4096
    assert m[("sos_namespace_quota_bytes", "met")] == 1 << 20
    assert m[("sos_namespace_fence_epoch", "met")] == 3
    assert m[("sos_namespace_appends_total", "met")] == 3
    assert m[("sos_namespace_append_bytes_total", "met")] == 1524
    assert t0 - 5 <= m[("sos_namespace_last_append_timestamp_seconds", "met")] <= time.time() + 5
    # a quota change shows at the next scrape, without an append; a namespace never used has no series
    assert server_cli("quota", "--data", srv.data_dir, "met", "2M").returncode == 0
    assert namespace_series(srv)[("sos_namespace_quota_bytes", "met")] == 2 << 20
    assert not any(ns == "idle" for _, ns in m)
    # after a restart: the last append's time from the files, counters from zero
    srv.restart()
    with Client(srv.address, key, "met") as c:
        c.stat("a")  # AUTH loads the namespace
    m = namespace_series(srv)
    assert m[("sos_namespace_bytes", "met")] == 1524
    assert m[("sos_namespace_appends_total", "met")] == 0
    assert t0 - 5 <= m[("sos_namespace_last_append_timestamp_seconds", "met")] <= time.time() + 5


# -- item 6: sos put over quota -----------------------------------------------------------
def test_put_over_quota_creates_nothing_and_quota_shows_usage(sos_server, tmp_path):
    srv = sos_server
    key = srv.keygen("q", "append")
    assert server_cli("quota", "--data", srv.data_dir, "q", "1500K").returncode == 0
    big = tmp_path / "big"
    big.write_bytes(os.urandom(3 << 20))  # three 1 MiB appends on main: the first landed, then QUOTA_EXCEEDED
    r = run_sos_as(srv, key, "put", big, "q/big")
    assert r.returncode == 1 and "QUOTA_EXCEEDED" in r.stderr and "was not created" in r.stderr, r.stderr
    assert run_sos_as(srv, key, "ls", "q").stdout == ""  # nothing: the name is still free
    piped = run_sos_as(srv, key, "put", "-", "q/piped", input="p" * (2 << 20))
    assert piped.returncode == 1 and run_sos_as(srv, key, "ls", "q").stdout == ""
    assert server_cli("quota", "--data", srv.data_dir, "q").stdout == "q\t1536000\tused 0 (objects 0, data bytes 0)\n"
    assert server_cli("quota", "--data", srv.data_dir, "q", "8M").returncode == 0
    r = run_sos_as(srv, key, "put", big, "q/big")  # the retry under the same name works
    assert r.returncode == 0, r.stderr
    assert run_sos_as(srv, key, "put", "-", "q/e", input="").returncode == 0  # an empty file: an empty object
    used = (3 << 20) + 2 * 4096
    out = server_cli("quota", "--data", srv.data_dir, "q")  # while the server runs
    assert out.stdout == f"q\t{8 << 20}\tused {used} (objects 2, data bytes {3 << 20})\n", out.stdout


def test_put_larger_than_one_append_over_quota_says_what_it_left(sos_server, tmp_path):
    srv = sos_server
    key = srv.keygen("q2", "append")
    assert server_cli("quota", "--data", srv.data_dir, "q2", "9M").returncode == 0
    f = tmp_path / "f"
    f.write_bytes(b"x" * (10 << 20))
    r = run_sos_as(srv, key, "put", f, "q2/f")
    assert r.returncode == 1
    length = int(run_sos_as(srv, key, "stat", "q2/f").stdout)
    assert 0 < length < 10 << 20
    assert f"was created and holds the first {length} bytes" in r.stderr, r.stderr


# -- item 7: retention ----------------------------------------------------------------------
def make_generations(srv, key: str, ns: str, n: int) -> None:
    with Client(srv.address, key, ns) as c:
        for g in range(1, n + 1):
            c.append(f"gen/{g:010d}/0000000001-0000000000.seg", 0, b"records")
            c.append(f"gen/{g:010d}/ready", 0, b"")
            c.seal(f"gen/{g:010d}/ready")


def names(srv, key: str, ns: str) -> list[str]:
    with Client(srv.address, key, ns) as c:
        return [e.name for e in c.list("")]


def test_gc_dry_run_beside_a_running_server(sos_server):
    srv = sos_server
    key = srv.keygen("ret", "append")
    make_generations(srv, key, "ret", 3)
    before = names(srv, key, "ret")
    time.sleep(0.05)  # objects older than --min-age 0
    r = server_cli("gc", "--data", srv.data_dir, "--keep-generations", "1", "--min-age", "0", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == sorted(
        f"would remove ret/{n}" for n in before if not n.startswith("gen/0000000003/")
    )
    assert "4 objects to remove" in r.stderr
    assert names(srv, key, "ret") == before  # changed nothing
    real = server_cli("gc", "--data", srv.data_dir, "--keep-generations", "1", "--min-age", "0")
    assert real.returncode == 1 and "in use" in real.stderr and "--dry-run" in real.stderr
    assert names(srv, key, "ret") == before


def test_sighup_applies_new_retention_settings(sos_server_factory):
    srv = sos_server_factory(args=["--keep-generations", "5", "--min-age", "1h", "--gc-interval", "1h"])
    key = srv.keygen("hup", "append")
    make_generations(srv, key, "hup", 3)
    time.sleep(0.05)
    r = server_cli("retention", "--data", srv.data_dir, "--keep-generations", "1", "--min-age", "0")
    assert r.returncode == 0 and r.stdout == "retention\tkeep-generations 1\tmin-age 0s\n", (r.stdout, r.stderr)
    assert len(names(srv, key, "hup")) == 6  # not applied yet: the next round is an hour away
    os.kill(srv.pid, signal.SIGHUP)
    wait_for(
        lambda: names(srv, key, "hup") == ["gen/0000000003/0000000001-0000000000.seg", "gen/0000000003/ready"],
        60,
        "retention after SIGHUP",
    )
    assert srv.running()  # SIGHUP's default action would have ended it
    settings = [
        json.loads(line)
        for line in srv.log_text().splitlines()
        if line.startswith("{") and "retention settings" in line
    ]
    assert settings[0]["source"] == "command line" and settings[0]["keep_generations"] == 5
    assert settings[-1]["source"].endswith("/retention") and settings[-1]["keep_generations"] == 1
    # a damaged file: the settings in force are kept, the server serves on
    with open(os.path.join(srv.data_dir, "retention"), "w") as f:
        f.write("{not json")
    os.kill(srv.pid, signal.SIGHUP)
    wait_for(lambda: "retention file" in srv.log_text() and "damaged" in srv.log_text(), 60, "the error logged")
    assert srv.running() and len(names(srv, key, "hup")) == 2
    assert server_cli("retention", "--data", srv.data_dir, "none").stdout.startswith("retention\tnone")


# -- every option's default in --help ---------------------------------------------------------
def _parsers(parser: argparse.ArgumentParser, path: list[str]):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, [*path, name])


def test_every_option_with_a_default_says_it_in_help():
    missing = []
    walked = set()
    for top, name in ((server_parser(), "sos-server"), (sos_parser(), "sos")):
        for path, parser in _parsers(top, [name]):
            walked.add(" ".join(path))
            for a in parser._actions:
                if (
                    not a.option_strings
                    or a.required
                    or a.help == argparse.SUPPRESS
                    or a.default in (None, False, argparse.SUPPRESS)
                ):
                    continue
                if "default" not in (a.help or ""):
                    missing.append(f"{' '.join(path)} {a.option_strings[0]} (default {a.default!r})")
    assert {
        "sos-server serve",
        "sos-server gc",
        "sos-server keys list",
        "sos-server retention",
        "sos put",
        "sos restore",
        "sos verify",
    } <= walked
    assert not missing, missing
    shown = server_cli("serve", "--help", timeout=TIMEOUT, env=dict(os.environ, COLUMNS="200")).stdout
    assert re.search(r"--gc-interval \S+\s+how often retention runs \(default 5m", shown), shown


# -- item 10: sos verify of a mistyped namespace ---------------------------------------------
def test_verify_and_restore_of_an_unknown_namespace_exit_4(sos_server, tmp_path):
    srv = sos_server
    key = srv.keygen("jobs", "append")
    for args in (("verify", "jbos"), ("restore", "jbos", tmp_path / "t")):
        r = run_sos_as(srv, key, *args)
        assert r.returncode == 4, (args, r.returncode, r.stderr)
        assert "no such namespace" in r.stderr and "or the key is not for it" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "t").exists() or not os.listdir(tmp_path / "t")
    assert "(AUTH_FAILED)" in run_sos_as(srv, key, "verify", "--help").stdout


# -- the documented commands (docs/DEPLOY.md, Keys and Retention) ---------------------------------
def _documented(section: str) -> list[str]:
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "DEPLOY.md")) as f:
        text = f.read()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", body, re.DOTALL)
    return [line.split("  #")[0].strip() for b in blocks for line in b.splitlines() if line.strip()]


def _run_documented(line: str, data: str, cwd, **subs: str) -> subprocess.CompletedProcess[str]:
    line = line.replace("--data /data", f"--data {data}")
    for name, value in subs.items():
        line = line.replace(name, value)
    bindir = os.path.dirname(sys.executable)  # sos-server of this environment
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, env=env)


def test_documented_key_and_retention_commands(sos_server, tmp_path):
    srv = sos_server
    keys = [
        line
        for line in _documented("Keys")
        if line.startswith("sos-server ") and "docker" not in line and "quota" not in line  # quota: test_ops_docs
    ]
    assert [line.split()[1:3] for line in keys] == [
        ["keygen", "--data"],
        ["keys", "list"],
        ["keys", "list"],
        ["keys", "revoke"],
    ]
    made = _run_documented(keys[0], srv.data_dir, tmp_path)
    assert made.returncode == 0 and made.stdout == "", made.stderr
    keyfile = tmp_path / "sparkjob.key"
    assert stat.S_IMODE(os.stat(keyfile).st_mode) == 0o600
    key = keyfile.read_text().strip()
    with Client(srv.address, key, "sparkjob") as c:
        c.append("note", 0, b"hi")
    for line in keys[1:3]:
        listed = _run_documented(line, srv.data_dir, tmp_path)
        assert listed.stdout.split("\t")[:3] == ["sparkjob", key.partition(".")[0], "append"], listed
    assert _run_documented(keys[3], srv.data_dir, tmp_path, KEY_ID=key.partition(".")[0]).returncode == 0
    with RawClient(srv.address) as c:
        r = c.login(key, "sparkjob")
        assert isinstance(r, ev.Error) and r.code is ErrorCode.AUTH_FAILED

    retention = _documented("Retention")
    assert len(retention) == 4
    for line in retention:
        r = _run_documented(line, srv.data_dir, tmp_path, **{'"$(pidof sos-server)"': str(srv.pid)})
        assert r.returncode == 0, (line, r.stderr)
    assert srv.running()
    wait_for(
        lambda: "retention settings" in srv.log_text() and os.path.join(srv.data_dir, "retention") in srv.log_text(),
        60,
        "the SIGHUP's reload",
    )
