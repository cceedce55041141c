"""A Spark standalone cluster on one machine whose nodes share no local directory.

Each node (the Master, every Worker with the executors it launches, and the driver) runs in
its own mount namespace (``unshare --mount --propagation private``) with a private tmpfs
mounted on the same path, ``NODE_ROOT``: what one node writes to its local disk (executor
work dirs, shuffle and state-store scratch files, a ``file://`` checkpoint) no other node
can see, and killing a node and unmounting its tmpfs loses it, as losing a machine does.
The network stays shared (everything listens on 127.0.0.1).

Used by the cluster tests, the cluster demo and the crash loop:

    with SparkCluster(base, workers=2) as cluster:
        cluster.start()
        drv = cluster.start_driver([python, "-m", "tools.demo", "_driver", cfg])
        cluster.kill_worker(0)          # SIGKILL the Worker and its executors
        cluster.start_worker(0)         # a new node in its place (empty local disk)

Needs root (mount namespaces and tmpfs) and the ``unshare`` command (util-linux).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil

from tools.jvm import spark_jvm_options

#: the path every node sees as its own local disk (a private tmpfs in its namespace)
NODE_ROOT = "/tmp/sos-node"

#: the daemons' and executors' JVMs: C1 only, serial GC, the class-data archive (tools/jvm.py)
_JVM_LIGHT = spark_jvm_options()


class ClusterError(Exception):
    pass


def spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def can_isolate_nodes() -> str | None:
    """None if nodes can be isolated here, else the reason why not."""
    if os.geteuid() != 0:
        return "mount namespaces and tmpfs mounts need root"
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    return None


def node_command(argv: list[str], tmpfs_mb: int = 2048) -> list[str]:
    """``argv`` run in a new mount namespace with a private tmpfs on NODE_ROOT."""
    script = (
        f"mkdir -p {NODE_ROOT} && mount -t tmpfs -o size={tmpfs_mb}m,mode=1777 sos-node {NODE_ROOT}"
        f' && mkdir -p {NODE_ROOT}/work {NODE_ROOT}/local {NODE_ROOT}/tmp && exec "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sos-node", *argv]


@dataclass
class Node:
    name: str
    proc: subprocess.Popen
    log_path: str
    extra: dict = field(default_factory=dict)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the node's whole process tree (a Worker's executors are its children)."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired as exc:  # pragma: no cover - the kernel reaps it
            raise ClusterError(f"{self.name} did not die") from exc
        psutil.wait_procs(procs, timeout=30)

    def executors(self) -> list[psutil.Process]:
        """The executor JVMs this Worker launched (CoarseGrainedExecutorBackend)."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        out = []
        for k in kids:
            try:
                if any("CoarseGrainedExecutorBackend" in a for a in k.cmdline()):
                    out.append(k)
            except psutil.NoSuchProcess:
                continue
        return out


class SparkCluster:
    """A standalone Master and ``workers`` Workers of ``cores`` cores each, on 127.0.0.1."""

    def __init__(
        self,
        base_dir: str,
        *,
        workers: int = 2,
        cores: int = 1,
        memory: str = "768m",
        env: dict[str, str] | None = None,
    ) -> None:
        self.base = base_dir
        self.n_workers = workers
        self.cores = cores
        self.memory = memory
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("SPARK_DAEMON_MEMORY", "256m")
        self.env.setdefault("SPARK_DAEMON_JAVA_OPTS", _JVM_LIGHT)
        self.env["SPARK_HOME"] = spark_home()
        self.env["PYSPARK_PYTHON"] = sys.executable
        self.env["SPARK_LOCAL_IP"] = "127.0.0.1"
        self.master: Node | None = None
        self.workers: list[Node | None] = [None] * workers
        self.drivers: list[Node] = []
        self._starting: list[Node] = []  # Workers spawned by start(wait=False), not yet registered
        self.master_port = free_port()
        os.makedirs(os.path.join(base_dir, "logs"), exist_ok=True)

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    # -- processes ---------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Node:
        log_path = os.path.join(self.base, "logs", f"{name}.log")
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(
                node_command(argv), stdout=log, stderr=subprocess.STDOUT, env=env or self.env, start_new_session=True
            )
        finally:
            log.close()
        return Node(name, proc, log_path)

    def _spark_class(self, cls: str, *args: str) -> list[str]:
        return [os.path.join(spark_home(), "bin", "spark-class"), cls, *args]

    def start(self, timeout: float = 120.0, *, wait: bool = True) -> None:
        """The Master, then the Workers side by side (each JVM's start-up is mostly one
        thread's work). ``wait``: until every Worker registered; else the caller calls
        :meth:`wait_workers` later (a driver can start meanwhile: it waits for executors)."""
        self.master = self._spawn(
            "master",
            self._spark_class(
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.master_port),
                "--webui-port",
                "0",
            ),
        )
        self._wait_log(self.master, "I have been elected leader", timeout)
        self._starting = [self._spawn_worker(i) for i in range(self.n_workers)]
        if wait:
            self.wait_workers(timeout)

    def wait_workers(self, timeout: float = 120.0) -> None:
        """Until the Workers :meth:`start` spawned registered with the Master."""
        nodes, self._starting = self._starting, []
        for node in nodes:
            self._wait_log(node, "Successfully registered with master", timeout)

    def start_worker(self, i: int, timeout: float = 120.0) -> Node:
        """(Re)start worker ``i`` and wait until it registered with the Master."""
        node = self._spawn_worker(i)
        self._wait_log(node, "Successfully registered with master", timeout)
        return node

    def _spawn_worker(self, i: int) -> Node:
        old = self.workers[i]
        if old is not None and old.alive():
            raise ClusterError(f"worker {i} is still running")
        node = self._spawn(
            f"worker{i}-{int(time.time() * 1000)}",
            self._spark_class(
                "org.apache.spark.deploy.worker.Worker",
                self.master_url,
                "--host",
                "127.0.0.1",
                "--webui-port",
                "0",
                "--cores",
                str(self.cores),
                "--memory",
                self.memory,
                "--work-dir",
                f"{NODE_ROOT}/work",
            ),
            env=dict(self.env, SPARK_LOCAL_DIRS=f"{NODE_ROOT}/local", TMPDIR=f"{NODE_ROOT}/tmp"),
        )
        self.workers[i] = node
        return node

    def kill_worker(self, i: int) -> None:
        node = self.workers[i]
        if node is not None:
            node.kill()

    def start_driver(self, argv: list[str], env: dict[str, str] | None = None, name: str = "driver") -> Node:
        """A driver process (e.g. ``python -m ...``) on a node of its own."""
        node = self._spawn(
            f"{name}-{int(time.time() * 1000)}", argv, env=dict(self.env, TMPDIR=f"{NODE_ROOT}/tmp", **(env or {}))
        )
        self.drivers.append(node)
        return node

    def spark_conf(self) -> dict[str, str]:
        """What a driver's SparkSession needs to run its executors on this cluster."""
        return {
            "spark.master": self.master_url,
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.executor.memory": "512m",
            "spark.executor.cores": str(self.cores),
            "spark.cores.max": str(self.cores * self.n_workers),
            "spark.executor.extraJavaOptions": _JVM_LIGHT,
            "spark.local.dir": f"{NODE_ROOT}/local",
            "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "2",
            # all nodes are 127.0.0.1: without this an executor reads another's shuffle files
            # straight from "its" disk, which in another mount namespace it cannot see
            "spark.shuffle.readHostLocalDisk": "false",
        }

    def stop(self) -> None:
        for node in [*self.drivers, *[w for w in self.workers if w], *([self.master] if self.master else [])]:
            if node.alive():
                node.kill()

    def __enter__(self) -> SparkCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _wait_log(node: Node, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(node.log_path, "rb") as f:
                if needle.encode() in f.read():
                    return
            if not node.alive():
                break
            time.sleep(0.2)
        with open(node.log_path, "rb") as f:
            tail = f.read()[-3000:].decode(errors="replace")
        raise ClusterError(f"{node.name}: no {needle!r} within {timeout:.0f}s\n{tail}")
