"""Day two of running `sos gateway` (issue 23): a fenced gateway stops loudly, the newcomer
says whom it fenced, the metrics endpoint, rolling the namespace back to a batch, the
redirects naming the address the user gave, the marker listener's warnings. Real parts: a
real sos-server, real `sos gateway` child processes, real HTTP."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import time
import urllib.parse

import pytest
import requests

from spark_plugin.gateway.client import GatewayClient
from spark_plugin.spark import (
    GatewayCheckpoint,
    GatewayMarkerListener,
    markers,  # the listeners warn through its logger
)
from tests.gateway.support import NS, Gw, wait_exit

pytestmark = [pytest.mark.day2, pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- fencing


def test_a_fenced_idle_gateway_refuses_everything_and_exits_non_zero(sos_server, tmp_path):
    old = Gw(sos_server, tmp_path, name="old")
    assert old.session.put(old.u("/chk/offsets", op="MKDIRS")).status_code == 200
    new = Gw(sos_server, tmp_path, name="new", key=old.key)  # takes the namespace over
    try:
        # the old one was idle: its fence check (FENCE(0), every 5 s) finds the newer epoch;
        # from then on every request is refused, the health check's too, and it exits 3
        code = wait_exit(old.proc)
        assert code == 3, old.proc.log()
        log = old.proc.log()
        assert "FENCED" in log and "by a newer writer" in log
        with pytest.raises(requests.ConnectionError):
            old.session.put(old.u("/chk/x", op="MKDIRS"), timeout=10)
        # the newcomer said whom it fenced: the old writer wrote a moment ago
        assert "FENCED A LIVE WRITER?" in new.proc.log()
        assert new.session.put(new.u("/chk/y", op="MKDIRS")).status_code == 200
    finally:
        new.stop()
        old.proc.stop()


def test_mkdirs_on_a_fenced_gateway_is_refused_not_200(sos_server, tmp_path):
    """Before its fence check runs, a fenced gateway's MKDIRS reaches the server (sync mode:
    MKDIRS replies once durable) and is refused; then the gateway stops."""
    old = Gw(sos_server, tmp_path, name="old", args=["--fence-check", "3600"])
    new = Gw(sos_server, tmp_path, name="new", key=old.key)
    try:
        r = old.session.put(old.u("/after/fence", op="MKDIRS"), timeout=60)
        assert r.status_code >= 400, r.text
        assert "fenced" in r.text.lower() or "no longer serves" in r.text
        assert wait_exit(old.proc) == 3, old.proc.log()
    finally:
        new.stop()
        old.proc.stop()


def _healthy(addr: str) -> bool:
    """The image's health check of a gateway (deploy/healthcheck.py --gateway), as run."""
    env = dict(os.environ, SOS_HEALTH_ADDR=addr, SOS_HEALTH_TLS="0")
    return (
        subprocess.run(
            [sys.executable, str(ROOT / "deploy" / "healthcheck.py"), "--gateway"],
            env=env,
            capture_output=True,
            timeout=60,
        ).returncode
        == 0
    )


def test_a_fenced_gateway_fails_the_health_check(sos_server, tmp_path):
    old = Gw(sos_server, tmp_path, name="old")
    addr = f"{old.host}:{old.port}"
    assert _healthy(addr)
    new = Gw(sos_server, tmp_path, name="new", key=old.key)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _healthy(addr):
            time.sleep(0.2)
        assert not _healthy(addr)
    finally:
        new.stop()
        old.proc.stop()


# ---------------------------------------------------------------------------- markers


class _Unreachable(GatewayClient):
    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9", NS, "00.00", timeout=2)


class _Progress:
    def __init__(self, batch: int) -> None:
        self.name, self.batchId, self.id = None, batch, "q"


class _Event:
    def __init__(self, batch: int) -> None:
        self.progress = _Progress(batch)


def test_a_listener_that_cannot_reach_the_gateway_warns_once_not_per_batch(caplog):
    chk = GatewayCheckpoint(
        "webhdfs://127.0.0.1:9/chk", relpath="chk", namespace=NS, gateway_url="http://127.0.0.1:9", conf={}, key="00.00"
    )
    listener = GatewayMarkerListener(chk, client=_Unreachable())
    with caplog.at_level(logging.WARNING, logger=markers.log.name):
        for batch in range(5):
            listener.onQueryProgress(_Event(batch))
    records = [r for r in caplog.records if r.name == markers.log.name]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert records[0].exc_info is None  # no traceback
    assert "sos restore --batch works without markers" in records[0].getMessage()
    assert len(listener.errors) == 5


# ---------------------------------------------------------------------------- addresses


def test_redirects_name_the_address_the_user_gave(sos_server, tmp_path):
    g = Gw(sos_server, tmp_path, listen="127.0.0.1:0")
    try:
        r = g.session.put(g.u("/a", op="CREATE"), allow_redirects=False)
        assert r.status_code == 307
        assert urllib.parse.urlsplit(r.headers["Location"]).hostname == "127.0.0.1"
    finally:
        g.stop()


# ---------------------------------------------------------------------------- the mount


def test_ls_a_on_the_mount_shows_dot_and_dotdot(sos_server, tmp_path):
    from spark_plugin.mount.process import MountProcess

    ns = "dots"
    key = sos_server.keygen(ns, "append")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mp = MountProcess(
        ns, str(mnt), str(tmp_path / "cache"), sos_server.address, key, log_path=str(tmp_path / "mount.log")
    ).start()
    try:
        (mnt / "d").mkdir()
        (mnt / "d" / "f").write_bytes(b"x")
        out = subprocess.run(["ls", "-a1", str(mnt / "d")], capture_output=True, text=True, check=True).stdout.split()
        assert out == [".", "..", "f"]
        assert subprocess.run(["ls", "-a1", str(mnt)], capture_output=True, text=True, check=True).stdout.split() == [
            ".",
            "..",
            "d",
        ]
        assert sorted(os.listdir(mnt / "d")) == ["f"]  # Python's listdir leaves them out
        la = subprocess.run(["ls", "-la", str(mnt / "d")], capture_output=True, text=True, check=True).stdout
        assert la.splitlines()[1].endswith(" .") and la.splitlines()[2].endswith(" ..")
        assert os.stat(mnt / "d").st_ino == os.stat(mnt / "d" / ".").st_ino
    finally:
        assert mp.stop() == 0
