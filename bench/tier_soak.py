"""Pieces per object stay bounded (issue 29 item 5): a gateway pair with ``--lease 1`` on a server
with ``--tier``, soaked for ``--minutes`` (default 10) under a small write load (on demand, not
in CI).

One run: moto's S3 server (its own process, 127.0.0.1), one real ``sos-server serve --tier
s3://bench/sos`` (its defaults: --tier-flush 100ms, --tier-compact 30s, unless --server-arg
says otherwise), an active ``sos gateway --lease 1`` and a ``--standby --lease 1`` beside it
(both ``--durability tier`` unless --durability server). The lease alone renews every few
hundred ms: before the batched log each renewal left a piece of its own in the bucket (32
pieces in 8 s). A WebHDFS client commits a batch every --batch seconds as Spark does (a small
``offsets/N``, a temporary file renamed onto ``commits/N``) through the active (the standby if
the active refuses). Every --every seconds a row: the bucket listing read as a reader does
(``sos_tier.scan``: the most pieces any object has, which object, the mean, the pieces still
in flushed objects, the flushed objects ``v1/log/`` listed) and the server's metrics
(``sos_tier_flushes_total``, ``sos_tier_flushed_objects_left``, ``sos_tier_object_pieces``,
``sos_tier_requests_total`` by operation). At the end: S3 requests per hour by operation, the
server's CPU seconds, the load average, and whether the most pieces per object stopped growing
(the last third of the run's rows against the whole run's maximum).

    python bench/tier_soak.py                       # 10 minutes
    python bench/tier_soak.py --minutes 2 --every 15 --server-arg=--tier-compact=10s
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import add_server_arg, cpu_seconds, doc_parser, free_port, moto_work, scrape  # noqa: E402

NS = "soak"
URL = "s3://bench/sos"
OPS = ("put", "get", "list", "delete")


def req(op: str) -> str:
    """The metric of the store's requests of one operation."""
    return 'sos_tier_requests_total{op="' + op + '"}'


class Load:
    """Spark-like batches through WebHDFS, one every ``period`` seconds, on whichever gateway
    takes them (the active; after a promotion the other)."""

    def __init__(self, urls: list[str], key: str, period: float) -> None:
        self.urls = urls
        self.key = key
        self.period = period
        self.batches = 0
        self.refused = 0
        self.stop = threading.Event()
        self.error = ""
        self._at = 0
        self._token = ""
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _auth(self) -> dict[str, str]:
        if not self._token:
            for u in (self.urls[self._at], *self.urls):
                try:
                    r = requests.post(
                        u + "/oauth2/token",
                        data={"grant_type": "client_credentials", "client_id": NS, "client_secret": self.key},
                        timeout=30,
                    )
                    r.raise_for_status()
                    self._token = str(r.json()["access_token"])
                    break
                except requests.RequestException:
                    continue
        return {"Authorization": f"Bearer {self._token}"}

    def _put(self, path: str, op: str, data: bytes | None = None, **params: str) -> None:
        """One WebHDFS PUT (CREATE follows its redirect) on the gateway that takes it."""
        for _ in range(2 * len(self.urls) + 2):
            u = self.urls[self._at]
            try:
                q = "&".join(f"{k}={v}" for k, v in {"op": op, **params}.items())
                r = requests.put(f"{u}/webhdfs/v1/{path}?{q}", headers=self._auth(), allow_redirects=False, timeout=60)
                if r.status_code == 307:
                    r = requests.put(r.headers["Location"], data=data or b"", headers=self._auth(), timeout=60)
                if r.status_code in (200, 201):
                    return
                if r.status_code == 401:
                    self._token = ""
            except requests.RequestException:
                pass
            self.refused += 1
            self._at = (self._at + 1) % len(self.urls)
            time.sleep(0.5)
        raise RuntimeError(f"{op} {path}: no gateway took it")

    def _run(self) -> None:
        try:
            n = 0
            while not self.stop.is_set():
                t = time.monotonic()
                self._put(f"chk/offsets/{n}", "CREATE", b'v1\n{"batchWatermarkMs":0}\n{"logOffset":%d}' % n)
                self._put(f"chk/commits/.{n}.tmp", "CREATE", b'v1\n{"nextBatchWatermarkMs":0}')
                self._put(f"chk/commits/.{n}.tmp", "RENAME", destination=f"/chk/commits/{n}")
                n += 1
                self.batches = n
                self.stop.wait(max(0.0, self.period - (time.monotonic() - t)))
        except Exception as exc:  # reported at the end
            self.error = f"{type(exc).__name__}: {exc}"


def bucket_pieces() -> dict[str, object]:
    """The bucket as a reader sees it: the most pieces any object's run has (and its name),
    the most compacted pieces (not in a flushed object) any object has, the lease object's
    pieces, the mean, pieces still in flushed objects, flushed objects listed."""
    from sos_tier import open_store, scan

    store = open_store(URL)
    try:
        states = scan(store)
        objs = [o for st in states.values() for o in st.objects.values() if o.exists]
        flushed_keys = sum(1 for _ in store.list("v1/log/"))
    finally:
        store.close()
    top = max(objs, key=lambda o: len(o.pieces), default=None)
    return {
        "objects": len(objs),
        "max": len(top.pieces) if top else 0,
        "max_name": top.name if top else "",
        "compacted": max((sum(1 for p in o.pieces if not p.flushed) for o in objs), default=0),
        "lease": max((len(o.pieces) for o in objs if o.name.startswith("lease/")), default=0),
        "mean": sum(len(o.pieces) for o in objs) / max(1, len(objs)),
        "in_flushed": sum(1 for o in objs for p in o.pieces if p.flushed),
        "flushed_objects": flushed_keys,
    }


def start_pair(srv, key: str, work: str, durability: str, lease: float) -> list:
    from spark_plugin.gateway.process import GatewayProcess

    gws = []
    for i, extra in enumerate(([], ["--standby"])):
        gws.append(
            GatewayProcess(
                NS,
                os.path.join(work, f"gw{i}-cache"),
                srv.address,
                key,
                listen=f"127.0.0.1:{free_port()}",
                extra_args=["--lease", f"{lease:g}", *extra],
                log_path=os.path.join(work, f"gateway{i}.log"),
                durability=durability,
                start_timeout=300,
            ).start()
        )
    return gws


def sample(srv, t0: float, m0: dict) -> dict[str, object]:
    m = scrape(srv)
    b = bucket_pieces()
    hist_n = m.get("sos_tier_object_pieces_count", 0.0)
    row = {
        "t": time.monotonic() - t0,
        **b,
        "flushes": m.get("sos_tier_flushes_total", 0.0) - m0.get("sos_tier_flushes_total", 0.0),
        "left": m.get("sos_tier_flushed_objects_left", 0.0),
        "hist_mean": m.get("sos_tier_object_pieces_sum", 0.0) / hist_n if hist_n else 0.0,
        "puts": m.get(req("put"), 0.0) - m0.get(req("put"), 0.0),
    }
    return row


def main(argv: list[str] | None = None) -> int:
    p = doc_parser(__doc__)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the pair runs (default 10)")
    p.add_argument("--every", type=float, default=60.0, help="seconds between rows (default 60)")
    p.add_argument("--batch", type=float, default=1.0, help="seconds between batches of the load (default 1)")
    p.add_argument("--lease", type=float, default=1.0, help="--lease of the gateways (default 1)")
    p.add_argument("--durability", choices=("tier", "server"), default="tier", help="the gateways' (default tier)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    add_server_arg(p)
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.every <= 0 or args.batch <= 0:
        p.error("--minutes, --every and --batch must be positive")
    from tools.server import ServerProcess

    with moto_work("sos-bench-tier-soak-") as (work, _env):
        srv = ServerProcess(
            os.path.join(work, "data"), ["--tier", URL, *args.server_arg], log_path=os.path.join(work, "server.log")
        ).start()
        gws: list = []
        load = None
        try:
            key = srv.keygen(NS)
            gws = start_pair(srv, key, work, args.durability, args.lease)
            load = Load([g.url for g in gws], key, args.batch)
            m0, c0, t0 = scrape(srv), cpu_seconds(srv.pid), time.monotonic()
            load.thread.start()
            print(
                f"gateway pair --lease {args.lease:g} --durability {args.durability}, a batch every"
                f" {args.batch:g} s, {args.minutes:g} min; sos-server --tier {URL} {' '.join(args.server_arg)}"
            )
            print(
                "| min | batches | flushes | PUTs | objects | most pieces (object) | most compacted | lease |"
                " mean | in flushed | v1/log | left |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            rows = []
            end = t0 + 60 * args.minutes
            while True:
                time.sleep(max(0.0, min(args.every, end - time.monotonic())))
                r = sample(srv, t0, m0)
                rows.append(r)
                print(
                    f"| {r['t'] / 60:.1f} | {load.batches} | {r['flushes']:.0f} | {r['puts']:.0f} | {r['objects']}"
                    f" | {r['max']} ({r['max_name']}) | {r['compacted']} | {r['lease']} | {r['mean']:.1f} |"
                    f" {r['in_flushed']} |"
                    f" {r['flushed_objects']} | {r['left']:.0f} |",
                    flush=True,
                )
                if time.monotonic() >= end or load.error:
                    break
            m1, c1, elapsed = scrape(srv), cpu_seconds(srv.pid), time.monotonic() - t0
            load.stop.set()
            load.thread.join(120)
            report(args, rows, m0, m1, elapsed, c1 - c0, load, gws)
            return 1 if load.error else 0
        finally:
            if load is not None:
                load.stop.set()
            for g in gws:
                g.kill()
            srv.stop()
            if args.keep:
                kept = work + "-kept"
                shutil.copytree(work, kept, dirs_exist_ok=True)
                print(f"kept {kept}")


def report(args, rows: list[dict], m0: dict, m1: dict, elapsed: float, cpu: float, load: Load, gws: list) -> None:
    def d(k: str) -> float:
        return m1.get(k, 0.0) - m0.get(k, 0.0)

    print(
        f"{load.batches} batches in {elapsed / 60:.1f} min ({load.refused} requests retried on the other gateway)"
        + (f"; the load stopped: {load.error}" if load.error else "")
    )
    promotions = sum(g.log().count("standby: promoted") for g in gws)
    print(f"standby promotions: {promotions}")
    print(
        "S3 requests per hour (the whole server, one query): "
        + ", ".join(f"{op} {d(req(op)) * 3600 / elapsed:.0f}" for op in OPS)
    )
    print(f"flushes {d('sos_tier_flushes_total'):.0f} = {d('sos_tier_flushes_total') / elapsed:.2f}/s")
    print(
        f"server CPU {cpu:.1f} s = {1000 * cpu / max(1, load.batches):.1f} ms per batch;"
        f" load average {os.getloadavg()[0]:.1f}"
    )
    cut = len(rows) - max(1, len(rows) // 3)
    early = max((r["compacted"] for r in rows[:cut]), default=0)
    late = max((r["compacted"] for r in rows[cut:]), default=0)
    verdict = "no new high in the last third" if cut and late <= early else "a new high in the last third"
    print(f"most compacted pieces per object: {early} before the last third of the rows, {late} in it ({verdict})")
    per_pass = d("sos_tier_flushes_total") / elapsed * compact_seconds(args.server_arg)
    print(
        f"most pieces per object a reader saw: {max((r['max'] for r in rows), default=0)} (the compacted ones and"
        f" those in flushed objects waiting for the next compaction pass: ~{per_pass:.0f} flushes per pass)"
    )
    hist = sorted(
        (float(k.split('le="')[1].split('"')[0]), v)
        for k, v in m1.items()
        if k.startswith("sos_tier_object_pieces_bucket")
    )
    cum = ", ".join(f"<={le:g}: {v:.0f}" for le, v in hist)
    print(f"sos_tier_object_pieces (pieces per object each compaction wrote), cumulative: {cum}")


def compact_seconds(server_args: list[str]) -> float:
    """The server's --tier-compact in seconds (its default 30 s unless ``server_args`` say)."""
    from sos_wire import argtypes

    for a in server_args:
        if a.startswith("--tier-compact="):
            return float(argtypes.duration(a.split("=", 1)[1]))
    return 30.0


if __name__ == "__main__":
    sys.exit(main())
