"""Issue 17, items 1 and 13: no Spark job can own SOS through the shipped deployment.

Item 1 (Kubernetes): every path the issue names, evaluated over the manifests as the API
server and a NetworkPolicy plugin would (tests/deploy/support.py), not by reading their text:

(a) RBAC: the driver's service account, and every account it can become by starting a
    pod, has rules only in the jobs' namespace, on pods, services and configmaps: it
    cannot create a pod, read a Secret or touch anything in the namespace sos;
(b) every Secret and volume claim a job could want (sos-tls, sos-gateway-tls,
    sos-gateway-key, sos-data) lives in sos only, is made there by the documented
    commands, and nothing in a jobs' namespace refers to it; the job's own key is a
    token-role key;
(c) no Service (or endpoint) in sos can be created, patched or deleted by the driver;
(d) every NetworkPolicy peer that selects pods also selects their namespace, so a pod a
    job labels app=sos-gateway (or sos-gateway-client, or app=spark-streaming) in its own
    namespace reaches neither the server nor anything else in sos;
(e) no SOS pod or account and no executor mounts a Kubernetes API token; only the driver
    does; the jobs' namespace enforces the "restricted" Pod Security Standard (so a job
    cannot start a privileged or hostPath pod and read the node's copy of the Secrets);
(f) kubernetes-validate still passes on every manifest: tests/deploy/test_k8s.py.

Item 13 (compose): every Spark process authenticates with spark.authenticate and a secret
from a file, and the master's UI is published on loopback only (the metrics port not at all:
issue 26 item 7 put it on the server's loopback).
"""

from __future__ import annotations

import copy
import re
import shlex
import urllib.parse

import pytest

from tests.deploy.support import (
    COMPOSE,
    Pod,
    ServiceAccount,
    allowed,
    can,
    compose,
    documented_lines,
    grants,
    jobs_namespace,
    namespace_labels,
    namespace_of,
    objects,
    option,
    pod_labels,
    pod_spec,
    policy_peers,
    reachable,
    referenced_secrets_and_claims,
    service_accounts,
    spark_conf,
    spark_conf_secrets_and_claims,
    template_pod,
)

# where the manifests put things (on the single-namespace deployment of before, all three
# were `default`: the tests then show each attack working rather than a missing name)
SOS_NS = namespace_of(objects(), "StatefulSet", "sos-server")
JOBS_NS = jobs_namespace()
MOUNT_NS = namespace_of(objects(), "Pod", "spark-driver")
_DRIVER_SA = spark_conf()["spark.kubernetes.authenticate.driver.serviceAccountName"]
DRIVER = ServiceAccount(JOBS_NS, _DRIVER_SA)
# Spark's executors run as the driver's account unless told otherwise
EXECUTOR = ServiceAccount(
    JOBS_NS, spark_conf().get("spark.kubernetes.authenticate.executor.serviceAccountName", _DRIVER_SA)
)
WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")
#: what a job must never get at
SOS_SECRETS = {"sos-tls", "sos-gateway-tls", "sos-gateway-key", "sos-journal-key", "sos-tier-credentials"}
SOS_CLAIMS = {"sos-data"}


def _by_kind(objs, kind, ns=None):
    return [o for o in objs if o["kind"] == kind and (ns is None or o["ns"] == ns)]


def _named(objs, kind, name, ns):
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name and o["ns"] == ns]
    return found


def test_the_namespaces_are_separate_and_every_object_names_its_own():
    objs = objects()
    assert (SOS_NS, JOBS_NS, MOUNT_NS) == ("sos", "spark-jobs", "spark-mount")
    namespaces = {o["metadata"]["name"] for o in _by_kind(objs, "Namespace")}
    assert {SOS_NS, JOBS_NS, MOUNT_NS} <= namespaces
    for o in objs:
        if o["kind"] != "Namespace":
            # kubectl apply -f without -n puts an object without one in whatever namespace
            # the context points at: next to SOS, for a careless operator
            assert o["ns_named"], f"{o['file']}: {o['kind']} {o['metadata']['name']} names no namespace"
    where = {(o["kind"], o["metadata"]["name"]): o["ns"] for o in objs}
    for kind, name in (
        ("StatefulSet", "sos-server"),
        ("Service", "sos-server"),
        ("PersistentVolumeClaim", "sos-data"),
        ("Deployment", "sos-gateway"),
        ("Service", "sos-gateway"),
    ):
        assert where[(kind, name)] == SOS_NS, (kind, name)
    for kind, name in (("ServiceAccount", "spark"), ("Role", "spark-driver"), ("RoleBinding", "spark-driver")):
        assert where[(kind, name)] == JOBS_NS, (kind, name)
    assert spark_conf()["spark.kubernetes.authenticate.driver.serviceAccountName"] == DRIVER.name
    assert spark_conf()["spark.kubernetes.authenticate.executor.serviceAccountName"] == EXECUTOR.name


# ------------------------------------------------------------------ (a) RBAC


def test_a_the_drivers_account_can_do_nothing_outside_its_namespace():
    objs = objects()
    assert not _by_kind(objs, "ClusterRole") and not _by_kind(objs, "ClusterRoleBinding")
    assert not _by_kind(objs, "Role", SOS_NS) and not _by_kind(objs, "RoleBinding", SOS_NS)
    accounts = reachable(objs, DRIVER)
    # starting a pod lets it run as any account of its namespace: all of them are counted
    assert accounts == service_accounts(objs, JOBS_NS) == {DRIVER, EXECUTOR, ServiceAccount(JOBS_NS, "default")}
    rules = [g for a in accounts for g in grants(objs, a)]
    assert rules, "the driver needs its Role to start executors"
    for g in rules:
        r = g.rule_dict
        assert g.ns == JOBS_NS, g  # never a ClusterRoleBinding, never a binding in sos
        assert r["apiGroups"] == ("",) and set(r["resources"]) <= {"pods", "services", "configmaps"}, g
        assert "*" not in r["verbs"] and not {"escalate", "bind", "impersonate"} & set(r["verbs"]), g
    # what the job's code can do with the driver's token
    assert can(objs, DRIVER, "create", "pods", JOBS_NS)  # its executors
    for verb in ("create", "patch", "delete", "get", "list"):
        for resource in (
            "pods",
            "pods/exec",
            "services",
            "configmaps",
            "secrets",
            "persistentvolumeclaims",
            "serviceaccounts/token",
        ):
            assert not can(objs, DRIVER, verb, resource, SOS_NS), (verb, resource)
    for resource in ("secrets", "persistentvolumeclaims", "serviceaccounts/token"):
        assert not can(objs, DRIVER, "get", resource, JOBS_NS) and not can(objs, DRIVER, "create", resource, JOBS_NS)
    for group, resource in (
        ("rbac.authorization.k8s.io", "rolebindings"),
        ("apps", "deployments"),
        ("networking.k8s.io", "networkpolicies"),
    ):
        for ns in (SOS_NS, JOBS_NS):
            assert not can(objs, DRIVER, "create", resource, ns, group=group), (resource, ns)
    assert not can(objs, DRIVER, "patch", "namespaces", SOS_NS)  # e.g. its labels


def test_a_the_executors_and_the_sos_accounts_have_no_rights_at_all():
    objs = objects()
    for sa in {EXECUTOR} | service_accounts(objs, SOS_NS) | service_accounts(objs, MOUNT_NS):
        assert reachable(objs, sa) == {sa} and grants(objs, sa) == [], sa
    assert {sa.name for sa in service_accounts(objs, SOS_NS)} == {"sos-server", "sos-gateway", "default"}


def test_a_the_rbac_model_sees_what_would_open_sos():
    """Each of these manifests, added, gives the job a way into sos: the model must say so."""
    base = objects()
    assert not can(base, DRIVER, "create", "pods", SOS_NS)
    binding_in_sos = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "x", "namespace": SOS_NS},
        "subjects": [{"kind": "ServiceAccount", "name": "spark", "namespace": JOBS_NS}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
    }
    cluster_wide = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "y"},
        "subjects": [{"kind": "Group", "name": f"system:serviceaccounts:{JOBS_NS}"}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "z"},
    }
    cluster_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "z"},
        "rules": [{"apiGroups": [""], "resources": ["services"], "verbs": ["patch"]}],
    }
    # a second hop: the driver may start pods in spark-jobs, a pod may run as spark-executor,
    # and spark-executor holds a binding into sos
    via_executor = copy.deepcopy(binding_in_sos)
    via_executor["subjects"] = [{"kind": "ServiceAccount", "name": EXECUTOR.name, "namespace": JOBS_NS}]
    assert can(objects([binding_in_sos]), DRIVER, "create", "pods", SOS_NS)
    assert can(objects([cluster_wide, cluster_role]), DRIVER, "patch", "services", SOS_NS)
    assert can(objects([via_executor]), DRIVER, "get", "secrets", SOS_NS)


# ------------------------------------------------------------------ (b) Secrets and volumes


def _documented_created_secrets() -> dict[str, str]:
    """Secret name -> the namespace the documented `kubectl ... create secret` makes it in."""
    out: dict[str, str] = {}
    for line in documented_lines("create secret"):
        words = shlex.split(line.split("&&")[0])
        assert words[0] == "kubectl" and words[1] == "-n", f"no namespace: {line}"
        i = words.index("secret")
        name = words[i + 2]
        assert name not in out, f"{name} made twice"
        out[name] = words[2]
    return out


def test_b_sos_secrets_and_volume_live_in_sos_only_and_no_job_object_names_them():
    objs = objects()
    sos_refs = set()
    sos_claims = set()
    for o in objs:
        secrets, _, claims = referenced_secrets_and_claims(o)
        if o["ns"] == SOS_NS:
            sos_refs |= secrets
            sos_claims |= claims
        else:
            assert not (secrets & SOS_SECRETS), f"{o['file']}: {o['kind']} in {o['ns']} mounts {secrets}"
            assert not (claims & SOS_CLAIMS), f"{o['file']}: {o['kind']} in {o['ns']} mounts {claims}"
    assert sos_refs == SOS_SECRETS and sos_claims == SOS_CLAIMS
    assert _named(objs, "PersistentVolumeClaim", "sos-data", SOS_NS)
    # what spark-submit makes Spark mount in the jobs' namespace
    conf_secrets, conf_claims = spark_conf_secrets_and_claims()
    assert conf_secrets == {"sparkjob-key", "sos-gateway-trust"} and not conf_claims
    # where the documented commands make each Secret: SOS's in sos, the jobs' in theirs
    made = _documented_created_secrets()
    assert {n: made[n] for n in SOS_SECRETS} == dict.fromkeys(SOS_SECRETS, SOS_NS), made
    for name in conf_secrets:
        assert made[name] == JOBS_NS, (name, made)
    for o in objs:
        if o["ns"] not in (None, SOS_NS):
            secrets, _, _ = referenced_secrets_and_claims(o)
            for name in secrets:
                assert made.get(name) == o["ns"], f"{o['file']}: {name} is not made in {o['ns']}"
    # a job can mount every Secret of its namespace: there, only its own key and public
    # certificates (the truststore and the copies of tls.crt); and in the FUSE example's
    # namespace, whose mount sidecar is the namespace's journal writer, the journal key
    for line in documented_lines("create secret"):
        words = shlex.split(line.split("&&")[0])
        if words[2] != SOS_NS:
            files = [w.split("=")[-1] for w in words if w.startswith("--from-file=")]
            writer_key = words[2] == "spark-mount" and files == ["journal.key"]
            assert writer_key or not any(f.endswith(".key") and "job" not in f and "mount" not in f for f in files), (
                line
            )


def test_b_the_tiers_store_credentials_live_in_sos_and_only_the_server_gets_them():
    objs = objects()
    users = [
        (o["file"], o["kind"], o["ns"]) for o in objs if "sos-tier-credentials" in referenced_secrets_and_claims(o)[0]
    ]
    assert users == [("sos-server.yaml", "StatefulSet", SOS_NS)], users
    assert _documented_created_secrets()["sos-tier-credentials"] == SOS_NS
    (line,) = documented_lines("create secret generic sos-tier-credentials")
    # from files, never literals on a command line
    assert "--from-literal" not in line and line.count("--from-file=") == 2, line
    # no pod outside sos is handed a store credential by value or by reference
    for o in objs:
        spec = pod_spec(o)
        if spec is None or o["ns"] == SOS_NS:
            continue
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            names = {e["name"] for e in c.get("env", [])}
            assert not {n for n in names if n.startswith("AWS_")}, (o["file"], c["name"], names)


def test_b_the_jobs_key_is_a_token_role_key():
    made = _documented_created_secrets()
    (line,) = [x for x in documented_lines("create secret generic sparkjob-key")]
    key_file = re.search(r"--from-file=key=(\S+)", line).group(1)
    (keygen,) = [x for x in documented_lines("keygen") if x.rstrip().endswith(f"> {key_file}")]
    assert option(shlex.split(keygen.split(">")[0]), "--role") == "token", keygen
    assert made["sparkjob-key"] == JOBS_NS
    (gw_keygen,) = [x for x in documented_lines("keygen") if "gateway.key" in x]
    assert option(shlex.split(gw_keygen.split(">")[0]), "--role") == "append"  # the writer's


# ------------------------------------------------------------------ (c) the Services of sos


def test_c_no_service_in_sos_can_be_changed_by_the_driver():
    objs = objects()
    services = _by_kind(objs, "Service", SOS_NS)
    assert {s["metadata"]["name"] for s in services} == {"sos-server", "sos-gateway"}
    for svc in services:
        for verb in WRITE_VERBS:
            assert not can(objs, DRIVER, verb, "services", SOS_NS, name=svc["metadata"]["name"]), (verb, svc)
    for group, resource in (("", "endpoints"), ("discovery.k8s.io", "endpointslices")):
        for verb in WRITE_VERBS:
            assert not can(objs, DRIVER, verb, resource, SOS_NS, group=group), (verb, resource)


def test_c_the_jobs_reach_the_gateway_by_its_cross_namespace_name():
    """A Service a job makes in its own namespace named sos-gateway must not catch the
    traffic: the jobs use sos-gateway.sos.svc, which the gateway's certificate carries."""
    objs = objects()
    conf = spark_conf()
    gw = _named(objs, "Service", "sos-gateway", SOS_NS)
    host = f"{gw['metadata']['name']}.{SOS_NS}.svc"
    for key in ("spark.kubernetes.driverEnv.SOS_GATEWAY", "spark.hadoop.dfs.webhdfs.oauth2.refresh.url"):
        url = urllib.parse.urlsplit(conf[key])
        assert url.scheme == "https" and url.hostname == host, (key, conf[key])
        assert url.port in [p["port"] for p in gw["spec"]["ports"]]
    (gw_cert,) = [x for x in documented_lines("openssl req") if "/CN=sos-gateway" in x]
    assert f"DNS:{host}" in gw_cert
    # the mount alternative reaches the server's Service in sos, by a name its certificate has
    mount_pod = _named(objs, "Pod", "spark-driver", MOUNT_NS)
    env = {e["name"]: e for c in mount_pod["spec"]["initContainers"] for e in c.get("env", [])}
    server_host, port = env["SOS_SERVER"]["value"].split(":")
    server = _named(objs, "Service", "sos-server", SOS_NS)
    assert server_host == f"sos-server.{SOS_NS}.svc" and int(port) in [p["port"] for p in server["spec"]["ports"]]
    (server_cert,) = [x for x in documented_lines("openssl req") if "/CN=sos-server" in x]
    assert f"DNS:{server_host}" in server_cert


# ------------------------------------------------------------------ (d) NetworkPolicy


def _pods(objs):
    conf = spark_conf()
    pods = {}
    for o in objs:
        if pod_spec(o) is not None and o["file"] not in ("spark-pod-driver.yaml", "spark-pod-executor.yaml"):
            pods[o["metadata"]["name"]] = Pod.of(o["ns"], pod_labels(o))
    for role in ("driver", "executor"):
        labels = dict(template_pod(role)["metadata"].get("labels", {}))
        prefix = f"spark.kubernetes.{role}.label."
        labels |= {k[len(prefix) :]: v for k, v in conf.items() if k.startswith(prefix)}
        pods[role] = Pod.of(JOBS_NS, labels | {"spark-role": role})
    return pods


def test_d_every_peer_that_selects_pods_also_selects_their_namespace():
    peers = policy_peers(objects())
    assert peers
    for name, peer in peers:
        if "podSelector" in peer:
            assert "namespaceSelector" in peer and peer["namespaceSelector"].get("matchLabels"), (name, peer)
            # by the name the API server sets (nobody can label another namespace with it)
            assert set(peer["namespaceSelector"]["matchLabels"]) == {"kubernetes.io/metadata.name"}, (name, peer)


def test_d_a_job_pod_labelled_like_sos_reaches_nothing_in_sos():
    objs = objects()
    pods = _pods(objs)
    gateway, server = pods["sos-gateway"], pods["sos-server"]
    assert gateway.ns == server.ns == SOS_NS
    assert allowed(objs, gateway, server, 7070) and allowed(objs, pods["driver"], gateway, 9870)
    assert allowed(objs, pods["spark-driver"], server, 7070)  # the mount alternative's own way in
    every_label = gateway.label_dict | server.label_dict | pods["driver"].label_dict | pods["spark-driver"].label_dict
    impostors = {
        "app=sos-gateway in spark-jobs": Pod.of(JOBS_NS, gateway.label_dict),
        "every label in spark-jobs": Pod.of(JOBS_NS, every_label),
        "app=spark-streaming in spark-jobs": Pod.of(JOBS_NS, pods["spark-driver"].label_dict),
        "a job pod in a namespace of its own": Pod.of("elsewhere", every_label),
        "a job pod named like sos's namespace": Pod.of("sos-jobs", every_label),
    }
    for what, pod in impostors.items():
        for port in (7070, 9070):
            assert not allowed(objs, pod, server, port), what
        assert not allowed(objs, pod, gateway, 9870) or pod.ns == JOBS_NS, what
    # a pod in sos without the gateway's label reaches neither (default deny in sos)
    stray = Pod.of(SOS_NS, {"app": "something-else"})
    assert not allowed(objs, stray, server, 7070) and not allowed(objs, stray, gateway, 9870)
    assert not allowed(objs, pods["driver"], server, 7070) and not allowed(objs, pods["executor"], server, 7070)
    # default deny: every pod of sos is selected by an ingress policy
    any_pod = Pod.of(SOS_NS, {"app": "new-thing"})
    assert not allowed(objs, Pod.of(SOS_NS, {}), any_pod, 1234)


def test_d_the_policy_model_sees_the_label_trick_when_the_namespace_is_left_out():
    objs = objects()
    trick = Pod.of(JOBS_NS, {"app": "sos-gateway"})
    server = _pods(objs)["sos-server"]
    assert not allowed(objs, trick, server, 7070)
    loose = copy.deepcopy(objs)
    for o in loose:
        if o["kind"] == "NetworkPolicy":
            for rule in o["spec"].get("ingress", []):
                for peer in rule.get("from", []):
                    peer.pop("namespaceSelector", None)
                    peer.setdefault("namespaceSelector", {})  # {} = every namespace
    assert allowed(loose, trick, server, 7070)
    assert namespace_labels(objs, JOBS_NS)["kubernetes.io/metadata.name"] == JOBS_NS


# ------------------------------------------------------------------ (e) tokens, pod security


def test_e_no_api_token_but_in_the_driver():
    objs = objects()
    for sa in _by_kind(objs, "ServiceAccount"):
        assert sa.get("automountServiceAccountToken") is False, sa["metadata"]
    # the accounts `default` too: a pod that names none gets no token
    for ns in (SOS_NS, JOBS_NS, MOUNT_NS):
        assert _named(objs, "ServiceAccount", "default", ns)["automountServiceAccountToken"] is False
    for o in objs:
        spec = pod_spec(o)
        if spec is None:
            continue
        want = o["file"] == "spark-pod-driver.yaml"  # the one pod that talks to the API
        assert spec.get("automountServiceAccountToken") is want, (o["file"], o["metadata"]["name"])
        if o["ns"] == SOS_NS:
            sa = spec.get("serviceAccountName", "default")
            assert _named(objs, "ServiceAccount", sa, SOS_NS)
    assert template_pod("executor")["spec"]["automountServiceAccountToken"] is False


def test_e_pod_security_admission_restricted_where_jobs_and_sos_run():
    objs = objects()
    for ns in (SOS_NS, JOBS_NS):
        labels = namespace_labels(objs, ns)
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted", ns
    # the privileged mount alternative has a namespace of its own, where nobody may make pods
    assert namespace_labels(objs, MOUNT_NS)["pod-security.kubernetes.io/enforce"] == "privileged"
    (mount_pod,) = [o for o in objs if o["ns"] == MOUNT_NS and pod_spec(o) is not None]
    assert mount_pod["metadata"]["name"] == "spark-driver"
    for sa in service_accounts(objs, MOUNT_NS) | service_accounts(objs, JOBS_NS):
        assert not can(objs, sa, "create", "pods", MOUNT_NS), sa


# ------------------------------------------------------------------ item 13: compose


SPARK_SERVICES = ("spark-master", "spark-worker-1", "spark-worker-2", "spark-job")


def _java_opts(svc: dict) -> dict[str, str]:
    env = svc.get("environment", {})
    opts = " ".join(env.get(k, "") for k in ("SPARK_MASTER_OPTS", "SPARK_WORKER_OPTS"))
    out = dict(o[2:].split("=", 1) for o in opts.split() if o.startswith("-D"))
    argv = svc["command"]
    out |= dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--conf")
    return out


def test_compose_spark_authenticates_every_process_with_a_secret_from_a_file():
    c = compose()
    s = c["services"]
    text = COMPOSE.read_text()
    assert "spark.authenticate.secret=" not in text and "_SPARK_AUTH_SECRET" not in text
    secret_files = set()
    for name in SPARK_SERVICES:
        svc = s[name]
        opts = _java_opts(svc)
        assert opts.get("spark.authenticate") == "true", name
        assert opts.get("spark.network.crypto.enabled") == "true", name
        # the secret: a properties file that is a compose secret (never a value here)
        props = option(svc["command"], "--properties-file")
        (secret,) = [x for x in svc["secrets"] if props == f"/run/secrets/{x}"]
        secret_files.add(c["secrets"][secret]["file"])
        assert not any("secret" in k for k in opts), (name, opts)
        for value in svc.get("environment", {}).values():
            assert "spark.authenticate.secret" not in str(value), name
    (secret_file,) = secret_files  # one secret shared by all: master, workers, driver
    # made by the documented command, random, into that file
    header = text.split("\nname:")[0]
    (made,) = [line for line in header.splitlines() if f"> deploy/{secret_file[2:]}" in line]
    assert "spark.authenticate.secret" in made and "openssl rand" in made, made


def test_compose_publishes_the_master_ui_and_the_metrics_on_loopback_only():
    s = compose()["services"]

    def published(name):
        out = {}
        for p in s[name].get("ports", []):
            assert isinstance(p, str), p
            parts = p.split(":")
            host_ip = parts[0] if len(parts) == 3 else "0.0.0.0"
            out[int(parts[-1])] = host_ip
        return out

    master_ui = int(option(s["spark-master"]["command"], "--webui-port"))
    assert published("spark-master") == {master_ui: "127.0.0.1"}
    server = published("sos-server")
    # metrics (no authentication): not published at all, on the server's loopback for the
    # Prometheus in its network namespace (tests/deploy/test_shipped_quotas_metrics.py)
    assert 9070 not in server
    assert server[7070] == "0.0.0.0"  # TLS, every request authenticated: remote clients use it
    for name, svc in s.items():
        if name not in ("spark-master", "sos-server"):
            assert not svc.get("ports"), name  # workers' UIs, the driver's UI, the gateway
    assert _java_opts(s["spark-master"]).get("spark.ui.killEnabled") == "false"


@pytest.mark.parametrize("service", ["spark-worker-1", "spark-worker-2"])
def test_compose_workers_share_the_masters_spark_settings(service):
    s = compose()["services"]
    assert _java_opts(s[service]) | {"spark.ui.killEnabled": "false"} == _java_opts(s["spark-master"])


def test_compose_jobs_key_is_a_token_role_key():
    c = compose()
    header = COMPOSE.read_text().split("\nname:")[0]
    job_file = c["secrets"][c["services"]["spark-job"]["secrets"][0]]["file"]
    writer_file = c["secrets"][c["services"]["sos-gateway"]["secrets"][0]]["file"]
    lines = header.replace("\\\n#", "").splitlines()
    for path, role in ((job_file, "token"), (writer_file, "append")):
        (line,) = [x for x in lines if x.rstrip().endswith(f"> deploy/{path[2:]}")]
        assert option(shlex.split(line.lstrip("# ").split(">")[0]), "--role") == role, line


def test_compose_gateway_advertises_the_name_its_certificate_holds():
    """A gateway listening on 0.0.0.0 redirects data steps to ``--advertise``: the service
    name the JVM resolves and the certificate holds, never the container's own address."""
    gw = compose()["services"]["sos-gateway"]["command"]
    port = option(gw, "--listen").rsplit(":", 1)[1]
    assert option(gw, "--advertise") == f"sos-gateway:{port}"
    assert "DNS:sos-gateway," in (COMPOSE.parent.parent / "docs" / "DEPLOY.md").read_text()
