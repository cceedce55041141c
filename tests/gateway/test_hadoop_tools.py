"""Hadoop's own client against a real `sos gateway` and `sos-server` (issue 20): FsShell (as
``java -cp <pyspark/jars/*> org.apache.hadoop.fs.FsShell``, and in one JVM through
tests/java/HadoopHarness.java, compiled here with the JDK's javac) and FileSystem /
FileContext calls through the same harness, with the OAuth2 and retry settings of
spark_plugin.spark.gateway_conf. Each case is one of the gaps the issue lists: what HDFS
answers, the gateway answers."""

from __future__ import annotations

import getpass
import hashlib
import os
import subprocess
import urllib.request

import crc32c
import pytest

from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import gateway_conf, webhdfs_url
from tests.gateway.support import hadoop_harness, hadoop_java, hadoop_shell

pytestmark = [pytest.mark.hadoop, pytest.mark.slow, pytest.mark.timeout(900)]

NS = "hadooptools"


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    key = server.keygen(NS, "append")
    base = tmp_path_factory.mktemp("hadoop-gw")
    gw = GatewayProcess(
        NS, str(base / "cache"), server.address, key, debug=True, log_path=str(base / "gateway.log")
    ).start()
    yield gw, key
    assert gw.stop() == 0, gw.log()[-4000:]


@pytest.fixture(scope="module")
def conf_dir(gateway, tmp_path_factory):
    """A Hadoop configuration directory whose core-site.xml holds the gateway's settings
    (what an operator puts in HADOOP_CONF_DIR for `hadoop fs`; FsShell's main insists on a
    core-site.xml)."""
    gw, key = gateway
    d = tmp_path_factory.mktemp("hadoop-conf")
    props = "".join(
        f"<property><name>{k}</name><value>{v}</value></property>\n" for k, v in gateway_conf(gw.url, NS, key).items()
    )
    (d / "core-site.xml").write_text(f'<?xml version="1.0"?>\n<configuration>\n{props}</configuration>\n')
    return str(d)


def fs_shell(java_env, conf_dir, *args: str, conf: dict[str, str] | None = None):
    """Hadoop's FsShell in a JVM of its own, exactly as an operator runs it (`hadoop fs`:
    the configuration directory first on the classpath, -D for the rest)."""
    classpath, env = java_env
    defs = [a for k, v in (conf or {}).items() for a in ("-D", f"{k}={v}")]
    return subprocess.run(
        ["java", "-cp", f"{conf_dir}{os.pathsep}{classpath}", "org.apache.hadoop.fs.FsShell", *defs, *args],
        capture_output=True,
        env=env,
        timeout=300,
        check=False,
    )


def _crc32c_md5md5(data: bytes) -> str:
    """HDFS's MD5-of-0MD5-of-512CRC32C of a one-block file (bytes field, hex), in Python."""
    crcs = b"".join(crc32c.crc32c(data[i : i + 512]).to_bytes(4, "big") for i in range(0, len(data), 512))
    md5 = hashlib.md5(hashlib.md5(crcs).digest()).digest()
    return (512).to_bytes(4, "big").hex() + (0).to_bytes(8, "big").hex() + md5.hex()


# ---------------------------------------------------------------------------- the eight gaps


def test_block_locations_one_per_block_on_localhost(java_env, gateway):
    """Gap 1: GETFILEBLOCKLOCATIONS (what Spark's file index asks for every read), with
    listFiles and listLocatedStatus built on it, and -setrep -w."""
    r, [(code, out, err)] = hadoop_java(
        java_env, gateway, "gap1", "blocklocations", "blocklocations-dir", ["-setrep", "-w", "1", "{u}/gap1/blocks/a"]
    )
    status, value = r["blocklocations"]
    assert status == "ok", value
    assert value == (
        "whole=0+3000@localhost/localhost:9866; past= empty= "
        "listFiles=a=0+3000@localhost/localhost:9866; empty= listLocatedStatus=2"
    )
    # HDFS refuses a directory: Path is not a file
    assert r["blocklocations-dir"][0] == "error"
    assert r["blocklocations-dir"][1].startswith("java.io.FileNotFoundException"), r
    assert code == 0, err
    assert "Replication 1 set" in out and "Waiting for" in out, out


def test_non_ascii_names_through_fs_shell(java_env, gateway, conf_dir, tmp_path):
    """Gap 2: Hadoop sends raw UTF-8 in the request line; FsShell puts, lists and reads back a
    name with non-ASCII characters (the first three in one JVM, the read in a JVM of its own
    started as `hadoop fs` is, the name on its command line)."""
    gw, _ = gateway
    u = webhdfs_url(gw.url).rstrip("/")
    local = tmp_path / "local.txt"
    local.write_text("grüße\n", encoding="utf-8")
    name = "gap2/dïr ✓/fïlé 日本.txt"
    mkdir, put, ls = hadoop_shell(
        java_env,
        gateway,
        ["-mkdir", "-p", "{u}/gap2/dïr ✓"],
        ["-put", str(local), "{u}/" + name],
        ["-ls", "{u}/gap2/dïr ✓"],
    )
    assert mkdir[0] == 0, mkdir[2]
    assert put[0] == 0, put[2]
    assert ls[0] == 0, ls[2]
    assert "fïlé 日本.txt" in ls[1]
    cat = fs_shell(java_env, conf_dir, "-cat", f"{u}/{name}")
    assert cat.returncode == 0 and cat.stdout.decode("utf-8") == "grüße\n", cat.stderr.decode()


def test_create_flags_overwrite_and_append(java_env, gateway):
    """Gap 3: createflag (createNonRecursive, createFile(p).overwrite(true).build(),
    FileContext.create with CREATE|OVERWRITE and CREATE|APPEND)."""
    r = hadoop_harness(java_env, gateway, "gap3", "createNonRecursive", "createFileBuilder")
    assert r["createNonRecursive"] == ("ok", "new FileNotFoundException FileAlreadyExistsException"), r
    assert r["createFileBuilder"] == ("ok", "built context context+more"), r


def test_file_checksum_is_hdfs_md5_of_md5_of_crc32c(java_env, gateway, tmp_path):
    """Gap 4: GETFILECHECKSUM as HDFS computes it (checked against Hadoop's own DataChecksum
    and MD5Hash in the harness, and in Python), null for an empty file, `-checksum` exits 0;
    a directory is refused with an IOException (FileNotFoundException), which DistCp
    catches."""
    r, [(code, out, err)] = hadoop_java(
        java_env, gateway, "gap4", "checksum", "checksum-dir", "checksum-2blocks", ["-checksum", "{u}/gap4/sum"]
    )
    assert r["checksum-2blocks"] == ("ok", "MD5-of-262144MD5-of-512CRC32C true"), r
    # an empty file: HDFS's "magic entry", the MD5 of 32 zero bytes
    assert r["checksum"] == (
        "ok",
        "MD5-of-0MD5-of-512CRC32C true 28 empty=MD5-of-0MD5-of-0CRC32:70bc8f4b72a86921468bf8e8441dce51",
    ), r
    assert r["checksum-dir"][0] == "error"
    assert r["checksum-dir"][1].startswith("java.io.FileNotFoundException"), r
    data = bytes((k * 31 + 7 + (k >> 9)) & 0xFF for k in range(5 * 512 + 77))
    gw, _ = gateway
    assert code == 0, err
    assert out.split() == [f"{webhdfs_url(gw.url, 'gap4/sum')}", "MD5-of-0MD5-of-512CRC32C", _crc32c_md5md5(data)], out


def test_trash_rm_moves_to_user_trash(java_env, gateway):
    """Gap 5: GETTRASHROOT(S); -rm with fs.trash.interval set (-D, as on `hadoop fs`'s command
    line) moves to /user/USER/.Trash. One JVM, in order."""
    user = os.environ.get("HADOOP_USER_NAME") or getpass.getuser()
    res, [mkdir, touch, rm, ls] = hadoop_java(
        java_env,
        gateway,
        "gap5",
        ["-mkdir", "-p", "{u}/gap5"],
        ["-touchz", "{u}/gap5/doomed"],
        ["-D", "fs.trash.interval=60", "-rm", "{u}/gap5/doomed"],
        ["-ls", "-R", f"{{u}}/user/{user}/.Trash"],
        "trashRoot",
    )
    assert mkdir[0] == 0 and touch[0] == 0, (mkdir, touch)
    assert rm[0] == 0, rm[2]
    assert ls[0] == 0 and "gap5/doomed" in ls[1], ls[2]
    assert res["trashRoot"] == ("ok", f"/user/{user}/.Trash 1"), res


def test_set_owner_is_accepted_and_records_nothing(java_env, gateway, tmp_path):
    """Gap 6: SETOWNER accepted as on a filesystem without owners (FileSystem's own default,
    the object stores): -chown, -chgrp, -cp -p and -put -p exit 0; the owner stays the
    gateway's; a missing path is refused as HDFS refuses it."""
    local = tmp_path / "p.txt"
    local.write_text("preserved")
    r, results = hadoop_java(
        java_env,
        gateway,
        "gap6",
        ["-mkdir", "-p", "{u}/gap6"],
        ["-put", "-p", str(local), "{u}/gap6/p.txt"],
        ["-chown", "alice:staff", "{u}/gap6/p.txt"],
        ["-chgrp", "-R", "staff", "{u}/gap6"],
        ["-cp", "-p", "{u}/gap6/p.txt", "{u}/gap6/q.txt"],
        ["-cat", "{u}/gap6/q.txt"],
        ["-chown", "bob", "{u}/gap6/missing"],
        "setOwner",
    )
    for code, _out, err in results[:6]:
        assert code == 0, err
    assert results[5][1] == "preserved"
    assert results[6][0] != 0 and "No such file" in results[6][2], results[6]
    assert r["setOwner"] == ("ok", "true true false"), r


def test_count_e_shows_the_erasure_coding_policy(java_env, gateway):
    """Gap 7: GETCONTENTSUMMARY carries ecPolicy ("" for a directory without a policy,
    "Replicated" for a file, as HDFS), so -count -e works."""
    r, [(code, out, err)] = hadoop_java(java_env, gateway, "gap7", "contentSummary", ["-count", "-e", "{u}/gap7/cs/f"])
    assert r["contentSummary"] == ("ok", "[] [Replicated] 10 1"), r
    assert code == 0, err
    assert out.split()[:4] == ["0", "1", "10", "Replicated"], out


def test_df_reports_the_cache_filesystem(java_env, gateway):
    """Gap 8: GETSTATUS (capacity, used, remaining of the gateway's cache filesystem), so
    -df works."""
    r, [(code, out, err)] = hadoop_java(java_env, gateway, "gap8", "status", ["-df", "{u}/"])
    assert r["status"] == ("ok", "true true true true"), r
    gw, _ = gateway
    sv = os.statvfs(gw.cache_dir)
    assert code == 0, err
    fields = out.splitlines()[1].split()
    assert int(fields[1]) == sv.f_blocks * sv.f_frsize, out


# ---------------------------------------------------------------------------- smaller ones


def test_open_past_end_rename_into_child_and_delete_root_as_hdfs(java_env, gateway):
    """OPEN past the end: EOFException (HDFS's DataNode refuses the seek); renaming a
    directory into its own child: false from rename, IOException from rename2 (FileContext);
    delete("/", recursive): false, nothing deleted."""
    r = hadoop_harness(java_env, gateway, "small", "seekPastEnd", "renameIntoChild", "deleteRoot")
    assert r["seekPastEnd"] == ("ok", "EOFException"), r
    assert r["renameIntoChild"] == ("ok", "false IOException true"), r
    assert r["deleteRoot"] == ("ok", "false true"), r


# ---------------------------------------------------------------------------- retries after a crash


def test_a_rename_resent_after_a_gateway_crash_answers_as_the_first(server, tmp_path):
    """Hadoop's client resends a RENAME whose reply it did not get (the gateway killed
    after applying it, before answering): the resent one, on the gateway restarted on the
    same cache, answers as the first did (rename2: no error; rename: true), as HDFS's
    RetryCache answers a retried call; a rename of a source that never was is still refused.
    Every reply asks Java's client to drop pooled connections idle over 1 s."""
    from spark_plugin.gateway.client import GatewayClient, GatewayError

    key = server.keygen("retries", "append")
    gw = GatewayProcess("retries", str(tmp_path / "cache"), server.address, key).start()
    try:
        c = GatewayClient(gw.url, "retries", key)
        c.call("PUT", "/webhdfs/v1/ckpt/.0.tmp", b"", op="CREATE", data="true")
        c.call("PUT", "/webhdfs/v1/ckpt/.1.tmp", b"x", op="CREATE", data="true")
        c.call("PUT", "/webhdfs/v1/ckpt/.0.tmp", op="RENAME", destination="/ckpt/0", renameoptions="NONE")
        assert c.call("PUT", "/webhdfs/v1/ckpt/.1.tmp", op="RENAME", destination="/ckpt/1") == {"boolean": True}
        with urllib.request.urlopen(
            urllib.request.Request(
                f"{gw.url}/webhdfs/v1/ckpt?op=LISTSTATUS", headers={"Authorization": f"Bearer {c.token()}"}
            )
        ) as r:
            assert r.headers["Keep-Alive"] == "timeout=1"  # (urllib asked to close: h11 says close)
        port = gw.url.rsplit(":", 1)[1]
        gw.kill()
        gw = GatewayProcess("retries", str(tmp_path / "cache"), server.address, key, listen=f"127.0.0.1:{port}").start()
        c = GatewayClient(gw.url, "retries", key)
        # resent: the first answers
        assert c.call("PUT", "/webhdfs/v1/ckpt/.0.tmp", op="RENAME", destination="/ckpt/0", renameoptions="NONE") == {}
        assert c.call("PUT", "/webhdfs/v1/ckpt/.1.tmp", op="RENAME", destination="/ckpt/1") == {"boolean": True}
        # not a retry: another destination, or a source never renamed
        with pytest.raises(GatewayError) as err:
            c.call("PUT", "/webhdfs/v1/ckpt/.0.tmp", op="RENAME", destination="/ckpt/9", renameoptions="NONE")
        assert err.value.exception == "FileNotFoundException"
        assert c.call("PUT", "/webhdfs/v1/ckpt/.7.tmp", op="RENAME", destination="/ckpt/7") == {"boolean": False}
    finally:
        assert gw.stop() == 0, gw.log()[-4000:]
