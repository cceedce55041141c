"""The gateway ships its barriers' journal rounds from its event loop (sos_journal/writer/loop_ship.py):
through restarts of the SOS server every acknowledged file is in the journal, whole, and the
loop's rounds that failed were the replicator thread's to retry. Real server, real gateway."""

from __future__ import annotations

import re
import threading
import time

import requests

from sos_client import Client
from sos_journal import restore, verify
from sos_journal.testing import tree_state
from tests.gateway.support import TIMEOUT
from tests.support import start_gateway, token_for

#: outages at most until a loop round has failed and gone to the thread (test below)
OUTAGES = 4

NS = "gwhttp"


def _log(gw) -> str:
    with open(gw.log_path, encoding="utf-8") as f:
        return f.read()


def _commit(url: str, token: str, i: int) -> None:
    """What Spark does per checkpoint file: CREATE a temporary file (both steps), RENAME it."""
    auth = {"Authorization": f"Bearer {token}"}
    tmp = f"/webhdfs/v1/chk/commits/.{i}.tmp"
    r = requests.put(f"{url}{tmp}?op=CREATE&overwrite=false", headers=auth, allow_redirects=False, timeout=TIMEOUT)
    assert r.status_code == 307, r.text
    r = requests.put(r.headers["location"], headers=auth, data=b"v1\n%d\n" % i, timeout=TIMEOUT)
    assert r.status_code == 201, r.text
    r = requests.put(f"{url}{tmp}?op=RENAME&destination=/chk/commits/{i}", headers=auth, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"boolean": True}, r.text


def test_acknowledged_files_survive_server_restarts_between_loop_rounds(sos_server, tmp_path):
    # --barrier every: every CREATE body and RENAME waits, so each is a round from the loop
    gw = start_gateway(sos_server, tmp_path, "--barrier", "every", name="loopship", namespace=NS)
    token = token_for(gw.url, gw.key, NS)
    n = 0
    for _restart in range(3):
        for _ in range(5):
            _commit(gw.url, token, n)
            n += 1
        sos_server.kill()  # the loop's connection dies with it: its next round fails,
        sos_server.start()  # the thread reconnects (same port) and retries
    _commit(gw.url, token, n)
    n += 1
    assert gw.stop() == 0
    shipped = re.search(r"(\d+) journal rounds shipped from the event loop", _log(gw))
    assert shipped is not None and int(shipped.group(1)) > 0
    factory = lambda: Client(sos_server.address, gw.key, NS, timeout=60)  # noqa: E731
    restore(factory, NS, str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out" / "chk" / "commits")) == {str(i): b"v1\n%d\n" % i for i in range(n)}
    report = verify(factory, NS)
    assert report.ok and report.records == report.last_seq, report.text()


def test_a_round_the_loop_cannot_send_is_retried_by_the_thread(sos_server, tmp_path):
    gw = start_gateway(sos_server, tmp_path, "--barrier", "every", name="handover", namespace=NS)
    token = token_for(gw.url, gw.key, NS)
    _commit(gw.url, token, 0)
    # Each outage: a commit while the server is down. Its first round is usually the loop's
    # (the barrier claims it as the CREATE body is journaled); the replicator thread, looking
    # for records every 50 ms, can take it first, so a few outages make sure one of them
    # hands a failed loop round to the thread (the log's closing line counts them).
    commits = 1
    for _ in range(OUTAGES):
        sos_server.kill()
        done: list[BaseException | None] = []

        def commit(i: int = commits, done: list[BaseException | None] = done) -> None:
            try:
                _commit(gw.url, token, i)
                done.append(None)
            except BaseException as exc:
                done.append(exc)

        waiter = threading.Thread(target=commit)
        waiter.start()
        # the round fails (no server): the thread retries it with backoff, and says so
        deadline = time.monotonic() + TIMEOUT
        seen = _log(gw).count("retrying in")
        while _log(gw).count("retrying in") <= seen:
            assert time.monotonic() < deadline and not done, done
            time.sleep(0.05)
        assert not done  # not acknowledged while the server is down
        sos_server.start()
        waiter.join(TIMEOUT)
        assert done == [None]
        commits += 1
        if "the replicator thread takes over" in _log(gw):
            break
    _commit(gw.url, token, commits)  # and the loop ships again
    commits += 1
    assert gw.stop() == 0
    shipped = re.search(r"(\d+) journal rounds shipped from the event loop, (\d+) handed", _log(gw))
    assert shipped is not None and int(shipped.group(2)) >= 1
    factory = lambda: Client(sos_server.address, gw.key, NS, timeout=60)  # noqa: E731
    restore(factory, NS, str(tmp_path / "out"))
    assert tree_state(str(tmp_path / "out" / "chk" / "commits")) == {str(i): b"v1\n%d\n" % i for i in range(commits)}
