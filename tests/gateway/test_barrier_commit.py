"""The gateway's barrier rule ``--barrier commit`` (protocol.md 3.4, issue 28 item 4).

A checkpoint's state files (and the temp files of its logs) are answered once journaled in
the gateway's spool; the commit of a batch waits for the server and carries them. The
barrier waits of a batch (``sos_gateway_barrier_waits_total``) do not grow with the number of
state files. A gateway started on an empty cache (its predecessor lost with what it had not
shipped) refuses the commit of the batch that was in flight until the query reads its
``offsets/N`` again, as a restarted Spark driver does; a gateway restarted on its own cache
ships its spool and refuses nothing. Real processes: sos-server, gateways, HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import requests

from tests.gateway.support import NS, FreezableRelay, Gw, restore
from tests.support import metrics_url, scrape
from tests.support import tree_snapshot as tree_of

CHK = "q"


def waits(gw: Gw) -> float:
    return scrape(metrics_url(gw.proc.log())).get("sos_gateway_barrier_waits_total", 0.0)


def atomic(gw: Gw, path: str, data: bytes) -> None:
    """Spark's CheckpointFileManager.createAtomic: the body to a temp file beside ``path``,
    renamed onto it (rename2, OVERWRITE as state stores ask)."""
    head, _, name = path.rpartition("/")
    tmp = f"{head}/.{name}.0b1e.tmp"
    r = gw.put_file(tmp, data, overwrite="true")
    assert r.status_code == 201, r.text
    r = gw.session.put(gw.u(tmp, op="RENAME", destination=path, renameoptions="OVERWRITE"))
    assert r.status_code == 200, r.text


def plan(gw: Gw, n: int) -> None:
    atomic(gw, f"/{CHK}/offsets/{n}", f"v1\n{{}}\noffsets {n}".encode())


def state(gw: Gw, n: int, partitions: int) -> None:
    for p in range(partitions):
        r = gw.session.put(gw.u(f"/{CHK}/state/0/{p}", op="MKDIRS"))
        assert r.status_code == 200, r.text
        atomic(gw, f"/{CHK}/state/0/{p}/{n + 1}.delta", f"state {p} of batch {n}".encode())


def commit(gw: Gw, n: int) -> requests.Response:
    tmp = f"/{CHK}/commits/.{n}.0b1e.tmp"
    assert gw.put_file(tmp, f"v1\n{{}}\ncommit {n}".encode(), overwrite="true").status_code == 201
    return gw.session.put(gw.u(tmp, op="RENAME", destination=f"/{CHK}/commits/{n}", renameoptions="NONE"))


def start(gw: Gw) -> None:
    """What a query does once: its checkpoint directory with the logs' directories."""
    for d in ("offsets", "commits", "state"):
        assert gw.session.put(gw.u(f"/{CHK}/{d}", op="MKDIRS")).status_code == 200
    atomic(gw, f"/{CHK}/metadata", b'{"id":"q"}')


def test_the_waits_of_a_batch_do_not_grow_with_its_state_files(sos_server, tmp_path):
    gw = Gw(sos_server, tmp_path, args=["--metrics", "127.0.0.1:0"])
    try:
        start(gw)
        per_batch = {}
        for n, partitions in enumerate((2, 20, 200)):
            before = waits(gw)
            plan(gw, n)
            state(gw, n, partitions)
            assert commit(gw, n).status_code == 200
            per_batch[partitions] = waits(gw) - before
        # offsets/N: its temp file's body does not wait, its RENAME does; the state files
        # none; commits/N as offsets/N
        assert per_batch == {2: 2, 20: 2, 200: 2}, per_batch
        # outside a checkpoint every change waits as before: a body and a RENAME
        before = waits(gw)
        atomic(gw, "/data/part-0", b"output")
        assert waits(gw) - before == 2
        assert gw.read(f"/{CHK}/state/0/199/3.delta") == b"state 199 of batch 2"
    finally:
        assert gw.stop() == 0
    tree = tree_of(restore(sos_server, gw.key, tmp_path / "r"))
    assert tree[f"{CHK}/commits/2"] == b"v1\n{}\ncommit 2" and tree[f"{CHK}/state/0/7/2.delta"] == b"state 7 of batch 1"


def test_with_barrier_every_each_state_file_waits(sos_server, tmp_path):
    gw = Gw(sos_server, tmp_path, args=["--metrics", "127.0.0.1:0", "--barrier", "every"])
    try:
        start(gw)
        before = waits(gw)
        plan(gw, 0)
        state(gw, 0, 3)
        assert commit(gw, 0).status_code == 200
        # offsets 2, per partition MKDIRS + body + RENAME, commits 2
        assert waits(gw) - before == 2 + 3 * 3 + 2
    finally:
        assert gw.stop() == 0


def _answered_within(fn, seconds):
    """(whether ``fn()`` returned within *seconds*, [its result or exception]); the thread
    that runs it is left behind if not."""
    done = threading.Event()
    out: list = []

    def run():
        try:
            out.append(fn())
        except Exception as exc:
            out.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(seconds), out


def _while_the_server_hangs(sos_server, fn, seconds=10.0):
    """``fn()`` with the SOS server stopped (SIGSTOP): nothing becomes durable meanwhile
    (what the gateway sent it then is taken once it is resumed, after this returns)."""
    os.kill(sos_server.pid, signal.SIGSTOP)
    try:
        return _answered_within(fn, seconds)
    finally:
        os.kill(sos_server.pid, signal.SIGCONT)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_replacement_on_an_empty_cache_refuses_the_commit_of_the_batch_in_flight(sos_server, tmp_path, workers):
    relay = FreezableRelay(sos_server.address)  # the first gateway's way to the server
    try:
        g1 = Gw(SimpleNamespace(address=relay.address, keygen=sos_server.keygen), tmp_path, name="first")
        start(g1)
        plan(g1, 0)
        state(g1, 0, 2)
        assert commit(g1, 0).status_code == 200
        plan(g1, 1)  # durable: offsets/1 waits
        # batch 1's state file is answered from the spool while nothing the gateway sends
        # reaches the server any more, then the gateway and its disk are lost
        relay.freeze()
        answered, out = _answered_within(lambda: state(g1, 1, 1), 30)
        g1.proc.kill()
        assert answered and out == [None], out
    finally:
        relay.close()
    key = g1.key

    g2 = Gw(sos_server, tmp_path, key=key, name="second", args=["--metrics", "127.0.0.1:0"])
    try:
        lost = g2.session.get(g2.u(f"/{CHK}/state/0/0/2.delta", op="GETFILESTATUS"))
        assert lost.status_code == 404  # acknowledged, never shipped: why the commit is refused
        assert scrape(metrics_url(g2.proc.log()))["sos_gateway_batches_in_flight"] == 1
        refused = commit(g2, 1)
        assert refused.status_code == 403, refused.text
        exc = refused.json()["RemoteException"]
        assert exc["exception"] == "IOException" and exc["javaClassName"] == "java.io.IOException"
        assert "batch 1 of checkpoint /q" in exc["message"] and "again" in exc["message"]
        # a commit written in place is refused as its rename, before anything is sent
        direct = g2.session.put(g2.u(f"/{CHK}/commits/1", op="CREATE"), allow_redirects=False)
        assert direct.status_code == 403 and "batch 1" in direct.json()["RemoteException"]["message"]
        # a resend of the refused RENAME is refused again
        again = g2.session.put(
            g2.u(f"/{CHK}/commits/.1.0b1e.tmp", op="RENAME", destination=f"/{CHK}/commits/1", renameoptions="NONE")
        )
        assert again.status_code == 403
        # other checkpoints, other batches and other files are served as usual
        atomic(g2, "/other/file", b"x")
    finally:
        g2.proc.kill()  # the note survives a crash of the replacement: same cache
    g3 = Gw(  # with --workers 2 the read of offsets/1 reaches a read worker, which relays it
        sos_server,
        tmp_path,
        key=key,
        name="third",
        cache=tmp_path / "second-cache",
        args=["--metrics", "127.0.0.1:0", "--workers", str(workers)],
    )
    try:
        assert commit(g3, 1).status_code == 403
        # the query started again: its driver reads offsets/1, its tasks write the state again
        assert g3.read(f"/{CHK}/offsets/1") == b"v1\n{}\noffsets 1"
        assert scrape(metrics_url(g3.proc.log()))["sos_gateway_batches_in_flight"] == 0
        state(g3, 1, 2)
        assert commit(g3, 1).status_code == 200
        plan(g3, 2)
        assert commit(g3, 2).status_code == 200
        with open(tmp_path / "second-cache" / "gateway-inflight.json") as f:
            assert json.load(f)["in_flight"] == {}
    finally:
        assert g3.stop() == 0
    tree = tree_of(restore(sos_server, key, tmp_path / "r"))
    assert tree[f"{CHK}/state/0/0/2.delta"] == b"state 0 of batch 1"
    assert {p for p in tree if p.startswith(f"{CHK}/commits/")} == {f"{CHK}/commits/{n}" for n in range(3)}


def test_a_restart_on_the_same_cache_ships_the_spool_and_refuses_nothing(sos_server, tmp_path):
    g1 = Gw(sos_server, tmp_path, name="gw")
    start(g1)
    plan(g1, 0)
    answered, out = _while_the_server_hangs(sos_server, lambda: state(g1, 0, 2), seconds=30)
    g1.proc.kill()
    assert answered and out == [None], out
    g2 = Gw(sos_server, tmp_path, key=g1.key, name="gw")  # the same cache and spool
    try:
        assert g2.read(f"/{CHK}/state/0/1/1.delta") == b"state 1 of batch 0"
        assert commit(g2, 0).status_code == 200
        assert not os.path.exists(tmp_path / "gw-cache" / "gateway-inflight.json")
    finally:
        assert g2.stop() == 0
    tree = tree_of(restore(sos_server, g1.key, tmp_path / "r"))
    assert tree[f"{CHK}/state/0/1/1.delta"] == b"state 1 of batch 0" and f"{CHK}/commits/0" in tree


def test_a_gateway_stopped_cleanly_then_replaced_on_an_empty_cache_refuses_nothing(sos_server, tmp_path):
    """A rolling update on an empty cache (a Deployment's emptyDir): SIGTERM drains and flushes,
    and the stopped gateway's ``stopped/<epoch>`` tells its successor that nothing was lost."""
    g1 = Gw(sos_server, tmp_path, name="first")
    start(g1)
    plan(g1, 0)
    state(g1, 0, 2)  # batch 0 in flight: its state files answered early
    assert g1.stop() == 0
    g2 = Gw(sos_server, tmp_path, key=g1.key, name="second", args=["--metrics", "127.0.0.1:0"])
    try:
        assert scrape(metrics_url(g2.proc.log()))["sos_gateway_batches_in_flight"] == 0
        assert g2.read(f"/{CHK}/state/0/1/1.delta") == b"state 1 of batch 0"
        assert commit(g2, 0).status_code == 200
        # killed now (no clean stop): its successor on an empty cache refuses batch 1's commit
        plan(g2, 1)
    finally:
        g2.proc.kill()
    g3 = Gw(sos_server, tmp_path, key=g1.key, name="third")
    try:
        assert commit(g3, 1).status_code == 403
    finally:
        assert g3.stop() == 0
    assert "in flight" not in (tmp_path / "second.log").read_text()
    assert "batch 1 of checkpoint /q was in flight" in (tmp_path / "third.log").read_text()


def test_a_damaged_note_stops_the_gateway_rather_than_accept_a_commit(sos_server, tmp_path):
    g1 = Gw(sos_server, tmp_path, name="gw")
    assert g1.stop() == 0
    (tmp_path / "gw-cache" / "gateway-inflight.json").write_text("{not json")
    with pytest.raises(Exception):  # noqa: B017 - the child's start fails; its log says why
        Gw(sos_server, tmp_path, key=g1.key, name="gw")
    assert "gateway-inflight.json" in (tmp_path / "gw.log").read_text()


@pytest.mark.parametrize("pair", [["--lease", "3"], ["--standby"]])
def test_barrier_commit_is_refused_for_a_pair(sos_server, tmp_path, pair):
    key = sos_server.keygen(NS, "append")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "spark_plugin.gateway.cli", NS, "--listen", "127.0.0.1:0", "--barrier", "commit"),
            *("--server", sos_server.address, "--cache", str(tmp_path / "c"), *pair),
        ],
        env=dict(os.environ, SOS_KEY=key),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--barrier commit is not served by a gateway pair" in done.stderr, done.stderr
