"""Build SOS's image with podman where no registry is reachable (issue 21).

    python -m tools.container build [--tag localhost/sos:0.1.0] [--rebuild-base]
    python -m tools.container conf          # print the containers.conf this machine needs

The Dockerfile's base (``ARG PYTHON_IMAGE``, python:3.11-slim-bookworm from a registry) is
replaced by a stand-in made here, once, and reused from podman's local storage after that:

1. ``localhost/debian:bookworm``: ``debootstrap --variant=minbase bookworm ROOTFS MIRROR``
   (the mirror apt already uses, read from /etc/apt/sources.list*), then
   ``tar -C ROOTFS -c . | podman import - localhost/debian:bookworm``;
2. ``localhost/python:3.11-slim-bookworm``: Debian's python3 (3.11) with a virtual
   environment at /usr/local, which gives the official image's layout: ``python`` and
   ``pip`` in /usr/local/bin, site-packages in /usr/local/lib/python3.11, pip free to
   install there (no PEP 668 "externally managed" refusal);
3. the image: ``podman build --format docker`` (podman keeps HEALTHCHECK only in the docker
   format) ``--build-arg PYTHON_IMAGE=localhost/python:3.11-slim-bookworm``, with the
   host's CA bundle bind-mounted read-only into the RUN steps (pip and apt reach their
   indexes through it; it is never copied into a layer) and the host's network.

Podman here runs rootful with runc (crun 1.8 refuses some VMs' cgroup layouts) and with
ulimits no higher than the host's hard limits (podman's own defaults are higher and fail):
``engine_env()`` writes a containers.conf saying both and returns the environment that
points podman at it (CONTAINERS_CONF), so ``podman kube play`` gets them too.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"localhost/sos:{VERSION}"
DEBIAN = "localhost/debian:bookworm"
PYTHON = "localhost/python:3.11-slim-bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # an imported rootfs has none
STATE = pathlib.Path(os.environ.get("SOS_CONTAINER_STATE", "/var/tmp/sos-container"))

# the stand-in for python:3.11-slim-bookworm (only Debian's packages). docker-clean: what
# Debian's official images set, so that apt leaves no package caches (~80 MB) in a layer
PYTHON_CONTAINERFILE = f"""\
FROM {DEBIAN}
RUN printf '%s\\n' 'DPkg::Post-Invoke {{ "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; }};' \\
        'APT::Update::Post-Invoke {{ "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; }};' \\
        'Dir::Cache::pkgcache ""; Dir::Cache::srcpkgcache "";' > /etc/apt/apt.conf.d/docker-clean \\
    && apt-get update \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \\
    && python3 -m venv /usr/local \\
    && /usr/local/bin/python -m pip --version \\
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /root/.cache
ENV PATH={PATH} \\
    LANG=C.UTF-8
LABEL sos.base-recipe={{recipe}}
CMD ["python3"]
"""


def ca_bundle() -> str:
    """The host's CA bundle ($PIP_CERT, else Debian's), for pip and apt inside RUN steps."""
    for path in (os.environ.get("PIP_CERT"), "/etc/ssl/certs/ca-certificates.crt"):
        if path and os.path.isfile(path):
            return path
    raise SystemExit("container: no CA bundle ($PIP_CERT or /etc/ssl/certs/ca-certificates.crt)")


def _pid_max() -> int:
    try:
        return int(pathlib.Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 32768


def host_ulimits() -> dict[str, int]:
    """The host's hard limits: a container may not ask for more (and, here, for no more
    processes than kernel.pid_max: runc's setrlimit is refused above it)."""
    return {
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        "nproc": min(resource.getrlimit(resource.RLIMIT_NPROC)[1], _pid_max()),
    }


def ulimit_args() -> list[str]:
    """``--ulimit`` options at the host's hard limits (podman build does not apply
    containers.conf's default_ulimits to RUN steps)."""
    return [f"{name}={n}:{n}" for name, n in host_ulimits().items() if n != resource.RLIM_INFINITY]


def containers_conf() -> str:
    limits = ulimit_args()
    return (
        "[containers]\n"
        f"default_ulimits = [{', '.join(repr(x).replace(chr(39), chr(34)) for x in limits)}]\n"
        "[engine]\n"
        'runtime = "runc"\n'
        'cgroup_manager = "cgroupfs"\n'
        'events_logger = "file"\n'
    )


def engine_env(state: pathlib.Path = STATE) -> dict[str, str]:
    """os.environ plus CONTAINERS_CONF naming a containers.conf for this machine."""
    state.mkdir(parents=True, exist_ok=True)
    conf = state / "containers.conf"
    text = containers_conf()
    if not conf.exists() or conf.read_text() != text:
        conf.write_text(text)
    return dict(os.environ, CONTAINERS_CONF=str(conf))


def podman(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, check: bool = True, **kw
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["podman", *args], env=env or engine_env(), text=True, capture_output=True, timeout=timeout, check=False, **kw
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"podman {' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
        )
    return proc


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


def apt_mirror() -> str:
    """The Debian mirror apt uses here (sources.list one-line or deb822 format)."""
    files = [pathlib.Path("/etc/apt/sources.list"), *sorted(pathlib.Path("/etc/apt/sources.list.d").glob("*"))]
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text(errors="replace")
        for stanza in re.split(r"\n\s*\n", text):
            suites = re.search(r"^Suites:\s*(.*)$", stanza, re.M)
            uris = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
            if suites and uris and "bookworm" in suites.group(1).split():
                return uris.group(1)
        for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", text, re.M):
            return m.group(1)
    return DEFAULT_MIRROR


def _log(msg: str) -> None:
    print(f"container: {msg}", file=sys.stderr, flush=True)


def build_debian(env: dict[str, str]) -> float:
    """localhost/debian:bookworm from debootstrap; seconds taken."""
    t0 = time.monotonic()
    mirror = apt_mirror()
    _log(f"debootstrap --variant=minbase bookworm from {mirror}")
    with tempfile.TemporaryDirectory(prefix="sos-rootfs-", dir="/var/tmp") as tmp:
        rootfs = os.path.join(tmp, "rootfs")
        proc = subprocess.run(
            ["debootstrap", "--variant=minbase", "bookworm", rootfs, mirror],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError("debootstrap failed:\n" + (proc.stdout + proc.stderr)[-4000:])
        # the same sources the host uses, and no leftovers of debootstrap's own downloads
        shutil.rmtree(os.path.join(rootfs, "var/cache/apt/archives"), ignore_errors=True)
        os.makedirs(os.path.join(rootfs, "var/cache/apt/archives/partial"), exist_ok=True)
        shutil.rmtree(os.path.join(rootfs, "var/lib/apt/lists"), ignore_errors=True)
        os.makedirs(os.path.join(rootfs, "var/lib/apt/lists/partial"), exist_ok=True)
        tar = subprocess.Popen(["tar", "-C", rootfs, "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        try:
            imp = subprocess.run(
                ["podman", "import", "--change", f"ENV PATH={PATH}", "--change", 'CMD ["bash"]', "-", DEBIAN],
                stdin=tar.stdout,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise RuntimeError("podman import failed:\n" + imp.stderr[-4000:])
    return time.monotonic() - t0


def _build(
    env: dict[str, str], tag: str, context: str, *extra: str, containerfile: str | None = None, mount_ca: bool = True
) -> None:
    args = [
        "build",
        "--format",
        "docker",
        "--network",
        "host",
        *(x for lim in ulimit_args() for x in ("--ulimit", lim)),
        *extra,
        "-t",
        tag,
    ]
    if mount_ca:  # over the base's own bundle, for this build's RUN steps only
        args[1:1] = ["-v", f"{ca_bundle()}:/etc/ssl/certs/ca-certificates.crt:ro"]
    if containerfile is not None:
        args += ["-f", "-"]
    podman(*args, context, env=env, timeout=1800, input=containerfile)


def _recipe() -> str:
    return hashlib.sha256(PYTHON_CONTAINERFILE.encode()).hexdigest()[:16]


def python_base_current() -> bool:
    """The stand-in base is in local storage and made by this PYTHON_CONTAINERFILE."""
    r = podman("image", "inspect", "--format", '{{index .Labels "sos.base-recipe"}}', PYTHON, check=False)
    return r.returncode == 0 and r.stdout.strip() == _recipe()


def build_python(env: dict[str, str]) -> float:
    t0 = time.monotonic()
    _log(f"building {PYTHON} from {DEBIAN} (Debian's python3)")
    with tempfile.TemporaryDirectory(prefix="sos-pybase-") as ctx:
        # no bundle mounted: ca-certificates (pip's dependency) writes its own bundle here
        _build(env, PYTHON, ctx, containerfile=PYTHON_CONTAINERFILE.replace("{recipe}", _recipe()), mount_ca=False)
    return time.monotonic() - t0


def build_image(tag: str = IMAGE, *, rebuild_base: bool = False, env: dict[str, str] | None = None) -> dict[str, float]:
    """Build the image (and, when missing, its stand-in base); the seconds of each step
    (0.0 for a base reused from local storage)."""
    env = env or engine_env()
    times = {"debian": 0.0, "python": 0.0, "image": 0.0}
    if rebuild_base or not python_base_current():
        if rebuild_base or not image_exists(DEBIAN):
            times["debian"] = build_debian(env)
        times["python"] = build_python(env)
    t0 = time.monotonic()
    _log(f"podman build {tag} (PYTHON_IMAGE={PYTHON})")
    _build(env, tag, str(ROOT), "--build-arg", f"PYTHON_IMAGE={PYTHON}")
    times["image"] = time.monotonic() - t0
    return times


def image_size(tag: str = IMAGE) -> int:
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.container", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the image (and its stand-in base when missing)")
    b.add_argument("--tag", default=IMAGE)
    b.add_argument("--rebuild-base", action="store_true", help="debootstrap the base again")
    sub.add_parser("conf", help="print the containers.conf this machine needs")
    args = p.parse_args(argv)
    if args.cmd == "conf":
        print(containers_conf(), end="")
        return 0
    times = build_image(args.tag, rebuild_base=args.rebuild_base)
    size = image_size(args.tag)
    print(f"{args.tag}: {size / 1e6:.0f} MB; seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
