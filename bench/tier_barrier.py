"""The cost of ``durability="tier"`` per barrier (issue 19 item 3): how long the rename onto a
Spark-like ``commits/N`` takes when it returns once its record is durable on the SOS server
("server", the default) against once the server's object-store tier (the bucket) holds it too
("tier").

One run: moto's S3 server (its own process, 127.0.0.1) and one real ``sos-server serve --tier``
(the default --tier-interval, 1 s, unless --server-arg says otherwise). Per durability, a
namespace of its own is opened by ``open_namespace`` (what the gateway, the mount and fsspec
call) and N batches are committed as Spark does: a small ``offsets/N`` file, a temporary file
renamed onto ``commits/N`` (the barrier); each rename is timed. "tier (interval 1h)" runs the
same against a second server whose interval no barrier waits for: a TIER_WAIT starts the
server's upload round at once (protocol.md 1.11), so the wait is one round (a LIST of the fence
markers and one PUT per object) whatever the interval.

    python bench/tier_barrier.py                 # 50 barriers per durability
    python bench/tier_barrier.py -n 200 --size 4KiB
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import add_server_arg, doc_parser, moto_work  # noqa: E402
from sos_wire import argtypes  # noqa: E402


def run_mode(srv, ns: str, durability: str, n: int, size: int, work: str) -> list[float]:
    from sos_journal.tree.open import open_namespace

    key = srv.keygen(ns)
    opened = open_namespace(ns, os.path.join(work, f"cache-{ns}"), server=srv.address, key=key, durability=durability)
    tree = opened.tree
    try:
        for d in ("chk", "chk/offsets", "chk/commits"):
            tree.mkdir(d)
        body = os.urandom(size)
        times = []
        for i in range(n):
            tree.create(f"chk/offsets/{i}")
            tree.write(f"chk/offsets/{i}", 0, body)
            tmp = f"chk/commits/.{i}.tmp"
            tree.create(tmp)
            tree.write(tmp, 0, b"{}")
            t0 = time.perf_counter()
            tree.rename(tmp, f"chk/commits/{i}", overwrite=False)  # the barrier
            times.append(time.perf_counter() - t0)
        return times
    finally:
        opened.close(timeout=120)


def summary(label: str, times: list[float]) -> str:
    ms = sorted(t * 1000 for t in times)
    p90 = ms[min(len(ms) - 1, int(len(ms) * 0.9))]
    return (
        f"| {label} | {len(ms)} | {statistics.median(ms):.1f} | {statistics.mean(ms):.1f} | {p90:.1f} | {ms[-1]:.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = doc_parser(__doc__)
    p.add_argument("-n", type=argtypes.integer(1), default=50, help="barriers per durability (default 50)")
    p.add_argument("--size", type=argtypes.size(1), default=1024, help="bytes of each offsets/N file (default 1KiB)")
    add_server_arg(p)
    args = p.parse_args(argv)
    from tools.server import ServerProcess

    with moto_work("sos-bench-tier-barrier-") as (work, env):
        servers = []
        try:
            srv = ServerProcess(
                os.path.join(work, "data"),
                ["--tier", "s3://bench/sos", *args.server_arg],
                log_path=os.path.join(work, "server.log"),
                metrics=False,
            )
            servers.append(srv.start())
            slow = ServerProcess(
                os.path.join(work, "data-1h"),
                ["--tier", "s3://bench/sos-1h", "--tier-interval", "1h"],
                log_path=os.path.join(work, "server-1h.log"),
                metrics=False,
            )
            servers.append(slow.start())
            print(
                f"sos-server --tier s3://bench/sos {' '.join(args.server_arg) or '(default --tier-interval 1s)'};"
                f" moto at {env['AWS_ENDPOINT_URL']}; {args.n} batches per row: offsets/N of {args.size} B, then"
                " the rename onto commits/N",
                flush=True,
            )
            rows = [
                ("server", run_mode(srv, "bserver", "server", args.n, args.size, work)),
                ("tier", run_mode(srv, "btier", "tier", args.n, args.size, work)),
                ("tier (interval 1h)", run_mode(slow, "bslow", "tier", args.n, args.size, work)),
            ]
        finally:
            for s in servers:
                s.stop()
    print("| durability | barriers | median ms | mean ms | p90 ms | max ms |")
    print("|---|---|---|---|---|---|")
    for label, times in rows:
        print(summary(label, times))
    med = {label: statistics.median(times) for label, times in rows}
    print(f"tier costs {1000 * (med['tier'] - med['server']):.1f} ms more per barrier (median) than server")
    return 0


if __name__ == "__main__":
    sys.exit(main())
