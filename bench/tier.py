"""The object-store tier's lag at a crash (issue 19 item 2): how many acknowledged bytes, and how
many seconds of them, were not yet in the bucket when the server was SIGKILLed under load.

One run: moto's S3 server (its own process, 127.0.0.1) and a real ``sos-server serve --tier``
with the default --tier-interval (1 s) and --tier-bytes (8 MiB) unless given; W writer threads
append to objects of their own (one request in flight each) for --load seconds, then the server
is SIGKILLed while they write. Right after the kill the bucket is listed (every piece's CRC
checked): per object, the acknowledged bytes beyond the bucket's length are the **lost bytes if
the server's disk had gone with it**, and the age of the oldest of them (the time since it was
acknowledged) is the **lag in seconds**. The server is restarted on its data directory to check
that it uploads the rest (nothing lost, no problem in the bucket). Repeated --kills times.

    python bench/tier.py                       # defaults: 4 writers, 64 KiB appends, 10 s, 5 kills
    python bench/tier.py --writers 8 --size 4KiB --kills 3
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import add_server_arg, doc_parser, moto_work  # noqa: E402
from sos_wire import NEED_DATA, Connection, Key, Role, argtypes, crc32c  # noqa: E402
from sos_wire import events as ev  # noqa: E402

MIB = 1 << 20


class Writer(threading.Thread):
    """Appends *size*-byte blocks to one object, one request in flight; keeps (time, length) of
    every acknowledgement."""

    def __init__(self, address: str, key: str, ns: str, name: str, size: int) -> None:
        super().__init__(daemon=True)
        self.address, self.key, self.ns, self.name, self.size = address, key, ns, name, size
        self.acks: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            conn, sock = connect(self.address, self.key, self.ns)
            with sock:
                block = os.urandom(self.size)
                crc = crc32c(block)
                n = 0
                while not self.stop.is_set():
                    r = call(conn, sock, ev.Append(conn.next_request_id(), self.name, n, 0, crc, block))
                    if not isinstance(r, ev.AppendOk):
                        return
                    n = r.length
                    self.acks.append((time.monotonic(), n))
        except (OSError, EOFError):  # the kill: what was acknowledged is in self.acks
            return


def call(conn, sock: socket.socket, event):
    sock.sendall(conn.send(event))
    while True:
        got = conn.next_event()
        if got is not NEED_DATA:
            return got
        data = sock.recv(1 << 20)
        if not data:
            raise EOFError("server closed the connection")
        conn.receive_data(data)


def connect(address: str, key: str, ns: str):
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    conn = Connection(Role.CLIENT)
    hello = call(conn, sock, ev.Hello(conn.next_request_id(), "bench-tier", 1, 1))
    k = Key.parse(key)
    ok = call(conn, sock, ev.Auth(conn.next_request_id(), k.key_id, ns, k.proof(hello.nonce, ns, b"")))
    if not isinstance(ok, ev.AuthOk):
        raise SystemExit(f"AUTH failed: {ok}")
    return conn, sock


def one_run(i: int, args, env: dict[str, str], url: str, work: str) -> dict[str, float]:
    from sos_tier import open_store, scan
    from tools.server import ServerProcess

    data = os.path.join(work, f"data{i}")
    srv = ServerProcess(
        data, ["--tier", url, *args.server_arg], log_path=os.path.join(work, f"server{i}.log"), metrics=False
    )
    os.environ.update(env)
    srv.start()
    ns = f"bench{i}"
    key = srv.keygen(ns)
    writers = [Writer(srv.address, key, ns, f"obj{w}", args.size) for w in range(args.writers)]
    t0 = time.monotonic()
    for w in writers:
        w.start()
    time.sleep(args.load)
    srv.kill()
    t_kill = time.monotonic()
    for w in writers:
        w.stop.set()
        w.join(30)
    time.sleep(0.5)  # a PUT the dead server had fully sent may still complete at the store
    store = open_store(url)
    try:
        state = scan(store, ns, verify=True).get(ns)
    finally:
        store.close()
    lost = 0
    oldest: float | None = None
    acked = 0
    for w in writers:
        if not w.acks:
            continue
        top = w.acks[-1][1]
        acked += top
        have = state.objects[w.name].length if state is not None and w.name in state.objects else 0
        lost += max(0, top - have)
        for t, n in w.acks:
            if n > have:
                oldest = t if oldest is None else min(oldest, t)
                break
    problems = len(state.all_problems()) if state is not None else 0
    # restart: the server uploads the rest
    srv.start()
    done = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        store = open_store(url)
        try:
            st = scan(store, ns).get(ns)
        finally:
            store.close()
        if st is not None and all(
            w.name in st.objects and st.objects[w.name].length >= (w.acks[-1][1] if w.acks else 0) for w in writers
        ):
            done = time.monotonic()
            break
        time.sleep(0.2)
    restart_s = (done - t_kill) if done else float("nan")
    srv.stop()
    shutil.rmtree(data, ignore_errors=True)
    return {
        "rate": acked / (t_kill - t0) / MIB,
        "acked": acked / MIB,
        "lost_bytes": lost,
        "lag_s": (t_kill - oldest) if oldest is not None else 0.0,
        "problems": problems,
        "complete_after_restart": 1.0 if done else 0.0,
        "restart_s": restart_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = doc_parser(__doc__)
    p.add_argument("--writers", type=argtypes.integer(1), default=4, help="writer threads (default 4)")
    p.add_argument("--size", type=argtypes.size(1), default=64 << 10, help="bytes per append (default 64KiB)")
    p.add_argument("--load", type=argtypes.duration, default=10.0, help="seconds of load before the kill (default 10s)")
    p.add_argument("--kills", type=argtypes.integer(1), default=5, help="runs (default 5)")
    add_server_arg(p)
    args = p.parse_args(argv)
    with moto_work("sos-bench-tier-") as (work, env):
        url = "s3://bench/sos"
        print(
            f"sos-server --tier {url} {' '.join(args.server_arg) or '(defaults: --tier-interval 1s --tier-bytes 8MiB)'};"
            f" {args.writers} writers x {args.size} B appends"
            f", {args.load:g} s of load, then SIGKILL; moto at {env['AWS_ENDPOINT_URL']}"
        )
        rows = []
        for i in range(args.kills):
            r = one_run(i, args, env, url, work)
            rows.append(r)
            print(
                f"run {i + 1}: {r['rate']:.1f} MiB/s acknowledged, at the kill {r['lost_bytes'] / MIB:.2f} MiB"
                f" ({r['lost_bytes']} bytes) not in the bucket, oldest {r['lag_s']:.2f} s old; bucket problems"
                f" {r['problems']}; after restart complete: {'yes' if r['complete_after_restart'] else 'NO'}"
                f" ({r['restart_s']:.1f} s after the kill)",
                flush=True,
            )
        lost = [r["lost_bytes"] / MIB for r in rows]
        lag = [r["lag_s"] for r in rows]
        print(
            f"lag at the kill: median {statistics.median(lost):.2f} MiB / {statistics.median(lag):.2f} s,"
            f" max {max(lost):.2f} MiB / {max(lag):.2f} s over {len(rows)} kills;"
            f" load median {statistics.median(r['rate'] for r in rows):.1f} MiB/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
