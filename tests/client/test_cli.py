"""The `sos` command (put/cat/ls/stat) against a REAL server, run as a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from sos_client import cli

SOS = [shutil.which("sos")] if shutil.which("sos") else [sys.executable, "-m", "sos_client.cli"]


_n = iter(range(10_000))


@pytest.fixture
def env(server):
    ns = f"c{next(_n)}"
    e = dict(os.environ, SOS_SERVER=server.address, SOS_KEY=server.keygen(ns, "append"))
    return ns, e


def sos(*args, env, input=None):
    return subprocess.run([*SOS, *args], env=env, input=input, capture_output=True, timeout=120)


def test_put_cat_ls_stat_round_trip(env, tmp_path):
    ns, e = env
    data = os.urandom((3 << 20) + 17)
    src = tmp_path / "blob"
    src.write_bytes(data)
    r = sos("put", str(src), f"{ns}/dir/blob", env=e)
    assert r.returncode == 0, r.stderr
    r = sos("cat", f"{ns}/dir/blob", env=e)
    assert r.returncode == 0, r.stderr
    assert r.stdout == data
    r = sos("stat", f"{ns}/dir/blob", env=e)
    assert (r.returncode, r.stdout) == (0, f"{len(data)}\n".encode())
    (tmp_path / "small").write_bytes(b"tiny")
    assert sos("put", "--seal", str(tmp_path / "small"), f"{ns}/dir/small", env=e).returncode == 0
    r = sos("ls", f"{ns}/dir/", env=e)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().splitlines() == [f"dir/blob\t{len(data)}", "dir/small\t4\tsealed"]
    r = sos("cat", "--offset", "1", "--length", "2", f"{ns}/dir/small", env=e)
    assert r.stdout == b"in"


def test_options_instead_of_environment(server, tmp_path):
    key = server.keygen("opts", "append")
    key_file = tmp_path / "opts.key"
    key_file.write_text(key + "\n")
    e = {k: v for k, v in os.environ.items() if k not in ("SOS_SERVER", "SOS_KEY", "SOS_KEY_FILE")}
    r = sos(
        "put", "-", "opts/from-stdin", "--server", server.address, "--key-file", str(key_file), env=e, input=b"piped"
    )
    assert r.returncode == 0, r.stderr
    r = sos("cat", "opts/from-stdin", "--server", server.address, "--key-file", str(key_file), env=e)
    assert r.stdout == b"piped"


def test_put_refuses_an_existing_name(env, tmp_path):
    ns, e = env
    f = tmp_path / "f"
    f.write_bytes(b"first")
    assert sos("put", str(f), f"{ns}/x", env=e).returncode == 0
    f.write_bytes(b"second")
    r = sos("put", str(f), f"{ns}/x", env=e)
    assert r.returncode == 1
    err = r.stderr.decode()
    assert err.startswith("sos: ") and err.count("\n") == 1
    assert f"{ns}/x already exists (5 bytes)" in err
    assert sos("cat", f"{ns}/x", env=e).stdout == b"first"


def test_empty_file_becomes_an_empty_object(env, tmp_path):
    ns, e = env
    (tmp_path / "empty").write_bytes(b"")
    assert sos("put", str(tmp_path / "empty"), f"{ns}/empty", env=e).returncode == 0
    assert sos("stat", f"{ns}/empty", env=e).stdout == b"0\n"


def test_failures_exit_1_with_one_line(env, server, tmp_path, monkeypatch, capsys):
    ns, e = env
    r = sos("cat", f"{ns}/missing", env=e)
    assert r.returncode == 1 and r.stdout == b""
    assert r.stderr.decode().startswith("sos: ") and "NOT_FOUND" in r.stderr.decode()
    assert r.stderr.decode().count("\n") == 1
    # the same rules in-process (cheaper than a subprocess each)
    monkeypatch.setenv("SOS_SERVER", server.address)
    monkeypatch.setenv("SOS_KEY", e["SOS_KEY"])
    assert cli.main(["put", str(tmp_path / "no-such-file"), f"{ns}/y"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sos: cannot read") and err.count("\n") == 1
    assert cli.main(["ls", ns]) == 0  # a whole namespace; nothing in it yet
    assert capsys.readouterr().out == ""
    assert cli.main(["stat", f"{ns}/missing"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    monkeypatch.setenv("SOS_KEY", "00" * 8 + "." + "00" * 32)
    assert cli.main(["stat", f"{ns}/x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sos: ") and "AUTH_FAILED" in err


def test_help_and_usage_through_the_console_script():
    r = subprocess.run([*SOS, "--help"], capture_output=True, timeout=120)
    assert r.returncode == 0 and b"usage: sos" in r.stdout and b"put" in r.stdout
    r = subprocess.run([*SOS, "stat", "no-slash"], capture_output=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(b"sos: ")


# -- in-process: dispatch and hooks ------------------------------------------------------
def test_missing_key_is_an_operation_failure(monkeypatch, capsys):
    monkeypatch.delenv("SOS_KEY", raising=False)
    monkeypatch.setenv("SOS_SERVER", "127.0.0.1:9")
    assert cli.main(["stat", "ns/x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sos: no key given")


def test_split_target():
    assert cli.split_target("ns/a/b") == ("ns", "a/b")
    assert cli.split_target("ns", need_name=False) == ("ns", "")
    assert cli.split_target("ns/pre", need_name=False) == ("ns", "pre")
    for bad in ("ns", "ns/", "NS/a", "ns//a", "/a"):
        with pytest.raises(cli.UsageError):
            cli.split_target(bad)


@pytest.mark.parametrize(
    "args",
    [
        ["stat", "no-slash"],
        ["cat", "BAD/x"],
        ["stat", "ns/../x"],
        ["frobnicate"],
        [],
        ["cat", "ns/x", "--offset", "-1"],
    ],
)
def test_usage_errors_exit_2(args, capsys):
    assert cli.main(args) == 2
    assert capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["put", "cat", "ls", "stat"])
def test_help_everywhere(cmd, capsys):
    assert cli.main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: sos {cmd}") and "--server" in out and "--key" in out


@pytest.mark.parametrize("server", ["host:notaport", "host:0", ":7070"])
def test_malformed_server_address_is_a_usage_error(monkeypatch, capsys, server):
    monkeypatch.setenv("SOS_KEY", "0" * 16 + "." + "0" * 64)
    assert cli.main(["stat", "ns/x", "--server", server]) == 2
    err = capsys.readouterr().err  # argparse's usage, then what is wrong with which option
    assert err.startswith("usage: sos stat")
    assert err.splitlines()[-1].startswith("sos stat: error: argument --server: bad server address")


def test_every_subcommand_is_registered_and_an_import_error_is_not_hidden(monkeypatch):
    import sys as _sys

    from sos_client import cli

    names = set(cli.build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {"put", "cat", "ls", "stat", "restore", "verify", "mount", "gateway"} <= names
    # a broken subcommand module is an error of `sos` itself, not a silently missing command
    monkeypatch.setitem(_sys.modules, "spark_plugin.mount.cli", None)  # import raises ImportError
    with pytest.raises(ImportError):
        cli.build_parser()
