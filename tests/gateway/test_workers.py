"""``sos gateway --workers N`` (issue 28 item 3) against real parts: a real sos-server, a real
gateway of several processes, real HTTP from clients nobody here wrote (requests, fsspec's
WebHDFS, http.client), ``sos restore`` for what reached the journal. The answers and the
guarantees are those of one process: read-your-writes on any process, a dead worker started
again, SIGTERM drains every process, a fence stops them all with code 3."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import requests

from tests.gateway.support import Gw, chunked_create, restore, send_chunk, wait_exit, workers_of
from tests.support import tree_snapshot as tree_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


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
        for i in range(4):  # an HTTP/1.0 change without Host, relayed to the writer
            with socket.create_connection((g.host, g.port), timeout=60) as raw:
                raw.sendall(
                    f"PUT /webhdfs/v1/old{i}?op=MKDIRS HTTP/1.0\r\nAuthorization: Bearer {g.token}\r\n\r\n".encode()
                )
                reply = b""
                while chunk := raw.recv(65536):
                    reply += chunk
            assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b'{"boolean":true}'), reply
    finally:
        code = g.stop()
    assert code == 0, g.proc.log()[-3000:]
    assert served_by_workers(g.proc.log()) > 0, "no read was served by the worker"
    expected = {f"ryw/c{n}/f{i}.done": f"{n}-{i}".encode() * 100 for n in range(8) for i in range(6)}
    restored = {k: v for k, v in tree_of(restore(sos_server, g.key, tmp_path / "restored")).items() if v is not None}
    assert restored == expected


def test_fsspec_webhdfs_sees_the_same_through_two_processes(sos_server, tmp_path):
    from fsspec.implementations.webhdfs import WebHDFS

    g = Gw(sos_server, tmp_path, args=["--workers", "2"])
    big = os.urandom(3 << 20) + b"tail"  # several upload blocks (APPENDs)
    try:
        for round_ in range(4):  # new filesystems, new connections
            fs = WebHDFS(g.host, port=g.port, user="spark", skip_instance_cache=True)
            fs.session.headers["Authorization"] = f"Bearer {g.token}"
            top = f"/data{round_}"
            fs.mkdir(f"{top}/sub")
            with fs.open(f"{top}/a.bin", "wb", block_size=1 << 20) as f:
                f.write(big)
            fs.pipe_file(f"{top}/sub/small.txt", b"hello")
            fs.pipe_file(f"{top}/gone.txt", b"to be deleted")
            fs.mv(f"{top}/sub/small.txt", f"{top}/renamed.txt")
            fs.rm(f"{top}/gone.txt")
            assert fs.ls(top) == [f"{top}/a.bin", f"{top}/renamed.txt", f"{top}/sub"]
            assert fs.info(f"{top}/a.bin")["size"] == len(big)
            assert fs.cat(f"{top}/a.bin") == big
            assert fs.cat(f"{top}/renamed.txt") == b"hello"
            assert not fs.exists(f"{top}/gone.txt")
            fs.session.close()
    finally:
        code = g.stop()
    assert code == 0, g.proc.log()[-3000:]
    expected: dict[str, bytes | None] = {}
    for round_ in range(4):
        expected.update({f"data{round_}": None, f"data{round_}/sub": None})
        expected.update({f"data{round_}/a.bin": big, f"data{round_}/renamed.txt": b"hello"})
    assert tree_of(g.proc.cache_dir + "/tree") == expected
    assert tree_of(restore(sos_server, g.key, tmp_path / "restored")) == expected


def test_a_killed_worker_is_started_again_and_the_gateway_goes_on(sos_server, tmp_path):
    g = Gw(sos_server, tmp_path, args=["--workers", "3"])
    try:
        before = workers_of(g.proc.proc.pid)
        assert len(before) == 2
        os.kill(before[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            now = workers_of(g.proc.proc.pid)
            if len(now) == 2 and before[0] not in now and "serves again" in g.proc.log():
                break
            assert time.monotonic() < deadline, g.proc.log()[-3000:]
            time.sleep(0.1)
        assert before[1] in now  # the other one was left alone
        assert "exited with signal SIGKILL while serving" in g.proc.log()
        for i in range(20):  # every process serves, the new one too
            with fresh(g) as s:
                assert s.put(g.u(f"/k/d{i}", op="MKDIRS")).json() == {"boolean": True}
            with fresh(g) as s:
                assert s.get(g.u(f"/k/d{i}", op="GETFILESTATUS")).status_code == 200
    finally:
        code = g.stop()
    assert code == 0, g.proc.log()[-3000:]
    assert all(not alive(pid) for pid in now)


def test_sigterm_drains_every_process_then_flushes(sos_server, tmp_path):
    # bodies streaming on several connections (the kernel spreads them over the processes):
    # after SIGTERM every process stops accepting, each body is still answered and journaled
    g = Gw(sos_server, tmp_path, args=["--workers", "2"])
    pids = workers_of(g.proc.proc.pid)
    slow = [chunked_create(g, f"/d/file{i}") for i in range(8)]
    for i, conn in enumerate(slow):
        send_chunk(conn, b"first part %d;" % i)
    time.sleep(0.5)
    assert g.session.get(g.u("/", op="LISTSTATUS")).status_code == 200
    g.session.close()
    g.proc.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 120
    while True:  # the listening socket goes away in every process
        try:
            socket.create_connection((g.host, g.port), timeout=5).close()
        except ConnectionRefusedError:
            break
        assert time.monotonic() < deadline, "the gateway still accepts connections"
        time.sleep(0.05)
    assert g.proc.proc.poll() is None  # still running: requests are in progress
    for i, conn in enumerate(slow):
        send_chunk(conn, b"second part %d" % i)
        conn.send(b"0\r\n\r\n")
    for conn in slow:
        reply = conn.getresponse()
        assert reply.status == 201
        assert reply.getheader("connection") == "close"
        conn.close()
    assert g.proc.proc.wait(120) == 0, g.proc.log()[-3000:]
    assert all(not alive(pid) for pid in pids)
    restored = tree_of(restore(sos_server, g.key, tmp_path / "restored"))
    assert {k: v for k, v in restored.items() if k.startswith("d/")} == {
        f"d/file{i}": b"first part %d;second part %d" % (i, i) for i in range(8)
    }


def test_a_fence_stops_every_process_with_code_3(sos_server, tmp_path):
    old = Gw(sos_server, tmp_path, name="old", args=["--workers", "2", "--fence-check", "1"])
    pids = workers_of(old.proc.proc.pid)
    assert old.session.put(old.u("/chk/offsets", op="MKDIRS")).status_code == 200
    new = Gw(sos_server, tmp_path, name="new", key=old.key)  # takes the namespace over
    try:
        code = wait_exit(old.proc)
        assert code == 3, old.proc.log()[-3000:]
        assert all(not alive(pid) for pid in pids)
        log = old.proc.log()
        assert "FENCED" in log and "exited with code 3" in log
        with pytest.raises(requests.ConnectionError):
            fresh(old).get(old.u("/chk", op="GETFILESTATUS"), timeout=10)
        assert new.session.put(new.u("/chk/y", op="MKDIRS")).status_code == 200
    finally:
        new.stop()
        old.proc.stop()


def test_the_workers_of_a_writer_whose_lease_lapsed_refuse_as_a_standby(sos_server, tmp_path):
    # a paused writer (SIGSTOP: a zombie) renews no lease; its workers, still running, must
    # not serve reads from its cache once the lease would have lapsed: StandbyException, so
    # Hadoop's client goes to the other gateway of the pair
    g = Gw(sos_server, tmp_path, args=["--workers", "2", "--lease", "2"])
    try:
        assert g.session.put(g.u("/l/d", op="MKDIRS")).status_code == 200
        for _ in range(6):
            with fresh(g) as s:
                assert s.get(g.u("/l/d", op="GETFILESTATUS")).status_code == 200
        g.proc.proc.send_signal(signal.SIGSTOP)
        time.sleep(2.5)
        refused = 0
        for _ in range(40):  # connections the stopped writer accepts time out; a worker answers
            try:
                with fresh(g) as s:
                    r = s.get(g.u("/l/d", op="GETFILESTATUS"), timeout=1)
            except requests.RequestException:
                continue
            assert r.status_code == 403, r.text
            assert "StandbyException" in r.json()["RemoteException"]["message"]
            refused += 1
        assert refused > 0
    finally:
        g.proc.proc.send_signal(signal.SIGCONT)
    with fresh(g) as s:
        deadline = time.monotonic() + 30
        while s.get(g.u("/l/d", op="GETFILESTATUS"), timeout=30).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert g.stop() == 0, g.proc.log()[-3000:]


def test_the_metrics_endpoint_counts_every_process(sos_server, tmp_path):
    g = Gw(sos_server, tmp_path, args=["--workers", "2", "--metrics", "127.0.0.1:0"])
    try:
        port = int(g.proc.log().split("metrics on http://127.0.0.1:")[1].split("/")[0])
        assert g.session.put(g.u("/m", op="MKDIRS")).status_code == 200
        for _ in range(30):
            with fresh(g) as s:
                assert s.get(g.u("/m", op="GETFILESTATUS")).status_code == 200
        deadline = time.monotonic() + 30
        while True:  # the workers write their figures every 2 s
            page = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            served = {}
            for line in page.splitlines():
                if line.startswith(("sos_gateway_requests_total{", "sos_gateway_worker_requests_total{")):
                    served[line.split(" ")[0]] = float(line.split(" ")[1])
            reads = sum(v for k, v in served.items() if 'op="GETFILESTATUS"' in k)
            if reads == 30:
                break
            assert time.monotonic() < deadline, served
            time.sleep(0.5)
        assert served['sos_gateway_requests_total{op="MKDIRS"}'] == 1  # the writer's, once
        # the worker's reads are counted under its label (the writer served some, or none)
        assert any(k.startswith("sos_gateway_worker_requests_total{") and 'worker="1"' in k for k in served), served
    finally:
        assert g.stop() == 0, g.proc.log()[-3000:]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--workers", "0"], "at least 1"),
        (["--workers", "many"], "expected a number of processes or auto"),
        (["--workers", "2", "--standby"], "--workers is not served by a --standby gateway"),
    ],
)
def test_bad_workers_are_refused_as_usage_errors(args, said, tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, SOS_KEY="00" * 8 + "." + "11" * 32)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_plugin.gateway.cli",
            "ns",
            "--listen",
            "127.0.0.1:0",
            "--cache",
            str(tmp_path),
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2, r.stderr
    assert said in r.stderr


def test_a_killed_writer_takes_its_workers_with_it_and_a_restart_serves_the_same(sos_server, tmp_path):
    # SIGKILL of the process `sos gateway` started (a crash, an OOM kill): no worker goes on
    # serving reads of a cache that a replacement may rebuild; the replacement (here on the
    # same cache and port) serves what was acknowledged
    g = Gw(sos_server, tmp_path, args=["--workers", "3"])
    pids = workers_of(g.proc.proc.pid)
    assert len(pids) == 2
    assert g.put_file("/k/acked", b"acknowledged").status_code == 201
    with fresh(g) as s:
        assert s.put(g.u("/k/acked", op="RENAME", destination="/k/done")).json() == {"boolean": True}
    g.proc.kill()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a worker outlived its writer"
        time.sleep(0.05)
    # every copy of the listening socket closed: connections refused.  Polled, not tried once:
    # a killed process's fds close when its last thread has exited, which can trail the
    # moment /proc shows its leader a zombie on a loaded machine (one CI run connected there)
    while True:
        try:
            socket.create_connection((g.host, g.port), timeout=5).close()
        except OSError:
            break
        assert time.monotonic() < deadline, "the gateway's port still accepts with every process dead"
        time.sleep(0.05)
    again = Gw(
        sos_server,
        tmp_path,
        key=g.key,
        name="again",
        cache=g.proc.cache_dir,
        listen=f"{g.host}:{g.port}",
        args=["--workers", "2"],
    )
    try:
        for _ in range(6):
            with fresh(again) as s:
                assert s.get(again.u("/k/done", op="OPEN")).content == b"acknowledged"
        # the RENAME resent after the crash answers as the first one did (the writer's memory)
        with fresh(again) as s:
            assert s.put(again.u("/k/acked", op="RENAME", destination="/k/done")).json() == {"boolean": True}
    finally:
        assert again.stop() == 0, again.proc.log()[-3000:]


def test_https_through_the_workers(sos_server, tmp_path):
    from spark_plugin.gateway.process import GatewayProcess
    from tests.support import self_signed_cert

    cert, keyf = self_signed_cert(tmp_path, "cert", cn="127.0.0.1")
    key = sos_server.keygen("gw", "append")
    g = GatewayProcess(
        "gw",
        str(tmp_path / "c"),
        sos_server.address,
        key,
        extra_args=["--tls-cert", str(cert), "--tls-key", str(keyf), "--workers", "2"],
        log_path=str(tmp_path / "tls.log"),
    ).start()
    try:
        assert g.url.startswith("https://")
        v = {"verify": str(cert)}
        for i in range(4):
            with requests.Session() as s:
                r = s.post(
                    g.url + "/oauth2/token",
                    data={"grant_type": "client_credentials", "client_id": "gw", "client_secret": key},
                    **v,
                )
                s.headers["Authorization"] = f"Bearer {r.json()['access_token']}"
                r = s.put(f"{g.url}/webhdfs/v1/t/f{i}?op=CREATE", allow_redirects=False, **v)
                assert r.status_code == 307 and r.headers["location"].startswith(g.url + "/"), r.headers
                assert s.put(r.headers["location"], data=b"over tls", **v).status_code == 201
                assert s.get(f"{g.url}/webhdfs/v1/t/f{i}?op=OPEN", **v).content == b"over tls"
        with pytest.raises(requests.ConnectionError):
            requests.get(g.url.replace("https://", "http://") + "/webhdfs/v1/?op=LISTSTATUS", timeout=30)
    finally:
        assert g.stop() == 0, g.log()[-3000:]


def test_on_a_wildcard_address_the_redirects_name_the_address_each_client_reached(sos_server, tmp_path):
    # the writer builds CREATE's redirect; the worker tells it which of its addresses the
    # client connected to (as one process knows it from its own socket)
    g = Gw(sos_server, tmp_path, listen="0.0.0.0:0", args=["--workers", "2", "--insecure-plaintext"])
    try:
        for host in ("127.0.0.1", "127.0.0.5"):
            for i in range(3):
                with fresh(g) as s:
                    r = s.put(f"http://{host}:{g.port}/webhdfs/v1/w/f{i}?op=CREATE", allow_redirects=False)
                assert r.status_code == 307, r.text
                assert r.headers["location"].startswith(f"http://{host}:{g.port}/webhdfs/v1/w/f{i}?"), r.headers
    finally:
        assert g.stop() == 0, g.proc.log()[-3000:]
