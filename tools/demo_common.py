"""What the two demos (:mod:`tools.demo`, the mount demo and the entry point, and
:mod:`tools.demo_cluster`) and the crash loop (:mod:`tools.soak`) share: the input, the
exactly-once check of the output, the sink, the server launcher, process helpers and the
verdict. It imports neither demo, so they need not import each other.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from tools.jvm import spark_jvm_options
from tools.server import ServerProcess, ServerStartError

#: the query's checkpoint directory in the namespace (the mount demo, the crash loop)
CHECKPOINT = "checkpoint"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
#: a short-lived local driver's JVM: C1 only, serial GC, and this environment's class-data
#: archive of Spark's classes when it has one (tools/jvm.py says why and how)
DRIVER_JVM_OPTIONS = spark_jvm_options()


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
            ids += prev[len(prev) // 2 :]
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
    return {
        "records_in": len(expected),
        "records_out": sum(seen.values()),
        "lost": lost,
        "doubled": doubled,
        "corrupted": corrupted,
        "unknown": unknown,
        "uncommitted_output_ignored": outside,
        "committed_without_output": missing_output,
    }


# --------------------------------------------------------------------------- processes


def check_problems(check: dict, committed: set[int], batches: int) -> list[str]:
    """What is wrong after the run: batches ``0..batches-1`` not all committed, or records
    of the committed output (``check``, from :func:`check_output`) lost, doubled, corrupted,
    unknown, or a committed batch without output."""
    problems = []
    if committed != set(range(batches)):
        problems.append(f"committed batches {fmt(committed)}, expected 0..{batches - 1}")
    for k in ("lost", "doubled", "corrupted", "unknown", "committed_without_output"):
        if check[k]:
            problems.append(f"{len(check[k])} {k.replace('_', ' ')} (e.g. {check[k][:5]})")
    return problems


def check_summary(check: dict) -> str:
    """The check's line in the demo's output."""
    return (
        f"{check['records_in']} records in, {check['records_out']} out "
        f"of committed batches; lost {len(check['lost'])}, doubled {len(check['doubled'])}, "
        f"corrupted {len(check['corrupted'])}"
    )


def _python_call(module: str, func: str = "main") -> list[str]:
    return [sys.executable, "-c", f"import sys; from {module} import {func}; sys.exit({func}())"]


def use_journal_key(work: str) -> Callable[[], None]:
    """The demo namespace's journal key (protocol.md 2.5, docs/DEPLOY.md "The journal key"):
    made once in a 0600 file of the work directory and set as ``$SOS_JOURNAL_KEY_FILE`` for
    this process and every child it starts (mounts, gateways, ``sos restore``); returns what
    puts the environment back. The deployments do the same from a Secret."""
    path = os.path.join(work, "journal.key")
    if not os.path.exists(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    before = {v: os.environ.pop(v, None) for v in ("SOS_JOURNAL_KEY", "SOS_JOURNAL_KEY_FILE")}
    os.environ["SOS_JOURNAL_KEY_FILE"] = path

    def undo() -> None:
        os.environ.pop("SOS_JOURNAL_KEY_FILE", None)
        os.environ.update({k: v for k, v in before.items() if v is not None})

    return undo


def keygen(data_dir: str, namespace: str, role: str = "append") -> str:
    proc = subprocess.run(
        [*_python_call("sos_server.cli"), "keygen", "--data", data_dir, namespace, "--role", role],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise DemoFailure(f"sos-server keygen failed: {proc.stderr.strip()}")
    return proc.stdout.strip().splitlines()[-1].strip()


class LocalServer(ServerProcess):
    """The one server launcher (tools.server.ServerProcess) as the demo and the benches use
    it: metrics only when asked for, and a failed start is a DemoFailure."""

    def __init__(
        self,
        data_dir: str,
        log_path: str,
        *,
        args: Sequence[str] = (),
        metrics: bool = False,
        profile: str | None = None,
    ):
        super().__init__(data_dir, args, log_path=log_path, metrics=metrics, profile=profile)

    def start(self, timeout: float = 120.0) -> LocalServer:
        try:
            super().start(timeout)
        except ServerStartError as exc:
            raise DemoFailure(str(exc)) from None
        return self


# --------------------------------------------------------------------------- the object-store tier


class EmbeddedStore:
    """The demos' object store: moto's S3 server (``moto[server]``, in the extras
    ``scripts/setup`` installs) on 127.0.0.1 in this process, with one bucket, for the
    server's ``--tier`` (protocol.md Part 4).

    :meth:`start` puts the environment a tier reads through boto3's standard chain into
    ``os.environ`` (``AWS_ENDPOINT_URL``, dummy credentials, a region, no shared config
    files, no instance metadata), so every child inherits it: the server and
    ``sos restore --from``. Nothing goes on a command line. For a real bucket the same
    variables (or a profile, or workload identity) point elsewhere: docs/DEPLOY.md."""

    BUCKET = "sos-demo"

    def __init__(self, workdir: str, prefix: str = "tier") -> None:
        self.workdir = workdir
        self.url = f"s3://{self.BUCKET}/{prefix}"
        self.endpoint = ""
        self._server = None

    def start(self) -> EmbeddedStore:
        try:
            import boto3
            import moto.server  # noqa: F401  (moto[server], which tools.moto_s3 needs)
        except ImportError as exc:
            raise DemoFailure(
                f"the demo's object store needs moto[server] and boto3 ({exc}): run ./scripts/setup"
            ) from None
        os.makedirs(self.workdir, exist_ok=True)
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE"):
            os.environ.pop(var, None)
        os.environ.update(
            {
                "AWS_ACCESS_KEY_ID": "demo",
                "AWS_SECRET_ACCESS_KEY": "demo",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": os.path.join(self.workdir, "no-config"),
                "AWS_SHARED_CREDENTIALS_FILE": os.path.join(self.workdir, "no-credentials"),
            }
        )
        import logging

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
        from tools.moto_s3 import moto_server

        server = moto_server()
        server.start()
        self._server = server
        host, port = server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        os.environ["AWS_ENDPOINT_URL"] = self.endpoint
        boto3.session.Session().client("s3").create_bucket(Bucket=self.BUCKET)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def metrics_of(server: ServerProcess) -> dict[str, float]:
    """The server's Prometheus metrics (it runs with ``metrics=True``): {name{labels}: value}."""
    import urllib.request

    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def wait_tier_drained(server: ServerProcess, namespace: str, timeout: float = 120.0) -> float:
    """Wait until the bucket holds every byte and seal the server acknowledged for
    ``namespace`` (``sos_tier_lag_bytes`` and ``sos_tier_lag_seconds`` both 0; nothing
    writes meanwhile); returns the seconds waited. Without ``--durability tier`` that lag
    (at most about ``--tier-interval``) is what a lost server can take with it."""
    t0 = time.monotonic()
    label = f'{{namespace="{namespace}"}}'

    def drained() -> bool:
        m = metrics_of(server)
        return (
            f"sos_tier_lag_bytes{label}" in m
            and m[f"sos_tier_lag_bytes{label}"] == 0
            and m.get(f"sos_tier_lag_seconds{label}", 0) == 0
        )

    wait_for(drained, timeout, f"the bucket catching up with the server ({namespace})", alive=server.running)
    return time.monotonic() - t0


def backup_keys(data_dir: str, namespace: str, backup_dir: str) -> None:
    """Copy the namespace's key files out of the server's data directory (keys are not in
    the bucket: docs/DEPLOY.md, "Replacing a lost server")."""
    shutil.copytree(os.path.join(data_dir, "ns", namespace, "keys"), os.path.join(backup_dir, "ns", namespace, "keys"))


def restore_keys(backup_dir: str, data_dir: str, namespace: str) -> None:
    """Put the backed-up key files into an empty data directory (0700 directories): a
    namespace directory that holds only ``keys/`` is no namespace to the bootstrap."""
    ns_dir = os.path.join(data_dir, "ns", namespace)
    for d in (data_dir, os.path.join(data_dir, "ns"), ns_dir):
        os.makedirs(d, mode=0o700, exist_ok=True)
    shutil.copytree(os.path.join(backup_dir, "ns", namespace, "keys"), os.path.join(ns_dir, "keys"))


def tree_of(root: str | os.PathLike[str]) -> dict[str, bytes | None]:
    """{relative path: None for a directory, the bytes for a file} under ``root``."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for n in filenames:
            with open(os.path.join(dirpath, n), "rb") as f:
                out[os.path.normpath(os.path.join(rel, n))] = f.read()
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a driver and every process it started (the JVM)."""
    if proc.poll() is not None:
        return
    pids = [proc.pid]
    try:
        import psutil

        pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except Exception:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the driver runs in its own session
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
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
    return {int(st["pathSuffix"]) for st in doc["FileStatuses"]["FileStatus"] if st["pathSuffix"].isdigit()}


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
