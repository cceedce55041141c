"""Issue 21: the image is built and run here, with no registry (podman, rootful, runc).

The image is built as docs/DEPLOY.md says for a machine without a registry
(`python -m tools.container build`: a Debian stand-in for python:3.11-slim-bookworm made
once with debootstrap and reused from local storage, then `podman build --format docker`).
Then the shipped Kubernetes manifests run with `podman kube play` (chosen over
podman-compose: the manifests are the hardened deployment of record, two namespaces,
Secrets, probes, securityContext, and kube play runs them with podman alone; the compose
file's Spark cluster needs the Spark image from a registry): the server's StatefulSet pod
and the gateway's Deployment, with their Secrets, ConfigMap, PVC and emptyDirs, TLS on,
hardened as written. A Spark query on the host checkpoints through the containerised
gateway over swebhdfs:// with the documented truststore; the gateway container is
SIGKILLed mid-query, a new one starts on an empty cache, and the query resumes: every
record comes out exactly once.

What podman 4.3 cannot run of the manifests is changed by `_podman_pod()` and listed in
UNRUN; tests/deploy/test_k8s.py validates those fields against the Kubernetes schemas.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import secrets as secrets_module
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import yaml

from spark_plugin.spark import sos_command
from tests.deploy.support import k8s_documents, one, option, run_documented
from tests.support import output_ids
from tools import container
from tools.cluster import free_port
from tools.demo import DRIVER_JVM_OPTIONS, committed_batches, make_input

pytest_plugins = ["tests.tier.support"]
pytestmark = [pytest.mark.slow, pytest.mark.container, pytest.mark.spark, pytest.mark.timeout(1800)]

UID = 10001
NS = "sparkjob"
# a batch per file: the gateway is killed after the second; two more run behind its replacement
RECORDS = 400
FILES = 4
EMPTY_DIRS = ("cache", "tmp")  # the gateway's emptyDirs: kube play 4.3 makes them named volumes

# manifest fields podman 4.3's kube play does not run (the schema check covers them)
UNRUN = {
    "Namespace, ServiceAccount, Service, NetworkPolicy": "not podman objects: no API server, "
    "no cluster DNS, no CNI policy: SOS_SERVER's sos-server and --advertise's "
    "sos-gateway.sos.svc become localhost (a name of both certificates; hostAliases are "
    "ignored with host networking)",
    "StatefulSet sos-server": "not a kind kube play 4.3 plays: its pod template runs as a Pod named sos-server-0",
    "volumes[].secret": "kube play 4.3 panics on Secret volumes: each becomes a hostPath "
    "directory holding the Secret's files with the manifest's modes, root:10001 (what the "
    "kubelet's fsGroup gives)",
    "--listen / --metrics 0.0.0.0:PORT, ports": "host networking (no pod network here; kube "
    "play refuses port mappings with it): loopback and free ports instead, SOS_SERVER's and "
    "SOS_HEALTH_ADDR's ports to match",
    "startupProbe, readinessProbe": "not run by podman (the test waits for the port as the "
    "startup probe would); livenessProbe becomes the container's "
    "health check (run with `podman healthcheck run`: no systemd timers here)",
    "resources, ephemeral-storage, emptyDir sizeLimit/medium": "not enforced by kube play here (cgroup v1 under runc)",
    "emptyDir": "kube play 4.3 makes a named volume that outlives the pod: the test removes "
    "it with the pod, so a new pod starts on an empty one as with the kubelet",
    "ConfigMap sos-tier": "AWS_ENDPOINT_URL added (the manifest's optional key): moto's S3 "
    "server on the host stands in for the bucket",
}


def _podman(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return container.podman(*args, **kw)


@pytest.fixture(scope="module")
def image():
    if shutil.which("podman") is None or shutil.which("debootstrap") is None:
        pytest.skip("podman/debootstrap missing (scripts/setup installs them)")
    if os.geteuid() != 0:
        pytest.skip("podman runs rootful here")
    t0 = time.monotonic()
    times = container.build_image()
    size = container.image_size()
    print(
        f"\nimage {container.IMAGE}: {size / 1e6:.0f} MB; build {time.monotonic() - t0:.0f} s "
        f"(debootstrap {times['debian']:.0f} s, python base {times['python']:.0f} s, "
        f"image {times['image']:.0f} s; 0 = reused)"
    )
    layers = _podman("history", "--format", "{{.Size}}\t{{.CreatedBy}}", container.IMAGE).stdout
    print("\n".join(line[:150] for line in layers.splitlines() if not line.startswith("0B")))
    return container.IMAGE


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """The documented certificates and truststore (docs/DEPLOY.md's openssl/keytool lines)."""
    d = tmp_path_factory.mktemp("deploy")
    for cn in ("/CN=sos-server", "/CN=sos-gateway"):
        run_documented(d, "openssl req", cn)
    run_documented(d, "keytool -importcert")
    return d / "deploy" / "tls"


def _secret_dir(root: pathlib.Path, name: str, files: dict[str, bytes], mode: int) -> pathlib.Path:
    """A Secret volume as the kubelet lays it out: its files root:10001 (fsGroup), `mode`."""
    d = root / "secrets" / name
    d.mkdir(parents=True)
    os.chmod(root / "secrets", 0o755)
    os.chmod(d, 0o755)
    for key, data in files.items():
        (d / key).write_bytes(data)
        os.chown(d / key, 0, UID)
        os.chmod(d / key, mode)
    return d


def _podman_pod(
    pod: dict[str, Any], secrets: dict[str, dict[str, bytes]], root: pathlib.Path, ports: dict[int, int]
) -> dict[str, Any]:
    """The pod spec as podman runs it: Secret volumes as hostPath directories, host
    networking's addresses (UNRUN says why). Everything else as written."""
    spec = pod["spec"]
    for vol in spec["volumes"]:
        if "secret" in vol:
            src = vol.pop("secret")
            files = secrets[src["secretName"]]
            if "items" in src:
                files = {i["path"]: files[i["key"]] for i in src["items"]}
            mode = src.get("defaultMode", 0o644)
            vol["hostPath"] = {
                "path": str(_secret_dir(root, f"{pod['metadata']['name']}-{vol['name']}", files, mode)),
                "type": "Directory",
            }

    def local(addr: str) -> str:
        host, _, port = addr.rpartition(":")
        host = {"0.0.0.0": "127.0.0.1", "sos-server": "localhost", "sos-gateway.sos.svc": "localhost"}.get(host, host)
        return f"{host}:{ports.get(int(port), port)}"

    for c in spec["containers"]:
        args = c["args"]
        for opt in ("--listen", "--metrics", "--advertise"):
            if opt in args:
                args[args.index(opt) + 1] = local(option(args, opt))
        for e in c.get("env", []):
            if e["name"] in ("SOS_SERVER", "SOS_HEALTH_ADDR"):
                e["value"] = local(e["value"])
        c.pop("ports", None)
        c.pop("resources", None)
    return pod


def _kube_play(path: pathlib.Path, *extra: str) -> None:
    _podman("kube", "play", "--network", "host", *extra, str(path), timeout=300)


def _wait_listening(port: int, timeout: float = 300) -> None:
    """The startup probe's part (tcpSocket), which podman does not run: until it passes the
    liveness probe (the health check) must not count, or podman kills the container after
    failureThreshold failures, as the kubelet would without the startup probe."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.5)


def _wait_healthy(ctr: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = _podman("healthcheck", "run", ctr, check=False, timeout=60)
        if r.returncode == 0:
            status = _podman("inspect", "--format", "{{.State.Health.Status}}", ctr).stdout.strip()
            assert status == "healthy", status
            return
        if time.monotonic() > deadline:
            logs = _podman("logs", ctr, check=False).stderr[-4000:]
            raise AssertionError(f"{ctr} not healthy: {r.stdout}{r.stderr}\n{logs}")
        time.sleep(2)


def _main_pid(ctr: str) -> int:
    """The SOS process of the container (tini's child)."""
    tini = int(_podman("inspect", "--format", "{{.State.Pid}}", ctr).stdout)
    children = pathlib.Path(f"/proc/{tini}/task/{tini}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _assert_hardened(ctr: str) -> None:
    pid = _main_pid(ctr)
    st = dict(line.split(":", 1) for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines())
    st = {k: v.strip() for k, v in st.items()}
    assert st["Uid"].split() == [str(UID)] * 4 and st["Gid"].split() == [str(UID)] * 4, st["Uid"]
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[cap], 16) == 0, (ctr, cap, st[cap])
    assert st["NoNewPrivs"] == "1"
    root = next(
        line.split()
        for line in pathlib.Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        if line.split()[4] == "/"
    )
    assert "ro" in root[5].split(","), root


def _server_key(ctr: str, role: str) -> str:
    return _podman("exec", ctr, "sos-server", "keygen", "--data", "/data", NS, "--role", role).stdout.strip()


DRIVER = textwrap.dedent("""
    import json, os, sys, time
    cfg = json.load(open(sys.argv[1]))
    from tools.demo import write_batch_output
    from spark_plugin.spark import gateway_checkpoint
    from tests.support import dedup_query, spark_builder

    builder = spark_builder("sos-container", jvm=cfg["jvm"])
    with open(os.environ["SOS_KEY_FILE"]) as f:
        key = f.read().strip()
    loc = gateway_checkpoint(builder, cfg["url"], cfg["ns"], key, "checkpoint")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    loc.attach(spark)

    def sink(df, batch_id):
        time.sleep(1.5)   # a batch lasts long enough for the gateway to die in one
        write_batch_output(cfg["out"], df, batch_id)

    os.makedirs(cfg["out"], exist_ok=True)
    query = dedup_query(spark, cfg["input"], sink, str(loc))
    query.awaitTermination()
    spark.stop()
""")


def test_default_command_under_host_networking(image, tls, tmp_path):
    """The image's own CMD with the host's network: it binds the address given in
    SOS_LISTEN (not every interface), its HEALTHCHECK (kept: --format docker) follows that
    --listen, TLS is on and plaintext refused, hardened as the docs say."""
    port, metrics = free_port(), free_port()
    (tmp_path / "tls").mkdir()
    for f in ("tls.crt", "tls.key"):
        shutil.copyfile(tls / f, tmp_path / "tls" / f)
        os.chown(tmp_path / "tls" / f, UID, UID)
        os.chmod(tmp_path / "tls" / f, 0o600)
    name = f"sos-test-default-{os.getpid()}"
    health = _podman("image", "inspect", "--format", "{{json .Config.Healthcheck}}", image).stdout
    assert "healthcheck.py" in health, health
    _podman(
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "host",
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "-e",
        f"SOS_LISTEN=127.0.0.1:{port}",
        "-e",
        f"SOS_METRICS_LISTEN=127.0.0.1:{metrics}",
        "-v",
        f"{tmp_path / 'tls'}:/tls:ro",
        "--mount",
        "type=volume,destination=/data",
        image,
    )
    try:
        _wait_healthy(name)
        _assert_hardened(name)
        import psutil

        listening = {
            c.laddr for c in psutil.Process(_main_pid(name)).net_connections("tcp") if c.status == psutil.CONN_LISTEN
        }
        assert {(a.ip, a.port) for a in listening} == {("127.0.0.1", port), ("127.0.0.1", metrics)}
        # plaintext is refused: a client without TLS gets no session
        key = _podman("exec", name, "sos-server", "keygen", "--data", "/data", "t", "--role", "append").stdout.strip()
        env = dict(os.environ, SOS_KEY=key)
        plain = subprocess.run(
            [*sos_command(), "ls", "--server", f"127.0.0.1:{port}", "t"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert plain.returncode != 0
        ok = subprocess.run(
            [*sos_command(), "ls", "--server", f"127.0.0.1:{port}", "--tls-ca", str(tls / "tls.crt"), "t"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert ok.returncode == 0, ok.stderr
    finally:
        _podman("rm", "-f", "-v", "-t", "0", name, check=False)


def test_kube_manifests_run_and_a_query_survives_a_gateway_sigkill(image, tls, moto, tmp_path):
    import boto3

    print("\nmanifest fields podman does not run (tests/deploy/test_k8s.py validates them):")
    for field, why in UNRUN.items():
        print(f"  {field}: {why}")
    boto3.session.Session().client("s3").create_bucket(Bucket="sos-tier-bucket")
    ports = {7070: free_port(), 9070: free_port(), 9870: free_port()}
    server_docs = k8s_documents("sos-server.yaml")
    gateway_docs = k8s_documents("sos-gateway.yaml")
    sts = one(server_docs, "StatefulSet")
    dep = one(gateway_docs, "Deployment")
    assert sts["metadata"]["namespace"] == dep["metadata"]["namespace"] == "sos"
    server_args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    tier = option(server_args, "--tier")
    assert tier == "s3://sos-tier-bucket/sos", tier

    secrets: dict[str, dict[str, bytes]] = {
        "sos-tls": {"tls.crt": (tls / "tls.crt").read_bytes(), "tls.key": (tls / "tls.key").read_bytes()},
        "sos-gateway-tls": {
            "tls.crt": (tls / "gateway.crt").read_bytes(),
            "tls.key": (tls / "gateway.key").read_bytes(),
        },
    }
    # env secretKeyRef: a podman secret (kube play 4.3 reads it as a JSON map of base64 values)
    tier_secret = "sos-tier-credentials"
    _podman("secret", "rm", tier_secret, check=False)
    creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    _podman(
        "secret",
        "create",
        tier_secret,
        "-",
        input=json.dumps({k: base64.b64encode(v.encode()).decode() for k, v in creds.items()}),
    )

    server_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "sos-server-0",
            "namespace": "sos",
            "labels": sts["spec"]["template"]["metadata"]["labels"],
        },
        "spec": sts["spec"]["template"]["spec"],
    }
    others = [d for d in server_docs if d["kind"] in ("ConfigMap", "PersistentVolumeClaim")]
    for d in others:
        if d["kind"] == "ConfigMap":
            d["data"]["AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
    srv_ctr, gw_ctr = "sos-server-0-sos-server", "sos-gateway-pod-0-gateway"
    server_yaml, gateway_yaml = tmp_path / "sos-server.yaml", tmp_path / "sos-gateway.yaml"
    _podman("pod", "rm", "-f", "sos-server-0", "sos-gateway-pod-0", check=False)
    _podman("volume", "rm", "-f", "sos-data", *EMPTY_DIRS, check=False)
    try:
        server_yaml.write_text(yaml.safe_dump_all([*others, _podman_pod(server_pod, secrets, tmp_path, ports)]))
        t0 = time.monotonic()
        _kube_play(server_yaml)
        _wait_listening(ports[7070])
        _wait_healthy(srv_ctr)
        print(f"server healthy {time.monotonic() - t0:.1f} s after kube play")
        _assert_hardened(srv_ctr)
        writer, job = _server_key(srv_ctr, "append"), _server_key(srv_ctr, "token")
        secrets["sos-gateway-key"] = {"key": writer.encode() + b"\n"}
        # the namespace's journal key (docs/DEPLOY.md "The journal key"): 64 hex digits
        journal_key = secrets_module.token_hex(32)
        secrets["sos-journal-key"] = {"key": journal_key.encode() + b"\n"}

        gw_pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": dep["metadata"],
            "spec": dep["spec"]["template"]["spec"],
        }
        _podman_pod(gw_pod, secrets, tmp_path / "gw", ports)
        gw_doc = dict(dep, spec=dict(dep["spec"], template=dict(dep["spec"]["template"], spec=gw_pod["spec"])))
        gateway_yaml.write_text(yaml.safe_dump(gw_doc))
        _kube_play(gateway_yaml)
        _wait_listening(ports[9870])
        _wait_healthy(gw_ctr)
        _assert_hardened(gw_ctr)
        key_mode = os.stat(tmp_path / "gw" / "secrets" / "sos-gateway-key" / "key")
        assert key_mode.st_mode & 0o077 == 0o040 and key_mode.st_gid == UID  # 0440 root:10001
        first_cache = _podman("volume", "inspect", "--format", "{{.CreatedAt}}", "cache").stdout

        # the Spark query on the host, through the gateway (swebhdfs, documented truststore)
        staging, inp, out = tmp_path / "staging", tmp_path / "input", tmp_path / "out"
        make_input(str(staging), RECORDS, FILES)
        shutil.copytree(staging, inp)
        (tmp_path / "job.key").write_text(job + "\n")
        os.chmod(tmp_path / "job.key", 0o600)
        trust = (
            f"-Djavax.net.ssl.trustStore={tls / 'truststore.p12'} "
            "-Djavax.net.ssl.trustStoreType=PKCS12 -Djavax.net.ssl.trustStorePassword=changeit"
        )
        cfg = {
            "url": f"https://localhost:{ports[9870]}",
            "ns": NS,
            "input": str(inp),
            "out": str(out),
            "jvm": f"{trust} {DRIVER_JVM_OPTIONS}",
        }
        (tmp_path / "cfg.json").write_text(json.dumps(cfg))
        (tmp_path / "driver.py").write_text(DRIVER)
        env = dict(
            os.environ,
            SOS_KEY_FILE=str(tmp_path / "job.key"),
            SSL_CERT_FILE=str(tls / "gateway.crt"),
            PYTHONPATH=os.pathsep.join(
                p for p in (str(pathlib.Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")) if p
            ),
        )

        def run_driver(name: str) -> int:
            with open(tmp_path / f"{name}.log", "wb") as logf:
                return subprocess.run(
                    [sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "cfg.json")],
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=900,
                    check=False,
                ).returncode

        result: dict[str, int] = {}
        t = threading.Thread(target=lambda: result.setdefault("rc", run_driver("run1")))
        t.start()
        deadline = time.monotonic() + 600
        while (not out.exists() or len(os.listdir(out)) < 2) and t.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert t.is_alive(), (tmp_path / "run1.log").read_text()[-6000:]
        _podman("kill", "--signal", "KILL", gw_ctr)
        killed_after = len(os.listdir(out))
        t1 = time.monotonic()
        # the Deployment's new pod, on an empty emptyDir: kube play's emptyDirs are named
        # volumes that outlive their pod, so they go with it here, as the kubelet's would
        _podman("kube", "down", str(gateway_yaml))
        _podman("volume", "rm", "-f", *EMPTY_DIRS, check=False)
        _kube_play(gateway_yaml)
        _wait_listening(ports[9870])
        _wait_healthy(gw_ctr)
        print(
            f"gateway SIGKILLed after {killed_after} batches; the new one healthy {time.monotonic() - t1:.1f} s later"
        )
        second_cache = _podman("volume", "inspect", "--format", "{{.CreatedAt}}", "cache").stdout
        assert second_cache and second_cache != first_cache
        t.join(900)
        runs = 1
        if result.get("rc") != 0 or len(os.listdir(out)) < FILES:
            # the query died in the gateway's absence (Hadoop's retries ran out): resume it
            print("first run:", result.get("rc"), (tmp_path / "run1.log").read_text()[-1500:])
            runs = 2
            assert run_driver("run2") == 0, (tmp_path / "run2.log").read_text()[-6000:]
        print(f"query finished in {runs} run(s)")
        ids = output_ids(out)
        assert sorted(ids) == list(range(RECORDS)) and set(ids.values()) == {1}, "exactly once"

        # the journal on the server holds the committed batches
        restored = tmp_path / "restored"
        subprocess.run(
            [
                *sos_command(),
                "restore",
                "-q",
                "--server",
                f"localhost:{ports[7070]}",
                "--tls-ca",
                str(tls / "tls.crt"),
                NS,
                str(restored),
            ],
            env=dict(os.environ, SOS_KEY=writer, SOS_JOURNAL_KEY=journal_key),  # the gateway's journal key
            check=True,
            timeout=300,
            capture_output=True,
        )
        # one file per trigger, but a run cut while writing its file-source log resumes with the
        # files of two triggers in one batch (Spark's FileStreamSource): batches 0..N, no gap, one
        # output file per batch
        assert committed_batches(str(restored / "checkpoint")) == set(range(len(os.listdir(out))))
        # the tier: the server copied the journal to the bucket (moto on the host)
        objs = boto3.session.Session().client("s3").list_objects_v2(Bucket="sos-tier-bucket", Prefix="sos/")
        assert objs.get("KeyCount", 0) > 0
    finally:
        for y in (gateway_yaml, server_yaml):
            if y.exists():
                _podman("kube", "down", str(y), check=False)
        _podman("volume", "rm", "-f", "sos-data", *EMPTY_DIRS, check=False)
        _podman("secret", "rm", tier_secret, check=False)
