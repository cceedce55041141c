"""The bucket as a batched log (issue 29): what ``--durability tier`` costs per barrier and in
store requests when Q queries share one server, side by side with ``--durability server``.

One run: moto's S3 server (its own process, 127.0.0.1) and one real ``sos-server serve --tier``
(defaults: --tier-flush 100ms; --tier-compact as given). Q journal "queries" run at once, each
in a namespace of its own opened by ``open_namespace`` (what the gateway, the mount and fsspec
call), half with ``durability="tier"`` and half with ``"server"``, each committing batches as
Spark does (a small ``offsets/N``, then a temporary file renamed onto ``commits/N``: the
barrier) for --seconds. Printed: per durability the barrier's median/p99 and the batch time,
the tier/server ratio; for the whole server the flushes (PUTs of flushed objects) per second,
all PUTs per second, requests per query-hour by operation, the server's CPU seconds per batch
(/proc), and after one compaction pass the most pieces any object has. Load average printed.
The tier's barrier is set against its bound, "flush interval + one PUT" (protocol.md 4.3a item
2), with the PUT's and the fence LIST's duration measured by the server in the same run
(``sos_tier_request_seconds``: mean, and p50/p99 as the upper edge of their histogram bucket).

    python bench/tier_log.py                     # 30 queries, 20 s
    python bench/tier_log.py -q 2 --seconds 30 --think 300ms   # one tier query, one sync
    python bench/tier_log.py -q 10 --seconds 60 --tier-flush 50ms
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import add_server_arg, cpu_seconds, doc_parser, moto_work, scrape  # noqa: E402
from sos_wire import argtypes  # noqa: E402


def query(srv, ns: str, durability: str, stop: threading.Event, work: str, out: dict, think: float) -> None:
    from sos_journal.tree.open import open_namespace

    opened = open_namespace(
        ns, os.path.join(work, f"cache-{ns}"), server=srv.address, key=srv.keygen(ns), durability=durability
    )
    tree = opened.tree
    barriers, batches = [], []
    try:
        for d in ("chk", "chk/offsets", "chk/commits"):
            tree.mkdir(d)
        i = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            tree.create(f"chk/offsets/{i}")
            tree.write(f"chk/offsets/{i}", 0, b'{"batchWatermarkMs":0,"batchTimestampMs":%d}' % i)
            tmp = f"chk/commits/.{i}.tmp"
            tree.create(tmp)
            tree.write(tmp, 0, b"{}")
            t1 = time.perf_counter()
            tree.rename(tmp, f"chk/commits/{i}", overwrite=False)  # the barrier
            t2 = time.perf_counter()
            barriers.append(t2 - t1)
            batches.append(t2 - t0)
            i += 1
            if think:
                stop.wait(think)  # the rest of a Spark batch: barriers come apart, not back to back
    finally:
        opened.close(timeout=120)
    out[ns] = (durability, barriers, batches)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1000


def request_seconds(m0: dict, m1: dict, op: str) -> tuple[int, float, float, float]:
    """Of the server's requests *op* in the run (or its TIER_WAITs: "wait"): count, mean s, and
    p50/p99 as the upper edge of the histogram bucket that holds them."""
    metric, sel = ("sos_tier_wait_seconds", "") if op == "wait" else ("sos_tier_request_seconds", f'op="{op}"')
    edges: list[tuple[float, float]] = []
    for k, v in m1.items():
        if k.startswith(f"{metric}_bucket{{") and sel in k:
            le = re.search(r'le="([^"]+)"', k)
            if le is not None:
                edges.append((float(le.group(1)), v - m0.get(k, 0.0)))
    edges.sort()
    name = f"{metric}_{{}}{{{{{sel}}}}}" if sel else f"{metric}_{{}}"
    n = m1.get(name.format("count"), 0.0) - m0.get(name.format("count"), 0.0)
    total = m1.get(name.format("sum"), 0.0) - m0.get(name.format("sum"), 0.0)

    def q(f: float) -> float:
        return next((le for le, c in edges if c >= f * n), float("inf"))

    return int(n), total / n if n else 0.0, q(0.5), q(0.99)


def report(results: dict, m0: dict, m1: dict, elapsed: float, cpu: float, queries: int, flush: float) -> None:
    print("| durability | queries | batches | barrier p50 ms | barrier p99 ms | batch mean ms |")
    print("|---|---|---|---|---|---|")
    mean = {}
    for mode in ("server", "tier"):
        rows = [v for v in results.values() if v[0] == mode]
        bars = [b for r in rows for b in r[1]]
        bats = [b for r in rows for b in r[2]]
        if not bars:
            continue
        mean[mode] = statistics.mean(bats)
        print(
            f"| {mode} | {len(rows)} | {len(bats)} | {pct(bars, 0.5):.1f} | {pct(bars, 0.99):.1f} |"
            f" {1000 * mean[mode]:.1f} |"
        )
    if len(mean) == 2:
        print(f"tier/server batch time: {mean['tier'] / mean['server']:.2f}x")
    for op in ("put", "list", "wait"):
        n, avg, p50, p99 = request_seconds(m0, m1, op)
        what = "TIER_WAITs (on the server)" if op == "wait" else f"{op.upper()}s"
        print(f"server's {what}: {n}, mean {1000 * avg:.1f} ms, p50 <= {1000 * p50:.0f} ms, p99 <= {1000 * p99:.0f} ms")
    tier = [b for v in results.values() if v[0] == "tier" for b in v[1]]
    if tier:
        _, put, _, put99 = request_seconds(m0, m1, "put")
        print(
            f"tier barrier p50 {pct(tier, 0.5):.1f} / p99 {pct(tier, 0.99):.1f} ms against flush interval + one PUT:"
            f" {1000 * (flush + put):.1f} ms (mean PUT), {1000 * (flush + put99):.0f} ms (p99 PUT)"
        )

    def d(k: str) -> float:
        return m1.get(k, 0.0) - m0.get(k, 0.0)

    flushes = d("sos_tier_flushes_total")
    print(f"flushes (PUTs of flushed objects): {flushes:.0f} in {elapsed:.1f} s = {flushes / elapsed:.2f}/s")
    puts = d('sos_tier_requests_total{op="put"}')
    print(f"all PUTs (flushes, fence markers, compaction): {puts / elapsed:.2f}/s")
    for op in ("put", "get", "list", "delete"):
        n = d(f'sos_tier_requests_total{{op="{op}"}}')
        print(f"  {op}: {n / elapsed * 3600 / queries:.0f} per query-hour")
    nb = sum(len(v[2]) for v in results.values())
    print(f"server CPU: {cpu:.1f} s for {nb} batches = {1000 * cpu / max(1, nb):.1f} ms per batch")
    if flushes:
        print(
            f"bytes per flush {d('sos_tier_flush_bytes_sum') / flushes:.0f}, objects per flush"
            f" {d('sos_tier_flush_objects_sum') / flushes:.1f}"
        )


def print_warnings(path: str) -> None:
    """The server's warnings and errors in the run, counted by message (a store error's
    back-off delays barriers by a second or more)."""
    import collections
    import json

    seen: collections.Counter[str] = collections.Counter()
    with open(path, errors="replace") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if rec.get("level") in ("warning", "error"):
                    seen[str(rec.get("msg", rec.get("message", "")))[:160]] += 1
    print(f"server warnings and errors: {sum(seen.values())}")
    for msg, n in seen.most_common(5):
        print(f"  {n} x {msg}")


def main(argv: list[str] | None = None) -> int:
    p = doc_parser(__doc__)
    p.add_argument("-q", "--queries", type=argtypes.integer(2), default=30, help="queries at once (default 30)")
    p.add_argument("--seconds", type=float, default=20.0, help="how long they commit (default 20)")
    p.add_argument("--compact", default="10s", help="--tier-compact of the server (default 10s)")
    p.add_argument("--tier-flush", default="100ms", help="--tier-flush of the server (default 100ms)")
    p.add_argument(
        "--think", type=argtypes.duration, default=0.0, help="pause after each batch (default 0: back to back)"
    )
    add_server_arg(p)
    args = p.parse_args(argv)
    from sos_tier import open_store, scan
    from tools.server import ServerProcess

    with moto_work("sos-bench-tier-log-") as (work, _env):
        tier_args = ["--tier", "s3://bench/sos", "--tier-compact", args.compact, "--tier-flush", args.tier_flush]
        srv = ServerProcess(
            os.path.join(work, "data"),
            [*tier_args, *args.server_arg],
            log_path=os.path.join(work, "server.log"),
        ).start()
        try:
            results: dict = {}
            stop = threading.Event()
            modes = ["tier" if i % 2 else "server" for i in range(args.queries)]
            threads = [
                threading.Thread(target=query, args=(srv, f"q{i}", m, stop, work, results, args.think), daemon=True)
                for i, m in enumerate(modes)
            ]
            for t in threads:
                t.start()
            time.sleep(3)  # every query opened
            m0, c0, t0 = scrape(srv), cpu_seconds(srv.pid), time.monotonic()
            time.sleep(args.seconds)
            m1, c1, elapsed = scrape(srv), cpu_seconds(srv.pid), time.monotonic() - t0
            stop.set()
            for t in threads:
                t.join(180)
            print(
                f"{args.queries} queries ({modes.count('tier')} tier, {modes.count('server')} server),"
                f" {args.seconds:g} s; sos-server --tier s3://bench/sos --tier-flush {args.tier_flush}"
                f" {' '.join(args.server_arg)};"
                f" load average {os.getloadavg()[0]:.1f}"
            )
            report(results, m0, m1, elapsed, c1 - c0, args.queries, argtypes.duration(args.tier_flush))
            # compaction's PUTs share the flushes' slots (protocol.md 4.3b): under the load it
            # takes about one a second; once the load stops, the slots the flushes leave
            store = open_store("s3://bench/sos")
            try:
                t_idle = time.monotonic()
                while (left := sum(1 for _ in store.list("v1/log/"))) and time.monotonic() - t_idle < 300:
                    time.sleep(1)
                took = time.monotonic() - t_idle
                states = scan(store)
                most = max((len(o.pieces) for st in states.values() for o in st.objects.values()), default=0)
            finally:
                store.close()
            print(
                f"after the load: {left} flushed objects left {took:.0f} s later (compaction), at most {most}"
                " pieces per object"
            )
            print_warnings(os.path.join(work, "server.log"))
        finally:
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
