#!/usr/bin/env python3
"""Issue 13's table in ONE run (on demand, not in CI): every SOS figure beside the figure it
is judged against, measured in the same run, on the same disk, with the same writer count
and sizes, then the ratio, the target and a verdict (MET / MISSED; NOT RUN when a part
could not run).

    python bench/all.py [--quick | --smoke] [--dir DIR] [--no-spark] [--json FILE]

Rows (cases come from bench/append.py, bench/restore.py and bench/spark_checkpoint.py):

- ``sos put`` of 1 GiB (the CLI, a child process) vs ``dd bs=1M conv=fsync`` of the same
  file (a child process too), both from the page cache into DIR;
- 1 MiB appends, 1 writer, vs raw ``write+fdatasync``, 1 thread;
- 1 MiB appends, 8 writers, vs raw, 8 threads on 8 files (pyftpdlib with 8 writers shown);
- 4 KiB appends, 1 writer, vs pyftpdlib APPE (no fsync), 1 writer (raw shown);
- 4 KiB appends, 64 writers (rate and p99) vs raw, 64 threads on 64 files (pyftpdlib shown);
- server CPU per 4 KiB append (the server process's user+system CPU over the case divided
  by its appends), 1 and 64 writers, vs the raw loop's CPU per write+fdatasync;
- ``restore()`` of ~1 GiB (20,004 files) vs ``cp -r`` of the same tree, best vs best;
- Spark micro-batch duration with the checkpoint on ``sos mount`` vs a local directory
  (sync mount, Hadoop's .crc files, HDFS state store: the defaults).

Each append case runs SOS, raw and pyftpdlib back to back, so the three see the same
machine. One ``sos-server`` (tools.demo.LocalServer) serves the appends, the put and the
restore; the Spark row starts its own. ``--quick`` measures less (put 256 MiB, restore
~250 MiB, 1.5 s per append case, 20 Spark batches) and says so in the table; ``--smoke``
runs every row but Spark in seconds, to check the script, not the product.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's code, bench/ and tools/

from bench import append as appends  # noqa: E402 - after the checkout is on sys.path
from bench import restore as restores  # noqa: E402
from tools import child_env  # noqa: E402
from tools.demo import DRIVER_JVM_OPTIONS, LocalServer, keygen  # noqa: E402

MIB = 1 << 20
KIB4 = 4 << 10


@dataclass(frozen=True)
class Mode:
    name: str
    seconds: float  # measured per append case (after a warm-up of min(0.5, seconds / 4))
    put_mib: int
    put_runs: int
    restore_small: int
    restore_large: int
    restore_large_mib: int
    restore_runs: int
    spark_batches: int
    spark_rounds: int


MODES = {
    "full": Mode("full", 3.0, 1024, 2, 20000, 4, 160, 2, 60, 2),
    "quick": Mode("quick", 1.5, 256, 1, 5000, 4, 40, 2, 20, 1),
    "smoke": Mode("smoke", 0.2, 8, 1, 100, 1, 2, 1, 0, 0),
}


@dataclass
class Row:
    measure: str
    sos: str
    other: str
    ratio: str
    target: str
    verdict: str  # MET, MISSED or NOT RUN ...

    def line(self) -> str:
        return f"| {self.measure} | {self.sos} | {self.other} | {self.ratio} | {self.target} | {self.verdict} |"


HEADER = "| measure | SOS | compared with, same run | ratio | target | verdict |\n|---|---|---|---|---|---|"


def met(ok: bool) -> str:
    return "MET" if ok else "MISSED"


NOTHING = "NOT RUN (a case measured nothing: make the cases longer)"


def judge(ok: bool, *measured: float) -> str:
    """MET/MISSED, or NOT RUN when a figure it rests on is zero or unknown (a case too
    short for a loaded machine, a CPU time below the clock's tick)."""
    return NOTHING if any(not m or math.isnan(m) for m in measured) else met(ok)


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def fmt(x: float, spec: str = ".2f", suffix: str = "x") -> str:
    return "-" if math.isnan(x) else f"{x:{spec}}{suffix}"


def say(msg: str) -> None:
    print(f"# {msg}", flush=True)


def _size(n: int) -> str:
    return f"{n // 1024} GiB" if n >= 1024 and n % 1024 == 0 else f"{n} MiB"


# -- sos put vs dd ----------------------------------------------------------------------
def put_vs_dd(work: str, server: LocalServer, key: str, ns: str, mib: int, runs: int) -> Row:
    """``sos put FILE`` against ``dd if=FILE bs=1M conv=fsync``: both child processes,
    both read FILE from the page cache, both write into WORK's filesystem and are done
    when the data is on disk (dd's final fsync; put's last durable ack). ``sync`` before
    each timed step; the order alternates."""
    src = os.path.join(work, "put-src")
    blob = os.urandom(4 * MIB)
    with open(src, "wb") as f:
        for i in range(mib):
            f.write(blob[(i * 4096) % (3 * MIB) :][:MIB])
        f.flush()
        os.fsync(f.fileno())
    env = child_env()
    env["SOS_KEY"] = key
    put_cmd = [sys.executable, "-c", "import sys; from sos_client.cli import main; sys.exit(main())", "put"]
    put_s: list[float] = []
    dd_s: list[float] = []

    def timed(cmd: list[str], out: list[float], **kw) -> None:
        os.sync()
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, **kw)
        out.append(time.monotonic() - t0)

    for run in range(runs):
        dd_cmd = ["dd", f"if={src}", f"of={os.path.join(work, f'dd-{run}')}", "bs=1M", "conv=fsync", "status=none"]
        steps = [(dd_cmd, dd_s, None), ([*put_cmd, src, f"{ns}/put-{run}", "--server", server.address], put_s, env)]
        for cmd, out, cmd_env in steps if run % 2 == 0 else reversed(steps):
            timed(cmd, out, env=cmd_env)
        say(f"put run {run}: dd {dd_s[-1]:.2f} s, sos put {put_s[-1]:.2f} s")
    for run in range(runs):
        os.unlink(os.path.join(work, f"dd-{run}"))
    os.unlink(src)
    startup: list[float] = []  # the CLI's own start-up (interpreter, imports), inside put's time
    timed([*put_cmd, "--help"], startup, env=env)
    sos, dd = mib / min(put_s), mib / min(dd_s)
    r = sos / dd
    return Row(
        f"`sos put` of {_size(mib)} vs `dd bs=1M conv=fsync` of the same file (best of {runs})",
        f"{sos:,.0f} MiB/s ({min(put_s):.2f} s, of which CLI start-up {startup[0]:.2f} s)",
        f"dd {dd:,.0f} MiB/s ({min(dd_s):.2f} s)",
        f"{r:.2f}x",
        ">= 0.85x",
        met(r >= 0.85),
    )


# -- appends ------------------------------------------------------------------------------
APPEND_CASES = [  # (size, writers, with pyftpdlib)
    (MIB, 1, False),
    (MIB, 8, True),
    (KIB4, 1, True),
    (KIB4, 64, True),
]


def run_appends(
    work: str, server: LocalServer, key: str, ns: str, seconds: float, ftp: appends.FtpServer | None
) -> dict[tuple[str, int, int], appends.Result]:
    """Each case: SOS, raw and pyftpdlib back to back. Keys: (system, size, writers)."""
    from sos_wire.auth import Key

    raw_dir = os.path.join(work, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    k = Key.parse(key)
    out: dict[tuple[str, int, int], appends.Result] = {}
    for size, writers, with_ftp in APPEND_CASES:
        tag = f"{size}-{writers}"
        for system in ("sos", "raw", "ftp"):
            if system == "sos":
                r = appends.sos_case(server, k, ns, size, writers, seconds, tag)
            elif system == "raw":
                r = appends.raw_case(raw_dir, size, writers, seconds)
            elif with_ftp and ftp is not None:
                r = appends.ftp_case(ftp, size, writers, seconds, tag)
            else:
                continue
            out[(system, size, writers)] = r
            say(r.row())
    return out


def append_rows(res: dict[tuple[str, int, int], appends.Result]) -> list[Row]:
    pct = appends.pct
    rows = []
    for writers, target in ((1, 0.95), (8, 0.85)):
        sos, raw, ftp = (res.get((s, MIB, writers)) for s in ("sos", "raw", "ftp"))
        r = ratio(sos.mb_s, raw.mb_s)
        other = f"raw write+fdatasync, {writers} thread{'s' * (writers > 1)}: {raw.mb_s:,.0f} MB/s"
        if ftp is not None:
            other += f"; pyftpdlib (no fsync) {ftp.mb_s:,.0f} MB/s"
        rows.append(
            Row(
                f"1 MiB appends, {writers} writer{'s' * (writers > 1)}, ack after fsync",
                f"{sos.mb_s:,.0f} MB/s, p99 {pct(sos.lat, 99) * 1e3:.1f} ms",
                other,
                fmt(r),
                f">= {target:.2f}x raw",
                judge(r >= target, sos.mb_s, raw.mb_s),
            )
        )
    sos, raw, ftp = (res.get((s, KIB4, 1)) for s in ("sos", "raw", "ftp"))
    if ftp is not None:
        r = ratio(sos.ops_s, ftp.ops_s)
        rows.append(
            Row(
                "4 KiB appends, 1 writer",
                f"{sos.ops_s:,.0f}/s, p50 {pct(sos.lat, 50) * 1e3:.2f} ms",
                f"pyftpdlib (no fsync!) {ftp.ops_s:,.0f}/s; raw 1 thread {raw.ops_s:,.0f}/s "
                f"({fmt(ratio(sos.ops_s, raw.ops_s))} of raw)",
                fmt(r),
                ">= 2x pyftpdlib",
                judge(r >= 2, sos.ops_s, ftp.ops_s),
            )
        )
    else:
        rows.append(
            Row(
                "4 KiB appends, 1 writer",
                f"{sos.ops_s:,.0f}/s",
                f"raw 1 thread {raw.ops_s:,.0f}/s",
                "-",
                ">= 2x pyftpdlib",
                "NOT RUN (pyftpdlib missing)",
            )
        )
    sos, raw, ftp = (res.get((s, KIB4, 64)) for s in ("sos", "raw", "ftp"))
    p99 = pct(sos.lat, 99)
    other = f"raw 64 threads on 64 files {raw.ops_s:,.0f}/s, p99 {pct(raw.lat, 99) * 1e3:.1f} ms"
    if ftp is not None:
        other += f"; pyftpdlib (no fsync) {ftp.ops_s:,.0f}/s"
    rows.append(
        Row(
            "4 KiB appends, 64 writers",
            f"{sos.ops_s:,.0f}/s, p99 {p99 * 1e3:.1f} ms",
            other,
            fmt(ratio(sos.ops_s, raw.ops_s), suffix="x raw"),
            ">= 25,000/s, p99 <= 10 ms",
            judge(sos.ops_s >= 25000 and p99 <= 0.010, sos.ops_s),
        )
    )
    for writers in (1, 64):
        sos, raw = res[("sos", KIB4, writers)], res[("raw", KIB4, writers)]
        s_us = ratio(sos.cpu, sos.ops) * 1e6 if sos.cpu is not None else math.nan
        r_us = ratio(raw.cpu, raw.ops) * 1e6 if raw.cpu is not None else math.nan
        rows.append(
            Row(
                f"server CPU per 4 KiB append, {writers} writer{'s' * (writers > 1)}",
                fmt(s_us, ",.0f", " µs"),
                f"raw loop ({writers} thread{'s' * (writers > 1)}) {fmt(r_us, ',.0f', ' µs')} per write+fdatasync",
                fmt(ratio(s_us, r_us), ".1f"),
                "<= 80 µs",
                judge(s_us <= 80, s_us),
            )
        )
    return rows


# -- restore ------------------------------------------------------------------------------
def restore_row(work: str, server: LocalServer, key: str, ns: str, mode: Mode) -> Row:
    os.makedirs(work)
    tree, fac = restores.prepare(
        work, server.address, key, ns, mode.restore_small, mode.restore_large, mode.restore_large_mib, say=say
    )
    c = restores.compare(work, tree, fac, ns, mode.restore_runs, say=say)
    cp, rs = min(c.cp_s), min(c.restore_s)
    mib = tree.bytes / MIB
    ratios = ", ".join(f"{x:.2f}" for x in c.run_ratios)
    return Row(
        f"restore of {mib:,.0f} MiB ({tree.files:,} files) vs `cp -r`, best of {mode.restore_runs} vs best",
        f"{rs:.2f} s ({mib / rs:,.0f} MiB/s)",
        f"cp -r {cp:.2f} s ({mib / cp:,.0f} MiB/s); per run: {ratios}",
        f"{c.best_ratio:.2f}x",
        ">= 1.00x (100% of cp's speed)",
        met(c.best_ratio >= 1.0),
    )


# -- Spark ----------------------------------------------------------------------------------
SPARK_MEASURE = "Spark micro-batch, mount vs local dir, default settings"


def spark_row(work: str, mode: Mode, jvm_options: str) -> Row:
    """bench/spark_checkpoint.py's run (imported), its figures read from its JSON line."""
    target = "<= 1.05x"
    try:
        from bench import spark_checkpoint
    except Exception as exc:
        return Row(SPARK_MEASURE, "-", "-", "-", target, f"NOT RUN (import: {type(exc).__name__}: {exc})")
    if jvm_options and "PYSPARK_SUBMIT_ARGS" not in os.environ:  # a light driver on shared cores
        os.environ["PYSPARK_SUBMIT_ARGS"] = f'--driver-java-options "{jvm_options}" --driver-memory 768m pyspark-shell'
    captured = io.StringIO()
    old_tempdir = tempfile.tempdir
    tempfile.tempdir = work  # its local checkpoint and its server's data on the same disk as the rest
    try:
        with contextlib.redirect_stdout(captured):
            code = spark_checkpoint.main(["--batches", str(mode.spark_batches), "--rounds", str(mode.spark_rounds)])
    except BaseException as exc:
        return Row(SPARK_MEASURE, "-", "-", "-", target, f"NOT RUN ({type(exc).__name__}: {exc})")
    finally:
        tempfile.tempdir = old_tempdir
    for line in captured.getvalue().splitlines():
        say(f"spark: {line}")
    res = None
    for line in captured.getvalue().splitlines():
        if line.startswith("{") and "ratio_median" in line:
            res = json.loads(line)
    if code != 0 or res is None:
        return Row(SPARK_MEASURE, "-", "-", "-", target, f"NOT RUN (exit {code}, no figures)")
    r = res["mount_median_ms"] / res["local_median_ms"]
    n = res.get("batches_each", "?")
    return Row(
        f"{SPARK_MEASURE} ({n} batches each, median)",
        f"mount {res['mount_median_ms']:.0f} ms",
        f"local dir {res['local_median_ms']:.0f} ms",
        f"{r:.2f}x",
        target,
        met(r <= 1.05),
    )


# -- main ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sizes, shorter cases (the table says so)")
    size.add_argument("--smoke", action="store_true", help="seconds: checks the script runs (no Spark)")
    p.add_argument("--dir", default="/var/tmp", help="where all data goes, one disk (default /var/tmp)")
    p.add_argument("--no-spark", action="store_true", help="skip the Spark row")
    p.add_argument(
        "--spark-jvm-options",
        default=DRIVER_JVM_OPTIONS,
        help=f"driver JVM options for the Spark row (default: {DRIVER_JVM_OPTIONS!r}, light on "
        "shared cores; '' for the JVM's defaults; ignored if PYSPARK_SUBMIT_ARGS is set)",
    )
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = p.parse_args(argv)
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    from sos_server.listener import tune_malloc

    tune_malloc()  # the load generator is Python too: spare the shared CPUs its page faults
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="sos-bench-all-", dir=args.dir)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()[0]
    say(
        f"bench/all.py, mode {mode.name}, data under {work} ({os.cpu_count()} cpus), started {started}, "
        f"load average {load0:.1f}"
    )
    rows: list[Row] = []
    server = ftp = None
    try:
        data = os.path.join(work, "server")
        keys = {ns: keygen(data, ns) for ns in ("appends", "put", "restore")}
        server = LocalServer(data, os.path.join(work, "server.log"), metrics=True, args=appends.SERVER_ARGS).start()
        say(f"sos-server at {server.address}")
        try:
            ftp = appends.FtpServer(os.path.join(work, "ftp"))
        except (ImportError, SystemExit) as exc:
            say(f"pyftpdlib: not run ({exc})")
        res = run_appends(work, server, keys["appends"], "appends", mode.seconds, ftp)
        if ftp is not None:
            ftp.stop()
            ftp = None
        put = put_vs_dd(work, server, keys["put"], "put", mode.put_mib, mode.put_runs)
        rows.append(put)
        rows += append_rows(res)
        rows.append(restore_row(os.path.join(work, "restore"), server, keys["restore"], "restore", mode))
        server.stop()
        server = None
        if args.no_spark or mode.spark_batches == 0:
            rows.append(
                Row(
                    SPARK_MEASURE,
                    "-",
                    "-",
                    "-",
                    "<= 1.05x",
                    "NOT RUN (--no-spark)" if args.no_spark else f"NOT RUN ({mode.name} mode)",
                )
            )
        else:
            rows.append(spark_row(work, mode, args.spark_jvm_options))
    finally:
        if ftp is not None:
            ftp.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    load1 = os.getloadavg()[0]
    print()
    print(
        f"Issue 13's targets, one run ({mode.name} mode"
        + (": smaller sizes than the issue's, see the measure column" if mode.name != "full" else "")
        + f"), {started}, {os.cpu_count()} cpus, load average {load0:.1f} at the start and {load1:.1f} at the end, "
        f"data on {args.dir}, {mode.seconds:g} s per append case:"
    )
    print()
    print(HEADER)
    for r in rows:
        print(r.line())
    verdicts = [r.verdict for r in rows]
    print()
    print(
        f"{verdicts.count('MET')} met, {verdicts.count('MISSED')} missed, "
        f"{sum(v.startswith('NOT RUN') for v in verdicts)} not run"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"mode": mode.name, "started": started, "load": [load0, load1], "rows": [asdict(r) for r in rows]},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
