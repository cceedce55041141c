"""Issue 11, item 4: the Kubernetes manifests, the spark-submit conf and the compose file,
checked offline (no cluster and no container engine run here).

* every document of every manifest in deploy/k8s/ (the Spark pod templates too) validates
  against fixed Kubernetes versions' OpenAPI schemas, strictly (unknown fields are errors),
  with the PyPI package kubernetes-validate;
* the gateway's Deployment is unprivileged as promised (non-root, read-only root
  filesystem, no privilege escalation, all capabilities dropped, RuntimeDefault seccomp),
  takes its key from a Secret file (never an argument), talks TLS to the server, has
  probes and resources, one replica that is never doubled by a rollout;
* the spark-submit conf has gateway_conf()'s settings (but the credential), the trust
  store for every JVM and the labels the NetworkPolicy admits;
* the NetworkPolicies, evaluated on the pods the manifests describe: only the job's pods
  reach the gateway, only the gateway reaches the server;
* the compose file validates against the Compose Specification's JSON schema
  (tests/data/compose-spec.json, from github.com/compose-spec/compose-spec, commit
  170098ba07d9f53c383a41bfd4c5166b0a4529a6, Apache-2.0) and is wired as documented.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import tomllib
import urllib.parse

import jsonschema
import kubernetes_validate
import pytest

from spark_plugin.spark import GATEWAY_REDACTION_REGEX, gateway_conf
from tests.deploy.support import (
    COMPOSE,
    K8S,
    ROOT,
    SPARK_CONF,
    Pod,
    all_k8s_documents,
    allowed,
    compose,
    documented_line,
    k8s_documents,
    objects,
    one,
    option,
    spark_conf,
)

#: the oldest Kubernetes these manifests support (native sidecars in spark-driver.yaml)
#: and the newest schema the pinned kubernetes-validate ships
K8S_VERSIONS = ("1.29.0", "1.37.0")
CREDENTIAL = "dfs.webhdfs.oauth2.credential"


def conf_namespace() -> str:
    """The Kubernetes namespace of the Spark jobs (spark-gateway.conf)."""
    return spark_conf()["spark.kubernetes.namespace"]


def _validate(doc: dict, version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(exc.message)  # an unknown kind/apiVersion is an error, not a warning


# ------------------------------------------------------------------ schema


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schema(version):
    docs = all_k8s_documents()
    names = {p.name for p in K8S.glob("*.yaml")}
    assert {
        "sos-server.yaml",
        "sos-gateway.yaml",
        "networkpolicy.yaml",
        "spark-rbac.yaml",
        "spark-pod-driver.yaml",
        "spark-pod-executor.yaml",
        "spark-driver.yaml",
    } <= names
    assert {f for f, _ in docs} == names  # every file holds at least one document
    for name, doc in docs:
        try:
            _validate(doc, version)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {'.'.join(map(str, exc.path))}: {exc.message}")


def test_the_validator_catches_what_it_should():
    dep = one(k8s_documents("sos-gateway.yaml"), "Deployment")
    typo = copy.deepcopy(dep)
    sc = typo["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    sc["readOnlyRootFileSystem"] = sc.pop("readOnlyRootFilesystem")  # a typo is not ignored
    wrong_type = copy.deepcopy(dep)
    wrong_type["spec"]["replicas"] = "one"
    no_image = copy.deepcopy(dep)
    del no_image["spec"]["template"]["spec"]["containers"][0]["name"]
    for bad in (typo, wrong_type, no_image):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(dict(dep, kind="Deploymnet"), K8S_VERSIONS[0], strict=True)


def test_kubernetes_validate_is_a_test_dependency():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(r.replace(" ", "").startswith("kubernetes-validate") for r in extra), extra


# ------------------------------------------------------------------ security


def _pod_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def _assert_restricted(where: str, pod: dict, *, read_only_root: bool) -> None:
    """The Kubernetes "restricted" Pod Security Standard, and a read-only root if asked."""
    psc = pod.get("securityContext", {})
    assert psc.get("runAsNonRoot") is True, where
    assert psc.get("runAsUser", 1) != 0, where
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext", {})
        name = f"{where}/{c['name']}"
        assert sc.get("runAsUser", psc.get("runAsUser")) not in (0, None), name
        assert sc.get("runAsNonRoot", True) is True, name
        assert sc.get("privileged", False) is False, name
        assert sc.get("allowPrivilegeEscalation") is False, name
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], name
        assert not sc.get("capabilities", {}).get("add"), name
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {}))
        assert seccomp.get("type") == "RuntimeDefault", name
        if read_only_root:
            assert sc.get("readOnlyRootFilesystem") is True, name
        for port in c.get("ports", []):
            assert "hostPort" not in port, name
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), where
    assert not any("hostPath" in v for v in pod.get("volumes", [])), where


def _gateway():
    docs = k8s_documents("sos-gateway.yaml")
    dep = one(docs, "Deployment", "sos-gateway")
    pod = dep["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    return docs, dep, pod, pod["containers"][0]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def _volume_of(pod: dict, container: dict, path: str) -> tuple[dict, dict]:
    """(volumeMount, volume) under which ``path`` lies in ``container``."""
    mounts = [
        m
        for m in container["volumeMounts"]
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mounts, f"{path} is on no volume"
    m = max(mounts, key=lambda m: len(m["mountPath"]))
    return m, next(v for v in pod["volumes"] if v["name"] == m["name"])


def test_gateway_deployment_is_unprivileged_with_a_read_only_root():
    _, dep, pod, c = _gateway()
    _assert_restricted("sos-gateway", pod, read_only_root=True)
    assert pod["securityContext"]["runAsUser"] == 10001  # the image's user
    assert pod.get("automountServiceAccountToken") is False
    # everything it writes is on a volume: the cache and TMPDIR on emptyDirs
    argv = c["args"]
    assert argv[:2] == ["sos", "gateway"] and "command" not in c  # the image's tini entrypoint
    cache = option(argv, "--cache")
    m, vol = _volume_of(pod, c, cache)
    assert "emptyDir" in vol and cache != m["mountPath"], "the gateway's own directory inside the volume"
    tmpdir = _env(c)["TMPDIR"]["value"]
    _, tvol = _volume_of(pod, c, tmpdir)
    assert "emptyDir" in tvol and tvol["emptyDir"].get("sizeLimit")
    assert vol["emptyDir"].get("sizeLimit")


def test_gateway_has_one_replica_never_two_at_once():
    _, dep, _, _ = _gateway()
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate"  # a rolling update runs two writers
    text = (K8S / "sos-gateway.yaml").read_text()
    assert "one replica" in text.lower() and "fence" in text  # says why


def test_gateway_key_comes_from_a_secret_file_never_an_argument():
    _, _, pod, c = _gateway()
    argv = c.get("command", []) + c["args"]
    assert not any(a == "--key" or a.startswith("--key=") or a == "--key-file" for a in argv), argv
    env = _env(c)
    assert "SOS_KEY" not in env  # a value in the pod spec, or visible in the environment
    path = env["SOS_KEY_FILE"]["value"]
    m, vol = _volume_of(pod, c, path)
    assert m.get("readOnly") is True
    secret = vol["secret"]
    assert secret["secretName"] == "sos-gateway-key"
    item = next(i for i in secret["items"] if os.path.join(m["mountPath"], i["path"]) == path)
    mode = item.get("mode", secret.get("defaultMode", 0o644))
    assert mode & 0o007 == 0, oct(mode)  # not world-readable; group = fsGroup = the gateway
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    for e in c.get("env", []):
        assert "secretKeyRef" not in e.get("valueFrom", {}), "the key as a file, not in the environment"


def test_gateway_talks_tls_to_the_server_and_serves_https():
    _, _, pod, c = _gateway()
    argv = c["args"]
    ca = option(argv, "--tls-ca")
    m, vol = _volume_of(pod, c, ca)
    # only the server's certificate, from the server's Secret, not its key
    assert vol["secret"]["secretName"] == "sos-tls"
    assert vol["secret"]["items"] == [{"key": "tls.crt", "path": os.path.relpath(ca, m["mountPath"])}]
    server = one(k8s_documents("sos-server.yaml"), "StatefulSet")
    server_tls = next(v for v in server["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert server_tls["secret"]["secretName"] == "sos-tls"
    for opt in ("--tls-cert", "--tls-key"):
        m, vol = _volume_of(pod, c, option(argv, opt))
        assert vol["secret"]["secretName"] == "sos-gateway-tls" and m.get("readOnly") is True
        assert vol["secret"]["defaultMode"] & 0o007 == 0
    # the server it connects to is the server's Service
    host, port = _env(c)["SOS_SERVER"]["value"].split(":")
    svc = one(k8s_documents("sos-server.yaml"), "Service", host)
    assert int(port) in [p["port"] for p in svc["spec"]["ports"]]


def test_gateway_probes_resources_and_service():
    docs, dep, pod, c = _gateway()
    listen_port = int(option(c["args"], "--listen").rsplit(":", 1)[1])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["webhdfs"] == listen_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in c, probe
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600  # a restore
    live = c["livenessProbe"]["exec"]["command"]
    assert live[-1] == "--gateway" and live[1] == "/usr/local/lib/sos/healthcheck.py"
    assert _env(c)["SOS_HEALTH_ADDR"]["value"] == f"127.0.0.1:{listen_port}"
    res = c["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
    assert pod["terminationGracePeriodSeconds"] > 120  # the final flush waits up to 120 s
    svc = one(docs, "Service", "sos-gateway")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (sp,) = svc["spec"]["ports"]
    assert sp["targetPort"] == "webhdfs"


def test_server_statefulset_is_restricted_too():
    sts = one(k8s_documents("sos-server.yaml"), "StatefulSet")
    _assert_restricted("sos-server", sts["spec"]["template"]["spec"], read_only_root=True)


def test_spark_pod_templates_are_restricted():
    for name in ("spark-pod-driver.yaml", "spark-pod-executor.yaml"):
        (pod,) = k8s_documents(name)
        assert pod["kind"] == "Pod"
        _assert_restricted(name, pod["spec"], read_only_root=False)
    (executor,) = k8s_documents("spark-pod-executor.yaml")
    assert executor["spec"]["automountServiceAccountToken"] is False  # only the driver uses the API


# ------------------------------------------------------------------ spark-submit conf


def test_spark_conf_has_gateway_conf_but_the_credential():
    conf = spark_conf()
    url = conf["spark.kubernetes.driverEnv.SOS_GATEWAY"]
    namespace = conf["spark.kubernetes.driverEnv.SOS_NAMESPACE"]
    expected = gateway_conf(url, namespace, "THE-KEY")
    for key, value in expected.items():
        if key == CREDENTIAL:
            continue
        assert conf.get(f"spark.hadoop.{key}") == value, key
    assert f"spark.hadoop.{CREDENTIAL}" not in conf
    assert not any("THE-KEY" in v or "oauth2.credential" in k for k, v in conf.items())
    assert conf["spark.redaction.regex"] == GATEWAY_REDACTION_REGEX
    assert conf["spark.authenticate"] == "true" and conf["spark.network.crypto.enabled"] == "true"
    # the URL is the gateway's Service, with TLS, and the namespace is the one it serves
    _, _, _, c = _gateway()
    parsed = urllib.parse.urlsplit(url)
    svc = one(k8s_documents("sos-gateway.yaml"), "Service", "sos-gateway")
    # by its cross-namespace name: the jobs run in another namespace (test_deploy_isolation.py)
    assert parsed.scheme == "https"
    assert parsed.hostname == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc"
    assert parsed.port in [p["port"] for p in svc["spec"]["ports"]]
    assert "--tls-cert" in c["args"]
    assert c["args"][2] == namespace


def test_spark_conf_runs_executors_with_the_key_and_the_truststore():
    conf = spark_conf()
    assert conf["spark.submit.deployMode"] == "cluster"
    assert int(conf["spark.executor.instances"]) >= 2
    for role in ("driver", "executor"):
        template = ROOT / conf[f"spark.kubernetes.{role}.podTemplateFile"]
        assert template.parent == K8S and template.exists()
        (pod,) = k8s_documents(template.name)
        names = [c["name"] for c in pod["spec"]["containers"]]
        assert conf[f"spark.kubernetes.{role}.podTemplateContainerName"] in names
        # every JVM trusts the gateway's certificate: a truststore from a mounted Secret
        opts = conf[f"spark.{role}.extraJavaOptions"].split()
        store = next(o.split("=", 1)[1] for o in opts if o.startswith("-Djavax.net.ssl.trustStore="))
        mounts = {k.rsplit(".", 1)[1]: v for k, v in conf.items() if k.startswith(f"spark.kubernetes.{role}.secrets.")}
        assert any(store.startswith(mp + "/") for mp in mounts.values()), (role, store, mounts)
        assert "-Djavax.net.ssl.trustStoreType=PKCS12" in opts
    # the driver's key: a file of a mounted Secret, named by SOS_KEY_FILE
    key_file = conf["spark.kubernetes.driverEnv.SOS_KEY_FILE"]
    driver_secrets = {
        k.rsplit(".", 1)[1]: v for k, v in conf.items() if k.startswith("spark.kubernetes.driver.secrets.")
    }
    assert os.path.dirname(key_file) == driver_secrets["sparkjob-key"]
    assert not any(k.startswith("spark.kubernetes.driver.secretKeyRef.") for k in conf)
    ca = conf["spark.kubernetes.driverEnv.SSL_CERT_FILE"]
    assert os.path.dirname(ca) == driver_secrets["sos-gateway-trust"]
    # the application file is the one the driver template mounts from the ConfigMap
    (driver,) = k8s_documents("spark-pod-driver.yaml")
    job_mount = next(m for m in driver["spec"]["containers"][0]["volumeMounts"] if m["name"] == "job")
    assert f"local://{job_mount['mountPath']}/spark_job.py" in SPARK_CONF.read_text()


def test_configmap_items_are_the_files_the_job_imports():
    (driver,) = k8s_documents("spark-pod-driver.yaml")
    vol = next(v for v in driver["spec"]["volumes"] if v["name"] == "job")
    items = vol["configMap"]["items"]
    # the documented `kubectl create configmap spark-job` gives each file a key: KEY= when
    # written (two __init__.py more than the first), else the file's name
    cmd = documented_line("create configmap spark-job", f"-n {conf_namespace()}")
    files = [a.split("=", 1)[1] for a in cmd.split() if a.startswith("--from-file=")]
    keyed = dict(f.split("=", 1) if "=" in f else (pathlib.Path(f).name, f) for f in files)
    assert len(keyed) == len(files), files  # no key twice
    # each item is the checkout's file at its path (the job's own at the top), under its key
    for item in items:
        src = ROOT / ("deploy" if item["path"] == "spark_job.py" else "") / item["path"]
        assert (ROOT / keyed[item["key"]]).resolve() == src.resolve(), item
    # the job's imports are all there: every module of the Spark helpers, what they import,
    # and the gateway's client they name
    paths = {i["path"] for i in items}
    helpers = {f"spark_plugin/spark/{p.name}" for p in (ROOT / "spark_plugin" / "spark").glob("*.py")}
    assert {
        "spark_job.py",
        "spark_plugin/__init__.py",
        "spark_plugin/mounttable.py",
        "spark_plugin/gateway/__init__.py",
        "spark_plugin/gateway/client.py",
        *helpers,
    } <= paths, paths
    assert sorted(keyed) == sorted(i["key"] for i in items), (sorted(keyed), items)
    # (tests/deploy/test_spark.py runs the job with these files and nothing else)


# ------------------------------------------------------------------ NetworkPolicy


def _pods() -> dict[str, Pod]:
    """The pods the manifests describe, in the namespaces they name."""
    conf = spark_conf()
    objs = objects()
    jobs = conf_namespace()
    pods = {}
    _, dep, _, _ = _gateway()
    pods["gateway"] = Pod.of(dep["metadata"]["namespace"], dep["spec"]["template"]["metadata"]["labels"])
    sts = one(k8s_documents("sos-server.yaml"), "StatefulSet")
    pods["server"] = Pod.of(sts["metadata"]["namespace"], sts["spec"]["template"]["metadata"]["labels"])
    for role in ("driver", "executor"):
        (tpl,) = k8s_documents(pathlib.Path(conf[f"spark.kubernetes.{role}.podTemplateFile"]).name)
        labels = dict(tpl["metadata"].get("labels", {}))
        prefix = f"spark.kubernetes.{role}.label."
        labels |= {k[len(prefix) :]: v for k, v in conf.items() if k.startswith(prefix)}
        labels |= {"spark-role": role, "spark-app-selector": "spark-0123"}  # what Spark adds
        pods[role] = Pod.of(jobs, labels)
    mount_pod = one(k8s_documents("spark-driver.yaml"), "Pod")
    pods["mount-pod"] = Pod.of(mount_pod["metadata"]["namespace"], mount_pod["metadata"]["labels"])
    pods["other"] = Pod.of(jobs, {"app": "something-else"})
    pods["other-in-sos"] = Pod.of(pods["server"].ns, {"app": "something-else"})
    pods["other-namespace-driver"] = Pod.of("elsewhere", pods["driver"].label_dict)
    pods["dns"] = Pod.of("kube-system", {"k8s-app": "kube-dns"})
    assert {p.ns for p in pods.values()} >= {o["ns"] for o in objs if o["kind"] == "NetworkPolicy"}
    return pods


def _policies(*files: str) -> list[dict]:
    """The objects of ``files`` (the policies, and the Namespaces they select by)."""
    return [o for o in objects() if o["file"] in (*files, "namespaces.yaml")]


def test_network_policy_lets_only_the_job_reach_the_gateway_and_only_the_gateway_the_server():
    pods = _pods()
    gw_port = int(option(_gateway()[3]["args"], "--listen").rsplit(":", 1)[1])
    policies = _policies("networkpolicy.yaml", "spark-driver.yaml")
    ok = lambda a, b, port: allowed(policies, pods[a], pods[b], port)  # noqa: E731
    assert ok("driver", "gateway", gw_port) and ok("executor", "gateway", gw_port)
    for intruder in ("other", "other-in-sos", "server", "mount-pod", "other-namespace-driver"):
        assert not ok(intruder, "gateway", gw_port), intruder
    assert ok("gateway", "server", 7070)
    for intruder in ("driver", "executor", "other", "other-in-sos", "other-namespace-driver"):
        assert not ok(intruder, "server", 7070), intruder
    assert not ok("driver", "gateway", 7070)  # and only the gateway's port
    # the gateway reaches nothing else but DNS
    assert ok("gateway", "dns", 53)
    assert not ok("gateway", "other", 443) and not ok("gateway", "driver", 4040)
    # the mount alternative's own policy lets its pod reach the server ...
    assert ok("mount-pod", "server", 7070)
    # ... and without it, with the gateway's policies alone, only the gateway does
    alone = _policies("networkpolicy.yaml")
    assert not allowed(alone, pods["mount-pod"], pods["server"], 7070)
    assert allowed(alone, pods["gateway"], pods["server"], 7070)


def test_the_policy_evaluator_is_not_vacuous():
    pods = _pods()
    # no policy: everybody reaches everybody
    assert allowed([], pods["other"], pods["gateway"], 9870)
    # a policy that admits every pod of every namespace lets "other" in
    open_policy = copy.deepcopy(_policies("networkpolicy.yaml"))
    gw_policy = next(o for o in open_policy if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "sos-gateway")
    gw_policy["spec"]["ingress"][0]["from"] = [{"namespaceSelector": {}, "podSelector": {}}]
    assert allowed(open_policy, pods["other"], pods["gateway"], 9870)


# ------------------------------------------------------------------ compose


def test_compose_validates_against_the_compose_specification():
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(compose())]
    assert errors == []
    bad = compose()
    bad["services"]["sos-gateway"]["readonly"] = True  # a typo is caught
    assert list(validator.iter_errors(bad))


def test_compose_runs_server_gateway_master_two_workers_and_the_driver():
    services = compose()["services"]
    default = {n for n, s in services.items() if not s.get("profiles")}
    assert default == {"sos-server", "sos-gateway", "spark-master", "spark-worker-1", "spark-worker-2", "spark-job"}
    assert {n for n, s in services.items() if "mount" in s.get("profiles", [])} == {"sos-mount", "spark-mount-job"}
    for name, svc in services.items():
        for dep in svc.get("depends_on", []):
            assert dep in services, (name, dep)


def test_compose_gateway_is_unprivileged_with_a_read_only_root():
    c = compose()
    gw = c["services"]["sos-gateway"]
    assert gw["user"].split(":")[0] not in ("0", "root")
    assert gw["read_only"] is True
    assert "/tmp" in gw["tmpfs"]
    assert gw["cap_drop"] == ["ALL"] and "cap_add" not in gw and "devices" not in gw
    assert not gw.get("privileged")
    assert "no-new-privileges:true" in gw["security_opt"]
    argv = gw["command"]
    assert argv[:2] == ["sos", "gateway"]
    assert not any(a == "--key" or a.startswith("--key=") for a in argv)
    assert "SOS_KEY" not in gw["environment"]
    key_file = gw["environment"]["SOS_KEY_FILE"]
    assert key_file == f"/run/secrets/{gw['secrets'][0]}"
    assert gw["secrets"][0] in c["secrets"]
    # its writable places: the cache on a named volume (a directory inside), /tmp on tmpfs
    cache = option(argv, "--cache")
    vols = {v.split(":")[1]: v.split(":")[0] for v in gw["volumes"] if isinstance(v, str)}
    root = next(t for t in vols if cache.startswith(t + "/"))
    assert vols[root] in c["volumes"]
    # TLS to the server with its certificate only; HTTPS with the gateway's own
    ca = option(argv, "--tls-ca")
    assert vols[ca] == "./tls/tls.crt" and "./tls/tls.key" not in vols.values()
    assert vols[option(argv, "--tls-cert")] == "./tls/gateway.crt"
    assert vols[option(argv, "--tls-key")] == "./tls/gateway.key"
    assert gw["healthcheck"]["test"][-1] == "--gateway"
    listen_port = option(argv, "--listen").rsplit(":", 1)[1]
    assert gw["environment"]["SOS_HEALTH_ADDR"] == f"127.0.0.1:{listen_port}"
    assert gw["depends_on"]["sos-server"]["condition"] == "service_healthy"


def test_compose_spark_cluster_is_wired_to_the_gateway():
    c = compose()
    s = c["services"]
    master = s["spark-master"]["command"]
    master_url = f"spark://{option(master, '--host')}:{option(master, '--port')}"
    images = {s[n]["image"] for n in ("spark-master", "spark-worker-1", "spark-worker-2", "spark-job")}
    assert len(images) == 1 and images.pop().startswith("spark:")  # one Spark version everywhere
    hosts = set()
    for w in ("spark-worker-1", "spark-worker-2"):
        argv = s[w]["command"]
        assert "org.apache.spark.deploy.worker.Worker" in argv and argv[-1] == master_url
        assert option(argv, "--cores") == "1"
        hosts.add(option(argv, "--host"))
        assert s[w]["hostname"] == option(argv, "--host")
    assert len(hosts) == 2
    job = s["spark-job"]
    argv = job["command"]
    assert option(argv, "--master") == master_url and option(argv, "--deploy-mode") == "client"
    confs = dict(a.split("=", 1) for a in argv[argv.index("--master") :] if "=" in a and a.startswith("spark."))
    assert confs["spark.driver.host"] == job["hostname"]
    # every JVM (driver; executors, children of the workers) has the truststore mounted
    for role, services in (("driver", ["spark-job"]), ("executor", ["spark-worker-1", "spark-worker-2"])):
        opts = confs[f"spark.{role}.extraJavaOptions"].split()
        store = next(o.split("=", 1)[1] for o in opts if o.startswith("-Djavax.net.ssl.trustStore="))
        for name in services:
            mounted = {v.split(":")[1]: v.split(":")[0] for v in s[name]["volumes"] if isinstance(v, str)}
            assert mounted.get(store) == "./tls/truststore.p12", (name, store)
    env = job["environment"]
    gw_url = urllib.parse.urlsplit(env["SOS_GATEWAY"])
    gw = s["sos-gateway"]
    assert gw_url.scheme == "https" and gw_url.hostname == "sos-gateway"
    assert str(gw_url.port) == option(gw["command"], "--listen").rsplit(":", 1)[1]
    assert env["SOS_NAMESPACE"] == gw["command"][2]
    assert "SOS_KEY" not in env and env["SOS_KEY_FILE"] == f"/run/secrets/{job['secrets'][0]}"
    assert job["secrets"][0] != gw["secrets"][0]  # the job's key is not the gateway's
    mounted = {v.split(":")[1]: v.split(":")[0] for v in job["volumes"] if isinstance(v, str)}
    assert mounted[env["SSL_CERT_FILE"]] == "./tls/gateway.crt"
    assert mounted["/job/spark_job.py"] == "./spark_job.py" and mounted["/job/spark_plugin"] == "../spark_plugin"
    assert job["depends_on"]["sos-gateway"]["condition"] == "service_healthy"


def test_compose_bind_sources_exist_or_are_made_by_the_documented_commands():
    c = compose()
    made = ("./tls", "./keys/", "./shared")
    sources = [
        v.split(":")[0]
        for svc in c["services"].values()
        for v in svc.get("volumes", [])
        if isinstance(v, str) and v.startswith(".")
    ]
    sources += [
        v["source"]
        for svc in c["services"].values()
        for v in svc.get("volumes", [])
        if isinstance(v, dict) and v.get("type") == "bind"
    ]
    sources += [s["file"] for s in c["secrets"].values()]
    header = COMPOSE.read_text().split("\nname:")[0]  # the commands at the top
    made_keys = re.findall(r"> deploy/keys/(\S+)", header)
    for src in sources:
        if src.startswith("./keys/"):
            assert src[len("./keys/") :] in made_keys, src
        elif src.startswith(made):  # deploy/tls/X, or /tls/X in the keytool container
            assert f"tls/{os.path.basename(src)}" in header or src == "./shared", src
        else:
            assert (COMPOSE.parent / src).exists(), src


# ------------------------------------------------------------------ the object-store tier


def _server():
    docs = k8s_documents("sos-server.yaml")
    sts = one(docs, "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return docs, sts, container


def test_server_copies_to_the_tier_with_credentials_from_a_secret_never_an_argument():
    docs, sts, c = _server()
    tier = option(c["args"], "--tier")
    assert re.fullmatch(r"s3://[a-z0-9.-]+/\S+", tier), tier  # a bucket and a prefix, nothing else
    assert not any("AWS_" in a or "secret" in a.lower() for a in c["args"]), c["args"]
    env = {e["name"]: e for e in c["env"]}
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[var], var  # never a literal
        assert env[var]["valueFrom"] == {"secretKeyRef": {"name": "sos-tier-credentials", "key": var}}
    assert "AWS_SESSION_TOKEN" not in env and "AWS_PROFILE" not in env
    # region and endpoint from the ConfigMap next to it (the endpoint optional: AWS S3 needs none)
    cm = one(docs, "ConfigMap", "sos-tier")
    assert cm["metadata"]["namespace"] == sts["metadata"]["namespace"] == "sos"
    for var, optional in (("AWS_DEFAULT_REGION", False), ("AWS_ENDPOINT_URL", True)):
        ref = env[var]["valueFrom"]["configMapKeyRef"]
        assert ref["name"] == "sos-tier" and ref["key"] == var and ref.get("optional", False) is optional
    # TLS to the store: every endpoint the manifest sets or shows as an example is https
    text = (K8S / "sos-server.yaml").read_text()
    endpoints = re.findall(r"AWS_ENDPOINT_URL:\s*\"?([^\s\"]+)", text)
    assert len(endpoints) >= 2 and all(e.startswith("https://") for e in endpoints), endpoints
    assert all(not str(v).startswith("http://") for v in cm["data"].values())
    # the credentials are not the node's: the instance metadata service is not asked
    assert env["AWS_EC2_METADATA_DISABLED"]["value"] == "true"


def test_the_server_reaches_the_store_and_dns_and_nothing_else():
    pods = _pods()
    policies = _policies("networkpolicy.yaml")
    store = Pod.of("elsewhere", {})  # an address outside the cluster (an ipBlock peer)
    ok = lambda a, b, port: allowed(policies, a, b, port)  # noqa: E731
    assert ok(pods["server"], store, 443)
    assert ok(pods["server"], pods["dns"], 53)
    # egress is restricted: no other port, and none of the jobs' pods
    assert not ok(pods["server"], store, 80)
    assert not ok(pods["server"], pods["driver"], 4040)
    assert not ok(pods["server"], pods["gateway"], 9870)
    # its ingress is what it was: the gateway only
    assert ok(pods["gateway"], pods["server"], 7070)
    assert not ok(pods["driver"], pods["server"], 7070)


def test_compose_server_has_the_tier_with_credentials_from_a_secret_file():
    c = compose()
    srv = c["services"]["sos-server"]
    tier = option(srv["command"], "--tier")
    assert tier.startswith("s3://") and "@" not in tier
    assert srv["command"][:2] == ["sos-server", "serve"]
    for opt in ("--tls-cert", "--tls-key", "--metrics", "--data"):  # the image's defaults kept
        option(srv["command"], opt)
    env = srv["environment"]
    assert not any(k in env for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"))
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == "/run/secrets/tier-credentials"
    assert srv["secrets"] == ["tier-credentials"]
    assert c["secrets"]["tier-credentials"]["file"] == "./keys/tier-credentials"
    # the secret is the server's alone
    for name, svc in c["services"].items():
        if name != "sos-server":
            assert "tier-credentials" not in svc.get("secrets", []), name
            assert not any(str(k).startswith("AWS_") for k in (svc.get("environment") or {})), name
    text = COMPOSE.read_text()
    endpoints = re.findall(r"AWS_ENDPOINT_URL:\s*(\S+)", text)
    assert endpoints and all(e.startswith("https://") for e in endpoints), endpoints
