"""A full disk (a 4 MiB tmpfs): NO_SPACE, acked bytes intact, appends work again once
space is freed, and a restart finds everything whole."""

from __future__ import annotations

import os
import subprocess

import pytest

from sos_wire import events as ev
from sos_wire.errors import ErrorCode
from tests.conftest import RawClient

NS = "full"


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True, timeout=60
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a 4 MiB tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)


def pattern(offset: int, size: int) -> bytes:
    base = bytes((i * 7 + 3) % 251 for i in range(251))
    start = offset % 251
    return (base[start:] + base * (size // 251 + 2))[:size]


def test_full_disk_gives_no_space_and_recovers(small_disk, sos_server_factory):
    ballast = small_disk / "ballast"
    ballast.write_bytes(b"\0" * (1 << 20))  # freed later to make room
    # no default quota (25 % of this 4 MiB tmpfs): the test is about the disk filling up
    srv = sos_server_factory(data_dir=small_disk / "data", args=["--namespace-quota", "none"], start=False)
    key = srv.keygen(NS)
    srv.start()
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, NS), ev.AuthOk)
        assert c.append("small", 0, b"precious").length == 8
        acked = 0
        err = None
        for _ in range(100):  # 100 x 200 KiB > 4 MiB: must fill up
            data = pattern(acked, 200_000)
            r = c.append("big", acked, data)
            if isinstance(r, ev.Error):
                err = r
                break
            assert r.length == acked + len(data)
            acked = r.length
        assert err is not None and err.code is ErrorCode.NO_SPACE, err
        assert "space" in err.message
        assert acked > 1_000_000
        # the connection survives; nothing acked was lost; the failed append left nothing
        assert isinstance(c.call(ev.Ping(c.rid(), b"")), ev.Pong)
        st = c.stat("big")
        assert st.length == acked
        assert c.read("big") == pattern(0, acked)
        assert c.read("small") == b"precious"
        r = c.append("big", acked, pattern(acked, 200_000))
        assert isinstance(r, ev.Error) and r.code is ErrorCode.NO_SPACE  # still full
        # space comes back
        os.unlink(ballast)
        more = pattern(acked, 200_000)
        assert c.append("big", acked, more).length == acked + len(more)
        acked += len(more)
        assert c.append("small", 8, b"!").length == 9
    srv.restart()
    with RawClient(srv.address) as c:
        assert isinstance(c.login(key, NS), ev.AuthOk)
        assert c.stat("big").length == acked
        assert c.read("big") == pattern(0, acked)
        assert c.read("small") == b"precious!"
