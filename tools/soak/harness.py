"""The crash loop on one machine (:class:`Soak`): it starts the server, the mount and the
driver, feeds the input, draws and strikes the kill events, restarts what they killed,
checks after each (:class:`tools.soak.checks.Checks`) and drains at the end.

A stream of unique records (the demo's input: :func:`tools.demo_common.make_input`, each id
sent twice so the ``dropDuplicates`` state must survive every crash) flows through the
demo's query (file source, ``maxFilesPerTrigger=1``, ``dropDuplicates(["id"])``, a
foreachBatch sink writing ``out/batch-<N>.jsonl`` atomically) whose checkpointLocation is
on a ``sos mount``. The harness feeds input files a few batches ahead of the query and,
at random moments drawn from a seeded RNG, SIGKILLs:

- ``server``: the sos-server (restarted on the same port and data directory; the mount's
  writer reconnects, Spark only sees a slow rename);
- ``mount``: the ``sos mount`` process (the query fails on the dead mount; the driver
  stops it, a new mount starts on the same cache, the SAME driver JVM restarts the query);
- ``driver``: the Spark driver (the query moves to a new driver process: the expensive
  case; a warm spare process with its SparkSession already up takes over if there is one,
  kept while an event still to come needs a new driver, ``--no-spare`` to start every
  replacement cold);
- ``disk``: the server's disk is lost: the server is SIGKILLed and its data directory
  deleted; a replacement on the empty directory with the same ``--tier`` (moto's S3 server,
  embedded in the harness; the keys from a backup copy) rebuilds the namespace from the
  bucket before it listens, and the mount's writer reconnects to it. The writer is frozen
  (SIGSTOP) until the bucket holds everything the server acknowledged: without
  ``--durability tier`` the upload lag would go with the disk. With ``--durability tier``
  (the mount's, or the gateways' in ``--cluster``; the server always runs with ``--tier``
  then) nothing is frozen or waited for: the disk goes at a random moment, mid-flush or
  mid-barrier, and every barrier the writer saw return must be in the bucket (RPO 0);
- ``all``: server, mount and driver at once, then the worker is lost: mount point, cache
  and spool are deleted; recovery is either ``sos restore`` into a fresh directory (checked)
  followed by a mount on an empty cache, or directly a mount on an empty cache. The spare
  driver (if any) survives: it is a process that has only started a SparkSession, touched
  neither mount nor checkpoint nor output, like a freshly provisioned worker.

After every restart the checkpoint (through the new mount, or the restored directory) is
checked against the output, with the demo's checker (:func:`tools.demo_common.check_output`):
the committed batches 0..K (``commits/`` is contiguous; K never below a batch the driver
saw committed: RPO 0) must have produced exactly the records of input files 0..K: nothing
doubled, nothing corrupted, nothing unknown, nothing lost. At the end the kills stop, the
query drains every fed file and the final check demands the whole fed input.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from tools import child_env
from tools.demo_common import (
    CHECKPOINT,
    EmbeddedStore,
    backup_keys,
    check_output,
    keygen,
    kill_tree,
    make_input,
    restore_keys,
    wait_tier_drained,
)
from tools.server import ServerProcess
from tools.soak.checks import Checks, checkpoint_commits, source_offset
from tools.soak.common import KINDS, NAMESPACE, HarnessError, Violation, read_json, write_json_atomic


def ServerProc(data_dir: str, log_path: str, tier: str | None = None) -> ServerProcess:
    """``sos-server serve`` on a FIXED port (the mount and the gateway must find it again
    after a restart): the one launcher, tools.server. With ``tier``: ``--tier`` on that
    bucket, and metrics on (the ``disk`` event reads the tier's lag)."""
    return ServerProcess(
        data_dir, ["--tier", tier] if tier else [], log_path=log_path, fixed_port=True, metrics=tier is not None
    )


def signal_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a driver and every process it started (its own session), without waiting:
    :func:`tools.demo_common.kill_tree` reaps it later."""
    if proc.poll() is not None:
        return
    pids = [proc.pid]
    with contextlib.suppress(Exception):
        import psutil

        pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def percentiles(xs: list[float]) -> list[float]:
    """[p50, p99] of ``xs`` (nearest rank), rounded to 0.1 s."""
    xs = sorted(xs)
    return [round(xs[min(len(xs) - 1, int(q * len(xs)))], 1) for q in (0.5, 0.99)]


class Soak(Checks):
    """The crash loop on one machine: the query in a local[2] driver on an ``sos mount``."""

    #: the kinds of kill event, and those that may strike again before the next batch
    KINDS = KINDS
    CHEAP = ("server",)
    MODE = "mount"
    #: start the first driver before the server and the mount (it idles until told to run;
    #: a cluster-mode driver needs its cluster and gateway first)
    EARLY_DRIVER = True

    def __init__(
        self,
        *,
        duration: float,
        seed: int,
        workdir: str,
        rows: int,
        max_kills: int | None,
        weights: dict,
        state_store: str,
        ahead: int,
        stall_timeout: float,
        delay: tuple[float, float],
        quiet: bool = False,
        standby: bool = True,
        durability: str = "server",
    ):
        self.duration = duration
        self.seed = seed
        self.rng = random.Random(seed)
        self.work = workdir
        self.rows = rows
        self.max_kills = max_kills
        self.weights = weights
        self.state_store = state_store
        self.ahead = ahead
        self.stall_timeout = stall_timeout
        self.delay = delay
        self.quiet = quiet
        if durability not in ("server", "tier"):
            raise ValueError(f"durability {durability!r}: one of server, tier")
        #: the writer's (mount's, gateway's) --durability; "tier": the server runs with
        #: --tier and a barrier returns once the bucket holds it (RPO 0 with the disk lost)
        self.durability = durability
        self._init_files(workdir)
        self.t0 = time.monotonic()
        self._init_processes(standby)
        self._init_progress()
        self._init_figures()

    def _init_files(self, workdir: str) -> None:
        """The run's directories, the ``acked`` file the drivers append to, the events log."""
        p = {
            k: os.path.join(workdir, k)
            for k in ("staging", "input", "out", "server-data", "control", "logs", "restore", "key-backup", "aws")
        }
        self.paths = p
        for k in ("staging", "input", "out", "control", "logs"):
            os.makedirs(p[k], exist_ok=True)
        self.acked_path = os.path.join(workdir, "acked.log")
        open(self.acked_path, "a").close()
        self.events_log = open(os.path.join(p["logs"], "events.log"), "a")  # noqa: SIM115 - for the run; closed at its end

    def _init_processes(self, standby: bool) -> None:
        """The server (not started yet), and no mount, worker or driver so far."""
        p = self.paths
        # with ``disk`` events (or tier durability) the server copies every acknowledged byte
        # to a bucket (--tier) on moto's S3 server in this process, so that a replacement can
        # rebuild from it
        tiered = self.weights.get("disk", 0) > 0 or self.durability == "tier"
        self.store = EmbeddedStore(p["aws"]) if tiered else None
        self.server = ServerProc(
            p["server-data"], os.path.join(p["logs"], "server.log"), self.store.url if self.store else None
        )
        self.bootstraps: list[float] = []  # seconds each replacement server took to listen
        self.key = ""
        self.mount = None
        self.mount_n = 0
        self.worker_n = 0
        self.worker_dir = ""
        self.mountpoint = ""
        self.driver: subprocess.Popen | None = None
        self.driver_ctl = ""
        self.driver_n = 0
        # a warm spare driver process (SparkSession up, nothing else: it has not touched the
        # mount, the checkpoint or the output) that replaces a killed driver at once
        self.use_standby = standby
        self.standby: subprocess.Popen | None = None
        self.standby_ctl = ""
        self._standby_after = 0  # spawn the spare once the active driver committed past this
        self.promoted = 0
        self._drawn: str | None = None  # the kind of the event drawn and not struck yet
        self._events_drawn = 0
        self.cmd_seq = 0
        self.want_running = False  # the harness asked the driver to run the query

    def _init_progress(self) -> None:
        """The input fed so far and the batches acknowledged."""
        # input
        self.total_files = 0
        self.fed = 0
        self.file_ids: list[list[int]] = []
        self.expected_prefix: dict[int, str] = {}
        self.expected_all: dict[int, str] = {}
        # progress
        self._acked_off = 0
        self.acked_max = -1
        self.acked_files = 0  # input files consumed by acknowledged batches
        self.seen_files = 0  # input files consumed by batches a look at the checkpoint saw
        self.last_progress_t = time.monotonic()

    def _init_figures(self) -> None:
        """What the report counts: kills, restores, checks, violations, recovery times."""
        self.kills = {k: 0 for k in self.KINDS}
        self.restores = {"sos-restore": 0, "empty-cache": 0}
        self.processes_killed = {"server": 0, "mount": 0, "driver": 0, "server-disk": 0}
        self.query_restarts = 0  # same JVM, after a mount kill
        self.query_failures: list[str] = []  # failures the harness did not cause directly
        self.unexpected: list[str] = []  # processes that died without being killed
        self.checks = 0
        self.records_checked = 0  # records of committed output compared, all checks
        self.last_check_records = 0
        self.violations: list[str] = []
        self.restart_times = {k: [] for k in self.KINDS}
        # event -> first batch committed after it (beyond what the check saw): the real
        # cost of each kind of crash for the query
        self.recovery = {k: [] for k in self.KINDS}
        # (kind, t_event, last batch seen by the check) of every event not yet followed by a
        # committed batch (a later event does not cancel an earlier one's measure)
        self._pending_recovery: list[tuple[str, float, int]] = []
        #: queries that stopped, by the kill event before them (issue 30: goal 0 for
        #: "gateway" and a pair's failovers); "none": no kill in the 120 s before
        self.stopped_by: dict[str, int] = {}
        self.last_kill: tuple[str, float] | None = None
        self.last_check_hi = -1

    # ------------------------------------------------------------------ output
    def say(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        self.events_log.write(line + "\n")
        self.events_log.flush()
        if not self.quiet:
            print(line, flush=True)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------------ input
    def prepare_input(self) -> None:
        # batches are at most a few per second here; generous, the rest stays unused
        self.total_files = int(self.duration * 2) + 400
        records = self.total_files * self.rows
        self.expected_all = make_input(self.paths["staging"], records, self.total_files)
        bounds = [records * i // self.total_files for i in range(self.total_files + 1)]
        # the ids new in file i (make_input: file i = chunk i + half of chunk i-1 again)
        self.file_ids = [list(range(bounds[i], bounds[i + 1])) for i in range(self.total_files)]
        self.say(
            f"input: {self.total_files} files of {self.rows} new ids (+ duplicates of the "
            f"previous file) staged; fed {self.ahead} batches ahead of the query"
        )

    def consumed_files(self) -> int:
        """Input files the committed batches consumed: the driver's acknowledgements, or
        (cluster mode) a look at the checkpoint when an acknowledgement went missing."""
        return max(self.acked_files, self.seen_files)

    def feed(self) -> None:
        target = min(self.total_files, self.consumed_files() + self.ahead)
        while self.fed < target:
            name = f"part-{self.fed:05d}.json"
            os.rename(
                os.path.join(self.paths["staging"], name), os.path.join(self.paths["input"], name)
            )  # keeps make_input's mtime
            for rid in self.file_ids[self.fed]:
                self.expected_prefix[rid] = self.expected_all[rid]
            self.fed += 1

    def read_acked(self) -> int:
        with open(self.acked_path) as f:
            f.seek(self._acked_off)
            data = f.read()
        end = data.rfind("\n")
        if end >= 0:
            self._acked_off += end + 1
            for line in data[:end].splitlines():
                try:
                    b, log_offset = (int(x) for x in line.split())
                except ValueError:  # a driver killed mid-line: that batch is re-acked later
                    continue
                self.acked_files = max(self.acked_files, log_offset + 1)
                if b > self.acked_max:
                    self.acked_max = b
                    self.last_progress_t = time.monotonic()
                for pending in [p for p in self._pending_recovery if b > p[2]]:
                    self.recovery[pending[0]].append(time.monotonic() - pending[1])
                    self._pending_recovery.remove(pending)
        return self.acked_max

    # ------------------------------------------------------------------ processes
    def start_server(self) -> None:
        self.server.start()

    def new_worker(self) -> None:
        """A fresh worker: new cache directory (empty: the mount restores it)."""
        self.worker_n += 1
        self.worker_dir = os.path.join(self.work, f"worker{self.worker_n}")
        os.makedirs(os.path.join(self.worker_dir, "cache"), exist_ok=True)

    def start_mount(self) -> float:
        from spark_plugin.spark import start_mount

        self.mount_n += 1
        # a new mount point per mount: a dying query can never write into the directory
        # under a later mount
        self.mountpoint = os.path.join(self.worker_dir, f"mnt{self.mount_n}")
        t = time.monotonic()
        try:
            self.mount = start_mount(
                NAMESPACE,
                self.mountpoint,
                server=self.server.address,
                key=self.key,
                cache_dir=os.path.join(self.worker_dir, "cache"),
                timeout=300,
                log_path=os.path.join(self.paths["logs"], f"mount{self.mount_n}.log"),
                durability=self.durability,
            )
        except Exception as exc:
            raise HarnessError(f"sos mount #{self.mount_n} did not start: {exc}") from exc
        os.makedirs(self.checkpoint(), exist_ok=True)
        return time.monotonic() - t

    def checkpoint(self) -> str:
        return os.path.join(self.mountpoint, CHECKPOINT)

    def view(self):
        """The checkpoint as the harness's check reads it (here: through the mount)."""
        return self.checkpoint()

    def kill_mount_only(self) -> None:
        """SIGKILL the mount process but leave the dead mount in place (ENOTCONN)."""
        if self.mount is not None and self.mount.proc.poll() is None:
            os.kill(self.mount.pid, signal.SIGKILL)
            self.mount.proc.wait()
            self.processes_killed["mount"] += 1

    def drop_mount(self) -> None:
        """Lazily unmount the (dead) mount and remove its mount point."""
        if self.mount is not None:
            self.mount.kill()
            with contextlib.suppress(OSError):
                os.rmdir(self.mount.mountpoint)
            self.mount = None

    def command(self, action: str) -> int:
        self.cmd_seq += 1
        doc = {"seq": self.cmd_seq, "action": action}
        if action == "run":
            doc.update(mountpoint=self.mountpoint, checkpoint=self.checkpoint())
        write_json_atomic(os.path.join(self.driver_ctl, "cmd.json"), doc)
        self.want_running = action == "run"
        return self.cmd_seq

    def status(self):
        if self.driver is None:
            return None
        st = read_json(os.path.join(self.driver_ctl, "status.json"))
        if st is None or self.driver is None or st.get("pid") != self.driver.pid:
            return None
        return st

    def wait_status(self, seq: int, states, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st is not None and st["seq"] >= seq and st["state"] in states:
                return st
            if self.driver is None or self.driver.poll() is not None:
                return None
            time.sleep(0.05)
        return None

    def _driver_config(self, **extra: object) -> tuple[str, str]:
        """The next driver's control directory and its config file (``tools.soak.driver``
        reads it: input, output, control, acked file, state store, and ``extra``).
        Returns (control directory, config path)."""
        self.driver_n += 1
        ctl = os.path.join(self.paths["control"], f"d{self.driver_n}")
        os.makedirs(ctl, exist_ok=True)
        cfg = {
            "input": self.paths["input"],
            "out": self.paths["out"],
            "control": ctl,
            "acked": self.acked_path,
            "state_store": self.state_store,
            **extra,
        }
        cfg_path = os.path.join(ctl, "driver.json")
        write_json_atomic(cfg_path, cfg)
        return ctl, cfg_path

    def _spawn_driver(self) -> tuple[subprocess.Popen, str]:
        """A new driver process with its own control directory; it idles until told."""
        ctl, cfg_path = self._driver_config()
        log_path = os.path.join(self.paths["logs"], f"driver{self.driver_n}.log")
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tools.soak", "_driver", cfg_path],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                start_new_session=True,
                env=child_env(),
            )
        return proc, ctl

    def start_driver(self) -> str:
        """Run the query in a new driver: the warm spare if there is one, else a cold start."""
        how = "a cold-started driver"
        if self.standby is not None and self.standby.poll() is None:
            self.driver, self.driver_ctl = self.standby, self.standby_ctl
            self.standby = None
            self.promoted += 1
            how = "the warm spare driver"
        else:
            if self.standby is not None:
                self._standby_died()
            self.driver, self.driver_ctl = self._spawn_driver()
        self.command("run")
        self._standby_after = max(self.acked_max, self.last_check_hi)
        return how

    def _standby_died(self) -> None:
        rc = self.standby.poll()
        self.unexpected.append(f"t={self.elapsed():.0f}s: the spare driver exited by itself ({rc})")
        self.say(f"UNEXPECTED: the spare driver exited ({rc})")
        self.standby = None

    def tend_standby(self) -> None:
        if not self.use_standby:
            return
        if self.standby is not None:
            if self.standby.poll() is not None:
                self._standby_died()
            return
        # start the spare only once the active driver commits: its JVM start would
        # otherwise slow the query's own start; and only if an event ahead will need a new
        # driver (a JVM that no event would use costs a driver's start-up CPU for nothing)
        if self.driver is not None and self.acked_max > self._standby_after and self.spare_needed():
            self.standby, self.standby_ctl = self._spawn_driver()

    #: the kinds of event that run the query on a new driver (:meth:`start_driver`)
    NEW_DRIVER = ("driver", "all")

    def spare_needed(self) -> bool:
        """Does an event still to strike run the query on a new driver?"""
        kinds = self.upcoming_kinds()
        return kinds is None or any(k in self.NEW_DRIVER for k in kinds)

    def kill_driver(self, wait: bool = True) -> None:
        """SIGKILL the driver and its JVM; ``wait``: until they are gone. Not waiting is for a
        total loss: a thread of the driver inside a call on the mount (a barrier waiting for
        the killed server) cannot die before the mount answers or dies, so the waiting comes
        after the mount's kill (:meth:`reap_driver`)."""
        if self.driver is not None:
            if self.driver.poll() is None:
                self.processes_killed["driver"] += 1
            if wait:
                kill_tree(self.driver)
            else:
                signal_tree(self.driver)

    def reap_driver(self) -> None:
        """Wait for a driver :meth:`kill_driver` signalled without waiting."""
        if self.driver is not None:
            kill_tree(self.driver)

    # ------------------------------------------------------------------ events
    @staticmethod
    def server_outage(rng: random.Random) -> float:
        """How long a killed server stays down (the server event's one draw)."""
        return rng.uniform(0.0, 1.5)

    @staticmethod
    def total_loss_plan(rng: random.Random) -> tuple[list[str], str]:
        """The order of a total loss's kills and how it is restored (the ``all`` event's draws)."""
        order = ["server", "mount", "driver"]
        rng.shuffle(order)
        return order, rng.choice(("sos-restore", "empty-cache"))

    def handler_draws(self, kind: str, rng: random.Random) -> None:
        """Make on ``rng`` the draws that the handler of ``kind`` makes on :attr:`rng` (those
        above), so that :meth:`upcoming_kinds` can follow the schedule ahead."""
        if kind == "server":
            self.server_outage(rng)
        elif kind == "all":
            self.total_loss_plan(rng)

    def draw_event(self, rng: random.Random) -> tuple[str, float, float]:
        """The next event's kind, the delay before it and its jitter."""
        kind = rng.choices(self.KINDS, weights=[self.weights[k] for k in self.KINDS])[0]
        return kind, rng.uniform(*self.delay), rng.uniform(0.0, 1.0)

    def upcoming_kinds(self) -> list[str] | None:
        """The kinds of the events still to strike, the one drawn and waiting included (the
        draws do not depend on timing: the schedule ahead follows from a copy of the RNG);
        None when the run has no bound on its events."""
        if self.max_kills is None:
            return None
        rng = random.Random()
        rng.setstate(self.rng.getstate())
        kinds = []
        if self._drawn is not None:
            kinds.append(self._drawn)
            self.handler_draws(self._drawn, rng)
        for _ in range(self.max_kills - self._events_drawn):
            kind = self.draw_event(rng)[0]
            kinds.append(kind)
            self.handler_draws(kind, rng)
        return kinds

    def kill_server(self) -> str:
        pid = self.server.proc.pid
        self.kill_server_only()
        outage = self.server_outage(self.rng)
        time.sleep(outage)
        t = time.monotonic()
        self.server.start()
        verdict = self.check(self.view(), "after a server kill")
        return (
            f"server pid {pid} SIGKILLed, down {outage:.1f}s, restarted in "
            f"{time.monotonic() - t:.1f}s; check: {verdict}"
        )

    def writer_pid(self) -> int:
        """The process that writes the journal to the server (here: the mount)."""
        return self.mount.pid

    def kill_server_disk(self) -> str:
        """The server's disk is lost: SIGKILL the server, delete its data directory, start a
        replacement on the EMPTY directory with the same --tier and port, which rebuilds the
        namespace from the bucket before it listens (the keys come from the backup copy).

        Without ``--durability tier`` a lost server takes the bytes the bucket lacks with it
        (the upload lag, about ``--tier-interval``), and those may be committed batches: so
        the journal's writer is frozen (SIGSTOP) wherever the query is, the bucket catches up
        with everything the server acknowledged, and only then does the disk go. The writer
        is thawed once the replacement listens and reconnects to it on its own.

        With ``--durability tier`` nothing waits: the disk goes wherever the writer and the
        bucket are (mid-flush, mid-barrier); every barrier the writer saw returned is in the
        bucket, so the check after it must still find every committed batch (RPO 0)."""
        assert self.store is not None, "disk events need the tier (weights: disk > 0)"
        pid = self.server.proc.pid
        writer = self.writer_pid()
        boots = self.server.log_text().count('"tier bootstrap"')
        frozen = self.durability != "tier"
        waited = 0.0
        if frozen:
            os.kill(writer, signal.SIGSTOP)
        try:
            if frozen:
                waited = wait_tier_drained(self.server, NAMESPACE, timeout=min(self.stall_timeout, 120))
            self.server.kill()
            self.processes_killed["server-disk"] += 1
            shutil.rmtree(self.paths["server-data"])
            restore_keys(self.paths["key-backup"], self.paths["server-data"], NAMESPACE)
            t = time.monotonic()
            self.server.start()
            took = time.monotonic() - t
            self.bootstraps.append(took)
        finally:
            if frozen:
                os.kill(writer, signal.SIGCONT)
        if self.server.log_text().count('"tier bootstrap"') != boots + 1:
            raise Violation(
                "the replacement server on an empty data directory did not rebuild "
                "from the bucket (no tier bootstrap in its log)"
            )
        verdict = self.check(self.view(), "after the server's disk was lost")
        how = (
            f"writer pid {writer} frozen, the bucket caught up in {waited:.1f}s; "
            if frozen
            else f"writer pid {writer} running (durability tier, no wait for the bucket); "
        )
        return (
            f"{how}server pid {pid} SIGKILLed and its data directory deleted; a replacement on "
            f"an empty one rebuilt from the bucket and listened in {took:.1f}s; check: {verdict}"
        )

    def kill_mount(self) -> str:
        pid = self.mount.pid
        self.kill_mount_only()
        # the query dies on the dead mount (ENOTCONN); stop it before the mount point moves
        seq = self.command("stop")
        st = self.wait_status(seq, ("stopped",), 120)
        note = ""
        if st is None:
            note = "; driver did not stop its query within 120s: driver killed"
            self.unexpected.append(f"t={self.elapsed():.0f}s: driver did not stop its query after a mount kill")
            self.kill_driver()
            self.driver = None
        self.drop_mount()
        took = self.start_mount()
        verdict = self.check(self.checkpoint(), "after a mount kill")
        if self.driver is not None:
            self.command("run")
            self.query_restarts += 1
        else:
            self.start_driver()
        return (
            f"mount pid {pid} SIGKILLed, query stopped, new mount on the same cache in "
            f"{took:.1f}s; check: {verdict}; query restarted in the same driver{note}"
        )

    def kill_driver_event(self) -> str:
        pid = self.driver.pid if self.driver else None
        self.kill_driver()
        verdict = self.check(self.view(), "after a driver kill")
        how = self.start_driver()
        return f"driver pid {pid} (and its JVM) SIGKILLed; check: {verdict}; query on {how}"

    def kill_all(self) -> str:
        order, mode = self.total_loss_plan(self.rng)
        self.kill_in_order(order, {"mount": self.kill_mount_only, "driver": lambda: self.kill_driver(wait=False)})
        self.kill_mount_only()  # (killed already) lets a driver stuck on the mount die
        self.reap_driver()
        self.driver = None
        self.drop_mount()
        shutil.rmtree(self.worker_dir)  # the worker is gone: mount point, cache, spool
        self.server.start()
        self.new_worker()
        detail = self.restore_after_total_loss(mode)
        took = self.start_mount()
        verdict = self.check(self.checkpoint(), "after a total loss, on the rebuilt mount")
        detail += f"mount on an EMPTY cache rebuilt it in {took:.1f}s; check: {verdict}"
        how = self.start_driver()
        return f"SIGKILL {'+'.join(order)}, worker deleted; {detail}; query on {how}"

    def kill_server_only(self) -> None:
        """SIGKILL the server, counted."""
        self.server.kill()
        self.processes_killed["server"] += 1

    def kill_in_order(self, order: list[str], kills: dict[str, Callable[[], None]]) -> None:
        """A total loss: SIGKILL what ``order`` names, in its order: "server", or one of ``kills``."""
        for what in order:
            if what == "server":
                self.kill_server_only()
            else:
                kills[what]()

    def restore_after_total_loss(self, mode: str) -> str:
        """In mode "sos-restore": ``sos restore`` the namespace into a fresh directory and
        check the checkpoint there (then remove it); in either mode, count it. The start of
        the event's detail ("" in mode "empty-cache")."""
        detail = ""
        if mode == "sos-restore":
            target = os.path.join(self.paths["restore"], f"r{self.restores['sos-restore'] + 1}")
            t = time.monotonic()
            self.sos_restore(target)
            detail = f"sos restore into a fresh directory in {time.monotonic() - t:.1f}s"
            verdict = self.check(os.path.join(target, CHECKPOINT), "after sos restore")
            detail += f" ({verdict}); "
            shutil.rmtree(target)
        self.restores[mode] += 1
        return detail

    def sos_restore(self, target: str) -> None:
        from spark_plugin.spark import sos_command

        proc = subprocess.run(
            [*sos_command(), "restore", "-q", "--server", self.server.address, NAMESPACE, target],
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, SOS_KEY=self.key),
        )
        with open(os.path.join(self.paths["logs"], "restore.log"), "a") as f:
            f.write(f"--- {target}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
        if proc.returncode != 0:
            raise Violation(
                f"sos restore failed after a total loss (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
            )

    # ------------------------------------------------------------------ supervision
    def pump(self) -> None:
        """Feed input, notice failures nobody caused on purpose, keep the query running."""
        self.read_acked()
        self.feed()
        self.tend_standby()
        if not self.server.alive():
            self.unexpected.append(
                f"t={self.elapsed():.0f}s: sos-server exited by itself ({self.server.proc.returncode})"
            )
            self.say(f"UNEXPECTED: sos-server exited ({self.server.proc.returncode}); restarting")
            self.server.start()
        if self.supervise():
            return
        if self.mount is not None and self.mount.proc.poll() is not None:
            rc = self.mount.proc.returncode
            self.unexpected.append(f"t={self.elapsed():.0f}s: sos mount #{self.mount_n} exited by itself ({rc})")
            self.say(f"UNEXPECTED: sos mount #{self.mount_n} exited ({rc}); see {self.mount.log_path}; remounting")
            self.kill_mount()
            return
        if self.driver is not None and self.driver.poll() is not None:
            rc = self.driver.returncode
            self.unexpected.append(f"t={self.elapsed():.0f}s: driver #{self.driver_n} exited by itself ({rc})")
            self.say(f"UNEXPECTED: the driver exited ({rc}); starting a new one")
            self.start_driver()
            return
        st = self.status()
        if st is not None and st["seq"] == self.cmd_seq and st["state"] == "failed" and self.want_running:
            if st.get("checkpoint_unreadable"):
                raise Violation(
                    f"the query cannot load the state of its committed checkpoint "
                    f"(a state file of a committed batch is lost, empty or "
                    f"truncated): {(st.get('error') or '')[:500]}"
                )
            err = (st.get("error") or "").splitlines()[0][:300] if st.get("error") else ""
            self.query_failures.append(f"t={self.elapsed():.0f}s: {err}")
            by = self.last_kill[0] if self.last_kill and time.monotonic() - self.last_kill[1] < 120 else "none"
            self.stopped_by[by] = self.stopped_by.get(by, 0) + 1
            self.say(
                f"query failed{' without a mount kill' if self.MODE == 'mount' else ''}: "
                f"{err}; restarting it in the same driver"
            )
            self.command("run")
            self.query_restarts += 1
        if time.monotonic() - self.last_progress_t > self.stall_timeout:
            raise HarnessError(
                f"no batch committed for {self.stall_timeout:.0f}s (stall); last committed batch {self.acked_max}"
            )

    def supervise(self) -> bool:
        """Notice and repair the mode's own parts dying by themselves; True if it did."""
        return False

    def wait_progress(self, since: int, until: float) -> bool:
        while self.acked_max <= since:
            if time.monotonic() > until:
                return False
            self.pump()
            time.sleep(0.1)
        return True

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        self.say(
            f"soak: seed {self.seed}, duration {self.duration:.0f}s"
            + (f", at most {self.max_kills} kill events" if self.max_kills else "")
            + f", work dir {self.work}"
        )
        if self.EARLY_DRIVER:  # its JVM starts while the input, server and mount are made ready
            self.driver, self.driver_ctl = self._spawn_driver()
        self.prepare_input()
        self.key = keygen(self.paths["server-data"], NAMESPACE)
        if self.store is not None:
            backup_keys(self.paths["server-data"], NAMESPACE, self.paths["key-backup"])
            self.store.start()
        self.start_server()
        self.say(
            f"sos-server on {self.server.address}"
            + (f", --tier {self.store.url} (moto's S3 server at {self.store.endpoint})" if self.store else "")
        )
        self.setup()
        self.feed()
        if self.driver is not None:  # the driver started at the beginning: it runs the query now
            self.command("run")
            self._standby_after = max(self.acked_max, self.last_check_hi)
        else:
            self.start_driver()
        self.last_progress_t = time.monotonic()
        if not self.wait_progress(-1, time.monotonic() + self.stall_timeout):
            raise HarnessError("the query committed no batch after start")
        self.say("first batch committed; the crash loop starts")
        end = self.t0 + self.duration
        n = 0
        streak = 0  # server kills since the last committed batch
        while time.monotonic() < end and (self.max_kills is None or n < self.max_kills):
            # every draw happens for every event, so a seed gives the same sequence of events
            kind, delay, jitter = self.draw_event(self.rng)
            self._drawn = kind
            self._events_drawn += 1
            before = self.acked_max
            at = time.monotonic() + delay
            while time.monotonic() < at:
                self.pump()
                time.sleep(0.05)
            # before a mount, driver or total kill, at least one batch committed since the
            # previous event (the crash loop must not starve the query); then strike at a
            # random point of a later batch. Two server kills may come back to back.
            if self.acked_max > before:
                streak = 0
            if (kind not in self.CHEAP or streak >= 2) and self.acked_max <= before:
                self.wait_progress(before, time.monotonic() + self.stall_timeout)
                streak = 0
                self.pump()
                t = time.monotonic() + jitter
                while time.monotonic() < t:
                    self.pump()
                    time.sleep(0.05)
            if time.monotonic() >= end:
                break
            streak += 1
            n += 1
            t = time.monotonic()
            self.kills[kind] += 1
            self.say(f"#{n} kill {kind} (batch {self.acked_max} committed last)")
            what = self.handlers()[kind]()
            self._drawn = None
            self.restart_times[kind].append(time.monotonic() - t)
            self._pending_recovery.append((kind, t, max(self.last_check_hi, self.acked_max)))
            self.last_kill = (kind, time.monotonic())
            self.say(f"#{n} {kind}: {what} ({time.monotonic() - t:.1f}s)")
        self.say(f"{n} kill events; no more kills: draining the {self.fed} fed input files")
        self.drain()
        return self.summary()

    def setup(self) -> None:
        """Start what runs beside the server and the driver (here: the worker's mount)."""
        self.new_worker()
        self.start_mount()
        self.say(f"mounted {NAMESPACE} at {self.mountpoint}")

    def handlers(self) -> dict:
        return {
            "server": self.kill_server,
            "mount": self.kill_mount,
            "driver": self.kill_driver_event,
            "all": self.kill_all,
            "disk": self.kill_server_disk,
        }

    def drain(self) -> None:
        final_fed = self.fed
        deadline = time.monotonic() + max(self.stall_timeout, 120)
        while self.consumed_files() < final_fed:
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"drain: batch {self.acked_max} is the last committed, it "
                    f"read {self.consumed_files()} of the {final_fed} files fed"
                )
            self.read_acked()
            self.pump_no_feed()
            time.sleep(0.1)
        verdict = self.check(self.view(), "final")
        hi = max(checkpoint_commits(self.view()))
        if source_offset(self.view(), hi) != final_fed - 1:
            raise Violation(f"final: last committed batch {hi} does not end at the last fed file {final_fed - 1}")
        res = check_output(self.paths["out"], set(range(hi + 1)), self.expected_prefix)
        if res["lost"] or res["records_out"] != len(self.expected_prefix):
            raise Violation(
                f"final: {len(res['lost'])} records lost of {len(self.expected_prefix)} fed (e.g. {res['lost'][:5]})"
            )
        self.final_records = res["records_out"]
        self.say(f"final check: every fed record came out exactly once: {verdict}")
        if self.standby is not None:
            kill_tree(self.standby)
            self.standby = None
        seq = self.command("exit")
        self.wait_status(seq, ("exited",), 120)
        if self.driver is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.driver.wait(60)
            kill_tree(self.driver)
        self.driver = None
        self.finish()

    def finish(self) -> None:
        """After the final check and the driver's exit: stop the rest cleanly."""
        rc = self.mount.stop()
        if rc not in (0, None):
            self.unexpected.append(f"final clean unmount exited {rc}")
        self.mount = None

    def pump_no_feed(self) -> None:
        saved, self.ahead = self.ahead, -(10**9)
        try:
            self.pump()
        finally:
            self.ahead = saved

    def summary(self) -> dict:
        def med(xs):
            xs = sorted(xs)
            return round(xs[len(xs) // 2], 1) if xs else None

        return {
            "ok": not self.violations,
            "seed": self.seed,
            "durability": self.durability,
            "duration_s": round(self.elapsed(), 1),
            "kill_events": sum(self.kills.values()),
            "kills": dict(self.kills),
            "processes_killed": dict(self.processes_killed),
            "restores": dict(self.restores),
            "query_restarts_same_jvm": self.query_restarts,
            "driver_starts": self.driver_n,
            "spare_driver_promotions": self.promoted,
            "mount_starts": self.mount_n,
            "server_starts": self.server.starts,
            "server_bootstraps": len(self.bootstraps),
            "median_bootstrap_s": med(self.bootstraps),
            "batches_committed": self.acked_max + 1,
            "input_files_fed": self.fed,
            "records_final": getattr(self, "final_records", 0),
            "checks": self.checks,
            "records_checked": self.records_checked,
            "violations": list(self.violations),
            "query_failures": list(self.query_failures),
            "unexpected": list(self.unexpected),
            "median_event_s": {k: med(v) for k, v in self.restart_times.items()},
            "median_recovery_s": {k: med(v) for k, v in self.recovery.items()},
            # kill -> the next committed batch, the delay each kind of event gave the query
            "recovery_p50_p99_s": {k: percentiles(v) for k, v in self.recovery.items() if v},
            "stopped_queries": {k: self.stopped_by.get(k, 0) for k in [*self.KINDS, "none"]},
            "stopped_queries_per_kill": {
                k: round(self.stopped_by.get(k, 0) / n, 3) for k, n in self.kills.items() if n
            },
            "kills_per_hour": round(sum(self.kills.values()) * 3600 / max(self.elapsed(), 1), 0),
        }

    def cleanup(self) -> None:
        """Kill what is left, unmount. Safe to call twice."""
        for proc in (self.driver, self.standby):
            if proc is not None:
                signal_tree(proc)  # reaped once the mount is gone (kill_driver)
        if self.mount is not None:
            self.mount.kill()
            self.mount = None
        for proc in (self.driver, self.standby):
            if proc is not None:
                kill_tree(proc)
        self.driver = self.standby = None
        self.server.kill()
        if self.store is not None:
            self.store.stop()
        # mounts of earlier workers are already gone; be thorough anyway
        for root, dirs, _files in os.walk(self.work):
            for d in list(dirs):
                if d.startswith("mnt"):
                    from spark_plugin.mount.process import is_mounted, lazy_unmount

                    p = os.path.join(root, d)
                    if is_mounted(p):
                        lazy_unmount(p)
                    dirs.remove(d)
        self.events_log.close()
