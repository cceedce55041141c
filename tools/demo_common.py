"""What the two demos (:mod:`tools.demo`, the mount demo and the entry point, and
:mod:`tools.demo_cluster`) and the crash loop (:mod:`tools.soak`) share: the input, the
exactly-once check of the output, the sink, the server launcher, process helpers and the
verdict. It imports neither demo, so they need not import each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from tools.server import ServerProcess, ServerStartError

#: the query's checkpoint directory in the namespace (the mount demo, the crash loop)
CHECKPOINT = "checkpoint"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
#: a short-lived local driver starts and runs ~2x faster on 2 busy cores with the C1 JIT
#: only and the serial GC (measured: 44-50 s against 113-118 s for the same 4 batches)
DRIVER_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


_T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


class DemoFailure(Exception):
    pass


# --------------------------------------------------------------------------- input/output

def payload_of(rid: int) -> str:
    return hashlib.sha256(f"sos-demo-record-{rid}".encode()).hexdigest()[:40]


def make_input(input_dir: str, records: int, files: int) -> dict[int, str]:
    """Write ``files`` JSON-lines files; record ids 0..records-1, each sent twice.

    File i holds chunk i of the ids and again the second half of chunk i-1 (so a
    duplicate arrives one batch after the original; dropDuplicates must drop it, which
    only works if the state store came back intact). mtimes increase with i so the file
    source takes them in order. Returns {id: payload}.
    """
    os.makedirs(input_dir, exist_ok=True)
    bounds = [records * i // files for i in range(files + 1)]
    chunks = [list(range(bounds[i], bounds[i + 1])) for i in range(files)]
    base = time.time() - 10 * files
    expected = {}
    for i in range(files):
        ids = list(chunks[i])
        if i > 0:
            prev = chunks[i - 1]
            ids += prev[len(prev) // 2:]
        path = os.path.join(input_dir, f"part-{i:05d}.json")
        with open(path + ".tmp", "w") as f:
            for rid in ids:
                f.write(json.dumps({"id": rid, "payload": payload_of(rid)}) + "\n")
                expected[rid] = payload_of(rid)
        os.replace(path + ".tmp", path)
        os.utime(path, (base + 10 * i, base + 10 * i))
    return expected


def committed_batches(checkpoint_dir: str) -> set[int]:
    d = os.path.join(checkpoint_dir, "commits")
    if not os.path.isdir(d):
        return set()
    return {int(n) for n in os.listdir(d) if n.isdigit()}


def check_output(out_dir: str, committed: set[int], expected: dict[int, str]) -> dict:
    """The exactly-once check: committed output against the input."""
    seen: dict[int, int] = {}
    corrupted = []
    outside = []  # output files of batches that never committed (ignored, reported)
    batches_with_output = set()
    for name in sorted(os.listdir(out_dir)):
        m = re.fullmatch(r"batch-(\d+)\.jsonl", name)
        if not m:
            continue
        bid = int(m.group(1))
        if bid not in committed:
            outside.append(bid)
            continue
        batches_with_output.add(bid)
        with open(os.path.join(out_dir, name), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    rid = int(rec["id"])
                except (ValueError, KeyError, TypeError):
                    corrupted.append(line[:80])
                    continue
                seen[rid] = seen.get(rid, 0) + 1
                if expected.get(rid) != rec.get("payload"):
                    corrupted.append(line[:80])
    lost = sorted(set(expected) - set(seen))
    doubled = sorted(r for r, n in seen.items() if n > 1)
    unknown = sorted(set(seen) - set(expected))
    missing_output = sorted(committed - batches_with_output)
    return {"records_in": len(expected), "records_out": sum(seen.values()),
            "lost": lost, "doubled": doubled, "corrupted": corrupted, "unknown": unknown,
            "uncommitted_output_ignored": outside, "committed_without_output": missing_output}


# --------------------------------------------------------------------------- processes

def _python_call(module: str, func: str = "main") -> list[str]:
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


def keygen(data_dir: str, namespace: str, role: str = "append") -> str:
    proc = subprocess.run(_python_call("sos_server.cli") + ["keygen", "--data", data_dir,
                                                             namespace, "--role", role],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise DemoFailure(f"sos-server keygen failed: {proc.stderr.strip()}")
    return proc.stdout.strip().splitlines()[-1].strip()


class LocalServer(ServerProcess):
    """The one server launcher (tools.server.ServerProcess) as the demo and the benches use
    it: metrics only when asked for, and a failed start is a DemoFailure."""

    def __init__(self, data_dir: str, log_path: str, *, args: Sequence[str] = (),
                 metrics: bool = False, profile: str | None = None):
        super().__init__(data_dir, args, log_path=log_path, metrics=metrics, profile=profile)

    def start(self, timeout: float = 120.0) -> "LocalServer":
        try:
            super().start(timeout)
        except ServerStartError as exc:
            raise DemoFailure(str(exc)) from None
        return self


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a driver and every process it started (the JVM)."""
    if proc.poll() is not None:
        return
    pids = [proc.pid]
    try:
        import psutil

        pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - psutil missing or the process already gone
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver runs in its own session
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def wait_for(pred, timeout: float, what: str, alive=None, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return
        if alive is not None and not alive():
            raise DemoFailure(f"{what}: the process died first")
        if time.monotonic() > deadline:
            raise DemoFailure(f"{what}: not after {timeout:.0f}s")
        time.sleep(poll)


# --------------------------------------------------------------------------- checkpoint, sink, verdict

def gateway_committed_batches(client, checkpoint_relpath: str) -> set[int]:
    """:func:`committed_batches` of a checkpoint served by ``sos gateway`` (``client``: a
    :class:`spark_plugin.gateway.client.GatewayClient`), by LISTSTATUS of ``commits``."""
    from spark_plugin.gateway.client import GatewayError

    path = "/webhdfs/v1/" + "/".join(p for p in (checkpoint_relpath.strip("/"), "commits") if p)
    try:
        doc = client.call("GET", path, op="LISTSTATUS")
    except GatewayError as exc:
        if exc.status == 404:
            return set()
        raise
    return {int(st["pathSuffix"]) for st in doc["FileStatuses"]["FileStatus"]
            if st["pathSuffix"].isdigit()}


def write_batch_output(out_dir: str, df, batch_id: int) -> None:
    """The query's sink, idempotent by batch id: ``batch-<N>.jsonl`` holds the batch's rows,
    written to a temp file, fsynced and renamed (all there or not at all; a replayed batch
    replaces its own file)."""
    rows = sorted((r["id"], r["payload"]) for r in df.collect())
    final = os.path.join(out_dir, f"batch-{batch_id:06d}.jsonl")
    tmp = f"{final}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for rid, payload in rows:
            f.write(json.dumps({"id": rid, "payload": payload}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def fmt(batches) -> str:
    b = sorted(batches)
    if not b:
        return "(none)"
    if b == list(range(b[0], b[-1] + 1)):
        return f"{b[0]}..{b[-1]}" if len(b) > 1 else str(b[0])
    return ",".join(map(str, b))


def report(result: dict, *, as_json: bool, passed: Callable[[], str]) -> int:
    """Print a demo's result (JSON on request, the kept work dir) and its verdict as the last
    line (``passed()`` describes a success); the exit code: 0 PASS, 1 FAIL."""
    if as_json:
        print(json.dumps(result, sort_keys=True, default=str))
    if result.get("workdir"):
        say(f"work dir kept: {result['workdir']}")
    if result["ok"]:
        print(f"VERDICT: PASS - {passed()}", flush=True)
        return 0
    print("VERDICT: FAIL - " + "; ".join(result.get("problems") or ["unknown error"]), flush=True)
    return 1
