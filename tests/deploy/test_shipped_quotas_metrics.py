"""Issue 26 (hostile input, round 3) item 7: the two leftovers of earlier rounds.

(a) Quotas as shipped. A namespace without a byte quota of its own (`sos-server quota`)
    gets ``serve --namespace-quota``, by default 25% of the data directory's filesystem, so
    one namespace cannot fill the disk of the others; every shipped deployment (the
    Kubernetes StatefulSet, the compose file, the image's default command) passes an
    explicit one. Shown with a real server on a real (small) tmpfs, run with the storage
    settings parsed from each shipped file: one namespace fills its quota to the byte and
    gets the typed QUOTA_EXCEEDED while another still appends.

(b) Metrics pages have no authentication and their labels name every namespace (the
    gateway's: its namespace and checkpoints). ``sos-server serve --metrics`` and ``sos
    gateway --metrics`` refuse an address that is not loopback (exit 2, saying why and what
    to do) unless ``--metrics-public``; the shipped configs serve them where only
    Prometheus reaches: the pod's address with ``--metrics-public`` behind the
    NetworkPolicy that admits only Prometheus's pods (Kubernetes), the server's loopback
    with Prometheus in its network namespace (compose), loopback (the image).

Real processes throughout where a flag is concerned: ``sos-server`` and ``sos gateway``
child processes, real sockets, a real tmpfs (root, as tests/server/test_disk_full.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import urllib.request

import pytest
import yaml

from sos_client import Client, QuotaExceeded
from sos_server.cli import parse_namespace_quota
from sos_server.storage import OBJECT_CHARGE
from sos_wire.addresses import is_loopback, split_address
from spark_plugin.gateway.process import GatewayProcess
from tests.deploy.support import (
    COMPOSE,
    POD_TEMPLATES,
    Pod,
    allowed,
    compose,
    dockerfile_command,
    jobs_namespace,
    k8s_documents,
    namespace_of,
    objects,
    one,
    option,
    pod_labels,
    pod_spec,
    spark_conf,
    template_pod,
)
from tests.support import gateway_refused, scrape, server_cli
from tools.server import ServerProcess

pytestmark = [pytest.mark.hostile, pytest.mark.slow]

TIMEOUT = 120
TMPFS_SIZE = 32 << 20
#: serve's options that say where it listens, what it trusts and where its tier is: the
#: test's own (a loopback port, no TLS, no bucket); everything else is the shipped setting
ENDPOINT_OPTIONS = {"--data", "--listen", "--metrics", "--tls-cert", "--tls-key", "--tier"}
ENDPOINT_FLAGS = {"--metrics-public"}


# ---------------------------------------------------------------------------- the shipped files


def k8s_server_argv() -> list[str]:
    sts = one(k8s_documents("sos-server.yaml"), "StatefulSet", "sos-server")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return list(container["args"])


def compose_server_argv() -> list[str]:
    return list(compose()["services"]["sos-server"]["command"])


SHIPPED = {"k8s": k8s_server_argv, "compose": compose_server_argv, "image": dockerfile_command}


def storage_settings(argv: list[str]) -> list[str]:
    """The shipped ``sos-server serve`` argv without its endpoint options (ENDPOINT_OPTIONS)."""
    assert argv[:2] == ["sos-server", "serve"], argv
    out, rest = [], argv[2:]
    while rest:
        word = rest.pop(0)
        name = word.split("=", 1)[0]
        if name in ENDPOINT_OPTIONS:
            if "=" not in word:
                rest.pop(0)
        elif name not in ENDPOINT_FLAGS:
            out.append(word)
    return out


# ---------------------------------------------------------------------------- helpers


def filesystem_size(path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def fill_to_quota(c: Client, name: str, start: int = 0) -> tuple[int, list[QuotaExceeded]]:
    """Append to *name* in ever smaller pieces until not even one byte fits under the
    quota; returns the bytes acknowledged (from *start*) and the refusals."""
    length, refusals = start, []
    for size in (256 << 10, 16 << 10, 1 << 10, 64, 1):
        for _ in range(10_000):
            try:
                assert c.append(name, length, os.urandom(size)) == length + size
            except QuotaExceeded as exc:
                refusals.append(exc)
                break
            length += size
        else:
            pytest.fail(f"{size}-byte appends were never refused")
    return length, refusals


def other_ip() -> str | None:
    """An address of this host that is not loopback (None if it has none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent (UDP connect)
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if is_loopback(ip) else ip


# ---------------------------------------------------------------------------- (a) quotas


@pytest.mark.parametrize("where", sorted(SHIPPED))
def test_every_shipped_deployment_passes_a_namespace_quota_below_the_whole_disk(where):
    settings = storage_settings(SHIPPED[where]())
    quota = parse_namespace_quota(option(settings, "--namespace-quota"))
    assert quota.resolve(1 << 40) is not None  # not `none`
    assert quota.resolve(1 << 40) <= (1 << 40) // 2  # one namespace leaves at least half the disk


@pytest.mark.parametrize("where", sorted(SHIPPED))
def test_shipped_quota_one_namespace_cannot_fill_the_disk_of_another(where, tmpfs, sos_server_factory):
    settings = storage_settings(SHIPPED[where]())
    srv = sos_server_factory(data_dir=tmpfs / "data", args=settings, start=False)
    hog, other = srv.keygen("hog"), srv.keygen("other")
    srv.start()
    disk = filesystem_size(tmpfs)
    quota = parse_namespace_quota(option(settings, "--namespace-quota")).resolve(disk)
    assert quota is not None and quota < disk
    with Client(srv.address, hog, "hog", timeout=TIMEOUT) as c:
        length, refusals = fill_to_quota(c, "log")
        # to the byte: the object's charge plus its data is the quota, and nothing more fits
        assert OBJECT_CHARGE + length == quota
        assert len(refusals) == 5 and all(e.code.name == "QUOTA_EXCEEDED" for e in refusals)
        assert "quota" in str(refusals[-1])
        with pytest.raises(QuotaExceeded):
            c.append("new-object", 0, b"")  # a new object needs its 4 KiB charge
        assert c.stat("log") == (length, False)
        assert [e.name for e in c.list()] == ["log"]
    # the disk is not full: another namespace appends as much again as it likes
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    assert free > disk // 4, (free, disk)
    with Client(srv.address, other, "other", timeout=TIMEOUT) as c:
        for i in range(4):
            data = os.urandom(1 << 20)
            assert c.append(f"obj{i}", 0, data) == len(data)
            assert c.read(f"obj{i}") == data
    m = scrape(srv.metrics_address)
    assert m['sos_namespace_quota_bytes{namespace="hog"}'] == quota
    assert m['sos_namespace_quota_used_bytes{namespace="hog"}'] == quota


def test_without_any_quota_setting_a_quarter_of_the_disk_applies_and_sos_server_quota_overrides(
    tmpfs, sos_server_factory
):
    srv = sos_server_factory(data_dir=tmpfs / "data", start=False)  # no --namespace-quota
    hog = srv.keygen("hog")
    srv.start()
    disk = filesystem_size(tmpfs)
    with Client(srv.address, hog, "hog", timeout=TIMEOUT) as c:
        length, refusals = fill_to_quota(c, "log")
        assert OBJECT_CHARGE + length == disk // 4
        assert refusals[0].code.name == "QUOTA_EXCEEDED"
        # the namespace's own quota wins over the default, on the open connection too
        r = server_cli("quota", "--data", srv.data_dir, "hog", str(disk // 2))
        assert r.returncode == 0, r.stderr
        more = os.urandom(1 << 20)
        assert c.append("log", length, more) == length + len(more)
    assert '"namespace quota"' in srv.log_text() and '"setting": "25%"' in srv.log_text()


def test_namespace_quota_none_turns_the_default_off(tmpfs, sos_server_factory):
    srv = sos_server_factory(data_dir=tmpfs / "data", args=["--namespace-quota", "none"], start=False)
    hog = srv.keygen("hog")
    srv.start()
    disk = filesystem_size(tmpfs)
    with Client(srv.address, hog, "hog", timeout=TIMEOUT) as c:
        for i in range(12):  # 12 MiB: well past a quarter of 32 MiB
            assert c.append("log", i << 20, os.urandom(1 << 20)) == (i + 1) << 20
    assert disk // 4 < 12 << 20
    assert 'sos_namespace_quota_bytes{namespace="hog"}' not in scrape(srv.metrics_address)


@pytest.mark.parametrize("value", ["0%", "101%", "-5%", "x%", "nan%", "lots"])
def test_a_bad_namespace_quota_is_a_usage_error_before_anything_runs(value, tmp_path):
    r = server_cli("serve", "--data", tmp_path / "data", "--listen", "127.0.0.1:0", f"--namespace-quota={value}")
    assert r.returncode == 2, r.stderr
    assert "--namespace-quota" in r.stderr and repr(value) in r.stderr
    assert not (tmp_path / "data").exists()


# ---------------------------------------------------------------------------- (b) metrics


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0", "other-ip"])
def test_server_refuses_public_metrics_without_metrics_public(address, tmp_path):
    if address == "other-ip":
        ip = other_ip()
        if ip is None:
            pytest.skip("this host has no address but loopback")
        address = f"{ip}:0"
    r = server_cli("serve", "--data", tmp_path / "data", "--listen", "127.0.0.1:0", "--metrics", address, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--metrics-public" in r.stderr and "name every namespace" in r.stderr, r.stderr
    assert "127.0.0.1" in r.stderr  # what to do instead
    assert not (tmp_path / "data").exists()  # refused before the data directory is touched


@pytest.mark.parametrize("address", ["127.0.0.1:0", "localhost:0", "127.0.0.2:0"])
def test_server_serves_loopback_metrics_without_the_flag(address, tmp_path):
    srv = ServerProcess(tmp_path / "data", ["--metrics", address], log_path=tmp_path / "log", metrics=False).start()
    try:
        host, port = split_address(srv.metrics_address)
        assert port and is_loopback(host)
        assert scrape(f"{'127.0.0.2' if address.startswith('127.0.0.2') else '127.0.0.1'}:{port}")
    finally:
        srv.stop()


def test_server_with_metrics_public_serves_every_interface(tmp_path):
    srv = ServerProcess(
        tmp_path / "data", ["--metrics", "0.0.0.0:0", "--metrics-public"], log_path=tmp_path / "log", metrics=False
    ).start()
    try:
        host, port = split_address(srv.metrics_address)
        assert host == "0.0.0.0"
        assert scrape(f"127.0.0.1:{port}")
        ip = other_ip()
        if ip is not None:
            assert scrape(f"{ip}:{port}")
    finally:
        srv.stop()


def _gateway(sos_server, tmp_path, *extra: str) -> subprocess.CompletedProcess[str]:
    return gateway_refused(
        sos_server, sos_server.keygen("gwns", "append"), "gwns", tmp_path / "cache", *extra, timeout=TIMEOUT
    )


@pytest.mark.parametrize("address", ["0.0.0.0:0", "[::]:0"])
def test_gateway_refuses_public_metrics_without_metrics_public(address, sos_server, tmp_path):
    r = _gateway(sos_server, tmp_path, "--metrics", address)
    assert r.returncode == 2, r.stderr
    assert "--metrics-public" in r.stderr and "checkpoints" in r.stderr, r.stderr
    assert not (tmp_path / "cache").exists()


def test_gateway_with_metrics_public_serves_every_interface(sos_server, tmp_path):
    proc = GatewayProcess(
        "gwns",
        str(tmp_path / "cache"),
        sos_server.address,
        sos_server.keygen("gwns", "append"),
        extra_args=["--metrics", "0.0.0.0:0", "--metrics-public"],
        log_path=str(tmp_path / "gw.log"),
    ).start()
    try:
        line = [x for x in proc.log().splitlines() if "metrics on http://" in x]
        assert line, proc.log()
        port = int(line[0].split("metrics on http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        assert (
            "sos_gateway_up 1.0"
            in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        )
    finally:
        proc.stop()


def test_k8s_server_metrics_reach_only_prometheus():
    """--metrics-public on the pod's address, and the NetworkPolicies (evaluated as a plugin
    applies them, tests/deploy/support.py) let only Prometheus's pods reach the port."""
    argv = k8s_server_argv()
    host, port = split_address(option(argv, "--metrics"))
    assert not is_loopback(host) and "--metrics-public" in argv
    objs = objects()
    sos_ns = namespace_of(objs, "StatefulSet", "sos-server")
    pods = {
        o["metadata"]["name"]: Pod.of(o["ns"], pod_labels(o))
        for o in objs
        if pod_spec(o) is not None and o["file"] not in POD_TEMPLATES
    }
    jobs = jobs_namespace()
    conf = spark_conf()
    for role in ("driver", "executor"):  # as Spark makes them: the template's labels and the conf's
        labels = dict(template_pod(role)["metadata"].get("labels", {}))
        prefix = f"spark.kubernetes.{role}.label."
        labels |= {k[len(prefix) :]: v for k, v in conf.items() if k.startswith(prefix)}
        pods[role] = Pod.of(jobs, labels | {"spark-role": role})
    server = pods["sos-server"]
    prometheus = Pod.of("monitoring", {"app.kubernetes.io/name": "prometheus"})
    assert allowed(objs, prometheus, server, port)
    assert allowed(objs, pods["sos-gateway"], server, 7070)  # the model sees a way in where there is one
    others = {
        "gateway": pods["sos-gateway"],
        "mount pod": pods["spark-driver"],
        "driver": pods["driver"],
        "executor": pods["executor"],
        "a stray pod in sos": Pod.of(sos_ns, {"app": "something"}),
        "prometheus's label in the jobs' namespace": Pod.of(jobs, prometheus.label_dict),
        "another pod in monitoring": Pod.of("monitoring", {"app": "grafana"}),
    }
    for what, pod in others.items():
        assert not allowed(objs, pod, server, port), what
    # the port the policy admits Prometheus to is the one the server serves metrics on
    sts = one(k8s_documents("sos-server.yaml"), "StatefulSet", "sos-server")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert {"name": "metrics", "containerPort": port} in container["ports"]


def test_compose_server_metrics_reach_only_its_prometheus():
    """Loopback of the server's container; the only other process in that network namespace
    is the `prometheus` service, which scrapes exactly that address; nothing publishes it."""
    services = compose()["services"]
    server = services["sos-server"]
    host, port = split_address(option(server["command"], "--metrics"))
    assert is_loopback(host) and "--metrics-public" not in server["command"]
    assert not any(str(p).split(":")[-1] == str(port) for p in server.get("ports", []))
    sharing = [n for n, s in services.items() if s.get("network_mode") == "service:sos-server"]
    assert sharing == ["prometheus"]
    prom = services["prometheus"]
    assert "--web.listen-address=127.0.0.1:9090" in prom["command"]  # its API serves what it scraped
    mounted = [v for v in prom["volumes"] if v.endswith(":/etc/prometheus:ro")]
    (src,) = [v.split(":")[0] for v in mounted]
    conf = yaml.safe_load((COMPOSE.parent / src / "prometheus.yml").read_text())
    targets = [t for job in conf["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"127.0.0.1:{port}"]
    assert (COMPOSE.parent / src / conf["rule_files"][0]).exists()


def test_image_default_metrics_are_on_loopback():
    cmd = dockerfile_command()
    host, _ = split_address(option(cmd, "--metrics"))
    assert is_loopback(host) and "--metrics-public" not in cmd


def test_every_shipped_metrics_address_starts_a_real_server(tmp_path):
    """The metrics options of each shipped server argv, run (port 0): none is refused."""
    for where, argv_of in SHIPPED.items():
        argv = argv_of()
        host, _ = split_address(option(argv, "--metrics"))
        args = ["--metrics", f"{'[' + host + ']' if ':' in host else host}:0"]
        args += ["--metrics-public"] if "--metrics-public" in argv else []
        srv = ServerProcess(tmp_path / where, args, log_path=tmp_path / f"{where}.log", metrics=False).start()
        try:
            assert split_address(srv.metrics_address)[0] == host, where
        finally:
            srv.stop()
    # and the shipped gateways: none serves metrics off loopback without the flag
    gw_args = [
        one(k8s_documents("sos-gateway.yaml"), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    ]
    gw_args.append(compose()["services"]["sos-gateway"]["command"])
    for argv in gw_args:
        if "--metrics" in argv:
            assert is_loopback(split_address(option(argv, "--metrics"))[0]) or "--metrics-public" in argv, argv
