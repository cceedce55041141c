"""Reading the tier's bucket at many pieces per object (issue 26 item 3; on demand, not in CI).

    python bench/tier_pieces.py [--pieces 8000 32000] [--files 64]

Journals FILES files of 8 KiB into a real `sos-server`, copies its objects into a `file://`
tier, the largest object (the segment) cut into PIECES pieces (as an object that grew by that
many small appends was before pieces were merged), the others in one piece each, and times
`sos verify -q NS --from file://...` (a subprocess each; its peak RSS from /usr/bin/time when
there is one). Linear reading means x4 pieces costs about x4 time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sos_client import Client  # noqa: E402 - after the checkout is on sys.path
from sos_journal import JournaledTree, JournalWriter  # noqa: E402
from sos_journal.rebuild.restore import rebuild_cache  # noqa: E402
from sos_tier import LocalStore  # noqa: E402
from sos_tier.layout import piece_key, seal_content, seal_key  # noqa: E402
from sos_wire.crc import crc32c  # noqa: E402
from tools.server import ServerProcess  # noqa: E402


def put(store: LocalStore, key: str, data: bytes) -> None:
    """A key as LocalStore lays it out, without put_once's fsyncs (tens of thousands of keys)."""
    path = os.path.join(store.root, *key.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def copy(store: LocalStore, ns: str, objects: dict[str, tuple[bytes, bool]], pieces: int) -> str:
    """The objects into *store*, the largest one in *pieces* pieces; returns its name."""
    big = max(objects, key=lambda n: len(objects[n][0]))
    for name, (data, sealed) in objects.items():
        n = pieces if name == big else 1
        step = max(1, -(-len(data) // n))
        for b in range(0, len(data), step):
            chunk = data[b : b + step]
            put(store, piece_key(ns, name, b, b + len(chunk), crc32c(chunk)), chunk)
        if not data:
            put(store, piece_key(ns, name, 0, 0, 0), b"")
        if sealed:
            put(store, seal_key(ns, name, len(data)), seal_content(None))
    return big


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pieces", type=int, nargs="+", default=[8000, 32000])
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--keep", action="store_true", help="keep the tiers (printed) for a profile")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="sos-tier-pieces-")
    srv = ServerProcess(f"{base}/data", log_path=f"{base}/server.log").start()
    try:
        ns = "bench"
        key = srv.keygen(ns, "append")

        def fac() -> Client:
            return Client(srv.address, key, ns, timeout=60)

        w = JournalWriter(fac, ns, f"{base}/spool")
        t = JournaledTree(f"{base}/cache", w, rebuild=rebuild_cache).open()
        blob = os.urandom(8192)
        for i in range(args.files):
            t.create(f"f{i}")
            t.write(f"f{i}", 0, blob[i:] + blob[:i])
        t.close()
        objects = {}
        with fac() as c:
            for e in c.list(""):
                objects[e.name] = (c.read(e.name), bool(e.sealed))
        timer = ["/usr/bin/time", "-f", "peak RSS %M KiB"] if os.path.exists("/usr/bin/time") else []
        if args.keep:
            print(f"tiers kept under {base}", flush=True)
        for n in args.pieces:
            url = f"file://{base}/tier-{n}"
            big = copy(LocalStore(url), ns, objects, n)
            t0 = time.monotonic()
            r = subprocess.run(
                [*timer, sys.executable, "-m", "sos_client.cli", "verify", "-q", ns, "--from", url],
                capture_output=True,
                text=True,
            )
            dt = time.monotonic() - t0
            if r.returncode != 0:
                print(r.stdout, r.stderr, file=sys.stderr)
                return 1
            rss = r.stderr.strip().splitlines()[-1] if timer else ""
            size = len(objects[big][0])
            print(f"sos verify --from, {n:6d} pieces of {big} ({size} bytes): {dt:6.2f} s  {rss}", flush=True)
    finally:
        srv.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
