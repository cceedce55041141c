"""The crash loop on a Spark standalone cluster checkpointing through ``sos gateway``
(``scripts/soak --cluster``): :class:`ClusterSoak`.

``--cluster`` runs the same query, input, sink and check on a Spark standalone cluster
(:mod:`tools.cluster`: a Master, two Workers of one core and the driver, each a node with a
private local disk) whose checkpoint goes through ``sos gateway`` (``webhdfs://``, Hadoop's
retry policy) to the sos-server, and kills the gateway (restarted on the same port, on the
same cache or on an empty one), the server, the server's disk, one executor JVM, a Worker with its executors
(replaced by a new node), the driver (the query restarts in a new one), or everything at
once (every process and local directory including the gateway's cache; a new cluster, a
gateway on an empty cache, before it sometimes ``sos restore``).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

from tools import child_env
from tools.demo_common import CHECKPOINT
from tools.soak.checks import GatewayView, source_offset
from tools.soak.common import CLUSTER_KINDS, GATEWAY_EMPTY_CACHE, NAMESPACE, HarnessError
from tools.soak.harness import Soak


def pick_port() -> int:
    """A free port below the usual ephemeral range (so no outgoing connection takes it
    while the server is down)."""
    rnd = random.SystemRandom()
    for _ in range(200):
        port = rnd.randrange(20000, 32000)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise HarnessError("no free port")


class ClusterSoak(Soak):
    """The crash loop on a Spark standalone cluster (``tools.cluster``: a Master, two Workers
    of one core, the driver, each on a node of its own) that checkpoints through
    ``sos gateway`` (a child process outside the nodes) to the real ``sos-server``.

    Kill events:

    - ``gateway``: SIGKILL the gateway, restart it on the same port, on the same cache or
      (sometimes) on an EMPTY one that it restores from the server; the query rides through
      on Hadoop's retry policy (``gateway_conf``) and, for a body cut by the kill, the
      ride-through FileSystem's resend (``gateway_checkpoint``); a query that stops anyway
      is counted against the kill before it (``stopped_queries`` in SOAK-RESULT);
    - ``server``: SIGKILL the sos-server (restarted on the same port and data);
    - ``executor``: SIGKILL one executor JVM only; its Worker launches a new one;
    - ``worker``: SIGKILL a Worker and its executors and unmount its node's local disk; a
      replacement node registers with the Master;
    - ``driver``: SIGKILL the driver node (Spark's application ends, its executors with it);
      a new driver restarts the query from the checkpoint;
    - ``disk``: the server's disk lost: the server SIGKILLed and its data directory
      deleted, a replacement on an empty one rebuilds from the tier's bucket
      (:meth:`Soak.kill_server_disk`);
    - ``all``: every process (driver, Workers, executors, Master, gateway, server) and every
      local directory including the gateway's cache; a new cluster, then either
      ``sos restore`` into a fresh directory (checked) and a gateway on an empty cache, or
      directly a gateway on an empty cache; a new driver resumes the query.

    The check after every restart reads the checkpoint through the gateway (what Spark
    sees); after an ``sos restore``, the restored directory too.
    """

    KINDS = CLUSTER_KINDS
    CHEAP = ("gateway", "server")
    MODE = "cluster"
    EARLY_DRIVER = False

    def __init__(self, **kw) -> None:
        kw["standby"] = False  # a spare application would queue for the cluster's cores
        super().__init__(**kw)
        self.cluster = None
        self.cluster_n = 0
        self.gateway = None
        self.gateway_n = 0
        self.gateway_port = 0
        self.gateway_cache = ""
        self.gateway_url = ""
        self.processes_killed.update(gateway=0, worker=0, executor=0, master=0)
        self.gateway_restarts = {"same-cache": 0, "empty-cache": 0}
        self._last_peek = 0.0
        self.worker_starts = 0
        #: log every gateway request (--gateway-debug; big logs, for a diagnosis)
        self.gateway_debug = bool(os.environ.get("SOS_SOAK_GATEWAY_DEBUG"))
        del self.processes_killed["mount"]

    # ------------------------------------------------------------------ parts
    def setup(self) -> None:
        self.start_gateway(empty=True)
        self.say(f"sos gateway on {self.gateway_url} (cache {self.gateway_cache})")
        self.start_cluster()
        self.say(f"Spark cluster: Master {self.cluster.master_url}, 2 Workers of 1 core")

    def checkpoint(self) -> str:
        from spark_plugin.spark import webhdfs_url

        return webhdfs_url(self.gateway_url, CHECKPOINT)

    def view(self):
        return GatewayView(self.gateway_url, NAMESPACE, self.key, CHECKPOINT)

    def start_gateway(self, *, empty: bool) -> float:
        """``sos gateway`` on its fixed port; ``empty``: on a new, empty cache directory."""
        from spark_plugin.gateway.process import GatewayProcess

        if empty:
            if self.gateway_cache:
                shutil.rmtree(self.gateway_cache, ignore_errors=True)
            self.gateway_cache = os.path.join(self.work, f"gw-cache{self.gateway_n + 1}")
        if not self.gateway_port:
            self.gateway_port = pick_port()
        deadline = time.monotonic() + 300
        t = time.monotonic()
        while True:
            self.gateway_n += 1
            gw = GatewayProcess(
                NAMESPACE,
                self.gateway_cache,
                self.server.address,
                self.key,
                listen=f"127.0.0.1:{self.gateway_port}",
                start_timeout=300,
                debug=self.gateway_debug,
                log_path=os.path.join(self.paths["logs"], f"gateway{self.gateway_n}.log"),
                durability=self.durability,
            )
            try:
                gw.start()
                break
            except RuntimeError as exc:  # e.g. the port still taken for a moment
                if time.monotonic() > deadline:
                    raise HarnessError(f"sos gateway #{self.gateway_n} did not start: {str(exc)[-1500:]}") from exc
                time.sleep(0.5)
        self.gateway = gw
        self.gateway_url = gw.url
        return time.monotonic() - t

    def kill_gateway_only(self) -> None:
        if self.gateway is not None and self.gateway.proc.poll() is None:
            self.gateway.kill()
            self.processes_killed["gateway"] += 1

    def start_cluster(self) -> None:
        from tools.cluster import SparkCluster

        self.cluster_n += 1
        self.cluster = SparkCluster(
            os.path.join(self.work, f"cluster{self.cluster_n}"), workers=2, cores=1, env=child_env()
        )
        try:  # the Workers register while the next driver starts (_spawn_driver waits for them)
            self.cluster.start(timeout=300, wait=False)
        except Exception as exc:
            raise HarnessError(f"the Spark cluster did not start: {exc}") from exc
        self.worker_starts += 2

    def _spawn_driver(self) -> tuple[subprocess.Popen, str]:
        """A driver on a node of its own of the current cluster."""
        ctl, cfg_path = self._driver_config(
            spark_conf=self.cluster.spark_conf(), gateway={"url": self.gateway_url, "namespace": NAMESPACE}
        )
        node = self.cluster.start_driver(
            [sys.executable, "-m", "tools.soak", "_driver", cfg_path],
            env=child_env(dict(os.environ, SOS_KEY=self.key)),
            name=f"driver{self.driver_n}",
        )
        try:  # a new cluster's Workers, spawned side by side with this driver's start
            self.cluster.wait_workers(timeout=300)
        except Exception as exc:
            raise HarnessError(f"the Spark cluster's Workers did not start: {exc}") from exc
        return node.proc, ctl

    def executors(self) -> list:
        out = []
        for w in self.cluster.workers:
            if w is not None and w.alive():
                out.extend(w.executors())
        return out

    # ------------------------------------------------------------------ events
    def handlers(self) -> dict:
        return {
            "gateway": self.kill_gateway,
            "server": self.kill_server,
            "executor": self.kill_executor,
            "worker": self.kill_worker,
            "driver": self.kill_driver_event,
            "all": self.kill_all,
            "disk": self.kill_server_disk,
        }

    def writer_pid(self) -> int:
        """The journal's writer here is the gateway."""
        return self.gateway.pid

    def kill_gateway(self) -> str:
        pid = self.gateway.pid
        empty = self.rng.random() < GATEWAY_EMPTY_CACHE
        outage = self.rng.uniform(0.0, 1.5)
        self.kill_gateway_only()
        time.sleep(outage)
        took = self.start_gateway(empty=empty)
        self.gateway_restarts["empty-cache" if empty else "same-cache"] += 1
        verdict = self.check(self.view(), "after a gateway kill")
        return (
            f"gateway pid {pid} SIGKILLed, down {outage:.1f}s, restarted on the same port "
            f"on {'an EMPTY' if empty else 'the same'} cache in {took:.1f}s; "
            f"check: {verdict}"
        )

    def kill_executor(self) -> str:
        # an executor exists unless one is being relaunched: wait for one (pumping)
        i = self.rng.randrange(self.cluster.n_workers)
        deadline = time.monotonic() + self.stall_timeout
        while True:
            w = self.cluster.workers[i]
            execs = w.executors() if w is not None and w.alive() else []
            if not execs:
                execs = self.executors()
            if execs:
                break
            if time.monotonic() > deadline:
                raise HarnessError(f"no executor running for {self.stall_timeout:.0f}s")
            self.pump()
            time.sleep(0.2)
        victim = execs[0]
        pid = victim.pid
        try:
            victim.send_signal(signal.SIGKILL)
            self.processes_killed["executor"] += 1
        except Exception:
            pass
        verdict = self.check(self.view(), "after an executor kill")
        return f"executor JVM pid {pid} SIGKILLed (its Worker relaunches one); check: {verdict}"

    def kill_worker(self) -> str:
        i = self.rng.randrange(self.cluster.n_workers)
        node = self.cluster.workers[i]
        n_exec = len(node.executors()) if node is not None else 0
        self.cluster.kill_worker(i)
        self.processes_killed["worker"] += 1
        self.processes_killed["executor"] += n_exec
        verdict = self.check(self.view(), "after a worker kill")
        t = time.monotonic()
        try:
            self.cluster.start_worker(i, timeout=300)
        except Exception as exc:
            raise HarnessError(f"replacement worker {i} did not start: {exc}") from exc
        self.worker_starts += 1
        return (
            f"worker {i} (pid {node.proc.pid}, {n_exec} executor) SIGKILLed with its node's "
            f"disk; check: {verdict}; a new worker node registered in "
            f"{time.monotonic() - t:.1f}s"
        )

    def kill_all(self) -> str:
        mode = self.rng.choice(("sos-restore", "empty-cache"))
        order = ["server", "gateway", "cluster"]
        self.rng.shuffle(order)
        self.kill_in_order(order, {"gateway": self.kill_gateway_only, "cluster": self.kill_cluster})
        self.driver = None
        # every local directory: each node's disk (a tmpfs in its mount namespace) went with
        # its last process (the cluster's base directory holds only the harness's logs); the
        # gateway's cache and spool go here
        shutil.rmtree(self.gateway_cache, ignore_errors=True)
        self.server.start()
        detail = self.restore_after_total_loss(mode)
        took = self.start_gateway(empty=True)
        verdict = self.check(self.view(), "after a total loss, through the rebuilt gateway")
        detail += f"gateway on an EMPTY cache rebuilt it in {took:.1f}s; check: {verdict}"
        t = time.monotonic()
        self.start_cluster()
        detail += f"; a new cluster in {time.monotonic() - t:.1f}s"
        how = self.start_driver()
        return f"SIGKILL {'+'.join(order)}, every local directory deleted; {detail}; query on {how}"

    def kill_cluster(self) -> None:
        """SIGKILL every node: the driver, the Workers with their executors, the Master."""
        c = self.cluster
        if self.driver is not None and self.driver.poll() is None:
            self.processes_killed["driver"] += 1
        for w in c.workers:
            if w is not None and w.alive():
                self.processes_killed["worker"] += 1
                self.processes_killed["executor"] += len(w.executors())
        if c.master is not None and c.master.alive():
            self.processes_killed["master"] += 1
        c.stop()

    # ------------------------------------------------------------------ supervision
    def peek(self) -> None:
        """No acknowledged batch for a while: look at the checkpoint through the gateway. A
        batch whose acknowledgement the driver could not make (the gateway was down when
        its listener asked for ``commits/N``) still consumed its input; the harness feeds
        on from there (the RPO-0 baseline stays the acknowledged batches)."""
        now = time.monotonic()
        if now - self.last_progress_t < 15 or now - self._last_peek < 15:
            return
        self._last_peek = now
        try:
            view = self.view()
            commits = view.commits()
            if commits:
                self.seen_files = max(self.seen_files, source_offset(view, max(commits)) + 1)
        except Exception as exc:
            self.say(f"peek at the checkpoint failed: {exc!r:.200}")

    def supervise(self) -> bool:
        self.peek()
        if self.gateway is not None and self.gateway.proc.poll() is not None:
            rc = self.gateway.proc.returncode
            self.unexpected.append(f"t={self.elapsed():.0f}s: sos gateway #{self.gateway_n} exited by itself ({rc})")
            self.say(
                f"UNEXPECTED: sos gateway #{self.gateway_n} exited ({rc}); see "
                f"{self.gateway.log_path}; restarting it on the same cache"
            )
            self.start_gateway(empty=False)
            return True
        c = self.cluster
        if c is not None and c.master is not None and not c.master.alive():
            raise HarnessError(f"the Spark Master exited by itself; see {c.master.log_path}")
        if c is not None:
            for i, w in enumerate(c.workers):
                if w is not None and not w.alive():
                    self.unexpected.append(
                        f"t={self.elapsed():.0f}s: worker {i} exited by itself ({w.proc.returncode})"
                    )
                    self.say(f"UNEXPECTED: worker {i} exited; see {w.log_path}; replacing it")
                    c.start_worker(i, timeout=300)
                    self.worker_starts += 1
                    return True
        return False

    def finish(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        if self.gateway is not None:
            rc = self.gateway.stop()
            if rc not in (0, None):
                self.unexpected.append(f"final clean gateway stop exited {rc}")
            self.gateway = None

    def summary(self) -> dict:
        out = super().summary()
        out.update(
            mode="cluster",
            gateway_starts=self.gateway_n,
            gateway_restarts=dict(self.gateway_restarts),
            worker_starts=self.worker_starts,
            clusters=self.cluster_n,
        )
        return out

    def cleanup(self) -> None:
        try:
            if self.cluster is not None:
                self.cluster.stop()
        finally:
            if self.gateway is not None:
                self.gateway.kill()
                self.gateway = None
            super().cleanup()
