"""Failover benchmark (on demand, not in CI; issue 22 item 4): the time from SIGKILL of the
active gateway, with its node's disk (its cache directory is deleted), to the next batch
committed by Hadoop's own WebHDFS client, with a standby gateway and without one.

    python bench/failover.py [--sizes 100M,1G] [--modes standby,restart] [--lease 10]
    python bench/failover.py --query [--modes restart,standby,promote] [--kills 6] [--lease 3]

``--query`` (issue 30 item 6): the delay added to the batch in flight of a running Spark query
(not only the next commit) and the stopped queries: bench/failover_query.py.

For each size: a real `sos-server` on 127.0.0.1, an active `sos gateway --lease L` on a fixed
port, and the state: files of 8 MiB of random bytes written through the active (what a
checkpoint's state store holds). Then Hadoop's client (tests/data/HaWriter.java over pyspark's
jars: a file written and renamed onto commits/i per "batch", through a webhdfs://nameservice)
commits batches; once 10 are committed the active gateway is SIGKILLed and its cache deleted:

* ``standby``: a `sos gateway --standby --lease L` runs beside it from the start (its cache
  current by tailing the journal); the client's nameservice lists both addresses;
* ``restart``: no standby; a supervisor starts a new gateway on the same address on an empty
  cache right after the kill (it restores the namespace from the server before it listens).

Prints the seconds from the kill to the next commit. Then 5 more batches, and the check that
nothing was lost or doubled: restore from the server equals the batches the client was told
committed, and the state files are intact (SHA-256); `sos verify` exit 0.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import free_port  # noqa: E402
from sos_wire import argtypes  # noqa: E402
from spark_plugin.gateway.process import GatewayProcess  # noqa: E402 - after sys.path
from spark_plugin.spark import GATEWAY_FAILOVER, sos_command  # noqa: E402
from tools.server import ServerProcess  # noqa: E402

NS = "failover"
PIECE = 8 << 20


def compile_writer(out: str) -> str:
    import pyspark

    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
    if not glob.glob(os.path.join(jars, "hadoop-client-api-*.jar")):
        raise SystemExit("pyspark's Hadoop jars are missing")
    subprocess.run(
        ["javac", "-cp", os.path.join(jars, "*"), "-d", out, os.path.join(ROOT, "tests", "data", "HaWriter.java")],
        check=True,
    )
    return f"{jars}/*:{out}"


def token(url: str, key: str) -> str:
    r = requests.post(
        url + "/oauth2/token",
        data={"grant_type": "client_credentials", "client_id": NS, "client_secret": key},
        timeout=60,
    )
    r.raise_for_status()
    return str(r.json()["access_token"])


def write_state(url: str, key: str, size: int) -> dict[str, str]:
    """Files of PIECE random bytes through the gateway; {path: sha256}."""
    h = {"Authorization": f"Bearer {token(url, key)}"}
    digests = {}
    for i in range(max(1, size // PIECE)):
        data = os.urandom(PIECE)
        r = requests.put(
            f"{url}/webhdfs/v1/state/part-{i:05d}?op=CREATE&overwrite=true",
            headers=h,
            allow_redirects=False,
            timeout=120,
        )
        r = requests.put(r.headers["Location"], data=data, headers=h, timeout=300)
        if r.status_code != 201:
            raise RuntimeError(f"state write: {r.status_code} {r.text}")
        digests[f"state/part-{i:05d}"] = hashlib.sha256(data).hexdigest()
    return digests


class Writer:
    def __init__(self, classpath: str, key: str, addresses: list[str], token_url: str, work: str) -> None:
        self.commits: dict[int, float] = {}
        self.lines: list[str] = []
        self.stop_file = os.path.join(work, "STOP")
        self.log_path = os.path.join(work, "java.log")
        with open(os.path.join(work, "java.log"), "w") as log:
            self.proc = subprocess.Popen(
                [
                    "java",
                    "-Dhawriter.attempts=1000",
                    # the failover settings gateway_checkpoint gives a pair (spark.GATEWAY_FAILOVER)
                    *(f"-Dhadoop.{k}={v}" for k, v in GATEWAY_FAILOVER.items()),
                    "-cp",
                    classpath,
                    "HaWriter",
                    "bench",
                    ",".join(addresses),
                    token_url + "/oauth2/token",
                    NS,
                    "100000",
                    self.stop_file,
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=dict(os.environ, SOS_KEY=key),
            )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.startswith("COMMITTED "):
                self.commits[int(line.split()[1])] = time.monotonic()

    def wait(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.commits) < n:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                with open(self.log_path) as f:
                    log = f.read()[-3000:]
                raise RuntimeError(f"the writer did not commit {n} batches: {self.lines[-10:]}\n{log}")
            time.sleep(0.05)

    def finish(self) -> None:
        with open(self.stop_file, "w"):
            pass
        if self.proc.wait(timeout=300) != 0:
            raise RuntimeError(f"the writer failed: {self.lines[-10:]}")
        self.thread.join(timeout=10)


def sos(server: ServerProcess, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*sos_command(), *args, "--server", server.address],
        env=dict(os.environ, SOS_KEY=key),
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )


def check(server: ServerProcess, key: str, writer: Writer, digests: dict[str, str], work: str) -> None:
    """Exactly once: restore equals what the client was told, the state is intact."""
    sos(server, key, "verify", "-q", NS)
    target = os.path.join(work, "restored")
    sos(server, key, "restore", "-q", NS, target)
    commits = {int(n) for n in os.listdir(os.path.join(target, "ha", "commits"))}
    if commits != set(writer.commits):
        raise RuntimeError(
            f"restore has batches {sorted(commits ^ set(writer.commits))} the client "
            f"was not told committed, or lacks them"
        )
    for i in commits:
        with open(os.path.join(target, "ha", "commits", str(i)), "rb") as f:
            if f.read() != f"batch {i}\n".encode():
                raise RuntimeError(f"batch {i} holds the wrong bytes")
    for path, digest in digests.items():
        with open(os.path.join(target, path), "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != digest:
                raise RuntimeError(f"{path} changed")
    shutil.rmtree(target)


def run_one(classpath: str, size: int, mode: str, lease: float, base: str) -> dict[str, object]:
    work = tempfile.mkdtemp(prefix=f"failover-{mode}-", dir=base)
    server = ServerProcess(os.path.join(work, "data"), log_path=os.path.join(work, "server.log")).start()
    procs: list[GatewayProcess] = []
    writer: Writer | None = None
    try:
        key = server.keygen(NS)
        listen = f"127.0.0.1:{free_port()}"

        def gateway(name: str, listen: str, *extra: str) -> GatewayProcess:
            g = GatewayProcess(
                NS,
                os.path.join(work, f"{name}-cache"),
                server.address,
                key,
                listen=listen,
                extra_args=["--lease", f"{lease:g}", *extra],
                log_path=os.path.join(work, f"{name}.log"),
                start_timeout=1800,
            ).start()
            procs.append(g)
            return g

        active = gateway("active", listen)
        t = time.monotonic()
        digests = write_state(active.url or "", key, size)
        wrote = time.monotonic() - t
        addresses = [listen]
        token_url = active.url or ""
        if mode == "standby":
            standby = gateway("standby", f"127.0.0.1:{free_port()}", "--standby")
            addresses = [listen, standby.listen]
            token_url = standby.url or ""
        writer = Writer(classpath, key, addresses, token_url, work)
        writer.wait(10, 300)
        killed = time.monotonic()
        active.kill()
        shutil.rmtree(active.cache_dir)  # its node's disk
        if mode == "restart":
            gateway("restarted", listen)  # a supervisor's restart on an empty cache, same address
        n = len(writer.commits)
        writer.wait(n + 1, 1800)
        gap = min(c for c in writer.commits.values() if c > killed) - killed
        writer.wait(n + 5, 600)
        writer.finish()
        check(server, key, writer, digests, work)
        return {
            "mode": mode,
            "state_bytes": len(digests) * PIECE,
            "seconds_to_next_commit": round(gap, 2),
            "state_write_seconds": round(wrote, 1),
            "batches": len(writer.commits),
            "exactly_once": True,
        }
    finally:
        if writer is not None and writer.proc.poll() is None:
            writer.proc.kill()
        for g in procs:
            g.kill()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100M,1G", help="state sizes (default 100M,1G)")
    parser.add_argument("--modes", default="standby,restart", help="standby, restart or both")
    parser.add_argument("--lease", type=float, default=10.0, help="--lease of the gateways (default 10)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--query", action="store_true", help="a Spark query's batch in flight (failover_query.py)")
    parser.add_argument("--kills", type=int, default=6, help="--query: kills per mode (default 6)")
    parser.add_argument("--seed", type=int, default=None, help="--query: the random moments' seed")
    args = parser.parse_args()
    base = args.workdir or tempfile.gettempdir()
    if args.query:
        from bench.failover_query import main_query

        modes = args.modes.split(",") if args.modes != "standby,restart" else ["restart", "standby", "promote"]
        seed = args.seed if args.seed is not None else int(time.time())
        print(f"seed {seed}", flush=True)
        return main_query(modes, args.kills, args.lease if args.lease != 10.0 else 3.0, base, seed)
    with tempfile.TemporaryDirectory(prefix="hawriter-") as out:
        classpath = compile_writer(out)
        results = []
        for size in (argtypes.size(1)(s) for s in args.sizes.split(",")):
            for mode in args.modes.split(","):
                r = run_one(classpath, size, mode, args.lease, base)
                print(json.dumps(r), flush=True)
                results.append(r)
    print("\n| state | mode | SIGKILL of the active (+ its cache) -> next committed batch |")
    print("|---|---|---|")
    for r in results:
        print(f"| {int(r['state_bytes']) >> 20} MiB | {r['mode']} | {r['seconds_to_next_commit']} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
