"""Issue 26 (hostile input, round 3), items 4, 5 and 6, and issue 28 item 2: the gateway's
memory of its RENAMEs and `sos gateway promote`. Real processes: a `sos-server`, gateways
(`GatewayProcess`), the `sos` command; the memory's log on real files.

4. A RENAME of a missing source answered `true` (rename2: 200) whenever an earlier rename of
   the same two paths was remembered, even when the destination held another file of the
   same size by then, also after a restart. Now the memory keys on the identity of the entry
   the rename left (a digest of its contents, which survives the cache's rebuild) and forgets
   it as soon as its destination changes; a genuine resend still answers as the first.
28.2. The memory was rewritten whole (256 entries) on every RENAME: now one appended line.
5. `sos gateway promote` with a token-role key fenced the active gateway: now 403, as for a
   read-role key; an append-role key promotes.
6. `sos gateway promote` sent `client_secret=KEY` over plain http:// to a non-loopback host:
   refused before connecting; an error answer that echoes the key never shows it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.request

import pytest
import requests

from sos_journal.beneath import Beneath
from spark_plugin.gateway.client import GatewayClient, GatewayError
from spark_plugin.gateway.pair.standby import promote
from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.gateway.webhdfs import renames as rn
from tests.gateway.support import pair_gateway
from tests.support import pair_listen, run_sos_as, token_for
from tests.support import webhdfs_put as _put
from tests.support import webhdfs_rename as _rename

pytestmark = [pytest.mark.hostile]

NS = "round3"


def _gateway(server, key, cache, *args, listen=None, name="gw"):
    return GatewayProcess(
        NS,
        str(cache),
        server.address,
        key,
        listen=listen or pair_listen(),
        extra_args=list(args),
        log_path=str(cache) + f"-{name}.log",
    ).start()


def _read(c: GatewayClient, path: str) -> bytes:
    req = urllib.request.Request(f"{c.url}/webhdfs/v1{path}?op=OPEN", headers={"Authorization": f"Bearer {c.token()}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def _restart(gw, server, key, cache):
    """SIGKILL (a crash after the RENAME, before its reply reached the client), then a new
    gateway on the same cache and port (it rebuilds the cache from the server)."""
    port = gw.url.rsplit(":", 1)[1]
    gw.kill()
    return _gateway(server, key, cache, listen=f"127.0.0.1:{port}")


# ------------------------------------------------------------------ item 4: the RENAME memory


def test_a_resend_answers_as_the_first_only_while_the_destination_holds_the_renamed_file(sos_server, tmp_path):
    key = sos_server.keygen(NS)
    cache = tmp_path / "cache"
    gw = _gateway(sos_server, key, cache)
    try:
        c = GatewayClient(gw.url, NS, key)
        for i in range(6):
            _put(c, f"/c/.{i}.tmp", b"first-%d" % i)
        # 0 (rename2) and 1 (rename): renamed, then the destination replaced by another
        # file of the same size (an overwriting CREATE; a DELETE then a RENAME onto it)
        assert _rename(c, "/c/.0.tmp", "/c/0", rename2=True) is True
        assert _rename(c, "/c/.1.tmp", "/c/1") is True
        _put(c, "/c/0", b"other-0")
        c.call("DELETE", "/webhdfs/v1/c/1", op="DELETE")
        _put(c, "/c/.x", b"other-1")
        assert _rename(c, "/c/.x", "/c/1") is True
        assert _rename(c, "/c/.0.tmp", "/c/0", rename2=True) == "FileNotFoundException"
        assert _rename(c, "/c/.1.tmp", "/c/1") is False
        # 2: renamed, then the destination appended to: another file now
        assert _rename(c, "/c/.2.tmp", "/c/2") is True
        c.call("POST", "/webhdfs/v1/c/2", b"!", op="APPEND", data="true")
        assert _rename(c, "/c/.2.tmp", "/c/2") is False
        # 3: renamed, its destination replaced with the same size, then a crash and a restart
        # (the forgetting is in the log before the change: the restarted gateway knows it)
        assert _rename(c, "/c/.3.tmp", "/c/3") is True
        _put(c, "/c/3", b"other-3")
        # 4 and 5: renamed, then the crash; the resends come after the restart
        assert _rename(c, "/c/.4.tmp", "/c/4", rename2=True) is True
        assert _rename(c, "/c/.5.tmp", "/c/5") is True
        gw = _restart(gw, sos_server, key, cache)
        c = GatewayClient(gw.url, NS, key)
        assert _rename(c, "/c/.3.tmp", "/c/3") is False
        # genuine resends after the crash and the restart: the first answers
        assert _rename(c, "/c/.4.tmp", "/c/4", rename2=True) is True
        assert _rename(c, "/c/.5.tmp", "/c/5") is True
        assert _rename(c, "/c/.5.tmp", "/c/5") is True  # and again: nothing changed
        # 5's destination replaced (same size), then another crash: no longer a resend
        _put(c, "/c/5", b"other-5")
        gw = _restart(gw, sos_server, key, cache)
        c = GatewayClient(gw.url, NS, key)
        assert _rename(c, "/c/.5.tmp", "/c/5") is False
        assert _rename(c, "/c/.4.tmp", "/c/4", rename2=True) is True
        assert {p: _read(c, p) for p in ("/c/0", "/c/1", "/c/3", "/c/4", "/c/5")} == {
            "/c/0": b"other-0",
            "/c/1": b"other-1",
            "/c/3": b"other-3",
            "/c/4": b"first-4",
            "/c/5": b"other-5",
        }
    finally:
        gw.kill()


def test_a_destination_changed_by_another_writer_meanwhile_is_no_resend(sos_server, tmp_path):
    """The forgetting covers what this gateway changes. What another writer changed while it
    was down (here: gateway A renames and dies, B takes the namespace over and replaces A's
    destination with a file of the same size, then A comes back on its cache as a standby
    and is promoted: its memory is A's, its tree the journal's) is told apart by the
    destination's identity (size and contents)."""
    key = sos_server.keygen(NS)
    cache = tmp_path / "a"
    a = _gateway(sos_server, key, cache, name="a")
    try:
        c = GatewayClient(a.url, NS, key)
        _put(c, "/c/.0.tmp", b"mine")
        _put(c, "/c/.1.tmp", b"kept")
        assert _rename(c, "/c/.0.tmp", "/c/0") is True
        assert _rename(c, "/c/.1.tmp", "/c/1") is True
        a.kill()
        b = _gateway(sos_server, key, tmp_path / "b", name="b")
        try:
            _put(GatewayClient(b.url, NS, key), "/c/0", b"your")
        finally:
            assert b.stop() == 0
        a = _gateway(sos_server, key, cache, "--standby", "--lease", "60", name="a2")
        done = run_sos_as(sos_server, key, "gateway", "promote", NS, a.url)
        assert done.returncode == 0, done.stderr
        c = GatewayClient(a.url, NS, key)
        assert _read(c, "/c/0") == b"your"
        assert _rename(c, "/c/.0.tmp", "/c/0") is False
        assert _rename(c, "/c/.1.tmp", "/c/1") is True
    finally:
        a.kill()


def _memory(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir(exist_ok=True)
    return rn.RenameMemory(str(tmp_path / rn.RENAME_MEMORY_FILE)), Beneath(str(tree)), tree


def test_the_memory_is_an_append_only_log_a_torn_last_line_ignored_and_bounded(tmp_path):
    log_path = tmp_path / rn.RENAME_MEMORY_FILE
    mem, at, tree = _memory(tmp_path)
    try:
        (tree / "a").write_bytes(b"aaaa")
        mem.remember("a.tmp", "a", "a", rn.identity(at, "a", os.lstat(tree / "a")))
        inode, size = os.stat(log_path).st_ino, os.stat(log_path).st_size
        (tree / "b").write_bytes(b"bbbb")
        mem.remember("b.tmp", "b", "b", rn.identity(at, "b", os.lstat(tree / "b")))
        # one line appended to the same file (no rewrite of the whole memory)
        assert os.stat(log_path).st_ino == inode
        assert os.stat(log_path).st_size > size
        assert log_path.read_bytes().count(b"\n") == 2
        mem.forget("b")
        assert mem.applied("b.tmp", "b") is None
        assert mem.applied("a.tmp", "a") is not None
        # another file of the same size is another identity
        assert rn.identity(at, "a", os.lstat(tree / "a")) != rn.identity(at, "b", os.lstat(tree / "b"))
        assert rn.identity(at, "a", os.lstat(tree / "a")).startswith("f4:")
    finally:
        mem.close()
    # a crash in the middle of a line: the torn line is ignored, the rest stands
    with open(log_path, "ab") as f:
        f.write(b'["forget","a",fal')
    again, at2, _ = _memory(tmp_path)
    try:
        assert again.applied("a.tmp", "a") is not None  # the torn forget was never made
        assert again.applied("b.tmp", "b") is None  # the whole forget line was
        assert log_path.read_bytes().endswith(b"\n")  # rewritten at start: no torn tail left
        # bounded: past RENAME_LOG_LINES lines the log is rewritten with the live entries
        for i in range(rn.RENAME_LOG_LINES + 10):
            again.remember(f"s{i}", f"d{i}", f"d{i}", "d")
        assert log_path.read_bytes().count(b"\n") <= rn.RENAME_LOG_LINES
        assert len(again.recent) == rn.RENAME_MEMORY
    finally:
        again.close()
        at.close()
        at2.close()
    # a damaged line before the last: nothing of the log is trusted
    lines = log_path.read_bytes().split(b"\n")
    lines[3] = b"garbage"
    log_path.write_bytes(b"\n".join(lines))
    distrusted, at3, _ = _memory(tmp_path)
    try:
        assert distrusted.recent == {}
    finally:
        distrusted.close()
        at3.close()


# ------------------------------------------------------------------ items 5 and 6: promote


def test_promote_needs_an_append_role_key(sos_server, tmp_path):
    append = sos_server.keygen(NS)
    token_key = sos_server.keygen(NS, "token")
    read_key = sos_server.keygen(NS, "read")
    active = _gateway(sos_server, append, tmp_path / "active", "--lease", "60", name="active")
    standby = _gateway(sos_server, append, tmp_path / "standby", "--standby", "--lease", "60", name="standby")
    try:
        for key, role in ((token_key, "token"), (read_key, "read")):
            done = run_sos_as(sos_server, key, "gateway", "promote", NS, standby.url)
            assert done.returncode == 1, (role, done.stdout, done.stderr)
            assert "403" in done.stderr and "AccessControlException" in done.stderr, done.stderr
            assert "append-role key" in done.stderr, done.stderr
            # straight to the endpoint with the key's token: the same refusal
            r = requests.post(
                standby.url + "/sos/v1/promote", headers={"Authorization": f"Bearer {token_for(standby.url, key, NS)}"}
            )
            assert r.status_code == 403, (role, r.text)
            assert r.json()["RemoteException"]["exception"] == "AccessControlException"
        # nothing was fenced: the active still writes, the standby is still a standby
        c = GatewayClient(active.url, NS, token_key)
        _put(c, "/still-active", b"yes")
        r = requests.get(
            standby.url + "/webhdfs/v1/?op=LISTSTATUS",
            headers={"Authorization": f"Bearer {token_for(standby.url, append, NS)}"},
        )
        assert r.status_code == 403 and r.json()["RemoteException"]["exception"] == "StandbyException"
        assert "promoting" not in standby.log()
        # an append-role key promotes
        done = run_sos_as(sos_server, append, "gateway", "promote", NS, standby.url)
        assert done.returncode == 0 and "promoted: writer epoch" in done.stdout, (done.stdout, done.stderr)
        assert active.proc.wait(timeout=60) == 3  # fenced
        _put(GatewayClient(standby.url, NS, token_key), "/after", b"promoted")
    finally:
        active.kill()
        standby.kill()


def _non_loopback_address() -> str | None:
    """An address of this host that is not loopback (None if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.255", 9))  # no packet is sent: only the route is looked up
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_promote_over_plain_http_to_a_non_loopback_host_is_refused_without_connecting(sos_server):
    key = sos_server.keygen(NS)
    addr = _non_loopback_address()
    accepted: list[bytes] = []
    listener = None
    urls = ["http://sos-standby.invalid:9870", "http://192.0.2.1:9870", "http://10.1.2.3:9870"]
    if addr is not None:  # a listener on this host's own non-loopback address: is it reached?
        listener = socket.create_server((addr, 0))
        listener.settimeout(0.2)
        urls.insert(0, f"http://{addr}:{listener.getsockname()[1]}")
        stop = threading.Event()

        def accept():
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(2)
                    try:
                        accepted.append(conn.recv(65536))
                    except OSError:
                        accepted.append(b"")

        t = threading.Thread(target=accept, daemon=True)
        t.start()
    try:
        for url in urls:
            started = time.monotonic()
            done = run_sos_as(sos_server, key, "gateway", "promote", NS, url, timeout=60)
            assert done.returncode == 2, (url, done.stdout, done.stderr)
            assert "in clear" in done.stderr and "https://" in done.stderr, done.stderr
            assert key not in done.stderr and key.split(".")[1] not in done.stderr
            assert time.monotonic() - started < 30  # refused, not timed out connecting
            with pytest.raises(ValueError, match="in clear"):
                promote(url, NS, key)
        assert accepted == []
    finally:
        if listener is not None:
            stop.set()
            t.join(timeout=5)
            listener.close()


def test_an_error_answer_that_echoes_the_token_request_never_shows_the_key(tmp_path):
    """Whatever answers at the URL (a proxy, a wrong service on the port) may echo the
    token request's body, `client_secret=KEY`: the error the client raises (printed by
    `sos gateway promote`, logged by the marker listener) shows `<secret>` instead."""
    import http.server

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(400)
            self.send_header("content-type", "application/json")
            doc = json.dumps({"error": "bad", "error_description": "you sent " + body.decode()}).encode()
            self.send_header("content-length", str(len(doc)))
            self.end_headers()
            self.wfile.write(doc)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Echo)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    key = "0123456789abcdef." + "ab" * 32
    try:
        with pytest.raises(GatewayError) as err:
            promote(f"http://127.0.0.1:{server.server_address[1]}", NS, key)
        assert "client_secret=0123456789abcdef.<secret>" in str(err.value)
        assert "ab" * 32 not in str(err.value)
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------ item 6: every other path


def _secret_forms(key: str) -> list[str]:
    secret = key.split(".")[1]
    return [key, secret, secret.upper()]


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode("utf-8", "replace")


def test_no_key_in_argv_logs_or_errors_of_gateways_and_promote(sos_server, tmp_path):
    """The paths a key takes besides the token request: command lines (the gateways get it
    by environment, `sos gateway promote` from $SOS_KEY), the gateways' logs at --debug
    (every request is logged: a key a client put in a URL's query is shown redacted), the
    server's log, and what `sos gateway promote` prints when it fails (refused key, 403,
    404, nothing listening)."""
    append = sos_server.keygen(NS)
    token_key = sos_server.keygen(NS, "token")
    wrong = append.split(".")[0] + "." + "0" * 64  # the right id, another secret
    keys = (append, token_key, wrong)
    active = pair_gateway(sos_server, append, tmp_path, "active", namespace=NS, lease=60)
    standby = pair_gateway(sos_server, append, tmp_path, "standby", "--standby", namespace=NS, lease=60)
    outputs = []
    try:
        for g in (active, standby):
            line = _cmdline(g.proc.pid)
            assert not any(f in line for k in keys for f in _secret_forms(k)), line
        for key in keys:
            requests.post(
                active.url + "/oauth2/token",
                data={"grant_type": "client_credentials", "client_id": NS, "client_secret": key},
                timeout=60,
            )
            # a client that puts the key in the URL instead (and one with a token as well)
            requests.post(
                active.url + "/oauth2/token",
                params={"grant_type": "client_credentials", "client_id": NS, "client_secret": key},
                timeout=60,
            )
            requests.post(active.url + "/oauth2/token", auth=(NS, key), data={"grant_type": "client_credentials"})
        tok = token_for(active.url, append, NS)
        r = requests.get(
            active.url + "/webhdfs/v1/",
            params={"op": "LISTSTATUS", "client_secret": append},
            headers={"Authorization": f"Bearer {tok}"},
            timeout=60,
        )
        assert r.status_code == 200
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()
        for key, url in (
            (token_key, standby.url),  # 403
            (wrong, standby.url),  # the token request refused: 401
            (append, active.url),  # not a standby: 404
            (append, f"http://127.0.0.1:{port}"),  # nothing listens
        ):
            done = run_sos_as(sos_server, key, "gateway", "promote", NS, url)
            assert done.returncode == 1, (url, done.stdout, done.stderr)
            outputs.append(done.stdout + done.stderr)
    finally:
        active.kill()
        standby.kill()
    texts = {"active log": active.log(), "standby log": standby.log(), "server log": sos_server.log_text()}
    texts.update({f"promote output {i}": out for i, out in enumerate(outputs)})
    assert "client_secret=<redacted>" in texts["active log"]  # the request was logged, its key not
    for what, text in texts.items():
        for key in keys:
            for form in _secret_forms(key):
                assert form not in text, f"{what} holds a key's secret"
