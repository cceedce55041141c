"""CPU of one APPEND round trip: the blocking Client against the trio AsyncClient (issue 28 item 2, fifth round).

A real ``sos-server``; ``--appends`` appends of ``--size`` bytes one after the other on each
client; this process's CPU time (user + system, from getrusage) per append, the trio loop's
included for the AsyncClient. Then the gateway's reading of one Hadoop request head
(``parse_fast_head``, in a loop: the same head, its field block read again).

    python3 bench/round_trip.py [--appends 3000] [--size 300]

Run on demand (seconds), not a test.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trio  # noqa: E402

from bench.common import remove_work  # noqa: E402
from sos_client import Client  # noqa: E402
from sos_client.aio import AsyncClient  # noqa: E402
from spark_plugin.gateway.http.connection import parse_fast_head  # noqa: E402
from tools.demo import LocalServer, keygen  # noqa: E402

HEAD = (
    b"GET /webhdfs/v1/chk/q3/state/0/1/5.delta?op=GETFILESTATUS&user.name=spark HTTP/1.1\r\n"
    b"Authorization: Bearer " + b"A" * 180 + b"\r\n"
    b"User-Agent: Java/17.0.9\r\nHost: 127.0.0.1:9870\r\nAccept: */*\r\nConnection: keep-alive\r\n\r\n"
)


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--appends", type=int, default=3000)
    ap.add_argument("--size", type=int, default=300)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="sos-bench-rt-")
    data = os.path.join(work, "data")
    key = keygen(data, "ns")
    server = LocalServer(data, os.path.join(work, "server.log"))
    server.start()
    record = b"r" * args.size
    try:
        with Client(server.address, key, "ns", timeout=60) as client:
            offset = client.append("blocking", 0, record)
            started = cpu()
            for _ in range(args.appends):
                offset = client.append("blocking", offset, record)
            blocking = (cpu() - started) / args.appends

        async def run_async() -> float:
            aclient = AsyncClient(server.address, key, "ns", timeout=60)
            try:
                at = await aclient.append("async", 0, record)
                began = cpu()
                for _ in range(args.appends):
                    at = await aclient.append("async", at, record)
                return (cpu() - began) / args.appends
            finally:
                await aclient.aclose()

        async_cost = trio.run(run_async)
    finally:
        server.stop()
        remove_work(work, False)
    n = 100_000
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            parse_fast_head(HEAD, chunked=True)
        best = min(best, (time.perf_counter() - t) / n)
    print(
        f"APPEND of {args.size} bytes, x{args.appends}: blocking Client {blocking * 1e6:.0f} us CPU, "
        f"AsyncClient {async_cost * 1e6:.0f} us CPU (this process, trio's loop included); "
        f"parse_fast_head of a Hadoop head {best * 1e6:.2f} us; load average {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
