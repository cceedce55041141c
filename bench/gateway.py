"""Micro-batch time with the checkpoint on `sos gateway` (sync, and --durability tier) vs a
local directory vs `sos mount`.

One run, one Spark session (local[2], Spark's default settings but --partitions shuffle
partitions, default 2), the query of bench/spark_checkpoint.py (file source, maxFilesPerTrigger=1, dropDuplicates,
foreachBatch sink) over the same input, the same number of batches on each side, the
sides taken in turn for --rounds rounds (round r starts with side r): a local directory,
a journaled `sos mount` (sync) and `webhdfs://` through a `sos gateway` child process
(sync, OAuth2 bearer tokens as `gateway_checkpoint` sets them up), both on one real
`sos-server` on 127.0.0.1 (separate namespaces); and "gwtier": `webhdfs://` through a
`sos gateway --durability tier` (every barrier also waits until the bucket holds the
journal, issue 19 item 3) on a second `sos-server --tier s3://...` whose store is moto's S3
server, started by the bench as a process of its own on 127.0.0.1 (what turning the tier on
costs: the server's uploads and the barriers' waits). Per-batch time is Spark's
`durationMs.triggerExecution`. No batch markers on any side (no listener but the timer).
Target: gateway median <= 1.05 x local median.

Then the gateway itself: the per-operation latencies it logged at exit for the Spark
run (count, p50, p99), and a small HTTP load from Python threads (keep-alive
connections, bearer token) on a fresh gateway: GETFILESTATUS, CREATE (both steps, 1 KiB
bodies) and RENAME, each alone: requests/s and client-side p50/p99.

    python3 bench/gateway.py [--batches 60] [--rounds 3] [--records-per-batch 500]
                             [--state-store hdfs|rocksdb] [--partitions N] [--changelog] [--no-crc]
                             [--sides local,mount,gateway,gwtier] [--tier-interval 1s]
                             [--threads 8] [--load-requests 400]   (0: no HTTP load)

Prints tables and one JSON line; exit 0. Run on demand (several minutes), not a test.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import contextlib

from spark_checkpoint import (
    PHASES,
    BatchTimer,
    add_query_options,
    alternate,
    flat_figures,
    local_and_mount,
    open_session,
    side_figures,
)

from bench.common import BUCKET, doc_parser, remove_work, start_moto_bucket, stop_moto
from spark_plugin.gateway.client import GatewayClient
from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import gateway_checkpoint, start_gateway, start_mount
from tools.demo import LocalServer, keygen

#: the sides (a name holds no "-": BatchTimer labels are SIDE-ROUND); gwtier: the gateway
#: with --durability tier on a server with --tier
SIDES = ("local", "mount", "gateway", "gwtier")
LABELS = {"local": "local", "mount": "mount", "gateway": "gateway", "gwtier": "gateway tier"}
#: a line of the gateway's summary: "RENAME: ...", "CREATE data: ...", "token: ..."
STATS_RE = re.compile(
    r"^(.+?): (\d+) requests, mean ([\d.]+) ms, p50 ([\d.]+) ms, "
    r"p99 ([\d.]+) ms, max ([\d.]+) ms$"
)


def gateway_stats(log_text: str) -> dict[str, dict[str, float]]:
    """The per-operation summary a gateway logs when it stops (last one in the log)."""
    part = log_text.rsplit("requests served:", 1)
    out: dict[str, dict[str, float]] = {}
    if len(part) < 2:
        return out
    for line in part[1].splitlines():
        m = STATS_RE.match(line.strip())
        if m:
            out[m.group(1)] = {
                "count": int(m.group(2)),
                "mean_ms": float(m.group(3)),
                "p50_ms": float(m.group(4)),
                "p99_ms": float(m.group(5)),
                "max_ms": float(m.group(6)),
            }
    return out


def percentile(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))]


# --------------------------------------------------------------------------- HTTP load


class _Conn:
    """One keep-alive connection to the gateway, with the bearer token."""

    def __init__(self, url: str, token: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        self.host = parsed.netloc
        self.conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)
        self.auth = {"Authorization": f"Bearer {token}"}

    def request(self, method: str, path: str, body: bytes | None = None, **params: str) -> bytes:
        target = f"/webhdfs/v1{urllib.parse.quote(path)}?{urllib.parse.urlencode(params)}"
        return self.target(method, target, body)

    def target(self, method: str, target: str, body: bytes | None = None) -> bytes:
        self.conn.request(method, target, body=body, headers=self.auth)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"{method} {target} -> {resp.status} {data[:300]!r}")
        return data

    def create(self, path: str, body: bytes) -> None:
        doc = json.loads(self.request("PUT", path, op="CREATE", overwrite="true", noredirect="true"))
        loc = urllib.parse.urlsplit(doc["Location"])
        self.target("PUT", f"{loc.path}?{loc.query}", body)


def _timed(fn, threads: int, per_thread: int) -> tuple[list[float], float]:
    """``fn(thread, j)`` for j < per_thread in each of ``threads`` threads, started
    together: (every call's latency in seconds, wall seconds)."""
    latencies: list[list[float]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)

    def work(i: int) -> None:
        start.wait()
        try:
            for j in range(per_thread):
                t = time.perf_counter()
                fn(i, j)
                latencies[i].append(time.perf_counter() - t)
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return [x for per in latencies for x in per], wall


def http_load(url: str, token: str, threads: int, per_thread: int) -> dict[str, dict]:
    """GETFILESTATUS, CREATE (2 steps), RENAME from ``threads`` threads, one operation at a
    time, ``per_thread`` each: requests/s and client-side latencies."""
    conns = [_Conn(url, token) for _ in range(threads)]
    body = os.urandom(1024)
    for i, c in enumerate(conns):  # each thread's own directory and files
        c.request("PUT", f"/load/t{i}", op="MKDIRS")
        c.create(f"/load/t{i}/stat", body)
        c.create(f"/load/t{i}/a", body)

    def getfilestatus(i: int, j: int) -> None:
        conns[i].request("GET", f"/load/t{i}/stat", op="GETFILESTATUS")

    def create(i: int, j: int) -> None:
        conns[i].create(f"/load/t{i}/f{j}", body)

    def rename(i: int, j: int) -> None:
        src, dst = ("a", "b") if j % 2 == 0 else ("b", "a")
        conns[i].request("PUT", f"/load/t{i}/{src}", op="RENAME", destination=f"/load/t{i}/{dst}")

    results = {}
    for name, fn in (("GETFILESTATUS", getfilestatus), ("CREATE (2 requests)", create), ("RENAME", rename)):
        lat, wall = _timed(fn, threads, per_thread)
        results[name] = {
            "ops": len(lat),
            "ops_per_s": len(lat) / wall,
            "p50_ms": percentile(lat, 0.5) * 1e3,
            "p99_ms": percentile(lat, 0.99) * 1e3,
        }
    for c in conns:
        c.conn.close()
    return results


# --------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = doc_parser(__doc__, epilog=False)
    add_query_options(
        p, rounds=3, rounds_help="rounds over the 3 sides, each round starting with the next side (default 3)"
    )
    p.add_argument(
        "--no-crc", action="store_true", help="local and mount without Hadoop's .crc files (webhdfs never has them)"
    )
    p.add_argument("--threads", type=int, default=8, help="HTTP load threads (default 8)")
    p.add_argument(
        "--load-requests",
        type=int,
        default=400,
        help="operations per thread and per kind in the HTTP load (default 400)",
    )
    p.add_argument(
        "--sides",
        type=_sides,
        default=SIDES,
        metavar="LIST",
        help=f"comma-separated sides to run, local always among them (default {','.join(SIDES)})",
    )
    p.add_argument(
        "--tier-interval",
        default="1s",
        metavar="DURATION",
        help="gwtier: the tier server's --tier-interval (default 1s, its default)",
    )
    p.add_argument("--keep", action="store_true")
    return p


def _stopped_at_exit(stack: contextlib.ExitStack, proc):
    """*proc*, stopped when *stack* closes (a failure to stop is not the run's failure)."""

    def stop() -> None:
        with contextlib.suppress(Exception):
            proc.stop()

    stack.callback(stop)
    return proc


def _start_gateways(stack: contextlib.ExitStack, args, work: str, server: LocalServer, keys: dict[str, str]):
    """The gateway sides asked for by --sides: (the gateway on *server* or None, the gateway with
    durability "tier" on a tier server of its own, over moto, or None); stopped with *stack*."""
    gw = tier_gw = None
    if "gateway" in args.sides:
        gw = GatewayProcess(
            "benchgw",
            os.path.join(work, "gateway-cache"),
            server.address,
            keys["benchgw"],
            log_path=os.path.join(work, "gateway.log"),
        )
        _stopped_at_exit(stack, gw).start()
    if "gwtier" in args.sides:
        moto, tier_url = start_tier_store(work)
        stack.callback(stop_moto, moto)
        tier_data = os.path.join(work, "tier-server")
        keys["benchtier"] = keygen(tier_data, "benchtier")
        tier_server = LocalServer(
            tier_data,
            os.path.join(work, "tier-server.log"),
            args=["--tier", tier_url, "--tier-interval", args.tier_interval],
        )
        stack.callback(tier_server.stop)
        tier_server.start()
        tier_gw = start_gateway(
            "benchtier",
            server=tier_server.address,
            key=keys["benchtier"],
            cache_dir=os.path.join(work, "tier-gateway-cache"),
            durability="tier",
            log_path=os.path.join(work, "tier-gateway.log"),
        )
        _stopped_at_exit(stack, tier_gw)
    return gw, tier_gw


def _results(args, sides: dict, fig: dict, timer, elapsed: float, stats: dict[str, dict]) -> dict:
    """The JSON line's figures: per side, the ratios to local, per phase, the gateways' requests."""
    res: dict = {
        "state_store": args.state_store,
        "no_crc": args.no_crc,
        "records_per_batch": args.records_per_batch,
        "rounds": args.rounds,
        "batches": {w: fig[w]["n"] for w in sides},
        "elapsed_s": elapsed,
        "cores": os.cpu_count(),
        "load_avg_end": os.getloadavg(),
        "tier_interval": args.tier_interval if "gwtier" in sides else None,
    }
    res.update(flat_figures(fig, sides))
    for w in sides:
        if w != "local":
            res[f"ratio_{w}_local_median"] = fig[w]["median_ms"] / fig["local"]["median_ms"]
            res[f"ratio_{w}_local_mean"] = fig[w]["mean_ms"] / fig["local"]["mean_ms"]
    if "gateway" in sides and "gwtier" in sides:
        res["gwtier_minus_gateway_median_ms"] = fig["gwtier"]["median_ms"] - fig["gateway"]["median_ms"]
    res["phases_median_ms"] = {w: {k: statistics.median(v) for k, v in timer.phases[w].items()} for w in sides}
    for w, st in stats.items():
        total = sum(int(s["count"]) for s in st["ops"].values())
        res[f"{w}_spark"] = {
            "requests": total,
            "per_batch": total / max(1, fig[w]["n"]),
            "requests_per_s": total / st["wall"] if st["wall"] else 0.0,
            "ops": st["ops"],
        }
    return res


def _http_load_figures(args, work: str, server: LocalServer, key: str) -> dict:
    """The HTTP load, on a gateway of its own (its stats are not mixed with Spark's)."""
    load_gw = GatewayProcess(
        "benchload",
        os.path.join(work, "load-cache"),
        server.address,
        key,
        log_path=os.path.join(work, "load-gateway.log"),
    ).start()
    try:
        token = GatewayClient(load_gw.url, "benchload", key).token()
        client = http_load(load_gw.url, token, args.threads, args.load_requests)
    finally:
        load_gw.stop()
    return {"threads": args.threads, "client": client, "gateway": gateway_stats(load_gw.log())}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    work = tempfile.mkdtemp(prefix="sos-bench-gateway-")
    with contextlib.ExitStack() as stack:
        stack.callback(remove_work, work, args.keep)
        data = os.path.join(work, "server")
        server = LocalServer(data, os.path.join(work, "server.log"))
        keys = {ns: keygen(data, ns) for ns in ("benchmnt", "benchgw", "benchload")}
        stack.callback(server.stop)
        server.start()
        mnt = os.path.join(work, "mnt")
        if "mount" in args.sides:
            mount = start_mount(
                "benchmnt",
                mnt,
                server=server.address,
                key=keys["benchmnt"],
                cache_dir=os.path.join(work, "mount-cache"),
                log_path=os.path.join(work, "mount.log"),
            )
            _stopped_at_exit(stack, mount)
        gw, tier_gw = _start_gateways(stack, args, work, server, keys)

        spark = open_session(
            args.state_store, args.no_crc, app="sos-bench-gateway", partitions=args.partitions, changelog=args.changelog
        )
        timer = BatchTimer(spark)

        def on_gateway(proc, ns: str):
            def location(r: int) -> str:  # the settings go on the live session's Hadoop conf
                return str(gateway_checkpoint(spark, proc.url, ns, keys[ns], f"chk-{r}", listener=False))

            return location

        every = {
            **local_and_mount(work, mnt),
            "gateway": on_gateway(gw, "benchgw") if gw else None,
            "gwtier": on_gateway(tier_gw, "benchtier") if tier_gw else None,
        }
        sides = {w: every[w] for w in SIDES if w in args.sides}
        elapsed = alternate(spark, timer, work, sides, args, rotate=True)
        spark.stop()
        stats: dict[str, dict] = {}
        for w, proc in (("gateway", gw), ("gwtier", tier_gw)):
            if proc is not None:
                wall = sum(v for k, v in timer.wall.items() if k.startswith(f"{w}-"))
                proc.stop()
                stats[w] = {"wall": wall, "ops": gateway_stats(proc.log())}

        fig = {w: side_figures(timer, w) for w in sides}
        res = _results(args, sides, fig, timer, elapsed, stats)
        if args.load_requests > 0:
            res["http_load"] = _http_load_figures(args, work, server, keys["benchload"])
        report(args, sides, fig, timer, res)
    return 0


def _sides(text: str) -> tuple[str, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SIDES]
    if bad or "local" not in names:
        raise argparse.ArgumentTypeError(f"sides are among {', '.join(SIDES)}, local among them; not {text!r}")
    return tuple(w for w in SIDES if w in names)


def start_tier_store(work: str):
    """moto's S3 server with its bucket (bench.common.start_moto_bucket), the environment the tier
    reads in os.environ, so the tier server started after inherits it. (process, s3:// URL)"""
    moto, _env = start_moto_bucket(work)
    return moto, f"s3://{BUCKET}/gateway"


def report(args, sides: dict, fig: dict, timer, res: dict) -> None:
    print(
        f"Spark micro-batch duration (triggerExecution), {args.state_store} state store, "
        f"sync, {'no .crc files on local/mount, ' if args.no_crc else ''}"
        f"{args.rounds} rounds x {args.batches} batches per side, "
        f"{os.cpu_count()} cores:"
    )
    print(f"  {'':13} {'median':>9} {'mean':>9} {'p90':>9} {'x local (median)':>17}")
    for w in sides:
        print(
            f"  {LABELS[w]:13} {fig[w]['median_ms']:8.0f}ms {fig[w]['mean_ms']:8.0f}ms "
            f"{fig[w]['p90_ms']:8.0f}ms {fig[w]['median_ms'] / fig['local']['median_ms']:17.3f}"
        )
    if "gateway" in sides:
        ratio = res["ratio_gateway_local_median"]
        print(f"  gateway/local median {ratio:.3f}: target <= 1.05 {'met' if ratio <= 1.05 else 'MISSED'}")
    if "gwtier_minus_gateway_median_ms" in res:
        print(
            f"  --durability tier costs {res['gwtier_minus_gateway_median_ms']:.0f} ms per batch "
            f"(median) over the sync gateway (tier server: --tier-interval {args.tier_interval})"
        )
    print(
        f"  median per phase (ms), {'/'.join(sides)}: "
        + ", ".join(
            f"{k} " + "/".join(f"{statistics.median(timer.phases[w].get(k, [0])):.0f}" for w in sides) for k in PHASES
        )
    )
    for w in ("gateway", "gwtier"):
        g = res.get(f"{w}_spark")
        if g is None:
            continue
        print(
            f"{LABELS[w].capitalize()} under Spark: {g['requests']} requests, {g['per_batch']:.1f} per "
            f"batch, {g['requests_per_s']:.0f}/s over its runs; per operation (gateway side):"
        )
        for op, s in sorted(g["ops"].items(), key=lambda kv: -kv[1]["count"]):
            print(f"  {op:28} {int(s['count']):6d}  p50 {s['p50_ms']:7.2f} ms  p99 {s['p99_ms']:7.2f} ms")
    if "http_load" in res:
        print(
            f"HTTP load, {args.threads} threads x {args.load_requests} per operation "
            "(client side, keep-alive, bearer token):"
        )
        for op, s in res["http_load"]["client"].items():
            print(f"  {op:22} {s['ops_per_s']:8.0f} ops/s  p50 {s['p50_ms']:7.2f} ms  p99 {s['p99_ms']:7.2f} ms")
    print(json.dumps(res, sort_keys=True))


if __name__ == "__main__":
    sys.exit(main())
