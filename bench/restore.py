"""Restore benchmark (on demand, not in CI): `sos restore` of a ~1 GiB tree vs `cp -r`.

    python bench/restore.py [--small 20000] [--large 4] [--large-mib 160] [--workdir DIR] [--runs 2] [--workers 1,4]

Builds a tree of many small files (1-32 KiB, in 100 directories) and a few large ones,
journals it into a real `sos-server` (started here on 127.0.0.1:0) as generation 1's
snapshot, then times, in the same run and alternating: `cp -r SRC DST` and `restore()`
(reads over the protocol, verifies every CRC, replays into an empty directory). Both read
from the page cache (the source tree / the server's object files) and write to the same
filesystem. Checks the restored tree equals the source, prints the figures and the ratio.
Target: restore >= 100% of cp's speed (issue 13). ``--workers 1,4`` compares restore's
lane counts in the same run.
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
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.demo import LocalServer, keygen  # noqa: E402 - after the checkout is on sys.path


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
            f.write(blob[off : off + size])
        total += size
    os.makedirs(os.path.join(src, "big"), exist_ok=True)
    for j in range(n_large):
        with open(os.path.join(src, "big", f"{j}.zip"), "wb") as f:
            for k in range(large_mib):
                f.write(blob[(k * 4096) % (3 << 20) :][: 1 << 20])
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


@dataclass
class Tree:
    """A source tree built by :func:`build_tree` and journaled into a namespace."""

    src: str
    files: int
    bytes: int
    digest: str
    journal_s: float = 0.0


@dataclass
class Comparison:
    """Seconds per run of ``cp -r`` and of ``restore()``, same tree, same run."""

    cp_s: list[float] = field(default_factory=list)
    restore_s: list[float] = field(default_factory=list)

    @property
    def best_ratio(self) -> float:
        """Restore speed as a fraction of cp's, best run against best run."""
        return min(self.cp_s) / min(self.restore_s)

    @property
    def run_ratios(self) -> list[float]:
        return sorted(c / r for c, r in zip(self.cp_s, self.restore_s))


def prepare(
    work: str,
    address: str,
    key: str,
    ns: str,
    n_small: int,
    n_large: int,
    large_mib: int,
    say: Callable[[str], None] = print,
) -> tuple[Tree, Callable]:
    """Build the tree under WORK/src and journal it into NS on the server at ADDRESS as
    generation 1's snapshot. Returns the tree and a client factory for ``restore()``."""
    from sos_client import Client
    from sos_journal import JournaledTree, JournalWriter
    from sos_journal.rebuild.restore import rebuild_cache

    src = os.path.join(work, "src")
    t0 = time.monotonic()
    total = build_tree(src, n_small, n_large, large_mib)
    tree = Tree(src, n_small + n_large, total, tree_digest(src))
    say(f"tree: {tree.files} files, {total / 2**20:.0f} MiB (built in {time.monotonic() - t0:.1f}s)")
    fac = lambda: Client(address, key, ns, timeout=120)  # noqa: E731

    # Journal the tree: a fresh namespace + an existing cache = generation 1's snapshot.
    cache = os.path.join(work, "cache")
    shutil.copytree(src, cache)
    t0 = time.monotonic()
    w = JournalWriter(fac, ns, os.path.join(work, "spool"), generation_bytes=1 << 40)
    JournaledTree(cache, w, rebuild=rebuild_cache).open().close()
    tree.journal_s = time.monotonic() - t0
    say(f"journaled into sos-server in {tree.journal_s:.1f}s ({total / 2**20 / tree.journal_s:.0f} MiB/s)")
    shutil.rmtree(cache)
    return tree, fac


def compare(
    work: str,
    tree: Tree,
    fac: Callable,
    ns: str,
    runs: int,
    say: Callable[[str], None] = print,
    workers: int | None = None,
) -> Comparison:
    """Time ``cp -r`` and ``restore()`` of TREE RUNS times each, alternating which goes first,
    ``sync`` before each timed step; the first restore is checked against the source.
    ``workers``: restore's lanes (None: its default)."""
    from sos_journal import restore
    from sos_journal.rebuild.replay import DEFAULT_WORKERS

    lanes = DEFAULT_WORKERS if workers is None else workers
    tag = f"w{lanes}-"

    out = Comparison()

    def run_cp(run: int) -> None:
        dst = os.path.join(work, f"{tag}cp{run}")
        subprocess.run(["sync"])
        t0 = time.monotonic()
        subprocess.run(["cp", "-r", tree.src, dst], check=True)
        out.cp_s.append(time.monotonic() - t0)

    def run_restore(run: int) -> None:
        dst = os.path.join(work, f"{tag}restore{run}")
        subprocess.run(["sync"])
        t0 = time.monotonic()
        s = restore(fac, ns, dst, workers=lanes)
        out.restore_s.append(time.monotonic() - t0)
        if run == 0:
            assert s.files == tree.files and s.bytes == tree.bytes, s
            assert tree_digest(dst) == tree.digest, "restored tree differs from the source"

    # No deletions between timed steps (freeing 1 GiB slows the next writer down on this
    # disk); the order alternates so neither side always runs on a fresher page cache.
    for run in range(runs):
        if run % 2 == 0:
            run_cp(run)
            run_restore(run)
        else:
            run_restore(run)
            run_cp(run)
        say(f"run {run}: cp -r {out.cp_s[-1]:.2f}s, restore ({lanes} workers) {out.restore_s[-1]:.2f}s")
    return out


def compare_lanes(
    work: str,
    tree: Tree,
    fac: Callable,
    ns: str,
    runs: int,
    counts: list[int],
    say: Callable[[str], None] = print,
    server_pid: int | None = None,
) -> dict[str, list[float]]:
    """Seconds per run of ``cp -r`` and of restore with each lane count in ``counts``; every
    run takes them in a rotated order, so each sees the disk in each state (the page cache
    fills up over a run: later steps meet writeback). Each restore's line gives its own CPU
    (this process: readers, dispatcher, lanes) and the server's (psutil)."""
    import psutil

    from sos_journal import restore

    steps: list[str] = ["cp"] + [f"w{n}" for n in counts]
    out: dict[str, list[float]] = {k: [] for k in steps}
    me = psutil.Process()
    srv = psutil.Process(server_pid) if server_pid else None

    def cpu(p) -> float:
        t = p.cpu_times()
        return t.user + t.system

    for run in range(runs):
        order = steps[run % len(steps) :] + steps[: run % len(steps)]
        cpus = {}
        for step in order:
            dst = os.path.join(work, f"lanes-{step}-{run}")
            subprocess.run(["sync"])
            c0, s0 = cpu(me), cpu(srv) if srv else 0.0
            t0 = time.monotonic()
            if step == "cp":
                subprocess.run(["cp", "-r", tree.src, dst], check=True)
            else:
                restore(fac, ns, dst, workers=int(step[1:]))
            out[step].append(time.monotonic() - t0)
            if step != "cp":
                cpus[step] = f" (CPU: restore {cpu(me) - c0:.2f}s, server {(cpu(srv) if srv else 0.0) - s0:.2f}s)"
        say(f"run {run} ({', '.join(order)}): " + ", ".join(f"{k} {out[k][-1]:.2f}s{cpus.get(k, '')}" for k in steps))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=20000, help="number of small files (1-32 KiB)")
    ap.add_argument("--large", type=int, default=4, help="number of large files")
    ap.add_argument("--large-mib", type=int, default=160, help="size of each large file in MiB")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--workers",
        default="",
        help="restore's lane counts to compare, e.g. 1,4: every run times cp -r and each, "
        "in a rotated order (default: cp -r against restore's default)",
    )
    args = ap.parse_args(argv)
    lane_counts: list[int | None] = [int(x) for x in args.workers.split(",") if x] or [None]

    work = tempfile.mkdtemp(prefix="sos-bench-restore-", dir=args.workdir)
    server = None
    try:
        data = os.path.join(work, "data")
        ns = "bench"
        key = keygen(data, ns)
        server = LocalServer(data, os.path.join(work, "server.log")).start()
        tree, fac = prepare(work, server.address, key, ns, args.small, args.large, args.large_mib)
        if len(lane_counts) > 1:
            got = compare_lanes(work, tree, fac, ns, args.runs, [n or 0 for n in lane_counts], server_pid=server.pid)
            cp_best = min(got["cp"])
            for k, secs in got.items():
                med = sorted(secs)[len(secs) // 2]
                print(
                    f"{k:>4}: best {min(secs):.2f}s, median {med:.2f}s; speed vs cp -r best/best "
                    f"{cp_best / min(secs) * 100:.0f}%, median/median "
                    f"{sorted(got['cp'])[len(secs) // 2] / med * 100:.0f}%"
                )
            return 0
        for lanes in lane_counts:
            c = compare(work, tree, fac, ns, args.runs, workers=lanes)
            ratios = c.run_ratios
            print(
                f"workers={lanes or 'default'}: per-run restore/cp speed: "
                + ", ".join(f"{x * 100:.0f}%" for x in ratios)
                + f" (median {ratios[len(ratios) // 2] * 100:.0f}%)"
            )
            cp, rs = min(c.cp_s), min(c.restore_s)
            print(f"cp -r:   {cp:.2f}s  {tree.bytes / 2**20 / cp:.0f} MiB/s  {tree.files / cp:.0f} files/s")
            print(f"restore: {rs:.2f}s  {tree.bytes / 2**20 / rs:.0f} MiB/s  {tree.files / rs:.0f} files/s")
            print(f"restore speed = {cp / rs * 100:.0f}% of cp -r (target >= 100%)")
        return 0
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
