"""``sos gateway --workers N`` (issue 28 item 3) against real parts: a real sos-server, a real
gateway of several processes, real HTTP from clients nobody here wrote (requests, fsspec's
WebHDFS, http.client), ``sos restore`` for what reached the journal. The answers and the
guarantees are those of one process: read-your-writes on any process, a dead worker started
again, SIGTERM drains every process, a fence stops them all with code 3."""

from __future__ import annotations

import os
import threading

import pytest
import requests

from tests.gateway.test_gateway import Gw, restore
from tests.support import tree_snapshot as tree_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def workers_of(pid: int) -> list[int]:
    """The gateway's worker processes (its children running the workers module)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    found = []
    for child in out:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spark_plugin.gateway.workers" in f.read():
                    found.append(child)
        except FileNotFoundError:
            continue
    return sorted(found)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def fresh(g: Gw) -> requests.Session:
    """A new session (a new connection: the kernel gives it to any of the processes)."""
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {g.token}"
    return s


def served_by_workers(log: str) -> int:
    """GETFILESTATUS requests the workers counted in their stop summaries."""
    total = 0
    for line in log.splitlines():
        if "worker" in line and "stopped; requests served" in line:
            for part in line.split("\\n"):
                if part.startswith("GETFILESTATUS:"):
                    total += int(part.split()[1])
    return total


def test_two_processes_answer_as_one_and_every_read_sees_the_writes_before_it(sos_server, tmp_path):
    g = Gw(sos_server, tmp_path, args=["--workers", "2"])
    try:
        assert len(workers_of(g.proc.proc.pid)) == 1
        assert "2 processes" in g.proc.ready_line
        errors: list[str] = []

        def client(n: int) -> None:
            # each step on a new connection: a write's reply, then reads on other processes
            try:
                for i in range(6):
                    path = f"/ryw/c{n}/f{i}"
                    body = f"{n}-{i}".encode() * 100
                    with fresh(g) as s:
                        r = s.put(g.u(path, op="CREATE", overwrite="true"), allow_redirects=False)
                        assert r.status_code == 307, r.text
                    with fresh(g) as s:
                        assert s.put(r.headers["Location"], data=body).status_code == 201
                    with fresh(g) as s:
                        st = s.get(g.u(path, op="GETFILESTATUS")).json()["FileStatus"]
                        assert st["length"] == len(body), (path, st)
                    with fresh(g) as s:
                        assert s.get(g.u(path, op="OPEN")).content == body
                    with fresh(g) as s:
                        dst = path + ".done"
                        assert s.put(g.u(path, op="RENAME", destination=dst)).json() == {"boolean": True}
                    with fresh(g) as s:
                        assert s.get(g.u(dst, op="GETFILESTATUS")).status_code == 200
                        assert s.get(g.u(path, op="GETFILESTATUS")).status_code == 404
                    with fresh(g) as s:
                        names = [
                            e["pathSuffix"]
                            for e in s.get(g.u(f"/ryw/c{n}", op="LISTSTATUS")).json()["FileStatuses"]["FileStatus"]
                        ]
                        assert f"f{i}.done" in names and f"f{i}" not in names
            except Exception as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        # a refusal reads the same from every process (a token-less request, a missing path)
        for _ in range(6):
            with fresh(g) as s:
                r = s.get(g.u("/nothing", op="GETFILESTATUS"))
                assert r.status_code == 404 and r.json()["RemoteException"]["exception"] == "FileNotFoundException"
                r = s.put(g.u("/nothing", op="RENAME", destination="/x"))
                assert r.status_code == 200 and r.json() == {"boolean": False}
            r = requests.get(g.u("/", op="LISTSTATUS"))
            assert r.status_code == 401
    finally:
        code = g.stop()
    assert code == 0, g.proc.log()[-3000:]
    assert served_by_workers(g.proc.log()) > 0, "no read was served by the worker"
    expected = {f"ryw/c{n}/f{i}.done": f"{n}-{i}".encode() * 100 for n in range(8) for i in range(6)}
    restored = {k: v for k, v in tree_of(restore(sos_server, g.key, tmp_path / "restored")).items() if v is not None}
    assert restored == expected
