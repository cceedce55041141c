"""The single-JVM disaster-recovery demo through the FUSE mount (``./scripts/demo --mount``).

``./scripts/demo`` without ``--mount`` (README's first command) runs the cluster demo,
:mod:`tools.demo_cluster`; this module is the entry point of both and dispatches to it.
What both share (input, output check, sink, server process) is in :mod:`tools.demo_common`.

1. Start a local ``sos-server`` (temp data dir, port 0) and make an append key.
2. Mount the namespace (``sos mount``) and start a stateful Structured Streaming query in a
   SEPARATE driver process: a file source of records (each id sent twice, in two different
   files, so ``dropDuplicates`` state decides what is new), ``maxFilesPerTrigger=1``, and a
   foreachBatch sink that writes ``out/batch-<N>.jsonl`` atomically (idempotent by batch
   id). The checkpointLocation is on the mount.
3. After a few committed batches, while batch K is half done (its output is written, its
   ``commits/K`` is not), SIGKILL the driver and the mount and DELETE the mount point and
   the cache directory: the worker is gone.
4. A new worker: ``sos restore`` rebuilds the namespace into its empty cache's tree
   directory (must be batches 0..K-1: RPO 0); ``sos mount`` on that cache serves the
   restored tree (it starts a new journal generation from it); the query restarts on the
   restored checkpoint and runs to the end.
5. Check like the seed's paper: keep only the output of batches whose ``commits/N`` exists,
   compare with the input: nothing lost, nothing doubled, nothing corrupted. The verdict
   is the last line; the exit code is 0 only on success.

``python -m tools.demo --mount --help`` for the options. ``_driver CONFIG`` is the internal
entry of the driver process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tools import child_env
from tools.demo_common import (  # the tests and benches import these from here too
    CHECKPOINT,
    DRIVER_JVM_OPTIONS,
    ROCKSDB_PROVIDER,
    DemoFailure,
    LocalServer,
    check_output,
    check_problems,
    check_summary,
    committed_batches,
    fmt,
    gateway_committed_batches,
    keygen,
    kill_tree,
    make_input,
    report,
    say,
    tail,
    use_journal_key,
    wait_for,
    write_batch_output,
)

NAMESPACE = "sparkdemo"


# --------------------------------------------------------------------------- driver process


def start_driver(cfg: dict, log_path: str, cfg_path: str, *, key: str | None = None) -> subprocess.Popen:
    """Start ``driver_main`` in its own process (and session: :func:`kill_tree` kills it
    with its JVM). ``key``: the namespace key a gateway checkpoint needs, given to the
    driver as ``$SOS_KEY`` (never in the config file or on the command line)."""
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    env = child_env()
    if key is not None:
        env["SOS_KEY"] = str(key)
    with open(log_path, "ab") as logf:
        return subprocess.Popen(
            [sys.executable, "-m", "tools.demo", "_driver", cfg_path],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=logf,
            start_new_session=True,
            env=env,
        )


def driver_main(cfg_path: str) -> int:
    """The Spark driver: one stateful streaming query, run until the input is used up.

    The checkpoint is ``cfg["checkpoint"]`` (a directory, e.g. on a mount), or with
    ``cfg["gateway"] = {"url", "namespace", "checkpoint"}`` the ``webhdfs://`` location of
    that checkpoint (a path inside the namespace) through ``sos gateway``, with the key
    from ``$SOS_KEY``."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    spark, location = _driver_session(cfg)
    checkpoint, committed, listener = _driver_checkpoint(cfg, spark, location)
    os.makedirs(cfg["out"], exist_ok=True)
    stream = (
        spark.readStream.schema("id LONG, payload STRING")
        .option("maxFilesPerTrigger", 1)
        .json(cfg["input"])
        .dropDuplicates(["id"])
    )
    query = (
        stream.writeStream.foreachBatch(_hanging_sink(cfg["out"], cfg["flags"], cfg.get("hang_at_batch")))
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if listener is not None:
        _save_markers(listener, committed, cfg["flags"])
    spark.stop()
    return 0


def _driver_session(cfg: dict):
    """The driver's SparkSession (``local[2]``, the state store and JVM options ``cfg``
    asks for) and, with ``cfg["gateway"]``, the checkpoint's location on the gateway
    (else None)."""
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master("local[2]")
        .appName("sos-demo")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.streaming.stateStore.maintenanceInterval", cfg.get("maintenance_interval", "60s"))
    )
    if cfg.get("state_store") == "rocksdb":
        builder = builder.config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
    if cfg.get("jvm_options", DRIVER_JVM_OPTIONS):
        builder = builder.config("spark.driver.extraJavaOptions", cfg.get("jvm_options", DRIVER_JVM_OPTIONS))
    for k, v in cfg.get("spark_conf", {}).items():
        builder = builder.config(k, v)
    gateway = cfg.get("gateway")
    location = None
    if gateway:
        from spark_plugin.spark import gateway_checkpoint

        location = gateway_checkpoint(
            builder, gateway["url"], gateway["namespace"], os.environ["SOS_KEY"], gateway["checkpoint"]
        )
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark, location


def _driver_checkpoint(cfg: dict, spark, location) -> tuple[str, Callable[[], set[int]], Any]:
    """The query's checkpointLocation, how to list its committed batches, and the batch
    marker listener registered on ``spark`` (None without ``cfg["markers"]``, or on a
    plain directory)."""
    if location is not None:
        location.attach(spark, listener=bool(cfg.get("markers")))
        client = location.client()
        return str(location), lambda: gateway_committed_batches(client, location.relpath), location.listener
    checkpoint = cfg["checkpoint"]
    listener = None
    if cfg.get("markers") and cfg.get("mountpoint"):
        from spark_plugin.spark import MarkerListener

        listener = MarkerListener(checkpoint, mountpoint=cfg["mountpoint"])
        spark.streams.addListener(listener)
    return checkpoint, lambda: committed_batches(checkpoint), listener


def _hanging_sink(out_dir: str, flag_dir: str, hang_at: int | None) -> Callable[[Any, int], None]:
    """The foreachBatch sink: writes the batch's output; in batch ``hang_at`` it then says
    so (``flags/hang-N``) and waits for ``flags/release-N``."""

    def sink(df, batch_id):
        write_batch_output(out_dir, df, batch_id)
        if hang_at is not None and batch_id == hang_at:
            # batch output written, commits/N not yet: the worst moment to lose the worker
            with open(os.path.join(flag_dir, f"hang-{batch_id}"), "w") as f:
                f.write(str(os.getpid()))
            release = os.path.join(flag_dir, f"release-{batch_id}")
            while not os.path.exists(release):
                time.sleep(0.1)

    return sink


def _save_markers(listener, committed: Callable[[], set[int]], flag_dir: str) -> None:
    """Wait for the marker of the last committed batch (progress events are delivered
    asynchronously), then write what the listener did to ``flags/markers.json``."""
    last = max(committed(), default=-1)
    deadline = time.monotonic() + 120
    while last >= 0 and last not in listener.written and time.monotonic() < deadline:
        if listener.errors:
            break
        time.sleep(0.1)
    with open(os.path.join(flag_dir, "markers.json"), "w") as f:
        json.dump({"written": listener.written, "errors": listener.errors}, f)


# --------------------------------------------------------------------------- the demo


def run_demo(
    *,
    records: int = 3000,
    batches: int = 8,
    crash_after: int = 4,
    kill: str = "both",
    state_store: str = "hdfs",
    workdir: str | None = None,
    keep: bool = False,
    markers: bool = True,
) -> dict:
    """Run the whole scenario; returns the result dict (``ok`` True/False)."""
    if not 0 < crash_after < batches:
        raise ValueError("need 0 < --crash-after < --batches")
    own_dir = workdir is None
    work = workdir or tempfile.mkdtemp(prefix="sos-demo-")
    os.makedirs(work, exist_ok=True)
    undo_key = use_journal_key(work)  # every writer and restore of the demo authenticates the journal
    demo = MountDemo(work, state_store=state_store, markers=markers)
    result = demo.result
    try:
        say(f"work dir {work}; state store {state_store}; {records} records in {batches} files")
        expected = make_input(demo.paths["input"], records, batches)
        say(
            f"input: {batches} files, {records} unique ids, each sent twice "
            "(dropDuplicates state must remember them across the crash)"
        )
        demo.start_server()
        # ---- worker 1: runs until it is destroyed in the middle of batch `crash_after`
        m1, d1, cfg, before = demo.worker1_until(crash_after)
        demo.destroy_worker1(m1, d1, crash_after, kill)
        # ---- worker 2: restores, mounts the restored tree and runs the query to the end
        final = demo.worker2_to_the_end(cfg, before)
        # ---- the check
        check = check_output(demo.paths["out"], final, expected)
        result.update(check)
        problems = check_problems(check, final, batches)
        say(f"check: {check_summary(check)}")
        result["problems"] = problems
        result["ok"] = not problems
        return result
    except Exception as exc:
        result["problems"] = [str(exc) if isinstance(exc, DemoFailure) else f"{type(exc).__name__}: {exc}"]
        demo.show_failed_drivers()
        return result
    finally:
        demo.close()
        undo_key()
        if own_dir and not keep and result.get("ok"):
            shutil.rmtree(work, ignore_errors=True)
            result["workdir"] = None


class MountDemo:
    """The mount demo's moving parts (server, mounts, drivers) and its steps; ``result``
    collects what each step saw."""

    def __init__(self, work: str, *, state_store: str, markers: bool) -> None:
        self.work = work
        self.state_store = state_store
        self.markers = markers
        self.paths = {k: os.path.join(work, k) for k in ("input", "out", "server-data", "flags", "logs")}
        for k in ("flags", "logs"):
            os.makedirs(self.paths[k], exist_ok=True)
        self.server = LocalServer(self.paths["server-data"], os.path.join(self.paths["logs"], "server.log"))
        self.key = ""
        self.mounts: list = []
        self.drivers: list[subprocess.Popen] = []
        self.result: dict = {"ok": False, "workdir": work, "state_store": state_store}

    def start_server(self) -> None:
        self.key = keygen(self.paths["server-data"], NAMESPACE)
        self.server.start()
        say(f"sos-server listening on {self.server.address} (data {self.paths['server-data']})")

    def mount(self, n: int):
        """``sos mount`` of worker ``n``: (the mount, its mount point, its cache)."""
        from spark_plugin.spark import start_mount

        mnt = os.path.join(self.work, f"worker{n}", "mnt")
        cache = os.path.join(self.work, f"worker{n}", "cache")
        m = start_mount(
            NAMESPACE,
            mnt,
            server=self.server.address,
            key=self.key,
            cache_dir=cache,
            log_path=os.path.join(self.paths["logs"], f"mount{n}.log"),
        )
        self.mounts.append(m)
        return m, mnt, cache

    def start_driver(self, n: int, cfg: dict) -> subprocess.Popen:
        d = start_driver(
            cfg, os.path.join(self.paths["logs"], f"driver{n}.log"), os.path.join(self.work, f"driver{n}.json")
        )
        self.drivers.append(d)
        return d

    def worker1_until(self, crash_after: int):
        """Worker 1 mounts the namespace and runs the query until batch ``crash_after``'s
        output is written (its commit not yet). Returns (mount, driver, driver config, the
        batches committed)."""
        m1, mnt1, cache1 = self.mount(1)
        chk1 = os.path.join(mnt1, CHECKPOINT)
        say(f"worker 1: {NAMESPACE} mounted at {mnt1} (cache {cache1})")
        cfg = {
            "input": self.paths["input"],
            "out": self.paths["out"],
            "flags": self.paths["flags"],
            "checkpoint": chk1,
            "mountpoint": mnt1,
            "markers": self.markers,
            "state_store": self.state_store,
            "hang_at_batch": crash_after,
        }
        d1 = self.start_driver(1, cfg)
        say(f"worker 1: Spark driver started (pid {d1.pid}), checkpointLocation {chk1}")
        hang_flag = os.path.join(self.paths["flags"], f"hang-{crash_after}")
        wait_for(
            lambda: os.path.exists(hang_flag),
            600,
            f"driver 1 reaching batch {crash_after}",
            alive=lambda: d1.poll() is None,
        )
        before = committed_batches(chk1)
        say(
            f"worker 1: batches {fmt(before)} committed; batch {crash_after} output written, "
            f"commits/{crash_after} not yet"
        )
        if before != set(range(crash_after)):
            raise DemoFailure(f"expected batches 0..{crash_after - 1} committed, got {before}")
        self.result["committed_before_crash"] = sorted(before)
        return m1, d1, cfg, before

    def destroy_worker1(self, m1, d1: subprocess.Popen, crash_after: int, kill: str) -> None:
        """SIGKILL worker 1's driver and mount (``kill="mount"``: the mount first, under the
        live driver), then delete its mount point, cache and spool."""
        if kill == "mount":
            # the mount process dies first, under a live driver that then tries to commit:
            # the dead mount stays in place (every access fails with ENOTCONN) until the
            # driver is gone, as after a real crash of the FUSE daemon
            os.kill(m1.pid, signal.SIGKILL)
            m1.proc.wait()
            say("CRASH: sos mount SIGKILLed in the middle of the batch; releasing the driver")
            with open(os.path.join(self.paths["flags"], f"release-{crash_after}"), "w"):
                pass
            try:
                d1.wait(300)
                self.result["driver1_exit"] = d1.returncode
                say(
                    f"worker 1: driver failed on the dead mount (exit {d1.returncode})"
                    if d1.returncode != 0
                    else "worker 1: driver exited 0 on a dead mount?!"
                )
            except subprocess.TimeoutExpired:
                say("worker 1: driver still alive on the dead mount: killing it")
            kill_tree(d1)
            m1.kill()  # lazy unmount of the dead mount
        else:
            kill_tree(d1)
            m1.kill()
            say("CRASH: Spark driver and sos mount SIGKILLed in the middle of the batch")
        shutil.rmtree(os.path.join(self.work, "worker1"))
        say("worker 1 destroyed: mount point, cache and spool deleted")

    def restore_worker2(self, before: set[int]) -> tuple[set[int], int]:
        """``sos restore`` rebuilds the namespace into worker 2's fresh cache's tree
        directory; it must hold what worker 1 committed (``before``). Returns (its commits, the journal
        generation before)."""
        from spark_plugin.spark import sos_command

        cache2 = os.path.join(self.work, "worker2", "cache")
        tree2 = os.path.join(cache2, "tree")
        gens_before = journal_generations(self.server.address, self.key)
        proc = subprocess.run(
            [*sos_command(), "restore", "-q", "--server", self.server.address, NAMESPACE, tree2],
            capture_output=True,
            text=True,
            timeout=900,
            env=dict(os.environ, SOS_KEY=self.key),
        )
        if proc.returncode != 0:
            raise DemoFailure(f"sos restore failed: {proc.stderr.strip()}")
        restored = committed_batches(os.path.join(tree2, CHECKPOINT))
        say(
            f"worker 2: sos restore into its empty cache ({tree2}): the server gave back a "
            f"checkpoint with batches {fmt(restored)} committed"
        )
        self.result["restored_committed"] = sorted(restored)
        if restored != before:
            raise DemoFailure(f"restored checkpoint has commits {restored}, expected {before}")
        return restored, gens_before

    def worker2_to_the_end(self, cfg: dict, before: set[int]) -> set[int]:
        """Worker 2: ``sos restore`` into its fresh cache's tree directory, then ``sos
        mount`` serves that tree (a non-empty tree with an empty spool: the mount fences
        older writers, then starts a new journal generation whose snapshot is the restored
        tree, so the journal goes on from exactly what restore produced); the query restarts
        on it and runs to the end. Returns the batches committed."""
        restored, gens_before = self.restore_worker2(before)
        m2, mnt2, _cache2 = self.mount(2)
        chk2 = os.path.join(mnt2, CHECKPOINT)
        seen = committed_batches(chk2)
        gens_after = journal_generations(self.server.address, self.key)
        self.result["generations"] = [gens_before, gens_after]
        say(
            f"worker 2: sos mount serves the restored tree (batches {fmt(seen)} committed); "
            f"journal generation {gens_after} starts with its snapshot (was {gens_before})"
        )
        if seen != restored:
            raise DemoFailure(f"the mount shows commits {seen}, the restore gave {restored}")
        d2 = self.start_driver(2, dict(cfg, checkpoint=chk2, mountpoint=mnt2, hang_at_batch=None))
        say(f"worker 2: Spark driver restarted (pid {d2.pid}) on the restored checkpoint")
        try:
            rc = d2.wait(900)
        except subprocess.TimeoutExpired:
            raise DemoFailure("driver 2 did not finish in 900s") from None
        if rc != 0:
            raise DemoFailure(f"driver 2 failed (exit {rc}):\n{tail(os.path.join(self.paths['logs'], 'driver2.log'))}")
        final = committed_batches(chk2)
        say(f"worker 2: query finished; batches {fmt(final)} committed")
        self.result["committed_final"] = sorted(final)
        if self.markers:
            try:
                with open(os.path.join(self.paths["flags"], "markers.json")) as f:
                    self.result["markers_written"] = json.load(f)["written"]
            except FileNotFoundError:
                self.result["markers_written"] = []
        m2.stop()
        return final

    def show_failed_drivers(self) -> None:
        for d, n in zip(self.drivers, (1, 2)):
            if d.poll() is not None and d.returncode not in (0, -9):
                say(f"driver {n} log tail:\n{tail(os.path.join(self.paths['logs'], f'driver{n}.log'))}")

    def close(self) -> None:
        for d in self.drivers:
            kill_tree(d)
        for m in self.mounts:
            with contextlib.suppress(Exception):
                m.stop()
        self.server.stop()


def journal_generations(server_address: str, key: str) -> int:
    """The newest journal generation of the demo's namespace on the server (0: none)."""
    from sos_client import Client
    from sos_journal.rebuild.restore import list_generations

    with Client(server_address, key, NAMESPACE) as client:
        return max(list_generations(client), default=0)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_driver":
        return driver_main(argv[1])
    if "--mount" not in argv:  # the main job: the cluster demo
        from tools.demo_cluster import main as cluster_main

        return cluster_main(argv)
    argv = [a for a in argv if a != "--mount"]
    p = argparse.ArgumentParser(prog="scripts/demo --mount", description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=3000, help="unique record ids (default 3000)")
    p.add_argument("--batches", type=int, default=8, help="input files = micro-batches (default 8)")
    p.add_argument("--crash-after", type=int, default=None, help="committed batches before the crash (default: half)")
    p.add_argument(
        "--kill",
        choices=("both", "mount"),
        default="both",
        help="both: SIGKILL driver and mount; mount: SIGKILL only the mount under a live driver (default both)",
    )
    p.add_argument("--state-store", choices=("hdfs", "rocksdb"), default="hdfs")
    p.add_argument("--workdir", help="work directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", action="store_true", help="print the result as JSON before the verdict")
    args = p.parse_args(argv)
    crash_after = args.crash_after if args.crash_after is not None else max(1, args.batches // 2)
    try:
        result = run_demo(
            records=args.records,
            batches=args.batches,
            crash_after=crash_after,
            kill=args.kill,
            state_store=args.state_store,
            workdir=args.workdir,
            keep=args.keep,
        )
    except ValueError as exc:
        p.error(str(exc))
    return report(
        result,
        as_json=args.json,
        passed=lambda: (
            f"exactly once after losing the worker in batch {crash_after}: "
            f"{result['records_in']} records in, {result['records_out']} out, 0 lost, "
            f"0 doubled, 0 corrupted ({args.state_store} state store)"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
