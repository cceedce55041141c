"""Issue 11, item 4: the image runs `sos gateway` unprivileged. No container engine runs
here, so the test runs what the image would run, as the Deployment says, the way a
container runtime would:

* the command and environment come from deploy/k8s/sos-gateway.yaml and the Dockerfile
  (ENV), with only the paths of the pod's volumes mapped to directories here, the port
  made free and the server's name made local;
* each volume is made as Kubernetes makes it: emptyDirs owned by root, mode 0777; Secret
  files owned by root, group fsGroup, with the manifest's modes;
* it runs in a private mount namespace where every mount but /proc, /sys, /dev and the
  emptyDirs is read-only (tests/deploy/ro_sandbox.py), as uid/gid 10001 with the supplementary
  group fsGroup, no capabilities (bounding set empty) and no_new_privs (setpriv);
* strace records every file system call that could write: only the cache volume may
  show up (no __pycache__, nothing in /tmp, $HOME or the root filesystem);
* the gateway then serves a real client over HTTPS (the documented certificates), with
  TLS to a real sos-server, the liveness probe of the manifest answers, SIGTERM flushes;
  a second gateway on an empty cache restores the namespace from the server at start.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import secrets as secrets_module
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.parse

import psutil
import pytest
import requests

from spark_plugin.gateway.process import READY_MARKER
from spark_plugin.spark import sos_command
from tests.deploy.support import (
    ROOT,
    dockerfile_copies,
    dockerfile_env,
    documented_line,
    k8s_documents,
    one,
    option,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

UID = 10001
#: syscalls that create, change or remove something in the file system
_ALWAYS_WRITES = {
    "mkdir",
    "mkdirat",
    "rename",
    "renameat",
    "renameat2",
    "unlink",
    "unlinkat",
    "rmdir",
    "link",
    "linkat",
    "symlink",
    "symlinkat",
    "truncate",
    "chmod",
    "fchmodat",
    "chown",
    "lchown",
    "fchownat",
    "utimensat",
    "mknod",
    "mknodat",
    # on a descriptor (strace -y names its file)
    "fchmod",
    "fchown",
    "ftruncate",
    "fallocate",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
}
TRACED = ",".join(sorted({"open", "openat", "openat2", "creat"} | _ALWAYS_WRITES))
_WRITE_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is needed (util-linux / strace; CI installs them)")
    return path


# ------------------------------------------------------------------ the pod, made here


class Pod:
    """The gateway container of the Deployment, with its volumes as directories here."""

    def __init__(self, base: pathlib.Path, secrets: dict[str, dict[str, bytes]]) -> None:
        dep = one(k8s_documents("sos-gateway.yaml"), "Deployment")
        self.spec = dep["spec"]["template"]["spec"]
        assert len(self.spec["containers"]) == 1 and not self.spec.get("initContainers")
        self.container = self.spec["containers"][0]
        self.fs_group = self.spec["securityContext"]["fsGroup"]
        assert self.spec["securityContext"]["runAsUser"] == UID
        self.base = base
        self.mounts: dict[str, pathlib.Path] = {}  # mountPath -> directory here
        self.empty_dirs: list[pathlib.Path] = []
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        for m in self.container["volumeMounts"]:
            vol = volumes[m["name"]]
            host = base / "volumes" / m["name"]
            host.mkdir(parents=True)
            if "emptyDir" in vol:
                os.chmod(host, 0o777)  # what the kubelet makes: root's, world-writable
                self.empty_dirs.append(host)
            elif "secret" in vol:
                self._secret(host, vol["secret"], secrets)
            else:
                pytest.fail(f"volume {m['name']}: only emptyDir and secret volumes are expected")
            self.mounts[m["mountPath"]] = host

    def _secret(self, host: pathlib.Path, ref: dict, secrets: dict[str, dict[str, bytes]]) -> None:
        data = secrets[ref["secretName"]]
        items = ref.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            path = host / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data[item["key"]])
            os.chown(path, 0, self.fs_group)
            os.chmod(path, item.get("mode", ref.get("defaultMode", 0o644)))
        os.chmod(host, 0o755)

    def host_path(self, path: str) -> str:
        """A path in the container -> the same file here (through the volume mounts)."""
        best = max((mp for mp in self.mounts if path == mp or path.startswith(mp + "/")), key=len, default=None)
        assert best is not None, f"{path} is on no volume of the pod"
        return str(self.mounts[best]) + path[len(best) :]

    def map_arg(self, arg: str) -> str:
        if arg.startswith("/") and any(arg == mp or arg.startswith(mp + "/") for mp in self.mounts):
            return self.host_path(arg)
        return arg

    def environment(self, **overrides: str) -> dict[str, str]:
        """The container's environment: the image's ENV, then the manifest's env."""
        env = dockerfile_env()
        for e in self.container.get("env", []):
            assert "value" in e, f"{e['name']}: a key or secret never goes in the pod spec's env"
            env[e["name"]] = self.map_arg(e["value"])
        env.update(overrides)
        # the image has `sos` and `python` on PATH; here the venv's, and this checkout's code
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
        env["PYTHONPATH"] = str(ROOT)
        env["HOME"] = "/nonexistent"  # the image user's home is not in the gateway's pod
        return env


def _reveal(paths: list[str]) -> list[str]:
    """Directories that uid 10001 could not reach because an ancestor is closed to others
    (e.g. a Python under /root, 0700): ro_sandbox.py lays them open in its namespace only."""
    out = []
    for path in paths:
        parts = pathlib.Path(os.path.realpath(path)).parts
        for i in range(1, len(parts) - 1):
            ancestor = os.path.join(*parts[: i + 1])
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                child = os.path.join(ancestor, parts[i + 1])
                if child not in out:
                    out.append(child)
                break
    return out


@pytest.fixture
def tmp_path():
    """This module's tests' directory: outside pytest's base temporary directory, whose root
    (/tmp/pytest-of-root) every pytest process that starts closes to others again (0700),
    also while a sandbox of uid 10001 here is reading its key file below it (seen: another
    xdist worker's first test, "Permission denied"). Under /tmp, open to traversal only."""
    import tempfile

    path = pathlib.Path(tempfile.mkdtemp(prefix="sos-test-deploy-"))
    os.chmod(path, 0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def open_to_others():
    """pytest makes its temporary directories 0700, and /tmp/pytest-of-root too (it closes
    it again at every session start): let uid 10001 traverse (o+x, no listing) from a path
    up to the first ancestor it can already traverse; the modes come back after the test."""
    changed: list[tuple[pathlib.Path, int]] = []

    def open_(path: pathlib.Path) -> None:
        for p in [path, *path.parents]:
            mode = os.stat(p).st_mode
            if p != path and mode & stat.S_IXOTH:
                break
            if (mode & 0o011) != 0o011:
                changed.append((p, stat.S_IMODE(mode)))
                os.chmod(p, stat.S_IMODE(mode) | 0o011)

    yield open_
    for p, mode in reversed(changed):
        os.chmod(p, mode)


class Sandboxed:
    """``argv`` run by ro_sandbox.py as uid 10001 (group fsGroup), no capabilities,
    no_new_privs, under strace."""

    def __init__(
        self,
        tmp_path: pathlib.Path,
        name: str,
        argv: list[str],
        env: dict[str, str],
        writable: list[pathlib.Path],
        fs_group: int,
        registry: list,
    ) -> None:
        self.trace = tmp_path / f"{name}.strace"
        self.log = tmp_path / f"{name}.log"
        trace_fd = os.open(self.trace, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        stage = tmp_path / f"{name}-stage"
        stage.mkdir()
        spec = {
            "writable": [str(w) for w in writable],
            "must_fail": [str(tmp_path), "/tmp", str(ROOT), os.path.dirname(sys.executable)],
            "reveal": _reveal([sys.executable, sys.prefix, sys.base_prefix, str(ROOT)]),
            "stage": str(stage),
            "cwd": "/",
            "env": env,
            "argv": [
                _tool("strace"),
                "-f",
                "-qq",
                "--seccomp-bpf",
                "-y",
                "-e",
                f"trace={TRACED}",
                "-o",
                f"/proc/self/fd/{trace_fd}",
                "--",
                _tool("setpriv"),
                f"--reuid={UID}",
                f"--regid={UID}",
                f"--groups={fs_group}",
                "--no-new-privs",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--",
                *argv,
            ],
        }
        spec_path = tmp_path / f"{name}.json"
        spec_path.write_text(json.dumps(spec))
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(
                [
                    _tool("unshare"),
                    "--mount",
                    "--propagation",
                    "private",
                    sys.executable,
                    str(ROOT / "tests" / "deploy" / "ro_sandbox.py"),
                    str(spec_path),
                ],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                pass_fds=(trace_fd,),
            )
        os.close(trace_fd)
        registry.append(self)

    def kill(self) -> None:
        """SIGKILL the traced program, then strace (a killed tracer would let it run on)."""
        if self.proc.poll() is None:
            try:
                for kid in psutil.Process(self.proc.pid).children(recursive=True):
                    kid.kill()
            except psutil.NoSuchProcess:
                pass
            self.proc.kill()
        self.proc.wait(60)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def target(self) -> psutil.Process:
        """The traced program (strace's child: setpriv exec'd it)."""
        while True:
            kids = psutil.Process(self.proc.pid).children()
            if kids:
                return kids[0]
            assert self.proc.poll() is None, self.text()
            time.sleep(0.05)

    def wait_ready(self, deadline: float = 300.0) -> str:
        end = time.monotonic() + deadline
        while True:
            for line in self.text().splitlines():
                if line.startswith(READY_MARKER):
                    return line[len(READY_MARKER) :].split()[0]
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.text()[-4000:]}"
            assert time.monotonic() < end, f"not ready:\n{self.text()[-4000:]}"
            time.sleep(0.1)

    def writes(self) -> list[tuple[str, str]]:
        """(syscall, absolute path) of every call that could write, from the trace."""
        out = []
        for line in self.trace.read_text(errors="replace").splitlines():
            m = re.match(r"\d+\s+(\w+)\((.*)", line)
            if not m or m.group(1) == "exited":
                continue
            call, args = m.group(1), m.group(2)
            if call in ("open", "openat", "openat2", "creat"):
                if call != "creat" and not any(f in args for f in _WRITE_FLAGS):
                    continue
            elif call not in _ALWAYS_WRITES:
                continue
            for path in _paths(call, args):
                out.append((call, path))
        return out


def _paths(call: str, args: str) -> list[str]:
    """The absolute paths a traced call names (strace -y prints a descriptor's path)."""
    paths = []
    for dirfd, rel in re.findall(r'(?:(?:AT_FDCWD|\d+)<([^>]*)>, )?"((?:[^"\\]|\\.)*)"', args):
        if call in ("symlink", "symlinkat") and not paths and not dirfd:
            paths.append("")  # the link's target is not written
            continue
        paths.append(rel if rel.startswith("/") else os.path.normpath(os.path.join(dirfd or "/", rel)))
    if not paths:  # a call on a descriptor (utimensat(fd, NULL, ...), fchmod, ...)
        m = re.match(r"\d+<([^>]*)>", args)
        if m:
            paths.append(m.group(1))
    return [p for p in paths if p]


# ------------------------------------------------------------------ the test


def _make_certificates(tmp_path: pathlib.Path) -> pathlib.Path:
    """The documented commands (docs/DEPLOY.md): the server's and the gateway's."""
    for cn in ("/CN=sos-server", "/CN=sos-gateway"):
        subprocess.run(
            ["bash", "-c", documented_line("openssl req", cn)],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            timeout=120,
        )
    return tmp_path / "deploy" / "tls"


class _Client:
    """HTTPS to the gateway, trusting exactly its certificate (per request: the
    environment's REQUESTS_CA_BUNDLE would beat a session's verify)."""

    def __init__(self, url: str, key: str, namespace: str, ca: str) -> None:
        self.ca = ca
        r = requests.post(
            url + "/oauth2/token",
            verify=ca,
            timeout=60,
            data={"grant_type": "client_credentials", "client_id": namespace, "client_secret": key},
        )
        assert r.status_code == 200, r.text
        self.headers = {"Authorization": f"Bearer {r.json()['access_token']}"}

    def __getattr__(self, method: str):
        def call(url: str, **kwargs):
            return requests.request(method.upper(), url, headers=self.headers, verify=self.ca, timeout=60, **kwargs)

        return call


def _status(proc: psutil.Process) -> dict[str, str]:
    with open(f"/proc/{proc.pid}/status", encoding="utf-8") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _mount_flags(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            out[fields[4]] = fields[5].split(",")[0]
    return out


@pytest.fixture
def sandboxes():
    """Every Sandboxed of a test: killed at the end if still running (a failed test)."""
    boxes: list[Sandboxed] = []
    yield boxes
    for box in boxes:
        box.kill()


def test_gateway_runs_unprivileged_on_a_read_only_root_as_the_deployment_says(
    tmp_path, open_to_others, sos_server_factory, sandboxes
):
    tls = _make_certificates(tmp_path)
    srv = sos_server_factory(args=["--tls-cert", tls / "tls.crt", "--tls-key", tls / "tls.key"], start=False)
    pod0 = one(k8s_documents("sos-gateway.yaml"), "Deployment")["spec"]["template"]["spec"]
    argv0 = pod0["containers"][0]["args"]
    assert argv0[:2] == ["sos", "gateway"]
    namespace = argv0[2]
    writer_key = srv.keygen(namespace, "append")
    job_key = srv.keygen(namespace, "token")  # the shipped job credential: gateway-only
    srv.start()
    journal_key = secrets_module.token_hex(32)  # the namespace's (docs/DEPLOY.md "The journal key")
    secrets = {
        "sos-tls": {"tls.crt": (tls / "tls.crt").read_bytes(), "tls.key": (tls / "tls.key").read_bytes()},
        "sos-gateway-tls": {
            "tls.crt": (tls / "gateway.crt").read_bytes(),
            "tls.key": (tls / "gateway.key").read_bytes(),
        },
        "sos-gateway-key": {"key": writer_key.encode() + b"\n"},
        "sos-journal-key": {"key": journal_key.encode() + b"\n"},  # the journal key
    }
    open_to_others(tmp_path)
    gw_ca = str(tls / "gateway.crt")
    runs = []

    def start(name: str) -> tuple[Pod, Sandboxed, str]:
        pod = Pod(tmp_path / name, secrets)
        c = pod.container
        argv = [os.path.join(os.path.dirname(sys.executable), "sos"), *[pod.map_arg(a) for a in c["args"][1:]]]
        listen = option(argv, "--listen")
        assert listen.startswith("0.0.0.0:")
        argv[argv.index(listen)] = "127.0.0.1:0"  # a free port here
        # redirects name the Service the certificate holds, never the pod's address; here the
        # listen address stands in for it (a kernel-chosen port cannot be advertised ahead)
        advertise = option(argv, "--advertise")
        assert advertise == f"sos-gateway.sos.svc:{listen.rsplit(':', 1)[1]}", advertise
        i = argv.index("--advertise")
        del argv[i : i + 2]
        server = pod.environment()["SOS_SERVER"]
        assert server.split(":")[0] == "sos-server"
        env = pod.environment(SOS_SERVER=f"localhost:{srv.host_port[1]}")  # the cert's name here
        cache = option(argv, "--cache")
        # an emptyDir belongs to root: the gateway makes its own (0700) directory inside
        assert any(cache.startswith(str(d) + "/") for d in pod.empty_dirs), cache
        box = Sandboxed(tmp_path, name, argv, env, pod.empty_dirs, pod.fs_group, sandboxes)
        url = box.wait_ready()
        runs.append((pod, box))
        return pod, box, url

    # ---- first gateway: serves, writes, flushes on SIGTERM
    pod, box, url = start("gateway-1")
    proc = box.target()
    st = _status(proc)
    assert st["Uid"].split() == [str(UID)] * 4 and st["Gid"].split() == [str(UID)] * 4
    assert st["Groups"].split() == [str(pod.fs_group)]
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[cap], 16) == 0, (cap, st[cap])
    assert st["NoNewPrivs"] == "1"
    flags = _mount_flags(proc.pid)
    assert flags["/"] == "ro"
    for d in pod.empty_dirs:
        assert flags[str(d)] == "rw"

    # the probes of the manifest: TCP (startup, readiness), the health check (liveness)
    port = urllib.parse.urlsplit(url).port
    c = pod.container
    assert c["startupProbe"]["tcpSocket"]["port"] == c["readinessProbe"]["tcpSocket"]["port"] == "webhdfs"
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["webhdfs"] == int(
        option(c["args"], "--listen").rsplit(":", 1)[1]
    )
    probe = c["livenessProbe"]["exec"]["command"]
    assert probe[0] == "python"
    image_files = dockerfile_copies()
    probe_argv = [sys.executable, str(image_files[probe[1]]), *probe[2:]]
    health = Sandboxed(
        tmp_path,
        "liveness",
        probe_argv,
        pod.environment(SOS_HEALTH_ADDR=f"127.0.0.1:{port}"),
        pod.empty_dirs,
        pod.fs_group,
        sandboxes,
    )
    assert health.proc.wait(300) == 0, health.text()

    s = _Client(url, job_key, namespace, gw_ca)
    base = f"{url}/webhdfs/v1"
    r = s.put(f"{base}/checkpoint/offsets/.0.tmp?op=CREATE", allow_redirects=False)
    assert r.status_code == 307, r.text
    assert s.put(r.headers["Location"], data=b"v1\n{}\n").status_code == 201
    r = s.put(f"{base}/checkpoint/offsets/.0.tmp?op=RENAME&destination=/checkpoint/offsets/0")
    assert r.status_code == 200 and r.json() == {"boolean": True}, r.text
    r = s.post(f"{url}/sos/v1/marker?label=deploy-test", data=b"marker")
    assert r.status_code == 200, r.text
    assert s.get(f"{base}/checkpoint/offsets/0?op=OPEN").content == b"v1\n{}\n"
    proc.send_signal(signal.SIGTERM)
    assert box.proc.wait(300) == 0, box.text()[-4000:]  # strace exits with the gateway's status

    # ---- a new pod: empty cache, restored from the server before it listens
    pod2, box2, url2 = start("gateway-2")
    assert "rebuilt from the server" in box2.text()
    r = _Client(url2, job_key, namespace, gw_ca).get(f"{url2}/webhdfs/v1/checkpoint/offsets/0?op=OPEN")
    assert r.status_code == 200 and r.content == b"v1\n{}\n", r.text
    box2.target().send_signal(signal.SIGTERM)
    assert box2.proc.wait(300) == 0, box2.text()[-4000:]

    env = dict(os.environ, SOS_KEY=writer_key, SOS_JOURNAL_KEY=journal_key)  # what the gateway wrote with
    subprocess.run(
        [
            *sos_command(),
            "restore",
            "-q",
            "--server",
            f"localhost:{srv.host_port[1]}",
            "--tls-ca",
            str(tls / "tls.crt"),
            namespace,
            str(tmp_path / "restored"),
        ],
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
    )
    assert (tmp_path / "restored" / "checkpoint" / "offsets" / "0").read_bytes() == b"v1\n{}\n"

    # ---- what the gateways and the probe tried to write: their cache volume, nothing else
    allowed = tuple(str(d) for p, _ in runs for d in p.empty_dirs if p.mounts.get("/cache") == d)
    stray = []
    tmp_writes = []
    cache_writes = 0
    for p, b in [*runs, (pod, health)]:
        tmp_dir = p.mounts.get("/tmp")
        for call, path in b.writes():
            if path == "/dev/null":
                continue
            if any(path == a or path.startswith(a + "/") for a in allowed):
                cache_writes += 1
            elif tmp_dir is not None and path.startswith(str(tmp_dir) + "/"):
                tmp_writes.append((call, path))
            else:
                stray.append((call, path))
    assert cache_writes > 0, "the trace saw no write at all: is strace tracing?"
    assert stray == [], f"writes outside the volumes: {stray[:20]}"
    assert tmp_writes == [], f"writes in TMPDIR (an emptyDir, allowed, but DEPLOY.md says none): {tmp_writes[:20]}"


def test_image_env_keeps_python_from_writing_and_the_trace_would_see_it(tmp_path, open_to_others, sandboxes):
    """The check above is not vacuous: in the same sandbox, Python without the image's
    PYTHONDONTWRITEBYTECODE tries to write a __pycache__ (EROFS, silently), and a write to
    /tmp fails; both show up in the trace. With the image's environment neither happens."""
    mod = tmp_path / "code"
    mod.mkdir()
    (mod / "fresh_module.py").write_text("VALUE = 1\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o777)
    open_to_others(mod)
    script = (
        "import errno, fresh_module\n"
        "try:\n    open('/tmp/sos-ro-probe', 'w')\n"
        "except OSError as exc:\n    print(errno.errorcode[exc.errno])\n"
    )

    def run(name: str, env: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
        env = dict(env, PYTHONPATH=str(mod), PATH="/usr/bin:/bin", HOME="/nonexistent")
        box = Sandboxed(tmp_path, name, [sys.executable, "-c", script], env, [cache], UID, sandboxes)
        assert box.proc.wait(300) == 0, box.text()
        return box.text().strip(), [w for w in box.writes() if w[1] != "/dev/null"]

    out, writes = run("without-image-env", {})
    assert out == "EROFS"  # the root filesystem is read-only, also for /tmp
    assert ("openat", "/tmp/sos-ro-probe") in writes
    assert any("__pycache__" in path for _, path in writes), writes

    image_env = dockerfile_env()
    assert image_env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert image_env.get("TMPDIR") == "/tmp"
    out, writes = run("image-env", image_env)
    assert out == "EROFS"
    assert writes == [("openat", "/tmp/sos-ro-probe")]  # no __pycache__ attempt at all


def test_dockerfile_prepares_a_read_only_gateway():
    from tests.deploy.support import dockerfile_final_stage

    final = dockerfile_final_stage()
    runs = " ".join(a for i, a in final if i == "RUN")
    assert "compileall" in runs  # byte-compiled once: nothing to compile on a read-only root
    exposed = " ".join(a for i, a in final if i == "EXPOSE").split()
    gateway = one(k8s_documents("sos-gateway.yaml"), "Deployment")["spec"]["template"]["spec"]
    port = option(gateway["containers"][0]["args"], "--listen").rsplit(":", 1)[1]
    assert port in exposed
    user = [a for i, a in final if i == "USER"][-1].split(":")[0]
    assert user == str(gateway["securityContext"]["runAsUser"])
