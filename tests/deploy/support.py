"""What the deployment tests read from the shipped files, and the Kubernetes manifests as the
cluster would see them.

The files: the Dockerfile, the Kubernetes manifests, the compose file, the spark-submit conf
and the commands of docs/DEPLOY.md.

The model (the second half), evaluated offline on the objects (never on their text): which
namespace each object lands in, what RBAC lets a subject do (RoleBindings,
ClusterRoleBindings, the implicit groups of a service account, and what creating pods in a
namespace hands over: every service account of that namespace), which Secrets and volumes
each namespace's pods refer to, and which pods a set of NetworkPolicies lets talk to each
other. Where the model cannot know (an ipBlock, a named port), it answers "allowed": a
denial it reports holds in the cluster.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shlex
from collections.abc import Iterable
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
SPARK_CONF = K8S / "spark-gateway.conf"


def dockerfile_final_stage() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile's last stage, continuations joined."""
    out, cur = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if cur and line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        cur += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = cur.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    last = max(k for k, (i, _) in enumerate(out) if i == "FROM")
    return out[last:]


def dockerfile_env() -> dict[str, str]:
    """The image's environment (ENV KEY=VALUE ... of the last stage)."""
    env = {}
    for ins, args in dockerfile_final_stage():
        if ins == "ENV":
            for word in shlex.split(args):
                key, sep, value = word.partition("=")
                assert sep, f"ENV {args}: use KEY=VALUE"
                env[key] = value
    return env


def dockerfile_copies() -> dict[str, pathlib.Path]:
    """Destination in the image -> source file in the repository (COPY from the context)."""
    out = {}
    for ins, args in dockerfile_final_stage():
        if ins == "COPY" and "--from=" not in args:
            *srcs, dst = args.split()
            if len(srcs) == 1:
                out[dst] = ROOT / srcs[0]
    return out


def k8s_documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def all_k8s_documents() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in k8s_documents(p.name)]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d.get("metadata", {}).get("name") == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def option(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


def spark_conf(path: pathlib.Path = SPARK_CONF) -> dict[str, str]:
    """A spark-submit --properties-file (java.util.Properties: KEY VALUE or KEY=VALUE)."""
    conf = {}
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith(("#", "!")):
            continue
        m = re.match(r"(\S+?)\s*(?:[=:]|\s)\s*(.*)$", text)
        assert m, f"cannot parse {line!r}"
        assert m.group(1) not in conf, f"{m.group(1)} set twice"
        conf[m.group(1)] = m.group(2).strip()
    return conf


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def documented_lines(needle: str) -> list[str]:
    """Lines of docs/DEPLOY.md's ```sh blocks that contain ``needle``."""
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    return [line for b in blocks for line in b.splitlines() if needle in line]


def documented_line(*needles: str) -> str:
    lines = [line for line in documented_lines(needles[0]) if all(n in line for n in needles)]
    assert len(lines) == 1, (needles, lines)
    return lines[0]


def run_documented(cwd, *needles: str) -> None:
    """Run docs/DEPLOY.md's command line that holds every one of ``needles`` (bash, in ``cwd``);
    it must succeed."""
    import subprocess

    subprocess.run(["bash", "-c", documented_line(*needles)], cwd=cwd, check=True, capture_output=True, timeout=300)


def dockerfile_command(**env: str) -> list[str]:
    """The server's argv that the image's default CMD runs: its ``sh -c "exec ..."`` with the
    image's ENV (and ``env`` over it) expanded, as the shell does."""
    final = dockerfile_final_stage()
    cmd = json.loads([a for i, a in final if i == "CMD"][-1])
    assert cmd[:2] == ["sh", "-c"] and cmd[2].startswith("exec "), cmd
    values = dockerfile_env() | env
    words = shlex.split(cmd[2])[1:]
    return [re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], w) for w in words]


# ======================================== the shipped Kubernetes manifests as the cluster would see them

#: kinds the manifests use that have no namespace
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass", "PriorityClass"}
#: the Spark pod templates: Spark creates them in spark.kubernetes.namespace
POD_TEMPLATES = ("spark-pod-driver.yaml", "spark-pod-executor.yaml")
#: what can start a pod (and so use any service account, Secret, ConfigMap or volume claim
#: of its namespace)
POD_MAKERS = {
    ("", "pods"),
    ("", "replicationcontrollers"),
    ("apps", "deployments"),
    ("apps", "replicasets"),
    ("apps", "statefulsets"),
    ("apps", "daemonsets"),
    ("batch", "jobs"),
    ("batch", "cronjobs"),
}
WORKLOADS = {"Pod", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"}

Obj = dict[str, Any]


# ------------------------------------------------------------------ objects and namespaces


#: where `kubectl apply -f` puts an object that names no namespace (with the usual context)
#: and where Spark runs without spark.kubernetes.namespace
DEFAULT_NS = "default"


def jobs_namespace() -> str:
    return spark_conf().get("spark.kubernetes.namespace", DEFAULT_NS)


def objects(extra: Iterable[Obj] = ()) -> list[Obj]:
    """Every object of every manifest with the namespace it lands in (``ns``; None if
    cluster-scoped), whether the manifest names it (``ns_named``) and its file (``file``);
    the pod templates in the jobs' namespace."""
    out = []
    docs = [(name, doc) for name, doc in all_k8s_documents()] + [("<test>", d) for d in extra]
    for name, doc in docs:
        named = doc.get("metadata", {}).get("namespace")
        ns = named or DEFAULT_NS
        if name in POD_TEMPLATES:
            assert named in (None, jobs_namespace()), f"{name}: Spark creates it in {jobs_namespace()}"
            ns, named = jobs_namespace(), jobs_namespace()
        if doc["kind"] in CLUSTER_SCOPED:
            ns = named = None
        out.append(dict(doc, ns=ns, ns_named=named, file=name))
    return out


def namespace_of(objs: list[Obj], kind: str, name: str) -> str:
    (ns,) = {o["ns"] for o in objs if o["kind"] == kind and o["metadata"]["name"] == name}
    return ns


def namespace_labels(objs: list[Obj], ns: str) -> dict[str, str]:
    """A namespace's labels: the manifest's, and the one the API server always sets."""
    labels: dict[str, str] = {}
    for o in objs:
        if o["kind"] == "Namespace" and o["metadata"]["name"] == ns:
            labels |= o["metadata"].get("labels", {})
    return labels | {"kubernetes.io/metadata.name": ns}


def pod_spec(obj: Obj) -> dict[str, Any] | None:
    if obj["kind"] == "Pod":
        return obj["spec"]
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if obj["kind"] in WORKLOADS:
        return obj["spec"]["template"]["spec"]
    return None


def pod_labels(obj: Obj) -> dict[str, str]:
    meta = obj["metadata"] if obj["kind"] == "Pod" else obj["spec"]["template"]["metadata"]
    return dict(meta.get("labels", {}))


def referenced_secrets_and_claims(obj: Obj) -> tuple[set[str], set[str], set[str]]:
    """(Secrets, ConfigMaps, PersistentVolumeClaims) a pod of ``obj`` refers to."""
    secrets: set[str] = set()
    maps: set[str] = set()
    claims: set[str] = set()
    spec = pod_spec(obj)
    if spec is None:
        return secrets, maps, claims
    for v in spec.get("volumes", []):
        if "secret" in v:
            secrets.add(v["secret"]["secretName"])
        if "configMap" in v:
            maps.add(v["configMap"]["name"])
        if "persistentVolumeClaim" in v:
            claims.add(v["persistentVolumeClaim"]["claimName"])
        for src in v.get("projected", {}).get("sources", []):
            if "secret" in src:
                secrets.add(src["secret"]["name"])
            if "configMap" in src:
                maps.add(src["configMap"]["name"])
    for c in spec.get("initContainers", []) + spec.get("containers", []):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            if "secretKeyRef" in ref:
                secrets.add(ref["secretKeyRef"]["name"])
            if "configMapKeyRef" in ref:
                maps.add(ref["configMapKeyRef"]["name"])
        for e in c.get("envFrom", []):
            if "secretRef" in e:
                secrets.add(e["secretRef"]["name"])
            if "configMapRef" in e:
                maps.add(e["configMapRef"]["name"])
    secrets |= {s["name"] for s in spec.get("imagePullSecrets", [])}
    return secrets, maps, claims


def spark_conf_secrets_and_claims() -> tuple[set[str], set[str]]:
    """(Secrets, claims) the spark-submit conf makes Spark mount in the jobs' namespace."""
    secrets, claims = set(), set()
    for key, value in spark_conf().items():
        parts = key.split(".")
        if key.startswith(("spark.kubernetes.driver.secrets.", "spark.kubernetes.executor.secrets.")):
            secrets.add(parts[-1])
        elif ".secretKeyRef." in key:
            secrets.add(value.split(":")[0])
        elif ".volumes.persistentVolumeClaim." in key and key.endswith(".options.claimName"):
            claims.add(value)
    return secrets, claims


# ------------------------------------------------------------------ selectors


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); an empty one matches all."""
    selector = selector or {}
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


# ------------------------------------------------------------------ NetworkPolicy


@dataclasses.dataclass(frozen=True)
class Pod:
    ns: str
    labels: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, ns: str, labels: dict[str, str]) -> Pod:
        return cls(ns, tuple(sorted(labels.items())))

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)


def network_policies(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] == "NetworkPolicy"]


def _peer_matches(objs: list[Obj], peer: dict[str, Any], policy_ns: str, pod: Pod) -> bool:
    if "ipBlock" in peer:
        return True  # pod addresses may fall in it: assume they do
    if "namespaceSelector" in peer:
        in_ns = selector_matches(peer["namespaceSelector"], namespace_labels(objs, pod.ns))
    else:
        in_ns = pod.ns == policy_ns
    return in_ns and selector_matches(peer.get("podSelector"), pod.label_dict)


def _port_matches(rule: dict[str, Any], port: int) -> bool:
    if not rule.get("ports"):
        return True
    for p in rule["ports"]:
        if p.get("protocol", "TCP") != "TCP":
            continue
        want = p.get("port")
        if want is None or isinstance(want, str):
            return True  # every port, or a named one: assume it is this one
        if want <= port <= p.get("endPort", want):
            return True
    return False


def _policy_types(spec: dict[str, Any]) -> list[str]:
    return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))


def allowed(objs: list[Obj], src: Pod, dst: Pod, port: int) -> bool:
    """Does TCP traffic from ``src`` reach ``dst`` on ``port``, under every NetworkPolicy?"""
    policies = network_policies(objs)

    def side(pod: Pod, kind: str, peers_key: str, other: Pod) -> bool:
        selecting = [
            p
            for p in policies
            if p["ns"] == pod.ns
            and selector_matches(p["spec"]["podSelector"], pod.label_dict)
            and kind in _policy_types(p["spec"])
        ]
        if not selecting:
            return True  # no policy selects it in that direction: open
        for p in selecting:
            for rule in p["spec"].get(kind.lower(), []):
                peers = rule.get(peers_key)
                if (not peers or any(_peer_matches(objs, x, p["ns"], other) for x in peers)) and _port_matches(
                    rule, port
                ):
                    return True
        return False

    return side(src, "Egress", "to", dst) and side(dst, "Ingress", "from", src)


def policy_peers(objs: list[Obj]) -> list[tuple[str, dict[str, Any]]]:
    """Every (policy name, peer) of every ingress `from` and egress `to`."""
    out = []
    for p in network_policies(objs):
        for rule in p["spec"].get("ingress", []):
            out += [(p["metadata"]["name"], peer) for peer in rule.get("from", [])]
        for rule in p["spec"].get("egress", []):
            out += [(p["metadata"]["name"], peer) for peer in rule.get("to", [])]
    return out


# ------------------------------------------------------------------ RBAC


@dataclasses.dataclass(frozen=True)
class ServiceAccount:
    ns: str
    name: str

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.ns}:{self.name}"

    @property
    def groups(self) -> set[str]:
        return {"system:serviceaccounts", f"system:serviceaccounts:{self.ns}", "system:authenticated"}


@dataclasses.dataclass(frozen=True)
class Grant:
    """One rule of a role, granted to a subject in ``ns`` (None: every namespace and the
    cluster-scoped objects, through a ClusterRoleBinding)."""

    ns: str | None
    rule: tuple[tuple[str, tuple[str, ...]], ...]
    via: str

    @property
    def rule_dict(self) -> dict[str, tuple[str, ...]]:
        return dict(self.rule)


def _binding_applies(subject: dict[str, Any], sa: ServiceAccount, binding_ns: str | None) -> bool:
    kind = subject["kind"]
    if kind == "ServiceAccount":
        return subject["name"] == sa.name and subject.get("namespace", binding_ns) == sa.ns
    if kind == "User":
        return subject["name"] == sa.user
    if kind == "Group":
        return subject["name"] in sa.groups
    raise AssertionError(f"unknown subject kind {kind}")


def _role_rules(objs: list[Obj], ref: dict[str, Any], ns: str | None) -> list[dict[str, Any]]:
    kind, name = ref["kind"], ref["name"]
    found = [
        o
        for o in objs
        if o["kind"] == kind and o["metadata"]["name"] == name and (kind == "ClusterRole" or o["ns"] == ns)
    ]
    if not found:
        # a role that is not in the manifests (cluster-admin, edit, ...): assume it grants all
        return [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]
    (role,) = found
    assert "aggregationRule" not in role, f"{name}: aggregated rules are not modelled"
    return list(role.get("rules", []))


def grants(objs: list[Obj], sa: ServiceAccount) -> list[Grant]:
    """Every rule RBAC gives ``sa``, with the namespace it holds in."""
    out = []
    for b in objs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ns = b["ns"] if b["kind"] == "RoleBinding" else None
        if not any(_binding_applies(s, sa, ns) for s in b.get("subjects", [])):
            continue
        for rule in _role_rules(objs, b["roleRef"], ns):
            frozen = tuple(sorted((k, tuple(v)) for k, v in rule.items()))
            out.append(Grant(ns, frozen, f"{b['kind']} {b['metadata']['name']}"))
    return out


def _resource_matches(granted: Iterable[str], resource: str) -> bool:
    base, _, sub = resource.partition("/")
    for r in granted:
        if r == "*" or r == resource:
            return True
        if sub and r == f"*/{sub}":
            return True
        if not sub and r == base:
            return True
    return False


def rule_allows(
    rule: dict[str, tuple[str, ...]], verb: str, group: str, resource: str, name: str | None = None
) -> bool:
    if "nonResourceURLs" in rule and "resources" not in rule:
        return False
    return (
        (verb in rule.get("verbs", ()) or "*" in rule.get("verbs", ()))
        and (group in rule.get("apiGroups", ()) or "*" in rule.get("apiGroups", ()))
        and _resource_matches(rule.get("resources", ()), resource)
        and (not rule.get("resourceNames") or name in rule["resourceNames"])
    )


def service_accounts(objs: list[Obj], ns: str) -> set[ServiceAccount]:
    """The accounts a pod of ``ns`` can run as: those of the manifests, and `default`."""
    named = {ServiceAccount(ns, o["metadata"]["name"]) for o in objs if o["kind"] == "ServiceAccount" and o["ns"] == ns}
    return named | {ServiceAccount(ns, "default")}


def can(
    objs: list[Obj], sa: ServiceAccount, verb: str, resource: str, ns: str, group: str = "", name: str | None = None
) -> bool:
    return any(
        g.ns in (None, ns) and rule_allows(g.rule_dict, verb, group, resource, name)
        for s in reachable(objs, sa)
        for g in grants(objs, s)
    )


def reachable(objs: list[Obj], sa: ServiceAccount) -> set[ServiceAccount]:
    """``sa`` and every account it can act as: creating a pod (or anything that makes pods)
    in a namespace lets it run the pod under any service account of that namespace, and
    impersonating one is acting as it."""
    seen = {sa}
    todo = [sa]
    namespaces = {o["ns"] for o in objs if o["ns"]} | {o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"}
    while todo:
        cur = todo.pop()
        for g in grants(objs, cur):
            rule = g.rule_dict
            targets: set[ServiceAccount] = set()
            for ns in [g.ns] if g.ns else sorted(namespaces):
                if any(rule_allows(rule, "create", grp, res) for grp, res in POD_MAKERS):
                    targets |= service_accounts(objs, ns)
                if rule_allows(rule, "impersonate", "", "serviceaccounts") or rule_allows(
                    rule, "create", "", "serviceaccounts/token"
                ):
                    targets |= service_accounts(objs, ns)
            for t in targets - seen:
                seen.add(t)
                todo.append(t)
    return seen


def pod_template_path(role: str) -> pathlib.Path:
    return K8S / pathlib.Path(spark_conf()[f"spark.kubernetes.{role}.podTemplateFile"]).name


def template_pod(role: str) -> Obj:
    (doc,) = k8s_documents(pod_template_path(role).name)
    return doc
