"""Issue 13 step 6: does a compiled append front end close the 4 KiB targets? (on demand)

    python bench/proto/compiled_front.py [--seconds 3] [--dir /var/tmp] [--cases 4K:64,4K:1]

Builds two small C programs with gcc (``appendload.c``, ``appendfront.c``; libcrypto for the
HMAC of AUTH) and measures, in one run, on the same disk, with the same load generator:

- the real ``sos-server`` (Python, trio), as bench/append.py starts it;
- ``appendfront``: the smallest compiled piece that could take the 4 KiB path out of Python,
  a one-thread epoll front end speaking the real protocol (HELLO/AUTH with the proof, APPEND
  with both CRCs checked, the shared write-ahead log with one fdatasync per round);
- raw ``write + fdatasync`` with as many threads as writers (bench/append.py's baseline).

The load generator is C (``appendload``: one thread, epoll, every writer authenticated, one
append in flight each), so that it is not what limits the rate: bench/append.py's Python
writers top out near the Python server's own rate on this 2-core machine. Server CPU per
append: the process's user+system CPU (psutil) over the measured seconds / appends.
Prints a Markdown table. Never run in CI; the figures are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(HERE))

from append import SERVER_ARGS, raw_case  # noqa: E402 - bench/append.py, after sys.path

from sos_server.storage import Storage  # noqa: E402
from tools.demo import LocalServer  # noqa: E402


def build(out: str) -> tuple[str, str]:
    paths = []
    for prog in ("appendload", "appendfront"):
        exe = os.path.join(out, prog)
        subprocess.run(
            ["gcc", "-O2", "-msse4.2", "-Wall", "-o", exe, os.path.join(HERE, f"{prog}.c"), "-lcrypto"], check=True
        )
        paths.append(exe)
    return paths[0], paths[1]


def cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def load(loader: str, port: int, ns: str, key: str, writers: int, size: int, seconds: float, server_pid: int) -> dict:
    """Run the C load generator; the server's CPU is read over the measured window (the
    loader warms up 0.5 s first)."""
    proc = subprocess.Popen(
        [loader, str(port), ns, key, str(writers), str(size), str(seconds)], stdout=subprocess.PIPE, text=True
    )
    time.sleep(0.5 + min(0.2, seconds / 10))
    c0, t0 = cpu(server_pid), time.monotonic()
    time.sleep(seconds - 2 * min(0.2, seconds / 10))
    c1, t1 = cpu(server_pid), time.monotonic()
    out, _ = proc.communicate(timeout=seconds + 60)
    if proc.returncode:
        raise SystemExit(f"appendload failed ({proc.returncode}): {out}")
    got = dict(kv.split("=") for kv in out.split())
    rate = int(got["appends"]) / float(got["seconds"])
    return {
        "rate": rate,
        "p50": float(got["p50_ms"]),
        "p99": float(got["p99_ms"]),
        "cpu_us": (c1 - c0) / (rate * (t1 - t0)) * 1e6 if rate else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--cases", default="4K:64,4K:1")
    args = ap.parse_args(argv)
    cases = [
        (int(s[:-1]) * (1024 if s.endswith("K") else 1 << 20), int(w))
        for s, w in (c.split(":") for c in args.cases.split(","))
    ]
    work = tempfile.mkdtemp(prefix="sos-proto-", dir=args.dir)
    rows = []
    try:
        loader, front = build(work)
        data = os.path.join(work, "data")
        key = Storage(data).keygen("bench", "append")
        server = LocalServer(data, os.path.join(work, "server.log"), args=SERVER_ARGS).start()
        try:
            port = int(server.address.rsplit(":", 1)[1])
            for size, writers in cases:
                r = load(loader, port, "bench", key, writers, size, args.seconds, server.pid)  # type: ignore[arg-type]
                rows.append(("sos-server (Python, trio)", size, writers, r))
        finally:
            server.stop()
        waldir = os.path.join(work, "front")
        os.makedirs(waldir)
        fp = subprocess.Popen([front, waldir, "bench", key], stdout=subprocess.PIPE, text=True)
        try:
            line = fp.stdout.readline() if fp.stdout else ""
            port = int(line.rsplit(":", 1)[1])
            for size, writers in cases:
                r = load(loader, port, "bench", key, writers, size, args.seconds, fp.pid)
                rows.append(("appendfront (C prototype)", size, writers, r))
        finally:
            fp.kill()
            fp.wait()
        rawdir = os.path.join(work, "raw")
        os.makedirs(rawdir)
        for size, writers in cases:
            res = raw_case(rawdir, size, writers, args.seconds)
            rows.append(
                (
                    "raw write+fdatasync (Python threads)",
                    size,
                    writers,
                    {
                        "rate": res.ops_s,
                        "p50": sorted(res.lat)[len(res.lat) // 2] * 1e3,
                        "p99": sorted(res.lat)[int(len(res.lat) * 0.99)] * 1e3,
                        "cpu_us": res.cpu / res.ops * 1e6 if res.cpu and res.ops else float("nan"),
                    },
                )
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("| system | append | writers | appends/s | p50 ms | p99 ms | CPU µs/append |")
    print("|---|---|---|---|---|---|---|")
    for name, size, writers, r in rows:
        print(
            f"| {name} | {size // 1024} KiB | {writers} | {r['rate']:,.0f} | {r['p50']:.2f} | {r['p99']:.2f} | "
            f"{r['cpu_us']:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
