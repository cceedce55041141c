"""The query's side of a gateway restart or failover (issue 30 item 6), run by
``python bench/failover.py --query [--modes restart,standby,promote] [--kills 6] [--lease 3]``:
how long the batch in flight takes when its gateway goes away, against the batches that
meet no kill, and how many queries stopped (goal 0).

A real `sos-server`, gateways on 127.0.0.1 and one Spark query (local[2], dropDuplicates on
the RocksDB state store, ``gateway_checkpoint``'s settings and nothing else: the ride-through
jar included) over 60 input files, one per batch. While it runs the bench kills at random
moments (a batch every ~1-3 s, so about every kill lands in a batch or its commit):

* ``restart``: SIGKILL of the gateway, a supervisor's restart on the same address and cache
  0-1 s later;
* ``standby``: an active ``--lease L`` and a ``--standby --lease L``; SIGKILL of whichever is
  active, the promoted one serves, the dead one comes back as the standby;
* ``promote``: the same pair, ``sos gateway promote`` of the standby (the old active is fenced
  and exits; it comes back as the standby).

Per kill: the batch in flight (the first one still running or starting after the kill) and
its delay, its duration minus the median duration of the batches no kill touched; p50/p99 of
those delays, and the stopped queries.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import free_port  # noqa: E402
from spark_plugin.gateway.process import GatewayProcess  # noqa: E402
from spark_plugin.spark import sos_command  # noqa: E402
from tools.demo import make_input  # noqa: E402
from tools.server import ServerProcess  # noqa: E402

NS = "ridebench"
FILES = 60

DRIVER = textwrap.dedent("""
    import json, os, sys
    cfg = json.load(open(sys.argv[1]))
    from pyspark.sql import SparkSession
    from tools.demo import DRIVER_JVM_OPTIONS, write_batch_output
    from tools.demo_common import ROCKSDB_PROVIDER
    from spark_plugin.spark import gateway_checkpoint

    builder = (SparkSession.builder.master("local[2]").appName("sos-ride-bench")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.streaming.numRecentProgressUpdates", "1000")
               .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
               .config("spark.driver.extraJavaOptions", DRIVER_JVM_OPTIONS))
    loc = gateway_checkpoint(builder, cfg["urls"], cfg["ns"], os.environ["SOS_KEY"], "queries/bench")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    os.makedirs(cfg["out"], exist_ok=True)
    query = (spark.readStream.schema("id LONG, payload STRING")
             .option("maxFilesPerTrigger", 1).json(cfg["input"])
             .dropDuplicates(["id"])
             .writeStream.foreachBatch(lambda df, b: write_batch_output(cfg["out"], df, b))
             .option("checkpointLocation", str(loc)).trigger(availableNow=True).start())
    try:
        query.awaitTermination()
        stopped = None
    except Exception as exc:
        stopped = str(exc)[:2000]
    progress = [{"batch": p["batchId"], "start": p["timestamp"], "ms": p["durationMs"].get("triggerExecution", 0)}
                for p in (json.loads(x.json) for x in query.recentProgress)]
    with open(cfg["result"], "w") as f:
        json.dump({"progress": progress, "stopped": stopped}, f)
    spark.stop()
""")


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class Gateways:
    """The gateway(s) of one mode, on fixed addresses, with kill-and-replace."""

    def __init__(self, mode: str, server: ServerProcess, key: str, work: str, lease: float) -> None:
        self.mode, self.server, self.key, self.work, self.lease = mode, server, key, work, lease
        self.n = 0
        self.listens = [f"127.0.0.1:{free_port()}"] + ([f"127.0.0.1:{free_port()}"] if mode != "restart" else [])
        self.procs: list[GatewayProcess] = [self._start(0, standby=False)]
        if mode != "restart":
            self.procs.append(self._start(1, standby=True))
        self.active = 0

    def _start(self, i: int, *, standby: bool) -> GatewayProcess:
        self.n += 1
        extra = ["--lease", f"{self.lease:g}"] if self.mode != "restart" else []
        deadline = time.monotonic() + 60
        while True:
            try:
                return GatewayProcess(
                    NS,
                    os.path.join(self.work, f"cache-{i}"),
                    self.server.address,
                    self.key,
                    listen=self.listens[i],
                    extra_args=[*extra, *(["--standby"] if standby else [])],
                    log_path=os.path.join(self.work, f"gateway-{self.n}.log"),
                ).start()
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    @property
    def urls(self) -> list[str]:
        return [f"http://{a}" for a in self.listens]

    def disrupt(self, rng: random.Random) -> None:
        """Kill (or replace) the active gateway; bring the lost member back."""
        lost = self.active
        if self.mode == "promote":
            other = 1 - lost
            subprocess.run(
                [*sos_command(), "gateway", "promote", NS, self.urls[other], "--server", self.server.address],
                env=dict(os.environ, SOS_KEY=self.key),
                capture_output=True,
                timeout=120,
                check=True,
            )
            self.procs[lost].proc.wait(timeout=60)  # fenced: it stops
        else:
            self.procs[lost].kill()
        time.sleep(rng.uniform(0.0, 1.0))
        if self.mode == "restart":
            self.procs[0] = self._start(0, standby=False)
            return
        # the survivor takes over (its lease); the lost one comes back as its standby
        self.active = 1 - lost
        deadline = time.monotonic() + 120
        while "standby: promoted" not in self.procs[self.active].log() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.procs[lost] = self._start(lost, standby=True)

    def stop(self) -> None:
        for g in self.procs:
            g.kill()


def run_query_mode(mode: str, kills: int, lease: float, base: str, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix=f"ride-{mode}-", dir=base)
    server = ServerProcess(os.path.join(work, "data"), log_path=os.path.join(work, "server.log")).start()
    gws = None
    try:
        key = server.keygen(NS)
        gws = Gateways(mode, server, key, work, lease)
        make_input(os.path.join(work, "input"), FILES * 40, FILES)
        cfg = {
            "urls": gws.urls,
            "ns": NS,
            "input": os.path.join(work, "input"),
            "out": os.path.join(work, "out"),
            "result": os.path.join(work, "result.json"),
        }
        with open(os.path.join(work, "cfg.json"), "w") as f:
            json.dump(cfg, f)
        with open(os.path.join(work, "driver.py"), "w") as f:
            f.write(DRIVER)
        env = dict(os.environ, SOS_KEY=key, PYTHONPATH=ROOT)
        kill_times: list[float] = []
        with open(os.path.join(work, "driver.log"), "wb") as log:
            driver = subprocess.Popen(
                [sys.executable, os.path.join(work, "driver.py"), os.path.join(work, "cfg.json")],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            while driver.poll() is None and len(os.listdir(cfg["out"]) if os.path.isdir(cfg["out"]) else []) < 5:
                time.sleep(0.5)
            while driver.poll() is None and len(kill_times) < kills:
                time.sleep(rng.uniform(2.0, 6.0))
                if driver.poll() is not None:
                    break
                kill_times.append(time.time())
                gws.disrupt(rng)
            rc = driver.wait(timeout=1800)
        with open(cfg["result"]) as f:
            result = json.load(f)
        return summarize(mode, kill_times, result, rc)
    finally:
        if gws is not None:
            gws.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def summarize(mode: str, kill_times: list[float], result: dict, rc: int) -> dict[str, object]:
    batches = [(_epoch(p["start"]), p["ms"] / 1000.0, p["batch"]) for p in result["progress"]]
    touched: dict[int, float] = {}
    for t in kill_times:
        inflight = [b for b in batches if b[0] + b[1] >= t]
        if inflight:
            _start, seconds, batch = min(inflight)
            touched[batch] = seconds
    calm = [s for _start, s, b in batches if b not in touched]
    base = statistics.median(calm) if calm else 0.0
    delays = sorted(max(0.0, s - base) for s in touched.values())

    def pct(q: float) -> float:
        return round(delays[min(len(delays) - 1, int(q * len(delays)))], 2) if delays else 0.0

    return {
        "mode": mode,
        "kills": len(kill_times),
        "stopped_queries": int(rc != 0 or result.get("stopped") is not None),
        "batches": len(batches),
        "median_batch_s": round(base, 2),
        "delay_p50_s": pct(0.5),
        "delay_p99_s": pct(0.99),
        "delay_max_s": round(delays[-1], 2) if delays else 0.0,
    }


def main_query(modes: list[str], kills: int, lease: float, base: str, seed: int) -> int:
    results = []
    for mode in modes:
        r = run_query_mode(mode, kills, lease, base, seed)
        print(json.dumps(r), flush=True)
        results.append(r)
    print("\n| mode | kills | stopped queries | median batch | batch in flight: delay p50 / p99 / max |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['mode']} | {r['kills']} | {r['stopped_queries']} | {r['median_batch_s']} s | "
            f"{r['delay_p50_s']} / {r['delay_p99_s']} / {r['delay_max_s']} s |"
        )
    return 0 if all(r["stopped_queries"] == 0 for r in results) else 1
