"""Issue 9, item 9: every shipped deployment listens with TLS, and the documented way to
make a certificate works with the real server, the image's health check and the `sos` CLI.
(No container engine or cluster runs here: the files are parsed, the commands run.)"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.deploy.support import dockerfile_command, dockerfile_final_stage

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def _no_key_on_argv(argv: list[str]) -> None:
    assert not any(a == "--key" or a.startswith("--key=") for a in argv), argv


def test_image_serves_tls_by_default_and_its_healthcheck_speaks_it():
    final = dockerfile_final_stage()
    cmd = dockerfile_command()
    assert cmd[:2] == ["sos-server", "serve"]
    assert _option(cmd, "--tls-cert") == "/tls/tls.crt"
    assert _option(cmd, "--tls-key") == "/tls/tls.key"
    env = " ".join(a for i, a in final if i == "ENV")
    assert re.search(r"\bSOS_HEALTH_TLS=1\b", env)


def test_compose_server_and_sidecar_use_tls():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    server = compose["services"]["sos-server"]
    # the image's CMD (TLS) unless overridden; an override must keep TLS
    if "command" in server:
        assert _option(server["command"], "--tls-cert").startswith("/tls/")
    assert "./tls:/tls:ro" in server["volumes"]
    mount = compose["services"]["sos-mount"]
    ca = _option(mount["command"], "--tls-ca")
    mounted = [v for v in mount["volumes"] if isinstance(v, str) and v.split(":")[1] == ca]
    assert mounted and mounted[0].split(":")[0].endswith("tls.crt")  # the certificate, not the key
    assert not any("tls.key" in str(v) for v in mount["volumes"])
    _no_key_on_argv(mount["command"])
    # the key from a file (a compose secret), or the environment
    assert "SOS_KEY_FILE" in mount["environment"] or "SOS_KEY" in mount["environment"]


def test_kubernetes_server_and_sidecar_use_tls_from_a_secret():
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "sos-server.yaml").read_text()))
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "sos-server")
    args = container["args"]
    cert, key = _option(args, "--tls-cert"), _option(args, "--tls-key")
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    tls_mount = mounts[os.path.dirname(cert)]
    assert os.path.dirname(key) == tls_mount["mountPath"] and tls_mount.get("readOnly") is True
    volume = next(v for v in pod["volumes"] if v["name"] == tls_mount["name"])
    secret = volume["secret"]["secretName"]
    assert volume["secret"]["defaultMode"] & 0o007 == 0  # the key is not world-readable
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]

    driver = next(
        d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "spark-driver.yaml").read_text()) if d["kind"] == "Pod"
    )
    sidecar = next(c for c in driver["spec"]["initContainers"] if c["name"] == "sos-mount")
    argv = sidecar["command"] + sidecar.get("args", [])
    ca = _option(argv, "--tls-ca")
    ca_mount = next(m for m in sidecar["volumeMounts"] if ca.startswith(m["mountPath"] + "/"))
    ca_volume = next(v for v in driver["spec"]["volumes"] if v["name"] == ca_mount["name"])
    # the server's own secret stays in its namespace: the sidecar's namespace gets a copy of its
    # certificate alone, made by the documented command from the file sos-tls was made from
    assert secret == "sos-tls" and ca_volume["secret"]["secretName"] == "sos-server-ca"
    assert driver["metadata"]["namespace"] != sts["metadata"]["namespace"]
    made = (ROOT / "deploy" / "k8s" / "spark-driver.yaml").read_text()
    assert (
        f"-n {driver['metadata']['namespace']} create secret generic sos-server-ca "
        "--from-file=tls.crt=deploy/tls/tls.crt"
    ) in made
    # only the certificate is projected into the sidecar, at the path --tls-ca names
    assert ca_volume["secret"]["items"] == [{"key": "tls.crt", "path": os.path.relpath(ca, ca_mount["mountPath"])}]
    _no_key_on_argv(argv)
    assert any(e["name"] == "SOS_KEY" and "secretKeyRef" in e.get("valueFrom", {}) for e in sidecar["env"])


def _documented_cert_command() -> str:
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    lines = [line for b in blocks for line in b.splitlines() if "openssl req" in line and "/CN=sos-server" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_documented_certificate_serves_tls_to_the_cli_and_the_healthcheck(tmp_path, sos_server_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a certificate")
    subprocess.run(
        ["bash", "-c", _documented_cert_command()], cwd=tmp_path, check=True, capture_output=True, timeout=120
    )
    cert, key = tmp_path / "deploy" / "tls" / "tls.crt", tmp_path / "deploy" / "tls" / "tls.key"
    srv = sos_server_factory(args=["--tls-cert", cert, "--tls-key", key], start=False)
    sos_key = srv.keygen("deployed", "append")
    srv.start()
    port = srv.host_port[1]

    health = [sys.executable, str(ROOT / "deploy" / "healthcheck.py")]
    ok = subprocess.run(
        health,
        env=dict(os.environ, SOS_HEALTH_ADDR=srv.address, SOS_HEALTH_TLS="1"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    plain = subprocess.run(
        health,
        env=dict(os.environ, SOS_HEALTH_ADDR=srv.address, SOS_HEALTH_TLS="0"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert plain.returncode == 1

    env = dict(os.environ, SOS_KEY=sos_key, PYTHONPATH=str(ROOT))
    env.pop("SOS_SERVER", None)
    sos = [sys.executable, "-m", "sos_client.cli"]
    # by name (the certificate's DNS name localhost), verified against the certificate
    put = subprocess.run(
        [*sos, "put", "-", "deployed/over-tls", "--server", f"localhost:{port}", "--tls-ca", str(cert)],
        input=b"hello",
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert put.returncode == 0, put.stderr
    cat = subprocess.run(
        [*sos, "cat", "deployed/over-tls", "--server", f"localhost:{port}", "--tls-ca", str(cert)],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert cat.returncode == 0 and cat.stdout == b"hello", cat.stderr
    # without TLS the client gets nowhere
    bare = subprocess.run(
        [*sos, "stat", "deployed/over-tls", "--server", f"localhost:{port}", "--timeout", "20"],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert bare.returncode == 1
