"""What the deployment tests read from the shipped files: the Dockerfile, the Kubernetes
manifests, the compose file, the spark-submit conf and the commands of docs/DEPLOY.md."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
from typing import Any

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
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


def dockerfile_command(**env: str) -> list[str]:
    """The server's argv that the image's default CMD runs: its ``sh -c "exec ..."`` with the
    image's ENV (and ``env`` over it) expanded, as the shell does."""
    final = dockerfile_final_stage()
    cmd = json.loads([a for i, a in final if i == "CMD"][-1])
    assert cmd[:2] == ["sh", "-c"] and cmd[2].startswith("exec "), cmd
    values = dockerfile_env() | env
    words = shlex.split(cmd[2])[1:]
    return [re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], w) for w in words]
