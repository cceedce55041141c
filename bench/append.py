#!/usr/bin/env python3
"""Append benchmark (run on demand, not in CI).

Measures throughput and latency (p50, p99) of 1 MiB and 4 KiB appends with 1, 8 and 64
writers against a REAL ``sos-server`` process, and prints them beside

- raw ``write + fdatasync`` on the same disk (same sizes, as many threads as writers,
  each on its own file), and
- pyftpdlib FTP ``APPE`` on the same workload (no fsync: FTP promises nothing).

Each writer has its own connection and its own object and keeps one append in flight
(append, wait for the durable ack, next): the latency is what a journal writer's barrier
sees. Usage::

    python bench/append.py --seconds 3 --dir /var/tmp/sos-bench
    python bench/append.py --cases 4K:64 --no-ftp --no-raw --profile /tmp/server.prof

Targets (docs/BENCHMARKS.md): 1 MiB appends >= 85% of raw write+fdatasync throughput with
the same number of writers (like for like: N SOS writers against N raw threads); 4 KiB from
64 writers >= 25,000 appends/s with p99 < 10 ms. ``bench/all.py`` runs issue 13's whole
table in one run and imports the cases from here.
"""

from __future__ import annotations

import argparse
import ftplib
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import trio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's code, and tools/

from sos_wire import events as ev  # noqa: E402 - after the checkout is on sys.path
from sos_wire.auth import Key  # noqa: E402
from sos_wire.connection import NEED_DATA, Connection, Role  # noqa: E402
from sos_wire.crc import crc32c  # noqa: E402
from tools.demo import LocalServer  # noqa: E402

SIZES = {"1M": 1 << 20, "4K": 4 << 10}
DEFAULT_CASES = "1M:1,1M:8,1M:64,4K:1,4K:8,4K:64"


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


class Result:
    def __init__(
        self, name: str, size: int, writers: int, ops: int, seconds: float, lat: list[float], cpu: float | None = None
    ) -> None:
        self.name, self.size, self.writers, self.ops, self.seconds, self.lat = name, size, writers, ops, seconds, lat
        self.cpu = cpu  # server CPU seconds during the case (user + system), if known

    @property
    def ops_s(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    @property
    def mb_s(self) -> float:
        return self.ops_s * self.size / 1e6

    def row(self) -> str:
        return (
            f"| {self.name} | {_size_name(self.size)} | {self.writers} | {self.ops_s:,.0f} | {self.mb_s:,.1f} | "
            f"{pct(self.lat, 50) * 1e3:.2f} | {pct(self.lat, 99) * 1e3:.2f} | {self.cpu_per_op} |"
        )

    @property
    def cpu_per_op(self) -> str:
        if self.cpu is None or not self.ops:
            return "-"
        return f"{self.cpu / self.ops * 1e6:,.0f}"


def _size_name(size: int) -> str:
    return "1 MiB" if size == 1 << 20 else f"{size // 1024} KiB"


HEADER = (
    "| system | append | writers | appends/s | MB/s | p50 ms | p99 ms | CPU µs/append (server or raw process) |\n"
    "|---|---|---|---|---|---|---|---|"
)


# -- raw disk baseline ---------------------------------------------------------------------
def raw_case(directory: str, size: int, writers: int, seconds: float) -> Result:
    data = os.urandom(size)
    lat: list[list[float]] = [[] for _ in range(writers)]
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        path = os.path.join(directory, f"raw-{size}-{writers}-{i}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        try:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                os.write(fd, data)
                os.fdatasync(fd)
                lat[i].append(time.perf_counter() - t0)
        finally:
            os.close(fd)
            os.unlink(path)

    t0 = time.monotonic()
    cpu0 = _cpu(os.getpid())
    threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    cpu = _cpu(os.getpid()) - cpu0
    all_lat = [x for ls in lat for x in ls]
    return Result("raw write+fdatasync", size, writers, len(all_lat), elapsed, all_lat, cpu)


# -- sos-server ------------------------------------------------------------------------------
#: every writer connects from 127.0.0.1 at once: the server's default of 8 connections not
#: yet authenticated per address (a defence against one host hogging the handshake) would
#: answer BUSY to the 64-writer cases; that limit is not what is measured here
SERVER_ARGS = ["--log-level", "warning", "--max-unauthenticated-per-address", "128"]


def start_server(data: str, profile: str | None = None) -> LocalServer:
    """A real ``sos-server`` with metrics on (the shared launcher, tools.demo.LocalServer)."""
    return LocalServer(
        data, os.path.join(os.path.dirname(data), "server.log"), metrics=True, args=SERVER_ARGS, profile=profile
    ).start()


def sync_stats(server: LocalServer) -> tuple[float, float, float]:
    """(group-commit batches, seconds spent in them, fdatasync calls) so far."""
    import urllib.request

    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=30) as r:
        text = r.read().decode()
    vals = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
    return vals["sos_sync_seconds_count"], vals["sos_sync_seconds_sum"], vals["sos_synced_files_total"]


def _address(server: LocalServer) -> tuple[str, int]:
    host, port = server.address.rsplit(":", 1)
    return host, int(port)


async def _writer(address, key: Key, ns: str, name: str, size: int, stop_at: float, warm_at: float, out: list):
    stream = await trio.open_tcp_stream(*address)
    conn = Connection(Role.CLIENT)

    async def call(event):
        await stream.send_all(conn.send(event))
        while True:
            e = conn.next_event()
            if e is not NEED_DATA:
                return e
            conn.receive_data(await stream.receive_some(1 << 16))

    hello = await call(ev.Hello(conn.next_request_id(), "bench", 1, 1))
    auth = await call(ev.Auth(conn.next_request_id(), key.key_id, ns, key.proof(hello.nonce, ns)))
    assert isinstance(auth, ev.AuthOk), auth
    data = os.urandom(size)
    crc = crc32c(data)
    offset = 0
    lat = []
    ops = 0
    while True:
        now = trio.current_time()
        if now >= stop_at:
            break
        t0 = time.perf_counter()
        r = await call(ev.Append(conn.next_request_id(), name, offset, 0, crc, data))
        dt = time.perf_counter() - t0
        if not isinstance(r, ev.AppendOk):
            raise RuntimeError(f"append failed: {r}")
        offset = r.length
        if now >= warm_at:
            lat.append(dt)
            ops += 1
    await stream.aclose()
    out.append((ops, lat))


def _cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def sos_case(server: LocalServer, key: Key, ns: str, size: int, writers: int, seconds: float, tag: str) -> Result:
    out: list = []
    warm = min(0.5, seconds / 4)
    cpu0 = _cpu(server.pid)
    s0 = sync_stats(server)
    address = _address(server)

    async def main():
        start = trio.current_time()
        async with trio.open_nursery() as n:
            for i in range(writers):
                n.start_soon(
                    _writer, address, key, ns, f"bench/{tag}/{i}", size, start + warm + seconds, start + warm, out
                )

    trio.run(main)
    cpu = _cpu(server.pid) - cpu0
    s1 = sync_stats(server)
    batches, busy, files = (b - a for a, b in zip(s0, s1))
    if batches:
        print(
            f"<!-- {writers} x {_size_name(size)}: {batches:.0f} group commits, {busy / batches * 1e3:.2f} ms each, "
            f"{files / batches:.1f} files/batch, syncer busy {busy / (seconds + warm):.0%} -->",
            flush=True,
        )
    lat = [x for _, ls in out for x in ls]
    ops = sum(o for o, _ in out)
    # CPU covers the warm-up too: scale it to the measured share of the appends
    total = ops * (seconds + warm) / seconds if ops else 0
    return Result("sos-server", size, writers, ops, seconds, lat, cpu * ops / total if total else None)


# -- FTP APPE --------------------------------------------------------------------------------
class FtpServer:
    def __init__(self, root: str) -> None:
        os.makedirs(root, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        code = (
            "import logging, sys\n"
            "from pyftpdlib.authorizers import DummyAuthorizer\n"
            "from pyftpdlib.handlers import FTPHandler\n"
            "from pyftpdlib.servers import FTPServer\n"
            "logging.disable(logging.CRITICAL)\n"
            "a = DummyAuthorizer(); a.add_user('u', 'p', sys.argv[1], perm='elradfmwMT')\n"
            "FTPHandler.authorizer = a\n"
            "s = FTPServer(('127.0.0.1', int(sys.argv[2])), FTPHandler); s.max_cons = 1024\n"
            "s.serve_forever()\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, root, str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.pid = self.proc.pid
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("pyftpdlib server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def ftp_case(ftp: FtpServer, size: int, writers: int, seconds: float, tag: str) -> Result:
    data = os.urandom(size)
    warm = min(0.5, seconds / 4)
    start = time.monotonic()
    out: list = []
    cpu0 = _cpu(ftp.pid)

    def run(i: int) -> None:
        c = ftplib.FTP()
        c.connect("127.0.0.1", ftp.port, timeout=60)
        c.login("u", "p")
        lat, ops = [], 0
        while True:
            now = time.monotonic()
            if now >= start + warm + seconds:
                break
            t0 = time.perf_counter()
            c.storbinary(f"APPE {tag}-{i}", io.BytesIO(data), blocksize=1 << 20)
            dt = time.perf_counter() - t0
            if now >= start + warm:
                lat.append(dt)
                ops += 1
        c.quit()
        out.append((ops, lat))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = _cpu(ftp.pid) - cpu0
    lat = [x for _, ls in out for x in ls]
    ops = sum(o for o, _ in out)
    total = ops * (seconds + warm) / seconds if ops else 0
    return Result("pyftpdlib APPE (no fsync)", size, writers, ops, seconds, lat, cpu * ops / total if total else None)


def verdicts(results: list[Result]) -> list[str]:
    """The targets, judged like for like: SOS with N writers against raw write+fdatasync
    with N threads (same append size, same run), never against another writer count."""

    def find(name: str, size: int, writers: int) -> Result | None:
        return next((r for r in results if r.name.startswith(name) and r.size == size and r.writers == writers), None)

    lines = []
    for r in sorted((r for r in results if r.name == "sos-server" and r.size == 1 << 20), key=lambda r: r.writers):
        raw = find("raw", 1 << 20, r.writers)
        if raw is None or not raw.mb_s:
            continue
        ratio = r.mb_s / raw.mb_s
        lines.append(
            f"target 1 MiB >= 85% of raw, {r.writers} writer(s) vs {raw.writers} raw thread(s): "
            f"sos {r.mb_s:.1f} MB/s = {ratio:.0%} of raw {raw.mb_s:.1f} MB/s"
            f" -> {'MET' if ratio >= 0.85 else 'MISSED'}"
        )
    r = find("sos-server", 4096, 64)
    if r is not None:
        ok = r.ops_s >= 25000 and pct(r.lat, 99) < 0.010
        lines.append(
            f"target 4 KiB x 64 >= 25,000/s, p99 < 10 ms: {r.ops_s:,.0f}/s, p99 {pct(r.lat, 99) * 1e3:.2f} ms"
            f" -> {'MET' if ok else 'MISSED'}"
        )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per case (after 0.5 s warm-up)")
    p.add_argument("--dir", default=None, help="where data goes (default: a temp dir under /var/tmp)")
    p.add_argument("--cases", default=DEFAULT_CASES, help="SIZE:WRITERS,... with SIZE in 1M, 4K")
    p.add_argument("--no-raw", action="store_true")
    p.add_argument("--no-ftp", action="store_true")
    p.add_argument("--profile", default=None, help="run the server under cProfile, write stats here")
    args = p.parse_args(argv)
    from sos_server.listener import tune_malloc

    tune_malloc()  # the load generator is Python too: spare the shared CPUs its page faults

    base = tempfile.mkdtemp(prefix="sos-bench-", dir=args.dir or "/var/tmp")
    cases = [(SIZES[c.split(":")[0]], int(c.split(":")[1])) for c in args.cases.split(",")]
    results: list[Result] = []
    print(f"# data under {base} ({os.cpu_count()} cpus); {args.seconds:g} s per case", flush=True)
    print(HEADER, flush=True)
    try:
        if not args.no_raw:
            raw_dir = os.path.join(base, "raw")
            os.makedirs(raw_dir)
            for size, writers in sorted({(s, w) for s, w in cases}):
                r = raw_case(raw_dir, size, writers, args.seconds)
                results.append(r)
                print(r.row(), flush=True)
        data = os.path.join(base, "sos", "data")
        os.makedirs(data)
        from sos_server.storage import Storage

        key = Key.parse(Storage(data).keygen("bench", "append"))
        server = start_server(data, args.profile)
        try:
            for size, writers in cases:
                r = sos_case(server, key, "bench", size, writers, args.seconds, f"{size}-{writers}")
                results.append(r)
                print(r.row(), flush=True)
        finally:
            server.stop()
        if not args.no_ftp:
            ftp = FtpServer(os.path.join(base, "ftp"))
            try:
                for size, writers in cases:
                    r = ftp_case(ftp, size, writers, args.seconds, f"{size}-{writers}")
                    results.append(r)
                    print(r.row(), flush=True)
            finally:
                ftp.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print()
    for line in verdicts(results):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
