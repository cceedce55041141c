"""The cluster crash loop with a gateway pair (``scripts/soak --cluster --gateway-pair``):
:class:`PairSoak`, issue 22 item 5.

The query's checkpoint is ``webhdfs://<nameservice>/...`` over two gateways of the namespace
on two fixed ports (``gateway_checkpoint`` with both URLs): an active ``sos gateway --lease``
and a ``sos gateway --standby`` tailing the journal (protocol.md 3.6). Gateway events:

- ``gateway``: SIGKILL the ACTIVE gateway, sometimes with its cache (its node's disk); the
  standby takes over within the lease; the killed one comes back on its port as the new
  standby (an emptied cache is rebuilt from the server, a kept one has its spool moved aside);
- ``zombie`` (a split-brain attempt): SIGSTOP the active past its lease; the standby fences
  it and takes over; SIGCONT; the resumed gateway must refuse a write sent straight to it
  (StandbyException): a 2xx is a violation; then it is restarted as the new standby;
- ``standby``: SIGKILL the standby, restarted on its port (same or empty cache).

The other events are the cluster loop's (server, executor, worker, driver, all); ``disk``
is not run here (it freezes the writer past any lease, a failover the event does not expect).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time

from tools.demo_common import CHECKPOINT
from tools.soak.cluster_mode import ClusterSoak, pick_port
from tools.soak.common import CLUSTER_KINDS, GATEWAY_EMPTY_CACHE, NAMESPACE, HarnessError, Violation

#: --lease of both gateways (seconds)
LEASE = 5.0
PAIR_KINDS = (*tuple(k for k in CLUSTER_KINDS if k != "disk"), "zombie", "standby")
PAIR_WEIGHTS = {
    "gateway": 0.22,
    "zombie": 0.08,
    "standby": 0.06,
    "server": 0.12,
    "executor": 0.2,
    "worker": 0.14,
    "driver": 0.1,
    "all": 0.08,
}


class PairSoak(ClusterSoak):
    KINDS = PAIR_KINDS
    CHEAP = ("gateway", "server", "standby")
    MODE = "cluster-pair"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.ports: list[int] = []  # [active's, standby's]
        self.caches: list[str] = ["", ""]
        self.standby_gw = None
        self.processes_killed.update(standby=0)
        self.gateway_restarts.update(failovers=0, **{"split-brain-refused": 0})
        self.failover_s: list[float] = []

    # ------------------------------------------------------------------ parts
    def setup(self) -> None:
        self.start_gateway(empty=True)
        self.say(
            f"gateway pair: active {self.gateway.url}, standby {self.standby_gw.url} "
            f"(--lease {LEASE:g}s); the query on {self.checkpoint()}"
        )
        self.start_cluster()
        self.say(f"Spark cluster: Master {self.cluster.master_url}, 2 Workers of 1 core")

    def urls(self) -> str:
        return ",".join(f"http://127.0.0.1:{p}" for p in self.ports)

    def checkpoint(self) -> str:
        from spark_plugin.spark import nameservice_for, webhdfs_url

        return webhdfs_url(self.urls(), CHECKPOINT, nameservice=nameservice_for(NAMESPACE))

    def _start(self, slot: int, *, standby: bool, empty: bool):
        from spark_plugin.gateway.process import GatewayProcess

        if empty or not self.caches[slot]:
            if self.caches[slot]:
                shutil.rmtree(self.caches[slot], ignore_errors=True)
            self.caches[slot] = os.path.join(self.work, f"gw-cache{self.gateway_n + 1}")
        deadline = time.monotonic() + 300
        while True:
            self.gateway_n += 1
            args = ["--lease", f"{LEASE:g}"] + (["--standby"] if standby else [])
            gw = GatewayProcess(
                NAMESPACE,
                self.caches[slot],
                self.server.address,
                self.key,
                listen=f"127.0.0.1:{self.ports[slot]}",
                start_timeout=300,
                debug=self.gateway_debug,
                extra_args=args,
                durability=self.durability,
                log_path=os.path.join(
                    self.paths["logs"], f"gateway{self.gateway_n}{'-standby' if standby else ''}.log"
                ),
            )
            try:
                return gw.start()
            except RuntimeError as exc:
                if time.monotonic() > deadline:
                    raise HarnessError(f"sos gateway #{self.gateway_n} did not start: {str(exc)[-1500:]}") from exc
                time.sleep(0.5)

    def start_gateway(self, *, empty: bool) -> float:
        """Both gateways, from nothing (setup, after a total loss): the active on the first
        port, then the standby."""
        if not self.ports:
            self.ports = [pick_port(), pick_port()]
        t = time.monotonic()
        for g in (self.gateway, self.standby_gw):
            if g is not None:
                g.kill()
        self.gateway = self._start(0, standby=False, empty=empty)
        self.standby_gw = self._start(1, standby=True, empty=True)
        self.gateway_url = self.urls()
        return time.monotonic() - t

    def _swap(self) -> None:
        """The standby was promoted: it is the active now (slot 1 -> 0); the old active's
        port and cache (slot 0 -> 1) are the next standby's."""
        self.ports.reverse()
        self.caches.reverse()
        self.gateway, self.standby_gw = self.standby_gw, None

    def _promotions(self) -> int:
        return self.standby_gw.log().count("standby: promoted")

    def _wait_promoted(self, since: float, before: int) -> float:
        """Until the standby's log says it was promoted (it said so ``before`` times at
        ``since``); seconds from ``since``."""
        deadline = time.monotonic() + LEASE + 60
        while self._promotions() <= before:
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"the standby did not take over within {LEASE + 60:.0f}s; see {self.standby_gw.log_path}"
                )
            if self.standby_gw.proc.poll() is not None:
                raise HarnessError(
                    f"the standby exited ({self.standby_gw.proc.returncode}); see {self.standby_gw.log_path}"
                )
            self.pump()
            time.sleep(0.1)
        return time.monotonic() - since

    # ------------------------------------------------------------------ events
    def handlers(self) -> dict:
        return dict(super().handlers(), zombie=self.kill_zombie, standby=self.kill_standby)

    def kill_gateway(self) -> str:
        dead = self.gateway
        pid = dead.pid
        empty = self.rng.random() < GATEWAY_EMPTY_CACHE
        before = self._promotions()
        t = time.monotonic()
        self.gateway = None  # the supervisor must not restart it: the standby takes over
        dead.kill()
        self.processes_killed["gateway"] += 1
        if empty:
            shutil.rmtree(self.caches[0], ignore_errors=True)
        took = self._wait_promoted(t, before)
        self.failover_s.append(took)
        self.gateway_restarts["failovers"] += 1
        self._swap()
        self.standby_gw = self._start(1, standby=True, empty=empty)
        self.gateway_restarts["empty-cache" if empty else "same-cache"] += 1
        verdict = self.check(self.view(), "after the active gateway's kill")
        return (
            f"active gateway pid {pid} SIGKILLed{' with its cache' if empty else ''}; the "
            f"standby took over in {took:.1f}s; the killed one is the new standby; check: {verdict}"
        )

    def kill_zombie(self) -> str:
        """A split-brain attempt: pause the active past its lease, let the standby take over,
        resume it and send it a write of its own."""
        import requests

        zombie = self.gateway
        pid = zombie.pid
        url = f"http://127.0.0.1:{self.ports[0]}"
        token = requests.post(
            url + "/oauth2/token",
            data={"grant_type": "client_credentials", "client_id": NAMESPACE, "client_secret": self.key},
            timeout=60,
        )
        token.raise_for_status()
        h = {"Authorization": f"Bearer {token.json()['access_token']}"}
        before = self._promotions()
        t = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            took = self._wait_promoted(t, before)
        finally:
            self.gateway = None  # it stops by itself once it finds itself fenced (exit 3)
            os.kill(pid, signal.SIGCONT)
        self.failover_s.append(took)
        self.gateway_restarts["failovers"] += 1
        try:
            r = requests.put(f"{url}/webhdfs/v1/zombie-{self.gateway_n}?op=MKDIRS", headers=h, timeout=60)
        except requests.ConnectionError:
            r = None  # it had already stopped
        if r is not None and r.status_code < 300:
            raise Violation(
                f"split brain: the paused and resumed gateway pid {pid} accepted a "
                f"write ({r.status_code} {r.text[:200]}) after the standby took over"
            )
        if r is not None and "StandbyException" not in r.text:
            raise Violation(f"the resumed gateway refused with {r.status_code} {r.text[:200]}, not as a standby")
        self.gateway_restarts["split-brain-refused"] += 1
        try:
            rc = zombie.proc.wait(timeout=60)
        except Exception:
            zombie.kill()
            rc = None
        self._swap()
        self.standby_gw = self._start(1, standby=True, empty=False)
        verdict = self.check(self.view(), "after a paused active was fenced")
        refusal = "it had stopped" if r is None else f"{r.status_code} StandbyException"
        return (
            f"active gateway pid {pid} SIGSTOPped, the standby took over in {took:.1f}s, "
            f"SIGCONT: its write refused ({refusal}), it exited {rc}; restarted as the "
            f"standby; check: {verdict}"
        )

    def kill_standby(self) -> str:
        pid = self.standby_gw.pid
        empty = self.rng.random() < 0.5
        self.standby_gw.kill()
        self.processes_killed["standby"] += 1
        t = time.monotonic()
        self.standby_gw = self._start(1, standby=True, empty=empty)
        took = time.monotonic() - t
        verdict = self.check(self.view(), "after a standby kill")
        return (
            f"standby gateway pid {pid} SIGKILLed, restarted on {'an EMPTY' if empty else 'its'} "
            f"cache in {took:.1f}s; check: {verdict}"
        )

    def kill_all(self) -> str:
        if self.standby_gw is not None:
            self.standby_gw.kill()
            self.processes_killed["standby"] += 1
            shutil.rmtree(self.caches[1], ignore_errors=True)
        self.gateway_cache = self.caches[0]  # the cluster loop deletes it with the rest
        return super().kill_all()

    # ------------------------------------------------------------------ supervision
    def supervise(self) -> bool:
        if self.standby_gw is not None and self.standby_gw.proc.poll() is not None:
            rc = self.standby_gw.proc.returncode
            self.unexpected.append(f"t={self.elapsed():.0f}s: the standby exited by itself ({rc})")
            self.standby_gw = self._start(1, standby=True, empty=False)
            return True
        return super().supervise()

    def finish(self) -> None:
        if self.standby_gw is not None:
            self.standby_gw.stop()
            self.standby_gw = None
        super().finish()

    def summary(self) -> dict:
        out = super().summary()
        fs = sorted(self.failover_s)
        out.update(
            mode="cluster-pair",
            failover_median_s=fs[len(fs) // 2] if fs else None,
            failover_max_s=fs[-1] if fs else None,
        )
        return out

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            if self.standby_gw is not None:
                self.standby_gw.kill()
                self.standby_gw = None
        super().cleanup()
