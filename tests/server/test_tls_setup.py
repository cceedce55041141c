"""TLS on day two (issue 23.1, 23.2): a client that forgets --tls-ca against a TLS server is
told so at once; $SOS_TLS_CA is read wherever --tls-ca is; the server logs why a handshake
failed; restore_to_batch speaks TLS; the Spark helpers' trust (cafile=/truststore=) makes a
truststore the JVM reads and an HTTPS context the marker listener uses. Real parts: a real
sos-server with TLS, real `sos` commands and `sos gateway` processes, the JDK's keytool."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import time

import pytest
import requests

from sos_client import Client
from sos_client.errors import ConnectionLost
from spark_plugin.gateway.client import GatewayClient
from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import (
    GATEWAY_REDACTION_REGEX,
    GatewayTrust,
    gateway_checkpoint,
    make_truststore,
    restore_to_batch,
)
from tests.support import run_sos, self_signed_cert

NS = "tlsday2"
pytestmark = [pytest.mark.day2, pytest.mark.slow]


@pytest.fixture
def tls_server(sos_server_factory, tmp_path):
    cert, key = self_signed_cert(tmp_path, "server")
    srv = sos_server_factory(args=["--tls-cert", cert, "--tls-key", key], start=False)
    ns_key = srv.keygen(NS, "append")
    srv.start()
    return srv, ns_key, cert


def test_no_tls_ca_against_a_tls_server_says_so_at_once(tls_server):
    srv, key, _cert_file = tls_server
    started = time.monotonic()
    with pytest.raises(ConnectionLost) as info:
        Client(srv.address, key, NS, timeout=30)
    assert "the server requires TLS: pass --tls-ca" in str(info.value)
    assert "SOS_TLS_CA" in str(info.value)
    assert not info.value.retryable
    assert time.monotonic() - started < 15  # not the 30 s timeout, no retries
    # the command too, and its exit code is not "not found"
    r = run_sos("ls", "--server", srv.address, NS, env={"SOS_KEY": key}, drop=("SOS_TLS_CA",))
    assert r.returncode != 0 and "the server requires TLS: pass --tls-ca" in r.stderr, r.stderr
    # and the server says why the handshake failed
    deadline = time.monotonic() + 10
    while "WRONG_VERSION_NUMBER" not in srv.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(ln for ln in srv.log_text().splitlines() if "TLS handshake failed" in ln)
    assert '"error": ""' not in line and "SSLError" in line, line


def test_a_plain_server_is_not_reported_as_tls(sos_server):
    key = sos_server.keygen(NS, "append")
    sos_server.kill()
    with pytest.raises(ConnectionLost) as info:
        Client(sos_server.address, key, NS, timeout=5, reconnect_timeout=0)
    assert "requires TLS" not in str(info.value)


def test_sos_tls_ca_is_read_wherever_tls_ca_is(tls_server, tmp_path):
    srv, key, cert = tls_server
    env = {"SOS_KEY": key, "SOS_TLS_CA": cert}
    (tmp_path / "f").write_bytes(b"over tls")
    assert run_sos("put", "--server", srv.address, str(tmp_path / "f"), f"{NS}/f", env=env).returncode == 0
    r = run_sos("cat", "--server", srv.address, f"{NS}/f", env=env)
    assert r.returncode == 0 and r.stdout == "over tls", r.stderr
    # the library's default too, and the gateway's connection to the server
    os.environ["SOS_TLS_CA"] = cert
    try:
        with Client(srv.address, key, NS) as c:
            assert c.stat("f") == (8, False)
    finally:
        del os.environ["SOS_TLS_CA"]
    gw_env = dict(os.environ, SOS_TLS_CA=cert)
    g = GatewayProcess(NS, str(tmp_path / "gw-cache"), srv.address, key, log_path=str(tmp_path / "gw.log"))
    g.environment = lambda: dict(gw_env, SOS_KEY=key)  # type: ignore[method-assign]
    g.start()
    try:
        client = GatewayClient(g.url, NS, key)
        client.call("PUT", "/webhdfs/v1/d", op="MKDIRS")  # durable on the server over TLS
        assert client.exists("d")
    finally:
        assert g.stop() == 0


def test_a_gateway_without_tls_ca_fails_fast_saying_why(tls_server, tmp_path):
    srv, key, _cert_file = tls_server
    env = dict(os.environ, SOS_KEY=key)
    env.pop("SOS_TLS_CA", None)
    started = time.monotonic()
    r = subprocess.run(
        [*GatewayProcess(NS, str(tmp_path / "c"), srv.address, key).command()],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "the server requires TLS: pass --tls-ca" in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - started < 25, "it should not wait out the 30 s of retries"


def test_restore_to_batch_over_tls(tls_server, tmp_path):
    srv, key, cert = tls_server
    g = GatewayProcess(
        NS,
        str(tmp_path / "gw-cache"),
        srv.address,
        key,
        extra_args=["--tls-ca", cert],
        log_path=str(tmp_path / "gw.log"),
    ).start()
    try:
        client = GatewayClient(g.url, NS, key)
        auth = {"Authorization": f"Bearer {client.token()}"}
        for n in (0, 1):
            r = requests.put(
                f"{g.url}/webhdfs/v1/chk/commits/.{n}.tmp?op=CREATE", headers=auth, allow_redirects=False, timeout=60
            )
            assert requests.put(r.headers["Location"], data=b"v1", headers=auth, timeout=60).status_code == 201
            client.call("PUT", f"/webhdfs/v1/chk/commits/.{n}.tmp", op="RENAME", destination=f"/chk/commits/{n}")
    finally:
        assert g.stop() == 0
    with pytest.raises(RuntimeError, match="requires TLS"):
        restore_to_batch(NS, tmp_path / "plain", "chk", 0, server=srv.address, key=key)
    out = restore_to_batch(NS, tmp_path / "r", "chk", 0, server=srv.address, key=key, tls_ca=cert)
    assert sorted(os.listdir(os.path.join(out, "commits"))) == ["0"]


def test_gateway_trust_sets_the_jvm_and_python_sides(tls_server, tmp_path):
    if shutil.which("keytool") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("keytool (a JDK) is needed")
    srv, key, cert = tls_server
    gcert, gkey = self_signed_cert(tmp_path, "gateway")
    g = GatewayProcess(
        NS,
        str(tmp_path / "gw-cache"),
        srv.address,
        key,
        extra_args=["--tls-ca", cert, "--tls-cert", gcert, "--tls-key", gkey],
        log_path=str(tmp_path / "gw.log"),
    ).start()
    try:
        chk = gateway_checkpoint(None, g.url, NS, key, "chk", cafile=gcert)
        assert chk.startswith("swebhdfs://") and chk.trust is not None
        opts = shlex.split(chk.trust.java_options)
        assert "-Djavax.net.ssl.trustStoreType=PKCS12" in opts
        assert f"-Djavax.net.ssl.trustStorePassword={chk.trust.password}" in opts
        store = next(o.split("=", 1)[1] for o in opts if o.startswith("-Djavax.net.ssl.trustStore="))
        # the JVM reads the truststore with that password (keytool is the JDK's own reader)
        listed = subprocess.run(
            ["keytool", "-list", "-keystore", store, "-storetype", "PKCS12", "-storepass", chk.trust.password],
            capture_output=True,
            text=True,
        )
        assert listed.returncode == 0 and "trustedCertEntry" in listed.stdout, listed.stdout
        # the Python side: the marker listener's client verifies the gateway's certificate
        client = chk.client()
        client.call("PUT", "/webhdfs/v1/chk", op="MKDIRS")
        assert client.marker("spark.batch", b"{}") > 0
        # a truststore alone: its certificates are read back for Python
        store2 = make_truststore(gcert, tmp_path / "t.p12", password="s3cret")
        trust = GatewayTrust(truststore=store2, truststore_password="s3cret")
        assert GatewayClient(g.url, NS, key, context=trust.context).exists("chk")
        with pytest.raises(ValueError, match="truststore_password"):
            GatewayTrust(truststore=store2)

        class Builder:
            def __init__(self) -> None:
                self._options = {"spark.driver.extraJavaOptions": "-Xss4m"}

            def config(self, k: str, v: str) -> Builder:
                self._options[k] = v
                return self

        b = Builder()
        gateway_checkpoint(b, g.url, NS, key, "chk", cafile=gcert)
        assert b._options["spark.driver.extraJavaOptions"].startswith("-Xss4m -Djavax.net.ssl.trustStore=")
        assert "trustStorePassword" in b._options["spark.executor.extraJavaOptions"]
    finally:
        assert g.stop() == 0


def test_spark_md_tls_section_commands_run_and_its_table_has_the_redaction(tmp_path):
    """docs/SPARK.md's keytool line for users without the helper, run as written, makes a
    truststore the JDK reads with the documented password; the table names
    spark.redaction.regex with the helper's own value."""
    if shutil.which("keytool") is None:
        pytest.skip("keytool (a JDK) is needed")
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "SPARK.md").read_text()
    assert f"`{GATEWAY_REDACTION_REGEX.replace('|', chr(92) + '|')}`" in doc
    assert "`spark.redaction.regex`" in doc
    line = re.search(r"`(keytool -importcert[^`]*)`", doc.replace("\n  ", " ")).group(1)
    self_signed_cert(tmp_path, "gw")
    (tmp_path / "gw.crt").rename(tmp_path / "gw.pem")
    subprocess.run(shlex.split(line), cwd=tmp_path, check=True, capture_output=True, timeout=120)
    listed = subprocess.run(
        ["keytool", "-list", "-keystore", "truststore.p12", "-storetype", "PKCS12", "-storepass", "changeit"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert "trustedCertEntry" in listed.stdout
    for opt in (
        "-Djavax.net.ssl.trustStore=PATH",
        "-Djavax.net.ssl.trustStoreType=PKCS12",
        "-Djavax.net.ssl.trustStorePassword=PW",
    ):
        assert opt in doc.replace("\n  ", " ")
