"""`sos gateway` against real parts: a real sos-server process, a real `sos gateway` child
process, real HTTP from clients nobody here wrote (fsspec's WebHDFS over requests,
http.client), and `sos restore` to check what reached the journal."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import threading
import time

import pytest
import requests

from spark_plugin.gateway.http.auth import TokenAuthority
from spark_plugin.gateway.process import GatewayProcess
from tests.gateway.support import NS, Gw, chunked_create, peak_rss, remote, restore, send_chunk
from tests.support import gateway_refused, self_signed_cert, token_for
from tests.support import tree_snapshot as tree_of


@pytest.fixture
def gw(sos_server, tmp_path):
    g = Gw(sos_server, tmp_path)
    yield g
    g.stop()


# ---------------------------------------------------------------------------- (a) fsspec


def test_fsspec_webhdfs_writes_renames_deletes_lists_reads_and_restore_agrees(gw, tmp_path):
    from fsspec.implementations.webhdfs import WebHDFS

    fs = WebHDFS(gw.host, port=gw.port, user="spark", skip_instance_cache=True)
    fs.session.headers["Authorization"] = f"Bearer {gw.token}"
    request_session = fs.session
    big = os.urandom(3 << 20) + b"tail"  # several upload blocks (APPENDs)
    fs.mkdir("/data/sub")
    with fs.open("/data/a.bin", "wb", block_size=1 << 20) as f:
        f.write(big)
    fs.pipe_file("/data/sub/small.txt", b"hello")
    fs.pipe_file("/data/gone.txt", b"to be deleted")
    fs.mv("/data/sub/small.txt", "/data/renamed.txt")
    fs.rm("/data/gone.txt")
    fs.mkdir("/data/empty")
    fs.rm("/data/empty", recursive=True)
    assert fs.ls("/data") == ["/data/a.bin", "/data/renamed.txt", "/data/sub"]
    assert fs.info("/data/a.bin")["size"] == len(big)
    assert fs.cat("/data/a.bin") == big
    with fs.open("/data/a.bin", "rb") as f:
        f.seek(len(big) - 10)
        assert f.read() == big[-10:]
    assert fs.cat("/data/renamed.txt") == b"hello"
    assert not fs.exists("/data/gone.txt")
    request_session.close()
    expected = {"data": None, "data/sub": None, "data/a.bin": big, "data/renamed.txt": b"hello"}
    assert tree_of(gw.proc.cache_dir + "/tree") == expected
    assert gw.stop() == 0
    # the journal on the server holds the same tree
    assert tree_of(restore(gw.server, gw.key, tmp_path / "restored")) == expected


def test_empty_cache_is_restored_from_the_server(sos_server, tmp_path):
    g1 = Gw(sos_server, tmp_path, name="first")
    assert g1.put_file("/q/f", b"kept").status_code == 201
    assert g1.session.put(g1.u("/q/f", op="RENAME", destination="/q/g")).json() == {"boolean": True}
    g1.proc.kill()  # a crash: the RENAME was durable when it replied
    g2 = Gw(sos_server, tmp_path, key=g1.key, name="second")  # a new, empty cache
    try:
        names = [
            e["pathSuffix"] for e in g2.session.get(g2.u("/q", op="LISTSTATUS")).json()["FileStatuses"]["FileStatus"]
        ]
        assert names == ["g"]
        assert g2.read("/q/g") == b"kept"
    finally:
        assert g2.stop() == 0


# ---------------------------------------------------------------------------- (b) auth


def test_requests_without_a_valid_token_get_401(gw):
    for r in (
        requests.get(gw.u("/", op="LISTSTATUS")),
        requests.get(gw.u("/", op="LISTSTATUS"), headers={"Authorization": "Bearer nope"}),
        requests.put(gw.u("/x", op="MKDIRS"), headers={"Authorization": "Basic Zm9vOmJhcg=="}),
        requests.post(gw.url + "/sos/v1/marker?label=x", data=b""),
    ):
        assert r.status_code == 401
        assert "Bearer" in r.headers["www-authenticate"]
        assert remote(r)["javaClassName"] == "org.apache.hadoop.security.AccessControlException"
    # a token of another gateway key (forged MAC) is refused too
    forged, _ = TokenAuthority(NS, os.urandom(32)).issue("append")
    r = requests.get(gw.u("/", op="LISTSTATUS"), headers={"Authorization": f"Bearer {forged}"})
    assert r.status_code == 401
    assert not os.listdir(gw.proc.cache_dir + "/tree")  # nothing was created


def test_token_endpoint_refuses_bad_credentials(gw, sos_server):
    def post(**form):
        return requests.post(gw.url + "/oauth2/token", data=form)

    good = {"grant_type": "client_credentials", "client_id": NS}
    unknown_key = "0123456789abcdef." + "ab" * 32  # well formed, not on the server
    other_ns_key = sos_server.keygen("other", "append")
    for form, status, error in [
        (dict(good, client_secret=unknown_key), 401, "invalid_client"),
        (dict(good, client_secret=other_ns_key), 401, "invalid_client"),
        (dict(good, client_secret="not a key"), 401, "invalid_client"),
        (dict(good, client_id="other", client_secret=gw.key), 401, "invalid_client"),
        (dict(good), 400, "invalid_request"),
        (dict(good, grant_type="password", client_secret=gw.key), 400, "unsupported_grant_type"),
    ]:
        r = post(**form)
        assert r.status_code == status, (form, r.text)
        assert r.json()["error"] == error
        assert "content-type" not in r.headers and r.headers["cache-control"] == "no-store"
    assert requests.get(gw.url + "/oauth2/token").status_code == 405
    # client credentials in an HTTP Basic header work too (RFC 6749 2.3.1)
    r = requests.post(gw.url + "/oauth2/token", data={"grant_type": "client_credentials"}, auth=(NS, gw.key))
    assert r.status_code == 200 and r.json()["access_token"].startswith("sos2.")


def test_read_key_token_reads_but_cannot_write(gw, sos_server):
    assert gw.put_file("/r/f", b"data").status_code == 201
    read_token = token_for(gw.url, sos_server.keygen(NS, "read"), NS)
    h = {"Authorization": f"Bearer {read_token}"}
    assert requests.get(gw.u("/r/f", op="GETFILESTATUS"), headers=h).json()["FileStatus"]["length"] == 4
    assert requests.get(gw.u("/r/f", op="OPEN"), headers=h).content == b"data"
    refused = [
        requests.put(gw.u("/r/d", op="MKDIRS"), headers=h),
        requests.put(gw.u("/r/new", op="CREATE"), headers=h, allow_redirects=False),
        requests.put(gw.u("/r/new", op="CREATE", data="true"), headers=h, data=b"x"),
        requests.put(gw.u("/r/f", op="RENAME", destination="/r/g"), headers=h),
        requests.delete(gw.u("/r/f", op="DELETE"), headers=h),
        requests.post(gw.u("/r/f", op="APPEND"), headers=h, allow_redirects=False),
        requests.post(gw.url + "/sos/v1/marker?label=x", headers=h, data=b"p"),
    ]
    for r in refused:
        assert r.status_code == 403, r.text
        assert remote(r)["exception"] == "AccessControlException"
    assert sorted(os.listdir(gw.proc.cache_dir + "/tree/r")) == ["f"]
    assert gw.read("/r/f") == b"data"


def test_tokens_expire(sos_server, tmp_path):
    g = Gw(sos_server, tmp_path, args=["--token-ttl", "1"])
    try:
        assert g.session.get(g.u("/", op="LISTSTATUS")).status_code == 200
        time.sleep(2.2)  # past the 1 s lifetime (not a timing assertion: expiry is exact)
        r = g.session.get(g.u("/", op="LISTSTATUS"))
        assert r.status_code == 401
        assert "expired" in remote(r)["message"]
    finally:
        g.stop()


def test_tokens_survive_a_gateway_restart(sos_server, tmp_path):
    """Hadoop asks for a new token only when its timer says so, never after a 401."""
    g = Gw(sos_server, tmp_path, name="one")
    port = g.port
    g.proc.kill()
    g2 = GatewayProcess(
        NS,
        str(tmp_path / "two-cache"),
        sos_server.address,
        g.key,
        listen=f"127.0.0.1:{port}",
        log_path=str(tmp_path / "two.log"),
    ).start()
    try:
        r = g.session.get(g.u("/", op="LISTSTATUS"))  # the old token, the new process
        assert r.status_code == 200, r.text
    finally:
        assert g2.stop() == 0


def test_insecure_no_auth_only_on_loopback(sos_server, tmp_path):
    key = sos_server.keygen(NS, "append")
    proc = gateway_refused(sos_server, key, NS, tmp_path / "c", "--insecure-no-auth", listen="0.0.0.0:0")
    assert proc.returncode == 1 and "loopback" in proc.stderr
    g = GatewayProcess(
        NS,
        str(tmp_path / "c"),
        sos_server.address,
        key,
        extra_args=["--insecure-no-auth"],
        log_path=str(tmp_path / "i.log"),
    ).start()
    try:
        assert requests.put(f"{g.url}/webhdfs/v1/open?op=MKDIRS").json() == {"boolean": True}
    finally:
        assert g.stop() == 0


# ---------------------------------------------------------------------------- (c) headers


def test_no_reply_carries_a_content_type(gw):
    s = gw.session
    replies = [
        requests.post(
            gw.url + "/oauth2/token",
            data={"grant_type": "client_credentials", "client_id": NS, "client_secret": gw.key},
        ),
        requests.get(gw.u("/", op="LISTSTATUS")),  # 401
        s.put(gw.u("/h", op="MKDIRS")),
        s.put(gw.u("/h/f", op="CREATE"), allow_redirects=False),  # 307
        s.put(gw.u("/h/f", op="CREATE", data="true"), data=b"x"),  # 201
        s.put(gw.u("/h/f", op="CREATE", noredirect="true")),  # 403 (exists)
        s.put(gw.u("/h/g", op="CREATE", noredirect="true")),  # 200 + Location JSON
        s.get(gw.u("/h/f", op="OPEN"), allow_redirects=False),
        s.get(gw.u("/h/f", op="OPEN", data="true")),
        s.get(gw.u("/h/f", op="GETFILESTATUS")),
        s.get(gw.u("/h", op="LISTSTATUS")),
        s.get(gw.u("/h", op="LISTSTATUS_BATCH")),
        s.get(gw.u("/", op="GETSERVERDEFAULTS")),
        s.get(gw.u("/", op="GETHOMEDIRECTORY", **{"user.name": "spark"})),
        s.get(gw.u("/nope", op="GETFILESTATUS")),  # 404
        s.get(gw.u("/", op="GETACLSTATUS")),  # 400
        s.get(gw.url + "/elsewhere"),
        s.put(gw.u("/h/f", op="RENAME", destination="/h/g2", renameoptions="NONE")),
        s.delete(gw.u("/h/g2", op="DELETE")),
        s.post(gw.url + "/sos/v1/marker?label=test", data=b"payload"),
    ]
    statuses = [r.status_code for r in replies]
    assert statuses == [
        200,
        401,
        200,
        307,
        201,
        403,
        200,
        307,
        200,
        200,
        200,
        200,
        200,
        200,
        404,
        400,
        404,
        200,
        200,
        200,
    ]
    for r in replies:
        assert "content-type" not in r.headers, (r.request.url, r.headers)
    assert replies[6].json()["Location"].endswith("data=true")
    assert replies[12].json()["FsServerDefaults"]["checksumType"] == 2  # an integer
    assert replies[13].json() == {"Path": "/user/spark"}
    assert isinstance(replies[19].json()["seq"], int)


def test_file_status_fields_match_hdfs(gw):
    gw.session.put(gw.u("/s/d", op="MKDIRS", permission="750"))
    assert gw.put_file("/s/f", b"12345", permission="600", overwrite="true").status_code == 201
    st = gw.session.get(gw.u("/s/f", op="GETFILESTATUS")).json()["FileStatus"]
    assert st["type"] == "FILE" and st["length"] == 5 and st["permission"] == "600"
    assert st["pathSuffix"] == "" and st["replication"] == 1 and st["blockSize"] > 0
    assert isinstance(st["modificationTime"], int) and isinstance(st["fileId"], int)
    d = gw.session.get(gw.u("/s", op="LISTSTATUS")).json()["FileStatuses"]["FileStatus"]
    assert [(e["pathSuffix"], e["type"], e["permission"]) for e in d] == [
        ("d", "DIRECTORY", "750"),
        ("f", "FILE", "600"),
    ]
    assert gw.session.get(gw.u("/s", op="GETFILESTATUS")).json()["FileStatus"]["childrenNum"] == 2
    batch = gw.session.get(gw.u("/s", op="LISTSTATUS_BATCH", startafter="d")).json()
    listing = batch["DirectoryListing"]
    assert listing["remainingEntries"] == 0
    assert [e["pathSuffix"] for e in listing["partialListing"]["FileStatuses"]["FileStatus"]] == ["f"]
    summary = gw.session.get(gw.u("/s", op="GETCONTENTSUMMARY")).json()["ContentSummary"]
    assert (summary["fileCount"], summary["directoryCount"], summary["length"]) == (1, 2, 5)


# ---------------------------------------------------------------------------- (d) streaming


def test_a_streaming_create_does_not_block_other_requests(sos_server, tmp_path):
    # two worker threads only: a body in progress must hold none of them
    g = Gw(sos_server, tmp_path, args=["--threads", "2"])
    try:
        assert g.put_file("/c/older", b"old log").status_code == 201
        slow = chunked_create(g, "/c/new")
        send_chunk(slow, b"first part;")
        slow2 = chunked_create(g, "/c/other")  # a second body at the same time
        send_chunk(slow2, b"x" * 100_000)
        # meanwhile the same client needs other files (Spark reads the older log files
        # while it writes the new one), renames and deletes
        s = g.session
        assert g.read("/c/older") == b"old log"
        assert s.get(g.u("/c", op="LISTSTATUS")).status_code == 200
        assert g.put_file("/c/third", b"3").status_code == 201
        assert (
            s.put(g.u("/c/third", op="RENAME", destination="/c/third2", renameoptions="OVERWRITE")).status_code == 200
        )
        assert s.delete(g.u("/c/third2", op="DELETE")).json() == {"boolean": True}
        # a second writer of a file being written is refused, as HDFS's lease does
        r = g.put_file("/c/new", b"intruder", overwrite="true")
        assert r.status_code == 403 and remote(r)["exception"] == "AlreadyBeingCreatedException"
        send_chunk(slow, b"second part")
        slow.send(b"0\r\n\r\n")
        assert slow.getresponse().status == 201
        slow2.send(b"0\r\n\r\n")
        assert slow2.getresponse().status == 201
        assert g.read("/c/new") == b"first part;second part"
        assert g.read("/c/other") == b"x" * 100_000
        slow.close()
        slow2.close()
    finally:
        assert g.stop() == 0


# ---------------------------------------------------------------------------- (e) refusals


def test_every_refusal_has_hdfs_status_and_exception(gw):
    s, u = gw.session, gw.u
    assert gw.put_file("/e/f", b"file").status_code == 201
    assert s.put(u("/e/d/sub", op="MKDIRS")).status_code == 200
    assert gw.put_file("/e/d/sub/x", b"x").status_code == 201
    cases = [
        (s.get(u("/e/missing", op="GETFILESTATUS")), 404, "FileNotFoundException"),
        (s.get(u("/e/missing", op="LISTSTATUS")), 404, "FileNotFoundException"),
        (s.get(u("/e/missing", op="OPEN"), allow_redirects=False), 404, "FileNotFoundException"),
        (s.get(u("/e/d", op="OPEN"), allow_redirects=False), 404, "FileNotFoundException"),
        (s.post(u("/e/missing", op="APPEND"), allow_redirects=False), 404, "FileNotFoundException"),
        (s.put(u("/e/missing", op="RENAME", destination="/e/z", renameoptions="NONE")), 404, "FileNotFoundException"),
        (s.put(u("/e/f", op="RENAME", destination="/e/nodir/z", renameoptions="NONE")), 404, "FileNotFoundException"),
        (
            s.put(u("/e/nodir/f", op="CREATE", createparent="false"), allow_redirects=False),
            404,
            "FileNotFoundException",
        ),
        (s.put(u("/e/f", op="CREATE"), allow_redirects=False), 403, "FileAlreadyExistsException"),
        (s.put(u("/e/f", op="CREATE", data="true"), data=b"new"), 403, "FileAlreadyExistsException"),
        (s.put(u("/e/d", op="CREATE", overwrite="true"), allow_redirects=False), 403, "FileAlreadyExistsException"),
        (s.put(u("/e/f", op="MKDIRS")), 403, "FileAlreadyExistsException"),
        (s.put(u("/e/f", op="RENAME", destination="/e/d", renameoptions="NONE")), 403, "FileAlreadyExistsException"),
        (s.put(u("/e/f", op="RENAME", destination="/e/f", renameoptions="NONE")), 403, "FileAlreadyExistsException"),
        (s.put(u("/e/f/x", op="CREATE"), allow_redirects=False), 403, "ParentNotDirectoryException"),
        (s.put(u("/e/f", op="RENAME", destination="/e/f/y", renameoptions="NONE")), 403, "ParentNotDirectoryException"),
        (s.delete(u("/e/d", op="DELETE", recursive="false")), 403, "PathIsNotEmptyDirectoryException"),
        (s.put(u("/e/d", op="RENAME", destination="/e/d/sub/in", renameoptions="NONE")), 403, "IOException"),
        (s.put(u("/e/f", op="RENAME", destination="/e/d", renameoptions="OVERWRITE")), 403, "IOException"),
        (s.put(u("/e/d/sub/x", op="RENAME", destination="/e/d", renameoptions="OVERWRITE")), 403, "IOException"),
        (s.post(u("/e/f", op="TRUNCATE", newlength="99")), 400, "HadoopIllegalArgumentException"),
        (s.get(u("/e", op="NOSUCHOP")), 400, "IllegalArgumentException"),
        (s.get(u("/e")), 400, "IllegalArgumentException"),
        (s.get(u("/e", op="MKDIRS")), 400, "IllegalArgumentException"),
        (s.put(u("/e/p", op="MKDIRS", permission="999")), 400, "IllegalArgumentException"),
        (s.get(u("/e/f", op="OPEN", data="true", offset="-1")), 400, "IllegalArgumentException"),
        (s.delete(u("/e", op="DELETE", recursive="maybe")), 400, "IllegalArgumentException"),
        (s.get(u("/e/f", op="GETACLSTATUS")), 400, "UnsupportedOperationException"),
        (s.get(u("/e/f", op="GETDELEGATIONTOKEN")), 400, "UnsupportedOperationException"),
        (s.put(u("/e/f", op="SETACL", aclspec="user::rwx")), 400, "UnsupportedOperationException"),
        (s.put(u("/e/l", op="CREATESYMLINK", destination="/e/f")), 400, "UnsupportedOperationException"),
        (s.post(u("/e/f", op="CONCAT", sources="/e/d/sub/x")), 400, "UnsupportedOperationException"),
        (s.put(u("/e/f", op="SETXATTR", **{"xattr.name": "user.a"})), 400, "UnsupportedOperationException"),
        (s.delete(u("/e", op="DELETESNAPSHOT", snapshotname="s")), 400, "UnsupportedOperationException"),
    ]
    java = {
        "FileNotFoundException": "java.io.FileNotFoundException",
        "IOException": "java.io.IOException",
        "UnsupportedOperationException": "java.lang.UnsupportedOperationException",
        "IllegalArgumentException": "java.lang.IllegalArgumentException",
    }
    for r, status, exception in cases:
        assert r.status_code == status, (r.request.method, r.request.url, r.text)
        doc = remote(r)
        assert doc["exception"] == exception, (r.request.url, doc)
        assert doc["message"]
        if exception in java:
            assert doc["javaClassName"] == java[exception]
        else:
            assert doc["javaClassName"].endswith("." + exception)
    # a path with a '..' segment is refused, not resolved
    conn = http.client.HTTPConnection(gw.host, gw.port, timeout=60)
    conn.request("GET", "/webhdfs/v1/e/../../etc?op=GETFILESTATUS", headers={"Authorization": f"Bearer {gw.token}"})
    r = conn.getresponse()
    assert r.status == 400 and json.loads(r.read())["RemoteException"]["exception"] == "IllegalArgumentException"
    conn.close()
    # nothing of the refused operations changed the tree
    assert gw.read("/e/f") == b"file"
    assert sorted(os.listdir(gw.proc.cache_dir + "/tree/e")) == ["d", "f"]


def test_boolean_rename_and_delete_answer_false_as_hdfs(gw):
    s, u = gw.session, gw.u
    gw.put_file("/b/f", b"f")
    gw.put_file("/b/g", b"g")
    s.put(u("/b/dir", op="MKDIRS"))
    assert s.put(u("/b/missing", op="RENAME", destination="/b/z")).json() == {"boolean": False}
    assert s.put(u("/b/f", op="RENAME", destination="/b/g")).json() == {"boolean": False}
    assert s.put(u("/b/f", op="RENAME", destination="/nodir/z")).json() == {"boolean": False}
    assert s.put(u("/b/f", op="RENAME", destination="/b/dir")).json() == {"boolean": True}
    assert gw.read("/b/dir/f") == b"f"  # an existing directory receives the source
    assert s.delete(u("/b/missing", op="DELETE")).json() == {"boolean": False}
    assert s.delete(u("/", op="DELETE", recursive="true")).json() == {"boolean": False}
    assert s.put(u("/b/g", op="RENAME", destination="/b/dir/f", renameoptions="OVERWRITE")).status_code == 200
    assert gw.read("/b/dir/f") == b"g"


# ---------------------------------------------------------------------------- barrier


def test_rename_replies_only_once_durable_on_the_server(sos_server, tmp_path):
    g = Gw(sos_server, tmp_path)
    try:
        assert g.put_file("/d/.0.tmp", b"batch 0 committed").status_code == 201
        os.kill(sos_server.pid, signal.SIGSTOP)  # the server hangs: nothing gets durable
        done = threading.Event()
        replies = []

        def rename():
            replies.append(g.session.put(g.u("/d/.0.tmp", op="RENAME", destination="/d/0", renameoptions="NONE")))
            done.set()

        t = threading.Thread(target=rename)
        t.start()
        try:
            # the rename is applied to the cache, but the reply waits for the server
            assert not done.wait(2.0)
        finally:
            os.kill(sos_server.pid, signal.SIGCONT)
        t.join(120)
        assert replies and replies[0].status_code == 200
    finally:
        g.proc.kill()  # every disk of the gateway burns right after the reply
    assert tree_of(restore(sos_server, g.key, tmp_path / "r")) == {"d": None, "d/0": b"batch 0 committed"}


def test_a_file_acknowledged_before_the_gateway_is_lost_is_whole_behind_its_replacement(sos_server, tmp_path):
    """Found by the cluster crash loop (scripts/soak --cluster): an executor's CREATE of a
    state file got its 201, the gateway was SIGKILLed before it shipped the body, a gateway
    on an EMPTY cache took over, and the executor's RENAME there committed an EMPTY
    state/0/1/759.delta: batch 759 committed, its state unreadable, the query could never
    resume. In sync mode a file body's reply must mean durable."""
    g1 = Gw(sos_server, tmp_path, name="first")
    data = b"state of batch 759\n" * 8
    step1 = g1.session.put(g1.u("/s/.759.delta.tmp", op="CREATE", overwrite="true"), allow_redirects=False)
    assert step1.status_code == 307, step1.text
    replies = []
    done = threading.Event()

    def body():
        try:
            replies.append(g1.session.put(step1.headers["Location"], data=data))
        except requests.RequestException as exc:
            replies.append(exc)
        finally:
            g1.proc.kill()  # the gateway and its disk are lost right after it answered
            done.set()

    os.kill(sos_server.pid, signal.SIGSTOP)  # the server hangs: nothing gets durable
    t = threading.Thread(target=body)
    t.start()
    try:
        done.wait(2.0)  # a gateway that answers before the body is durable answers now
    finally:
        os.kill(sos_server.pid, signal.SIGCONT)
    t.join(120)
    assert done.is_set()
    g2 = Gw(sos_server, tmp_path, key=g1.key, name="second")  # empty cache: from the server
    try:
        assert isinstance(replies[0], requests.Response) and replies[0].status_code == 201
        rename = g2.session.put(
            g2.u("/s/.759.delta.tmp", op="RENAME", destination="/s/759.delta", renameoptions="NONE")
        )
        assert rename.status_code == 200, rename.text  # the writer's next step, elsewhere
        assert g2.read("/s/759.delta") == data
    finally:
        assert g2.stop() == 0


def test_truncate_replies_only_once_durable_on_the_server(sos_server, tmp_path):
    g = Gw(sos_server, tmp_path)
    try:
        assert g.put_file("/t/f", b"0123456789").status_code == 201
        os.kill(sos_server.pid, signal.SIGSTOP)
        done = threading.Event()
        replies = []

        def truncate():
            replies.append(g.session.post(g.u("/t/f", op="TRUNCATE", newlength="4")))
            done.set()

        t = threading.Thread(target=truncate)
        t.start()
        try:
            assert not done.wait(2.0)  # applied to the cache, the reply waits for the server
        finally:
            os.kill(sos_server.pid, signal.SIGCONT)
        t.join(120)
        assert replies and replies[0].status_code == 200, replies
    finally:
        g.proc.kill()
    assert tree_of(restore(sos_server, g.key, tmp_path / "r")) == {"t": None, "t/f": b"0123"}


def test_async_mode_does_not_wait_for_the_server(sos_server, tmp_path):
    g = Gw(sos_server, tmp_path, sync=False)
    try:
        assert g.put_file("/a/.0.tmp", b"x").status_code == 201
        os.kill(sos_server.pid, signal.SIGSTOP)
        try:
            r = g.session.put(g.u("/a/.0.tmp", op="RENAME", destination="/a/0", renameoptions="NONE"), timeout=60)
            assert r.status_code == 200
        finally:
            os.kill(sos_server.pid, signal.SIGCONT)
    finally:
        assert g.stop() == 0  # the final flush ships it
    assert tree_of(restore(sos_server, g.key, tmp_path / "r")) == {"a": None, "a/0": b"x"}


# ---------------------------------------------------------------------------- (f) memory


@pytest.mark.slow
def test_a_big_file_streams_through_in_bounded_memory(sos_server, tmp_path):
    g = Gw(sos_server, tmp_path)
    size = 384 << 20
    block = os.urandom(1 << 20)
    try:
        before = peak_rss(g.proc.pid)

        def body():
            for i in range(size // len(block)):
                yield block[:8] + i.to_bytes(8, "big") + block[16:]

        r = g.session.put(g.u("/big/f", op="CREATE", data="true"), data=body())
        assert r.status_code == 201, r.text
        with g.session.get(g.u("/big/f", op="OPEN", data="true"), stream=True) as r:
            got = 0
            for chunk in r.iter_content(1 << 20):
                got += len(chunk)
        assert got == size
        grown = peak_rss(g.proc.pid) - before
        assert grown < 96 << 20, f"gateway peak RSS grew by {grown >> 20} MiB for a {size >> 20} MiB file"
    finally:
        assert g.stop() == 0
    restored = restore(sos_server, g.key, tmp_path / "r")
    assert os.path.getsize(restored / "big" / "f") == size


def test_https_with_tls_cert_and_key(sos_server, tmp_path):
    cert, keyf = self_signed_cert(tmp_path, cn="127.0.0.1")
    key = sos_server.keygen(NS, "append")
    g = GatewayProcess(
        NS,
        str(tmp_path / "c"),
        sos_server.address,
        key,
        extra_args=["--tls-cert", str(cert), "--tls-key", str(keyf)],
        log_path=str(tmp_path / "tls.log"),
    ).start()
    try:
        assert g.url.startswith("https://")
        v = {"verify": str(cert)}  # per request: $REQUESTS_CA_BUNDLE beats Session.verify
        with requests.Session() as s:
            r = s.post(
                g.url + "/oauth2/token",
                data={"grant_type": "client_credentials", "client_id": NS, "client_secret": key},
                **v,
            )
            s.headers["Authorization"] = f"Bearer {r.json()['access_token']}"
            r = s.put(f"{g.url}/webhdfs/v1/t/f?op=CREATE", allow_redirects=False, **v)
            assert r.status_code == 307 and r.headers["location"].startswith("https://")
            assert s.put(r.headers["location"], data=b"over tls", **v).status_code == 201
            assert s.get(f"{g.url}/webhdfs/v1/t/f?op=OPEN", **v).content == b"over tls"
        # a plaintext client gets no answer, and the gateway keeps serving
        with pytest.raises(requests.ConnectionError):
            requests.get(g.url.replace("https://", "http://") + "/webhdfs/v1/?op=LISTSTATUS", timeout=30)
    finally:
        assert g.stop() == 0


def test_sigterm_lets_the_requests_in_progress_finish_and_refuses_new_connections(sos_server, tmp_path):
    # a rolling restart (Kubernetes sends SIGTERM, then SIGKILL after the grace period):
    # a CREATE whose body is streaming must still be answered and journaled; new
    # connections are refused (Hadoop's retry policy waits for the next gateway); an
    # idle keep-alive connection is closed at once instead of holding the stop
    g = Gw(sos_server, tmp_path)
    idle = http.client.HTTPConnection(g.host, g.port, timeout=120)
    idle.request("GET", "/webhdfs/v1/?op=GETFILESTATUS", headers={"Authorization": f"Bearer {g.token}"})
    first = idle.getresponse()
    first.read()
    assert first.status == 200 and not first.will_close  # kept alive, now idle
    slow = chunked_create(g, "/d/file")
    send_chunk(slow, b"first part;")
    assert g.session.get(g.u("/", op="LISTSTATUS")).status_code == 200  # body is in progress
    g.session.close()
    g.proc.proc.send_signal(signal.SIGTERM)

    idle.sock.settimeout(120)
    assert idle.sock.recv(1) == b""  # the idle connection was closed by the gateway
    idle.close()
    deadline = time.monotonic() + 120
    while True:  # the listening socket goes away
        try:
            socket.create_connection((g.host, g.port), timeout=5).close()
        except ConnectionRefusedError:
            break
        assert time.monotonic() < deadline, "the gateway still accepts connections"
        time.sleep(0.05)
    assert g.proc.proc.poll() is None  # still running: a request is in progress
    send_chunk(slow, b"second part")
    slow.send(b"0\r\n\r\n")
    reply = slow.getresponse()
    assert reply.status == 201
    assert reply.getheader("connection") == "close"
    slow.close()
    assert g.proc.proc.wait(120) == 0  # then it stops, journal flushed
    assert "in progress get" in g.proc.log()
    assert tree_of(restore(sos_server, g.key, tmp_path / "restored"))["d/file"] == b"first part;second part"


def test_every_token_request_asks_the_server(gw, sos_server):
    """No cache issues a token (protocol.md 3.2(1)): every token request authenticates with
    its key at the SOS server, so a key removed there gets no new token at once (issue 17
    item 8; this used to trust an accepted secret for 60 s). The token requests use a key of
    their own, so the gateway's own sessions (which may reconnect at any time) are not counted."""
    key = sos_server.keygen(NS, "append")
    key_id = key.partition(".")[0]

    def authentications() -> int:
        lines = sos_server.log_text().splitlines()
        return sum(1 for line in lines if '"authenticated"' in line and json.loads(line).get("key_id") == key_id)

    def logged(count: int) -> int:
        deadline = time.monotonic() + 30  # the server's log is written as it goes
        while authentications() < count and time.monotonic() < deadline:
            time.sleep(0.1)
        return authentications()

    token_for(gw.url, key, NS)
    assert logged(1) == 1, "the server logs each AUTH with its key (else this test proves nothing)"
    for _ in range(5):
        token_for(gw.url, key, NS)
    assert logged(6) == 6  # five more tokens, five more AUTHs at the server
    bad = "0123456789abcdef." + "cd" * 32
    for _ in range(2):
        r = requests.post(
            gw.url + "/oauth2/token", data={"grant_type": "client_credentials", "client_id": NS, "client_secret": bad}
        )
        assert r.status_code == 401
