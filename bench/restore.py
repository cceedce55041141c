"""Restore benchmark (on demand, not in CI): `sos restore` of a ~1 GiB tree vs `cp -r`.

    python bench/restore.py [--small 20000] [--large 4] [--large-mib 160] [--workdir DIR] [--runs 2]

Builds a tree of many small files (1-32 KiB, in 100 directories) and a few large ones,
journals it into a real `sos-server` (started here on 127.0.0.1:0) as generation 1's
snapshot, then times, in the same run and alternating: `cp -r SRC DST` and `restore()`
(reads over the protocol, verifies every CRC, replays into an empty directory). Both read
from the page cache (the source tree / the server's object files) and write to the same
filesystem. Checks the restored tree equals the source, prints the figures and the ratio.
Target: restore >= 80% of cp's speed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def start_server(data_dir: str):
    log = open(os.path.join(os.path.dirname(data_dir), "server.log"), "w+b")
    proc = subprocess.Popen([sys.executable, "-m", "sos_server.cli", "serve", "--data", data_dir,
                             "--listen", "127.0.0.1:0"], stdout=log, stderr=log, cwd=ROOT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        log.seek(0)
        for line in log.read().decode(errors="replace").splitlines():
            if line.startswith("sos-server listening on "):
                return proc, line.rsplit(" ", 1)[1].strip()
        if proc.poll() is not None:
            raise SystemExit("sos-server exited early; see " + log.name)
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("sos-server did not start")


def build_tree(src: str, n_small: int, n_large: int, large_mib: int) -> int:
    rnd = random.Random(42)
    total = 0
    blob = os.urandom(4 << 20)
    for i in range(n_small):
        d = os.path.join(src, "state", f"{i % 100:03d}")
        os.makedirs(d, exist_ok=True)
        size = rnd.randint(1 << 10, 32 << 10)
        off = rnd.randrange(0, len(blob) - size)
        with open(os.path.join(d, f"{i}.delta"), "wb") as f:
            f.write(blob[off:off + size])
        total += size
    os.makedirs(os.path.join(src, "big"), exist_ok=True)
    for j in range(n_large):
        with open(os.path.join(src, "big", f"{j}.zip"), "wb") as f:
            for k in range(large_mib):
                f.write(blob[(k * 4096) % (3 << 20):][:1 << 20])
        total += large_mib << 20
    return total


def tree_digest(root: str) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = os.path.join(dirpath, name)
            h.update(os.path.relpath(p, root).encode() + b"\0")
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=20000, help="number of small files (1-32 KiB)")
    ap.add_argument("--large", type=int, default=4, help="number of large files")
    ap.add_argument("--large-mib", type=int, default=160, help="size of each large file in MiB")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    from sos_client import Client
    from sos_client.journal import JournaledTree, JournalWriter, restore
    from sos_server.storage import Storage

    work = tempfile.mkdtemp(prefix="sos-bench-restore-", dir=args.workdir)
    server = None
    try:
        src = os.path.join(work, "src")
        t0 = time.monotonic()
        total = build_tree(src, args.small, args.large, args.large_mib)
        n_files = args.small + args.large
        print(f"tree: {n_files} files, {total / 2**20:.0f} MiB (built in {time.monotonic() - t0:.1f}s)")
        digest = tree_digest(src)

        data = os.path.join(work, "data")
        os.makedirs(data)
        server, address = start_server(data)
        ns = "bench"
        out = subprocess.run([sys.executable, "-m", "sos_server.cli", "keygen", "--data", data, ns,
                              "--role", "append"], capture_output=True, text=True, cwd=ROOT)
        key = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else Storage(data).keygen(ns, "append")
        fac = lambda: Client(address, key, ns, timeout=120)  # noqa: E731

        # Journal the tree: a fresh namespace + an existing cache = generation 1's snapshot.
        cache = os.path.join(work, "cache")
        shutil.copytree(src, cache)
        t0 = time.monotonic()
        w = JournalWriter(fac, ns, os.path.join(work, "spool"), generation_bytes=1 << 40)
        tree = JournaledTree(cache, w)
        tree.close()
        journal_s = time.monotonic() - t0
        print(f"journaled into sos-server in {journal_s:.1f}s ({total / 2**20 / journal_s:.0f} MiB/s)")
        shutil.rmtree(cache)

        cp_times, rs_times = [], []

        def run_cp(run):
            dst = os.path.join(work, f"cp{run}")
            subprocess.run(["sync"])
            t0 = time.monotonic()
            subprocess.run(["cp", "-r", src, dst], check=True)
            cp_times.append(time.monotonic() - t0)

        def run_restore(run):
            dst = os.path.join(work, f"restore{run}")
            subprocess.run(["sync"])
            t0 = time.monotonic()
            s = restore(fac, ns, dst)
            rs_times.append(time.monotonic() - t0)
            if run == 0:
                assert s.files == n_files and s.bytes == total, s
                assert tree_digest(dst) == digest, "restored tree differs from the source"

        # No deletions between timed steps (freeing 1 GiB slows the next writer down on this
        # disk); the order alternates so neither side always runs on a fresher page cache.
        for run in range(args.runs):
            if run % 2 == 0:
                run_cp(run)
                run_restore(run)
            else:
                run_restore(run)
                run_cp(run)
            print(f"run {run}: cp -r {cp_times[-1]:.2f}s, restore {rs_times[-1]:.2f}s")

        ratios = sorted(c / r for c, r in zip(cp_times, rs_times))
        print("per-run restore/cp speed: " + ", ".join(f"{x * 100:.0f}%" for x in ratios)
              + f" (median {ratios[len(ratios) // 2] * 100:.0f}%)")
        cp, rs = min(cp_times), min(rs_times)
        print(f"cp -r:   {cp:.2f}s  {total / 2**20 / cp:.0f} MiB/s  {n_files / cp:.0f} files/s")
        print(f"restore: {rs:.2f}s  {total / 2**20 / rs:.0f} MiB/s  {n_files / rs:.0f} files/s")
        print(f"restore speed = {cp / rs * 100:.0f}% of cp -r (target >= 80%)")
        return 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
