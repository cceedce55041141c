"""Issue 9, item 16: no secret on a command line.

Every local user reads any process's /proc/PID/cmdline (and ``ps``). ``--key KEY`` put
the secret there for as long as the command ran: days for ``sos mount``. Keys now come
from $SOS_KEY or a file (``--key-file PATH`` / $SOS_KEY_FILE); ``--key`` is refused with
a usage error that names both, before anything runs. Real server, real mount process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sos_client import Client, cli
from sos_wire.auth import Key

pytestmark = [pytest.mark.hostile]

NS = "argv"
TIMEOUT = 120


def _cmdlines() -> dict[int, bytes]:
    """Every process's command line, as any local user can read it."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read()
            except OSError:
                pass  # gone meanwhile
    return out


def _secret_forms(key: str) -> list[bytes]:
    k = Key.parse(key)
    return [key.encode(), k.secret.hex().encode(), k.secret.hex().upper().encode()]


def _env_without_keys() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("SOS_KEY", "SOS_KEY_FILE", "SOS_SERVER")}


@pytest.fixture
def server(sos_server):
    return sos_server


@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing: no FUSE")
@pytest.mark.parametrize("how", ["key-file", "SOS_KEY_FILE", "SOS_KEY"])
def test_running_mount_keeps_the_key_off_its_command_line(server, tmp_path, how):
    pytest.importorskip("pyfuse3")
    from spark_plugin.mount.process import MountProcess

    key = server.keygen(NS, "append")
    key_file = tmp_path / "sos.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    env = _env_without_keys()
    extra: list[str] = []
    if how == "key-file":
        extra = ["--key-file", str(key_file)]
    elif how == "SOS_KEY_FILE":
        env["SOS_KEY_FILE"] = str(key_file)
    # MountProcess always exports SOS_KEY: "" here unless the key is meant to come from it
    mp = MountProcess(
        NS,
        str(tmp_path / "mnt"),
        str(tmp_path / "cache"),
        server.address,
        key if how == "SOS_KEY" else "",
        log_path=str(tmp_path / "mount.log"),
        extra_args=extra,
        env=env,
    )
    try:
        mp.start()
        mine = _cmdlines()[mp.pid]
        assert b"spark_plugin.mount.cli" in mine  # it is the mount's command line
        for pid, line in _cmdlines().items():
            for secret in _secret_forms(key):
                assert secret not in line, f"the key is in /proc/{pid}/cmdline: {line!r}"
        with open(os.path.join(mp.mountpoint, "written"), "wb") as f:
            f.write(b"through the mount")
        assert mp.stop() == 0, mp.log()
    finally:
        if mp.proc is not None and mp.proc.poll() is None:
            mp.kill()
    # the key from the file/environment authenticated: the journal is on the server
    with Client(server.address, key, NS, timeout=TIMEOUT) as c:
        assert any(e.name.startswith("gen/") for e in c.list(""))
    for secret in _secret_forms(key):
        assert secret.decode() not in mp.log()


@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing: no FUSE")
def test_mount_with_key_argument_is_refused_before_mounting(server, tmp_path):
    from spark_plugin.mount.process import is_mounted

    key = server.keygen(NS, "append")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sos_client.cli",
            "mount",
            NS,
            str(mnt),
            "--cache",
            str(tmp_path / "cache"),
            "--server",
            server.address,
            "--key",
            key,
        ],
        env=_env_without_keys(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:  # it mounted and runs with the key on its command line
        proc.terminate()
        proc.communicate(timeout=TIMEOUT)
        pytest.fail("sos mount --key KEY started (the key stays in /proc/PID/cmdline)")
    assert proc.returncode == 2
    assert "--key-file" in err and "SOS_KEY" in err and "/proc/PID/cmdline" in err
    for secret in _secret_forms(key):
        assert secret.decode() not in err
    assert not is_mounted(str(mnt))


@pytest.mark.parametrize(
    "argv",
    [
        ["put", "-", "ns/x"],
        ["cat", "ns/x"],
        ["ls", "ns"],
        ["stat", "ns/x"],
        ["restore", "ns", "/nonexistent/target"],
        ["verify", "ns"],
        ["mount", "ns", "/nonexistent/mnt"],
    ],
)
@pytest.mark.parametrize("form", ["separate", "equals", "bare"])
def test_every_command_refuses_key_argument(argv, form, capsys, monkeypatch):
    secret = "0123456789abcdef." + "ab" * 32
    monkeypatch.delenv("SOS_KEY", raising=False)
    extra = {"separate": ["--key", secret], "equals": [f"--key={secret}"], "bare": ["--key"]}[form]
    assert cli.main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert "--key is not accepted" in err and "--key-file" in err and "SOS_KEY" in err
    assert "ab" * 32 not in err


def test_key_file_errors_name_the_file_not_the_content(server, tmp_path):
    env = dict(_env_without_keys(), PYTHONPATH=os.pathsep.join(sys.path))

    def stat(*args: str, **more: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "sos_client.cli", "stat", f"{NS}/x", "--server", server.address, *args],
            env=dict(env, **more),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )

    r = stat("--key-file", str(tmp_path / "missing"))
    assert r.returncode == 1 and f"cannot read the key file {tmp_path / 'missing'}" in r.stderr
    bad = tmp_path / "bad.key"
    bad.write_text("0123456789abcdef." + "cd" * 31 + "zz\n")  # a secret with a typo
    r = stat("--key-file", str(bad))
    assert r.returncode == 1 and f"bad key in the key file {bad}" in r.stderr
    assert "cd" * 31 not in r.stderr
    r = stat()
    assert r.returncode == 1 and "no key given" in r.stderr and "--key-file" in r.stderr
    # a good file, by option and by $SOS_KEY_FILE, wins over a wrong $SOS_KEY
    good = tmp_path / "good.key"
    good.write_text(server.keygen(NS, "read"))
    wrong = str(Key.generate())
    for r in (stat("--key-file", str(good), SOS_KEY=wrong), stat(SOS_KEY_FILE=str(good), SOS_KEY=wrong)):
        assert r.returncode == 1 and "no object" in r.stderr, r.stderr  # authenticated; x is absent
