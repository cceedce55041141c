"""N streaming queries on one `sos gateway`: a real query's WebHDFS requests, replayed (issue 28).

Two steps.

``capture``: runs a real stateful Spark query (bench/spark_checkpoint.py's: file source,
maxFilesPerTrigger=1, dropDuplicates, foreachBatch sink; local[2]) with its checkpoint on a
``sos gateway --debug`` (webhdfs://, OAuth2 tokens and the batch-marker listener, as
``gateway_checkpoint`` sets them up), reads the request log, takes the last whole batch (the
requests after the one that commits batch N-1, up to the one that commits batch N, and one
marker) and writes it as a *pattern*: every request (method, op, path, query, the status it
got, the size of its body) with the checkpoint directory, batch numbers and UUIDs made
placeholders, plus what must exist when a batch starts (directories, files read). Checked in:
bench/data/small_query.json (2 shuffle partitions, HDFS state store). The query at Spark's
default 200 partitions with RocksDB changelog checkpointing is captured the same way, on
demand (``--partitions 200 --state-store rocksdb --changelog``).

``replay`` (the default): for each mode (``sync``: a gateway on a plain ``sos-server``;
``tier``: ``sos gateway --durability tier`` on a ``sos-server --tier`` over moto's S3 server)
and each N of ``--queries``, a fresh gateway, then N imitated queries at once, each from its
own loopback address (127.0.0.2, 127.0.0.3, ...), with its own bearer token (POST
/oauth2/token from that address) and its own directory: each replays the pattern once every
``--interval`` seconds (batch numbers and UUIDs new each time), its requests one after the
other on one keep-alive connection the way Hadoop's client sends them (chunked bodies, its
headers; a connection idle for more than a second is not reused, as Hadoop's client does
after the gateway's ``Keep-Alive: timeout=1``). A batch that ends after the next one was due
starts the next at once (a query that falls behind runs back to back, as Spark does).

``stat``: one client, one keep-alive connection, ``--rounds`` times ``--requests`` operations
one after the other in Hadoop's request shape: ``--op getfilestatus`` (the default: the HTTP
path and a cache read alone) or ``--op commit`` (what Spark does per checkpoint file: CREATE
of a temporary file, both steps, a 1,200-byte body, then RENAME onto its name: the write
path, two barriers); the gateway's CPU per operation (user and system, and by thread), on a
plain ``sos-server``.

Reported per mode and N, over ``--seconds`` after ``--warmup`` seconds: offered and achieved
batches/s, p50/p99 batch time, requests/s, and the CPU time (user + system, all threads, from
/proc/PID/stat) of the gateway and of the server per request and as a share of one core; the
gateway's also by thread (/proc/PID/task: ``loop``, the event loop; ``workers``, trio's
worker threads; ``others``, the replicator and the metrics sampler). ``--profile DIR``:
py-spy records the gateway (samples holding the GIL, per thread: where its CPU goes).
CPU time per request is the figure to compare across runs on a shared machine; wall times
move with whatever else runs. The physical part beside it, measured first in the same run:
the CPU time the caches' filesystem takes to create an empty file (each CREATE makes one; on
the 2026-11-30 machine's root ext4 175-870 us, against 17-21 us on a new ext4 on the same
kernel), per request of the mix; and the floor of any request: the CPU time of a server that
only waits for a request on loopback TCP (epoll), reads it and writes a reply of a
GETFILESTATUS's size (26-33 us there). ``--work-dir DIR`` puts the run on another filesystem.
Every reply's status is compared with the one the capture got: a mismatch is counted and
shown (the pattern no longer fits the gateway).

    python3 bench/load.py [replay] [--pattern bench/data/small_query.json] [--queries 1,6,10]
                          [--modes sync,tier] [--seconds 20] [--warmup 3] [--interval 1.0]
                          [--json FILE] [--keep] [--gateway-arg ARG ...] [--profile DIR]
                          [--work-dir DIR]
    python3 bench/load.py stat [--op getfilestatus|commit] [--requests 3000] [--rounds 3]
    python3 bench/load.py capture [--out FILE] [--partitions 2] [--state-store hdfs|rocksdb]
                          [--changelog] [--batches 12] [--records-per-batch 500]

Run on demand (minutes), not a test; tests/gateway/test_load.py checks its logic.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import BUCKET, remove_work, start_moto_bucket, stop_moto  # noqa: E402
from tools.logtext import as_text  # noqa: E402

DEFAULT_PATTERN = os.path.join(ROOT, "bench", "data", "small_query.json")
PATTERN_FORMAT = "sos-bench-load-pattern/1"
NAMESPACE = "loadns"
MARKER_PATH = "/sos/v1/marker"
WEBHDFS = "/webhdfs/v1"
#: Java's HttpURLConnection drops a pooled connection idle longer than the gateway's
#: Keep-Alive hint (http.KEEP_ALIVE_HINT: timeout=1)
KEEP_ALIVE_S = 1.0
#: one line of ``sos gateway --debug``'s request log (its JSON line as tools.logtext writes it)
LOG_RE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?:sos\.gateway|spark_plugin\.gateway\.[\w.]+) DEBUG (GET|PUT|POST|DELETE) (\S+) (/\S*?)"
    r"( \[data\])? -> (\d+) \(([\d.]+) ms\) ?(\S*)$",
    re.MULTILINE,
)
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)
PLACEHOLDER_RE = re.compile(r"\{\{|\}\}|\{(root|batch[+-]\d+|batch|uuid\d+)\}")
#: a state store's partition directory (CHECKPOINT/state/OPERATOR/PARTITION): its numbers are
#: never batch numbers
STATE_DIR_RE = re.compile(r"(^|/)state/\d+(/\d+)?$")
PATH_OPS_WITH_STATUS = ("GETFILESTATUS", "GETFILELINKSTATUS", "LISTSTATUS", "LISTSTATUS_BATCH", "OPEN")


# --------------------------------------------------------------------------- the request log


@dataclass(frozen=True)
class Logged:
    """One request of the gateway's --debug log."""

    when: str
    method: str
    op: str  # "-" for a request without op= (a marker)
    path: str  # as the gateway logged it: /webhdfs/v1/... (unquoted) or /sos/v1/marker
    data: bool  # the data step of a two-step CREATE/APPEND/OPEN
    status: int
    ms: float
    query: str

    @property
    def fs_path(self) -> str:
        """The path inside the namespace ("/a/b"), or "" for a request outside /webhdfs/v1."""
        if self.path == WEBHDFS or self.path.startswith(WEBHDFS + "/"):
            return self.path[len(WEBHDFS) :] or "/"
        return ""

    @property
    def params(self) -> list[tuple[str, str]]:
        return urllib.parse.parse_qsl(self.query, keep_blank_values=True)

    @property
    def destination(self) -> str:
        return dict(self.params).get("destination", "")


def parse_log(text: str) -> list[Logged]:
    """Every request line of a gateway log, in order."""
    return [
        Logged(m[1], m[2], m[3], m[4], bool(m[5]), int(m[6]), float(m[7]), m[8]) for m in LOG_RE.finditer(as_text(text))
    ]


def _touches(req: Logged, path: str) -> bool:
    return req.fs_path == path or req.destination == path


def from_hadoop(req: Logged) -> bool:
    """A request of Hadoop's WebHdfsFileSystem (it names its user: ``user.name=``), not of
    the batch-marker listener (GETFILESTATUS of commits/N, then the marker) nor another client."""
    return any(k == "user.name" for k, _ in req.params)


def batch_of(requests: list[Logged], root: str, batch: int) -> list[Logged]:
    """The requests of batch ``batch`` of the checkpoint at ``root`` (an absolute path in the
    namespace): Hadoop's after the last one that touches ``root/commits/<batch-1>`` up to the
    last one that touches ``root/commits/<batch>``, then the marker listener's for the batch
    (it checks commits/N, then writes the marker; asynchronously, so in the log they land
    anywhere in the next batch)."""
    prev, cur = f"{root}/commits/{batch - 1}", f"{root}/commits/{batch}"
    hadoop = [r for r in requests if from_hadoop(r)]
    start = max((i for i, r in enumerate(hadoop) if _touches(r, prev)), default=None)
    end = max((i for i, r in enumerate(hadoop) if _touches(r, cur)), default=None)
    if start is None or end is None or end <= start:
        raise ValueError(f"the log holds no whole batch {batch} of {root}")
    body = hadoop[start + 1 : end + 1]
    for i, r in enumerate(requests):
        if r.path == MARKER_PATH and i > 0 and not from_hadoop(requests[i - 1]) and requests[i - 1].fs_path == cur:
            body += [requests[i - 1], r]
            break
    else:
        raise ValueError(f"the log holds no batch marker of batch {batch} of {root}")
    return body


def committed_batches(requests: list[Logged], root: str) -> list[int]:
    """The batches whose commits/N a request of the log created or renamed to."""
    found = set()
    prefix = f"{root}/commits/"
    for r in requests:
        for p in (r.fs_path, r.destination):
            if p.startswith(prefix) and p[len(prefix) :].isdigit():
                found.add(int(p[len(prefix) :]))
    return sorted(found)


# --------------------------------------------------------------------------- placeholders


class Templater:
    """Turns the paths of one captured batch into templates: the checkpoint directory becomes
    ``{root}``, a batch number (N-1, N, N+1 of captured batch N) in the last component
    ``{batch-1}``/``{batch}``/``{batch+1}`` (but never a state store's operator or partition
    directory), each distinct UUID ``{uuidK}``; braces are doubled."""

    def __init__(self, root: str, batch: int) -> None:
        self.root = root.rstrip("/")
        self.batch = batch
        self.uuids: dict[str, str] = {}

    def _uuid(self, m: re.Match[str] | str) -> str:
        key = (m if isinstance(m, str) else m.group(0)).lower()
        if key not in self.uuids:
            self.uuids[key] = f"{{uuid{len(self.uuids)}}}"
        return self.uuids[key]

    def _numbers(self, name: str) -> str:
        out = []
        for part in re.split(r"(\d+)", name):
            if (part.isdigit() and not part.startswith("0")) or part == "0":
                d = int(part) - self.batch
                if -1 <= d <= 1:
                    part = "{batch}" if d == 0 else f"{{batch{d:+d}}}"
            out.append(part)
        return "".join(out)

    def path(self, path: str) -> str:
        """The template of an absolute path of the namespace (one outside root stays as it is)."""
        escaped = path.replace("{", "{{").replace("}", "}}")
        if path != self.root and not path.startswith(self.root + "/"):
            return escaped
        rest = escaped[len(self.root) :]
        head, _, last = rest.rpartition("/")
        if last and not STATE_DIR_RE.search(path):
            parts = re.split(f"({UUID_RE.pattern})", last, flags=re.IGNORECASE)
            last = "".join(self._uuid(p) if i % 2 else self._numbers(p) for i, p in enumerate(parts))
        head = UUID_RE.sub(self._uuid, head)
        return "{root}" + (f"{head}/{last}" if rest else "")


def expand(template: str, values: dict[str, str]) -> str:
    """A template with its placeholders replaced: ``values`` maps ``root``, ``batch``,
    ``batch-1``, ``batch+1``, ``uuid0``... to text."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "{{":
            return "{"
        if m.group(0) == "}}":
            return "}"
        return values[m.group(1)]

    return PLACEHOLDER_RE.sub(sub, template)


def batch_values(root: str, batch: int, uuids: int, seed: str) -> dict[str, str]:
    """The placeholder values of one replayed batch (UUIDs derived from ``seed`` and the batch:
    each batch's temporary files are new names, as Spark's are)."""
    values = {"root": root.rstrip("/"), "batch": str(batch), "batch-1": str(batch - 1), "batch+1": str(batch + 1)}
    for i in range(uuids):
        values[f"uuid{i}"] = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{seed}/{batch}/{i}"))
    return values


# --------------------------------------------------------------------------- the pattern


def _created(batch: list[Logged]) -> set[str]:
    """Paths the batch creates (CREATE, MKDIRS, RENAME destinations)."""
    made = set()
    for r in batch:
        if r.op in ("CREATE", "MKDIRS") and r.status < 300:
            made.add(r.fs_path)
        if r.op == "RENAME" and r.status < 300 and r.destination:
            made.add(r.destination)
    return made


def needed_at_start(batch: list[Logged]) -> list[str]:
    """The paths that exist when the batch starts: read successfully before the batch made
    them, renamed from before it made them, and every parent directory of a path it names."""
    made: set[str] = set()
    need: dict[str, None] = {}
    for r in batch:
        p = r.fs_path
        reads = r.op in PATH_OPS_WITH_STATUS or r.op in ("RENAME", "DELETE", "APPEND")
        if p and p not in made and r.status < 300 and reads:
            need[p] = None
        for q in (p, r.destination):
            if q:
                parts = q.strip("/").split("/")
                for i in range(1, len(parts)):
                    need.setdefault("/" + "/".join(parts[:i]), None)
        made |= _created([r])
    return list(need)


def _body_sizes(batch: list[Logged], sizes: dict[str, int]) -> dict[int, int]:
    """index in ``batch`` of each CREATE/APPEND data step -> the size of its body: the size of
    the file it wrote at the end of the capture (where the batch renamed it, if it did)."""
    out = {}
    for i, r in enumerate(batch):
        if r.op in ("CREATE", "APPEND") and r.data:
            path = r.fs_path
            for later in batch[i + 1 :]:
                if later.op == "RENAME" and later.fs_path == path and later.status < 300 and later.destination:
                    path = later.destination
            out[i] = sizes.get(path, 0)
    return out


def make_pattern(
    batch: list[Logged], root: str, number: int, stat: dict[str, dict[str, Any]], about: dict[str, Any]
) -> dict[str, Any]:
    """The pattern of one captured batch (module docstring). ``stat``: path -> GETFILESTATUS's
    FileStatus at the end of the capture, for the paths the batch names."""
    t = Templater(root, number)
    sizes = {p: int(s.get("length", 0)) for p, s in stat.items() if s.get("type") == "FILE"}
    bodies = _body_sizes(batch, sizes)
    requests = []
    for i, r in enumerate(batch):
        params = [[k, t.path(v) if k == "destination" else v] for k, v in r.params]
        requests.append(
            {
                "method": r.method,
                "op": r.op if r.op != "-" else "",
                "path": t.path(r.fs_path) if r.fs_path else r.path,
                "webhdfs": bool(r.fs_path),
                "params": params,
                "data": r.data,
                "status": r.status,
                "body": bodies.get(i, 0),
                "captured_ms": r.ms,
            }
        )
    setup = []
    made = _created(batch)
    for p in sorted(needed_at_start(batch), key=lambda p: (p.count("/"), p)):
        if p == "/" or (root + "/").startswith(p + "/") or (p in made and p not in stat):
            continue  # the root and its ancestors: MKDIRS of {root} makes them
        s = stat.get(p, {"type": "DIRECTORY"})
        entry: dict[str, Any] = {"path": t.path(p), "type": s.get("type", "DIRECTORY")}
        if entry["type"] == "FILE":
            entry["length"] = int(s.get("length", 0))
        setup.append(entry)
    return {
        "format": PATTERN_FORMAT,
        "about": {**about, "batch": number, "root": root, "requests": len(requests)},
        "uuids": len(t.uuids),
        "requests": requests,
        "setup": setup,
    }


def dump_pattern(pattern: dict[str, Any]) -> str:
    """The pattern as JSON, one request or setup entry per line (readable in a diff)."""
    lines = ["{"]
    for k, v in pattern.items():
        if isinstance(v, list):
            items = ",\n".join("  " + json.dumps(x) for x in v)
            lines.append(f" {json.dumps(k)}: [\n{items}\n ],")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)},")
    lines[-1] = lines[-1].rstrip(",")
    return "\n".join([*lines, "}"]) + "\n"


def load_pattern(path: str) -> dict[str, Any]:
    with open(path) as f:
        pattern = json.load(f)
    if pattern.get("format") != PATTERN_FORMAT:
        raise ValueError(f"{path}: not a {PATTERN_FORMAT} file")
    return pattern


def op_counts(pattern: dict[str, Any]) -> Counter[str]:
    """Requests per operation ("CREATE data" for a data step, "marker")."""
    c: Counter[str] = Counter()
    for r in pattern["requests"]:
        name = r["op"] or "marker"
        c[f"{name} data" if r["data"] else name] += 1
    return c


# --------------------------------------------------------------------------- HTTP, as Hadoop sends it


class HttpError(Exception):
    pass


def _head(method: str, target: str, host: str, token: str, body: int | None) -> bytes:
    """The request head Java's HttpURLConnection sends for Hadoop's WebHdfsFileSystem:
    PUT/POST without a body send Content-Length: 0, with one a chunked octet stream."""
    lines = [
        f"{method} {target} HTTP/1.1",
        f"Authorization: Bearer {token}",
        "User-Agent: Java/17.0.15",
        f"Host: {host}",
        "Accept: */*",
        "Connection: keep-alive",
    ]
    if body is not None:
        lines += ["Content-Type: application/octet-stream", "Transfer-Encoding: chunked"]
    elif method in ("PUT", "POST"):
        lines += ["Content-type: application/x-www-form-urlencoded", "Content-Length: 0"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunked(body: bytes, chunk: int = 32 << 10) -> bytes:
    """``body`` in HTTP/1.1 chunks of ``chunk`` bytes (Hadoop: setChunkedStreamingMode(32 KiB))."""
    parts = [b"%x\r\n%b\r\n" % (len(body[i : i + chunk]), body[i : i + chunk]) for i in range(0, len(body), chunk)]
    return b"".join(parts) + b"0\r\n\r\n"


class Http:
    """One client's keep-alive connection to the gateway, from its own source address."""

    def __init__(self, gateway: tuple[str, int], source: str) -> None:
        self.gateway = gateway
        self.source = source
        self.host = f"{gateway[0]}:{gateway[1]}"
        self.sock: socket.socket | None = None
        self.buf = b""
        self.last_used = 0.0
        self.connects = 0

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock, self.buf = None, b""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.gateway, timeout=120, source_address=(self.source, 0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connects += 1
        return sock

    def exchange(self, data: bytes) -> tuple[int, bytes]:
        """Send one whole request; (status, body) of its reply. A connection idle longer than
        KEEP_ALIVE_S is replaced first; one the gateway closed meanwhile is replaced once."""
        now = time.monotonic()
        if self.sock is not None and now - self.last_used > KEEP_ALIVE_S:
            self.close()
        for attempt in (0, 1):
            fresh = self.sock is None
            if fresh:
                self.sock = self._connect()
            try:
                self.sock.sendall(data)
                status, body, close = self._reply()
            except (ConnectionError, HttpError):
                self.close()
                if fresh or attempt:
                    raise
                continue
            if close:
                self.close()
            self.last_used = time.monotonic()
            return status, body
        raise HttpError("unreachable")

    def _recv(self) -> None:
        assert self.sock is not None
        chunk = self.sock.recv(256 << 10)
        if not chunk:
            raise HttpError("the gateway closed the connection")
        self.buf += chunk

    def _reply(self) -> tuple[int, bytes, bool]:
        while b"\r\n\r\n" not in self.buf:
            self._recv()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if status == 100:
            return self._reply()
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            self._recv()
        body, self.buf = self.buf[:length], self.buf[length:]
        return status, body, headers.get("connection", "").lower() == "close"

    def request(self, method: str, target: str, token: str, body: bytes | None = None) -> tuple[int, bytes]:
        data = _head(method, target, self.host, token, None if body is None else len(body))
        if body is not None:
            data += chunked(body)
        return self.exchange(data)

    def token(self, namespace: str, key: str) -> str:
        form = urllib.parse.urlencode(
            {"grant_type": "client_credentials", "client_id": namespace, "client_secret": key}
        ).encode()
        head = (
            f"POST /oauth2/token HTTP/1.1\r\nHost: {self.host}\r\nUser-Agent: Java/17.0.15\r\n"
            f"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {len(form)}\r\n\r\n"
        ).encode()
        status, body = self.exchange(head + form)
        if status != 200:
            raise HttpError(f"token request from {self.source}: {status} {body[:200]!r}")
        return str(json.loads(body)["access_token"])


def webhdfs_target(path: str, params: list[tuple[str, str]]) -> str:
    return WEBHDFS + urllib.parse.quote(path, safe="/") + "?" + urllib.parse.urlencode(params)


# --------------------------------------------------------------------------- one imitated query


_BODIES: dict[int, bytes] = {}


def body_of(size: int) -> bytes:
    if size not in _BODIES:
        _BODIES[size] = os.urandom(size)
    return _BODIES[size]


@dataclass
class QueryStats:
    """What one imitated query did: every batch as (start, end) monotonic times, requests done,
    statuses that differ from the capture's (op -> count, and a few examples)."""

    batches: list[tuple[float, float]] = field(default_factory=list)
    requests: int = 0
    mismatches: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    error: str | None = None


class Query:
    """One imitated query: ``root`` its checkpoint directory, ``source`` its address."""

    def __init__(self, pattern: dict[str, Any], gateway: tuple[str, int], source: str, root: str) -> None:
        self.pattern = pattern
        self.http = Http(gateway, source)
        self.root = root
        self.token = ""
        self.first = int(pattern["about"]["batch"])
        self.stats = QueryStats()

    def _values(self, batch: int) -> dict[str, str]:
        return batch_values(self.root, batch, int(self.pattern["uuids"]), self.root)

    def prepare(self, namespace: str, key: str) -> None:
        """A token of its own, then what must exist when its first batch starts."""
        self.token = self.http.token(namespace, key)
        values = self._values(self.first)
        for entry in self.pattern["setup"]:
            path = expand(entry["path"], values)
            if entry["type"] == "DIRECTORY":
                self._check(self.http.request("PUT", webhdfs_target(path, [("op", "MKDIRS")]), self.token), 200)
                continue
            target = webhdfs_target(path, [("op", "CREATE"), ("overwrite", "true"), ("data", "true")])
            self._check(self.http.request("PUT", target, self.token, body_of(int(entry["length"]))), 201)

    @staticmethod
    def _check(reply: tuple[int, bytes], want: int) -> None:
        if reply[0] != want:
            raise HttpError(f"setup: {reply[0]} {reply[1][:300]!r}")

    def run_batch(self, batch: int) -> None:
        values = self._values(batch)
        for r in self.pattern["requests"]:
            path = expand(r["path"], values)
            if r["webhdfs"]:
                params = [(k, expand(v, values) if k == "destination" else v) for k, v in r["params"]]
                target = webhdfs_target(path, params)
            else:
                target = path + "?" + urllib.parse.urlencode([(k, v) for k, v in r["params"]])
            body = None
            if r["data"] and r["method"] in ("PUT", "POST"):
                body = body_of(int(r["body"]))
            elif not r["webhdfs"]:  # the marker's payload, as the listener writes it
                body = json.dumps({"checkpoint": self.root, "query_id": self.root, "batch_id": batch}).encode()
            status, reply = self.http.request(r["method"], target, self.token, body)
            self.stats.requests += 1
            if status != r["status"]:
                name = (r["op"] or "marker") + (" data" if r["data"] else "")
                self.stats.mismatches[name] += 1
                if len(self.stats.examples) < 3:
                    self.stats.examples.append(
                        f"{r['method']} {target} -> {status} (captured {r['status']}) {reply[:200]!r}"
                    )

    def run(self, t0: float, offset: float, interval: float, stop: threading.Event) -> None:
        """Batches every ``interval`` seconds from ``t0 + offset`` until ``stop``."""
        due = t0 + offset
        batch = self.first
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now < due and stop.wait(due - now):
                    break
                start = time.monotonic()
                self.run_batch(batch)
                end = time.monotonic()
                self.stats.batches.append((start, end))
                batch += 1
                due = max(due + interval, end)  # behind: the next one at once, as Spark does
        except Exception as exc:  # reported, never silent
            self.stats.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.http.close()


# --------------------------------------------------------------------------- CPU and the report


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` (all its threads) so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def run_queue_seconds(pid: int) -> float:
    """Seconds the threads of process ``pid`` alive now spent runnable but waiting for a CPU
    (/proc/PID/task/*/schedstat): on a shared machine, what the process could not run."""
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(FileNotFoundError, IndexError, ValueError),
                open(f"/proc/{pid}/task/{tid}/schedstat") as f,
            ):
                total += int(f.read().split()[1])
    return total / 1e9


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (kind, user + system CPU seconds so far) of the threads of process ``pid``
    alive now: ``loop`` (the main thread: the gateway's event loop), ``workers`` (trio's
    worker threads, named "Trio thread N"), ``others`` (the replicator, the metrics sampler...)."""
    out: dict[int, tuple[str, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, IndexError, ValueError):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    head, rest = f.read().rsplit(")", 1)
                fields = rest.split()
                name = head.split("(", 1)[1]
                kind = "loop" if int(tid) == pid else "workers" if name.startswith("Trio") else "others"
                out[int(tid)] = (kind, (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_split(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per kind of thread between two :func:`thread_cpu` readings (a thread
    born meanwhile counts from 0; one gone by the end is not seen: trio's idle workers live
    10 s, so the worker figure is a lower bound)."""
    split = {"loop": 0.0, "workers": 0.0, "others": 0.0}
    for tid, (kind, t1) in after.items():
        split[kind] += t1 - before.get(tid, (kind, 0.0))[1]
    return split


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) so far, from /proc."""
    return sum(cpu_times(pid))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * q))]


def summarize(
    stats: list[QueryStats],
    window: tuple[float, float],
    cpu: dict[str, tuple[float, float]],
    requests: tuple[int, int],
    interval: float,
) -> dict[str, Any]:
    """The figures of one run: ``window`` (start, end) monotonic; ``cpu``: process name ->
    (CPU seconds at the window's start, at its end); ``requests``: requests done by then."""
    w0, w1 = window
    seconds = w1 - w0
    done = [e - s for st in stats for s, e in st.batches if w0 <= s and e <= w1]
    ended = sum(1 for st in stats for _s, e in st.batches if w0 <= e <= w1)
    n_req = requests[1] - requests[0]
    out: dict[str, Any] = {
        "queries": len(stats),
        "seconds": seconds,
        "offered_batches_per_s": len(stats) / interval,
        "achieved_batches_per_s": ended / seconds if seconds > 0 else 0.0,
        "batch_p50_ms": percentile(done, 0.5) * 1e3,
        "batch_p99_ms": percentile(done, 0.99) * 1e3,
        "batches": ended,
        "requests": n_req,
        "requests_per_s": n_req / seconds if seconds > 0 else 0.0,
        "mismatches": dict(sum((st.mismatches for st in stats), Counter())),
        "examples": [e for st in stats for e in st.examples][:3],
        "errors": [st.error for st in stats if st.error][:3],
    }
    for name, (c0, c1) in cpu.items():
        used = c1 - c0
        out[f"{name}_cpu_us_per_request"] = used / n_req * 1e6 if n_req else float("nan")
        out[f"{name}_cpu_share"] = used / seconds if seconds > 0 else 0.0
    return out


def report_lines(rows: list[dict[str, Any]]) -> list[str]:
    head = (
        f"{'mode':5} {'N':>4} {'offered/s':>9} {'achieved/s':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'req/s':>7} {'gw us/req':>9} {'gw core':>7} {'gw waits':>8} {'srv us/req':>10} {'srv core':>8}  mismatches"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['mode']:5} {r['queries']:4d} {r['offered_batches_per_s']:9.1f} {r['achieved_batches_per_s']:10.2f} "
            f"{r['batch_p50_ms']:8.1f} {r['batch_p99_ms']:8.1f} {r['requests_per_s']:7.0f} "
            f"{r['gateway_cpu_us_per_request']:9.0f} {r['gateway_cpu_share'] * 100:6.0f}% "
            f"{r.get('gateway_run_queue_share', 0.0) * 100:7.0f}% "
            f"{r['server_cpu_us_per_request']:10.0f} {r['server_cpu_share'] * 100:7.0f}%  "
            f"{sum(r['mismatches'].values()) or '-'}"
        )
        threads = r.get("gateway_threads_us_per_request")
        if threads:
            lines.append("      gateway us/req by thread: " + ", ".join(f"{k} {v:.0f}" for k, v in threads.items()))
        if "gateway_cpu_us_per_request_above_creates" in r:
            lines.append(
                f"      gateway us/req above the filesystem's file creates: "
                f"{r['gateway_cpu_us_per_request_above_creates']:.0f} "
                f"(the creates measured raw: {r['file_create_us_per_request']:.0f})"
            )
        for e in r["errors"] + r["examples"]:
            lines.append(f"      {e}")
    return lines


# --------------------------------------------------------------------------- a replay run


def source_address(i: int) -> str:
    """The loopback address of query ``i`` (127.0.0.2, ...; 127.0.1.0 after 127.0.0.255)."""
    n = i + 2
    return f"127.0.{n // 256}.{n % 256}"


def replay(
    pattern: dict[str, Any],
    gateway_url: str,
    pids: dict[str, int],
    key: str,
    n: int,
    *,
    label: str,
    seconds: float,
    warmup: float,
    interval: float,
) -> dict[str, Any]:
    """N imitated queries against the running gateway at ``gateway_url``; the figures."""
    parsed = urllib.parse.urlsplit(gateway_url)
    gw = (parsed.hostname or "127.0.0.1", int(parsed.port or 80))
    queries = [Query(pattern, gw, source_address(i), f"/load/{label}/q{i}") for i in range(n)]
    for q in queries:
        q.prepare(NAMESPACE, key)
    stop = threading.Event()
    t0 = time.monotonic() + 0.2
    threads = [
        threading.Thread(target=q.run, args=(t0, interval * i / n, interval, stop), daemon=True)
        for i, q in enumerate(queries)
    ]
    for t in threads:
        t.start()
    time.sleep(max(0.0, t0 + warmup - time.monotonic()))
    s0 = {name: cpu_times(pid) for name, pid in pids.items()}
    t0_threads = thread_cpu(pids["gateway"])
    q0 = {name: run_queue_seconds(pid) for name, pid in pids.items()}
    r0 = sum(q.stats.requests for q in queries)
    w0 = time.monotonic()
    time.sleep(seconds)
    w1 = time.monotonic()
    r1 = sum(q.stats.requests for q in queries)
    s1 = {name: cpu_times(pid) for name, pid in pids.items()}
    t1_threads = thread_cpu(pids["gateway"])
    q1 = {name: run_queue_seconds(pid) for name, pid in pids.items()}
    stop.set()
    for t in threads:
        t.join(timeout=120)
    cpu = {name: (sum(s0[name]), sum(s1[name])) for name in pids}
    row = summarize([q.stats for q in queries], (w0, w1), cpu, (r0, r1), interval)
    n_req = max(1, r1 - r0)
    row["gateway_threads_us_per_request"] = {
        kind: used / n_req * 1e6 for kind, used in thread_split(t0_threads, t1_threads).items()
    }
    for name in pids:  # the kernel's part: system calls (sockets, the cache's files)
        used = sum(s1[name]) - sum(s0[name])
        row[f"{name}_system_share_of_cpu"] = (s1[name][1] - s0[name][1]) / used if used > 0 else 0.0
        # runnable but not running, per second of the window (threads alive at both ends)
        row[f"{name}_run_queue_share"] = (q1[name] - q0[name]) / (w1 - w0)
    return row


class Stack(contextlib.ExitStack):
    def stopping(self, proc: Any) -> Any:
        def stop() -> None:
            with contextlib.suppress(Exception):
                proc.stop()

        self.callback(stop)
        return proc


def _servers(stack: Stack, work: str, modes: list[str]) -> dict[str, tuple[Any, str]]:
    """mode -> (its sos-server, a key of NAMESPACE there)."""
    from tools.demo import LocalServer, keygen

    out = {}
    for mode in modes:
        data = os.path.join(work, f"server-{mode}")
        args: list[str] = []
        if mode == "tier":
            moto, _env = start_moto_bucket(work)
            stack.callback(stop_moto, moto)
            args = ["--tier", f"s3://{BUCKET}/load"]
        key = keygen(data, NAMESPACE)
        server = LocalServer(data, os.path.join(work, f"server-{mode}.log"), args=args)
        stack.callback(server.stop)
        server.start()
        out[mode] = (server, key)
    return out


def file_create_cpu_us(work: str, files: int = 1000) -> float:
    """The physical part of a CREATE on this machine: the CPU time (this thread's: the kernel's
    work included) of creating an empty file (O_CREAT|O_EXCL, then close) in a new directory
    of *work*'s filesystem, where the gateways keep their caches; the mean over *files*."""
    d = os.path.join(work, "raw-create")
    os.mkdir(d)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        t0 = time.thread_time()
        for i in range(files):
            os.close(os.open(f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644, dir_fd=dfd))
        spent = time.thread_time() - t0
        for i in range(files):
            os.unlink(f"f{i}", dir_fd=dfd)
    finally:
        os.close(dfd)
    os.rmdir(d)
    return spent / files * 1e6


#: what loopback_floor_us exchanges: a request head and a reply of about a GETFILESTATUS's sizes
_FLOOR_REQUEST = b"GET /webhdfs/v1/q/offsets?op=GETFILESTATUS&user.name=spark HTTP/1.1\r\n" + b"h" * 300 + b"\r\n\r\n"
_FLOOR_REPLY = b"HTTP/1.1 200 \r\ncontent-length: 250\r\n\r\n" + b"b" * 250


def loopback_floor_us(exchanges: int = 20000) -> float:
    """The physical part of serving any request on this machine: the CPU time of a server
    process that does nothing but wait for a request on a loopback TCP connection (epoll,
    one-shot, as trio waits), read it and write a reply of a GETFILESTATUS's size, one
    exchange after the other with a client in this process; the mean per exchange, in us."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server
        try:
            import select

            conn, _ = listener.accept()
            conn.setblocking(False)
            fd = conn.fileno()
            ep = select.epoll()
            ep.register(fd, select.EPOLLIN | select.EPOLLONESHOT)
            t0, n = time.thread_time(), 0
            while n < exchanges:
                ep.poll(5)
                if not os.read(fd, 262144):
                    break
                os.write(fd, _FLOOR_REPLY)
                n += 1
                ep.modify(fd, select.EPOLLIN | select.EPOLLONESHOT)
            os.write(w, b"%f" % ((time.thread_time() - t0) / max(n, 1) * 1e6))
        finally:
            os._exit(0)
    os.close(w)
    client = socket.create_connection(listener.getsockname())
    listener.close()
    try:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(exchanges):
            client.sendall(_FLOOR_REQUEST)
            got = 0
            while got < len(_FLOOR_REPLY):
                chunk = client.recv(65536)
                if not chunk:
                    raise OSError("the loopback floor's server closed early")
                got += len(chunk)
    finally:
        client.close()
        os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        return float(f.read() or b"nan")


def run_replay(args: argparse.Namespace) -> int:
    from spark_plugin.gateway.process import GatewayProcess

    pattern = load_pattern(args.pattern)
    counts = op_counts(pattern)
    print(
        f"pattern {os.path.relpath(args.pattern)}: {len(pattern['requests'])} requests per batch "
        f"({', '.join(f'{n} {op}' for op, n in counts.most_common())}); captured "
        f"{pattern['about'].get('query', '')}"
    )
    work = tempfile.mkdtemp(prefix="sos-bench-load-", dir=args.work_dir)
    rows = []
    with Stack() as stack:
        stack.callback(remove_work, work, args.keep)
        create_us = file_create_cpu_us(work)
        creates = counts.get("CREATE", 0)
        create_share = create_us * creates / len(pattern["requests"])
        print(
            f"the caches' filesystem ({work}): {create_us:.0f} us of CPU per new file (O_CREAT|O_EXCL and "
            f"close, measured now); the pattern's {creates} new files a batch are "
            f"{create_share:.0f} us per request of the mix",
            flush=True,
        )
        floor_us = loopback_floor_us()
        print(
            f"loopback: {floor_us:.0f} us of CPU per request for a server that only waits (epoll), reads "
            "a request and writes a reply of a GETFILESTATUS's size (measured now): the floor of any request",
            flush=True,
        )
        servers = _servers(stack, work, args.modes)
        for mode in args.modes:
            server, key = servers[mode]
            for n in args.queries:
                name = f"{mode}-n{n}"
                gw = GatewayProcess(
                    NAMESPACE,
                    os.path.join(work, f"cache-{name}"),
                    server.address,
                    key,
                    log_path=os.path.join(work, f"gateway-{name}.log"),
                    durability="tier" if mode == "tier" else "server",
                    extra_args=[*args.gateway_arg, *gateway_workers_args(args.gateway_workers)],
                )
                stack.stopping(gw).start()
                pids = {"gateway": int(gw.pid), "server": int(server.pid)}
                pids.update(gateway_worker_pids(int(gw.pid)))
                prof = _start_profile(args, gw, name)
                try:
                    row = replay(
                        pattern,
                        str(gw.url),
                        pids,
                        key,
                        n,
                        label=name,
                        seconds=args.seconds,
                        warmup=args.warmup,
                        interval=args.interval,
                    )
                finally:
                    _stop_profile(prof)
                    gw.stop()
                row["mode"] = mode
                add_gateway_workers(row, pids)
                row["file_create_us_per_request"] = create_share
                row["gateway_cpu_us_per_request_above_creates"] = row["gateway_cpu_us_per_request"] - create_share
                rows.append(row)
                print("\n".join(report_lines([row])[1:]), flush=True)
    print()
    print(
        f"{len(pattern['requests'])}-request batches, one per {args.interval:g} s per query; "
        f"{args.seconds:g} s measured after {args.warmup:g} s; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}; CPU per request = (user+system CPU of the process) / requests:"
    )
    print("\n".join(report_lines(rows)))
    result = {
        "pattern": os.path.relpath(args.pattern),
        "interval": args.interval,
        "rows": rows,
        "file_create_cpu_us": create_us,
        "loopback_floor_cpu_us": floor_us,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    print(json.dumps(result, sort_keys=True))
    return 0


def gateway_workers_args(workers: int) -> list[str]:
    """``--gateway-workers N``: the gateway's ``--workers N`` (nothing for 1)."""
    return ["--workers", str(workers)] if workers > 1 else []


def gateway_worker_pids(pid: int) -> dict[str, int]:
    """The read workers of the gateway ``pid`` (``sos gateway --workers``), named worker1, ..."""
    children: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children += [int(c) for c in f.read().split()]
    return {f"worker{i + 1}": child for i, child in enumerate(sorted(children))}


def add_gateway_workers(row: dict[str, Any], pids: dict[str, int]) -> None:
    """The gateway's figures (CPU per request, cores) made those of all its processes: the
    writer's alone stay as ``writer_*``, each worker's as ``workerN_*``."""
    workers = [name for name in pids if name.startswith("worker")]
    row["gateway_processes"] = 1 + len(workers)
    for figure in ("cpu_us_per_request", "cpu_share"):
        row[f"writer_{figure}"] = row[f"gateway_{figure}"]
        row[f"gateway_{figure}"] += sum(row[f"{name}_{figure}"] for name in workers)


def _start_profile(args: argparse.Namespace, gw: Any, name: str) -> subprocess.Popen[bytes] | None:
    """``--profile DIR``: py-spy records the gateway over the run (DIR/gateway-NAME.txt,
    collapsed stacks per thread, samples holding the GIL: where the CPU goes)."""
    if not args.profile:
        return None
    os.makedirs(args.profile, exist_ok=True)
    out = os.path.join(args.profile, f"gateway-{name}.txt")
    spy = shutil.which("py-spy") or "py-spy"
    return subprocess.Popen(
        [
            spy,
            "record",
            "--pid",
            str(gw.pid),
            "--format",
            "raw",
            "--output",
            out,
            "--rate",
            "200",
            "--nonblocking",
            "--gil",
            "--threads",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _stop_profile(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    import signal

    proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def _stat_steps(op: str) -> Any:
    """``stat --op``: the requests of the n-th operation, as (method, target, body, status)."""
    d = "/webhdfs/v1/stat/d"
    create = "op=CREATE&user.name=spark&overwrite=true&permission=644"

    def getfilestatus(n: int) -> list[tuple[str, str, bytes | None, int]]:
        return [("GET", f"{d}?op=GETFILESTATUS&user.name=spark", None, 200)]

    def commit(n: int) -> list[tuple[str, str, bytes | None, int]]:
        # what Spark's checkpoint does per file: CREATE (both steps) of a temporary file, RENAME
        tmp = f"{d}/.{n}.tmp"
        return [
            ("PUT", f"{tmp}?{create}", None, 307),
            ("PUT", f"{tmp}?{create}&data=true", body_of(1200), 201),
            ("PUT", f"{tmp}?op=RENAME&user.name=spark&destination=/stat/d/{n}&renameoptions=NONE", None, 200),
        ]

    return {"getfilestatus": getfilestatus, "commit": commit}[op]


def run_stat(args: argparse.Namespace) -> int:
    """``stat``: the gateway's CPU per operation (``--op``: GETFILESTATUS, or a commit: CREATE
    both steps and RENAME) on one keep-alive connection, one after the other."""
    from spark_plugin.gateway.process import GatewayProcess

    work = tempfile.mkdtemp(prefix="sos-bench-stat-", dir=args.work_dir)
    with Stack() as stack:
        stack.callback(remove_work, work, False)
        server, key = _servers(stack, work, ["sync"])["sync"]
        gw = GatewayProcess(
            NAMESPACE,
            os.path.join(work, "cache"),
            server.address,
            key,
            log_path=os.path.join(work, "gateway.log"),
            extra_args=args.gateway_arg,
        )
        stack.stopping(gw).start()
        parsed = urllib.parse.urlsplit(str(gw.url))
        http = Http((parsed.hostname or "127.0.0.1", int(parsed.port or 80)), "127.0.0.1")
        token = http.token(NAMESPACE, key)
        status, _ = http.request("PUT", "/webhdfs/v1/stat/d?op=MKDIRS&user.name=spark", token)
        if status != 200:
            raise HttpError(f"MKDIRS answered {status}")
        steps = _stat_steps(args.op)
        n = 0
        prof = None
        for i in range(args.rounds + 1):  # the first round warms up
            if i == 1:
                prof = _start_profile(args, gw, f"stat-{args.op}")
            user0, system0 = cpu_times(int(gw.pid))
            threads0 = thread_cpu(int(gw.pid))
            started = time.monotonic()
            for _ in range(args.requests):
                n += 1
                for method, target, body, want in steps(n):
                    status, _ = http.request(method, target, token, body)
                    if status != want:
                        raise HttpError(f"{method} {target} answered {status}, not {want}")
                http.last_used = time.monotonic()  # (the pause of a slow machine is not Java's idle)
            user1, system1 = cpu_times(int(gw.pid))
            split = thread_split(threads0, thread_cpu(int(gw.pid)))
            per = 1e6 / args.requests
            if i:
                print(
                    f"{args.op} x{args.requests}: gateway {(user1 - user0 + system1 - system0) * per:.0f} us "
                    f"CPU/{args.op} (user {(user1 - user0) * per:.0f}, system {(system1 - system0) * per:.0f}), "
                    f"{(time.monotonic() - started) * per:.0f} us wall/{args.op}; by thread: "
                    f"{', '.join(f'{k} {v * per:.0f}' for k, v in split.items())}; load average {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        _stop_profile(prof)
        gw.stop()
    return 0


# --------------------------------------------------------------------------- capture


def _session(args: argparse.Namespace):
    from pyspark.sql import SparkSession

    from tools.demo import DRIVER_JVM_OPTIONS, ROCKSDB_PROVIDER

    builder = (
        SparkSession.builder.master("local[2]")
        .appName("sos-bench-load-capture")
        .config("spark.sql.shuffle.partitions", str(args.partitions))
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", DRIVER_JVM_OPTIONS)
    )
    if args.state_store == "rocksdb":
        builder = builder.config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
        if args.changelog:
            builder = builder.config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _describe(args: argparse.Namespace) -> str:
    store = args.state_store + (" (changelog checkpointing)" if args.changelog else "")
    return (
        f"file source (maxFilesPerTrigger=1), dropDuplicates, foreachBatch sink; local[2], "
        f"{args.partitions} shuffle partitions, {store} state store"
    )


def run_capture(args: argparse.Namespace) -> int:
    from bench.spark_checkpoint import BatchTimer, run_query
    from spark_plugin.gateway.client import GatewayClient
    from spark_plugin.gateway.process import GatewayProcess
    from spark_plugin.spark import gateway_checkpoint
    from tools.demo import LocalServer, keygen, make_input

    work = tempfile.mkdtemp(prefix="sos-bench-load-capture-")
    root = "/capture/chk"
    with Stack() as stack:
        stack.callback(remove_work, work, args.keep)
        data = os.path.join(work, "server")
        key = keygen(data, NAMESPACE)
        server = LocalServer(data, os.path.join(work, "server.log"))
        stack.callback(server.stop)
        server.start()
        log_path = os.path.join(work, "gateway.log")
        gw = stack.stopping(
            GatewayProcess(
                NAMESPACE, os.path.join(work, "cache"), server.address, key, log_path=log_path, debug=True
            ).start()
        )
        input_dir = os.path.join(work, "input")
        make_input(input_dir, args.records_per_batch * args.batches, args.batches)
        spark = _session(args)
        try:
            location = gateway_checkpoint(spark, str(gw.url), NAMESPACE, key, root.strip("/"))
            run_query(
                spark, BatchTimer(spark), "capture", str(location), input_dir, os.path.join(work, "out"), args.batches
            )
            time.sleep(2.0)  # the last marker
        finally:
            spark.stop()
        requests = parse_log(gw.log())
        batches = committed_batches(requests, root)
        if len(batches) < 3:
            raise SystemExit(f"only {len(batches)} batches committed: see {log_path} (--keep)")
        number = batches[-1]
        batch = batch_of(requests, root, number)
        client = GatewayClient(str(gw.url), NAMESPACE, key)
        stat = {}
        names = {r.fs_path for r in batch if r.fs_path} | {r.destination for r in batch if r.destination}
        for p in sorted(names | set(needed_at_start(batch))):
            with contextlib.suppress(Exception):
                stat[p] = client.call("GET", WEBHDFS + p, op="GETFILESTATUS")["FileStatus"]
        about = {
            "query": _describe(args),
            "captured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python3 bench/load.py capture " + " ".join(sys.argv[2:]),
            "batches_run": len(batches),
        }
        pattern = make_pattern(batch, root, number, stat, about)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(dump_pattern(pattern))
    counts = op_counts(pattern)
    print(f"batch {number} of {len(batches)}: {len(batch)} requests -> {args.out}")
    for op, c in counts.most_common():
        print(f"  {op:24} {c}")
    return 0


# --------------------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of counts, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"counts are >= 1: {text!r}")
    return values


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in ("sync", "tier") for m in modes):
        raise argparse.ArgumentTypeError(f"modes are sync and tier: {text!r}")
    return modes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("replay", help="replay a pattern for N queries (the default)")
    _replay_options(r)
    st = sub.add_parser("stat", help="the gateway's CPU per GETFILESTATUS (or commit) on one connection")
    st.add_argument("--requests", type=int, default=3000, help="requests per round (default 3000)")
    st.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    st.add_argument(
        "--op",
        choices=("getfilestatus", "commit"),
        default="getfilestatus",
        help="GETFILESTATUS (default), or commit: CREATE (both steps) of a temporary file, then RENAME",
    )
    st.add_argument("--profile", metavar="DIR", help="py-spy the gateway over the measured rounds into DIR")
    st.add_argument("--gateway-arg", action="append", default=[], help="extra sos gateway argument (repeat)")
    st.add_argument("--work-dir", metavar="DIR", help="where the run's directory goes (default: the temp directory)")
    c = sub.add_parser("capture", help="capture a real query's pattern")
    c.add_argument("--out", default=DEFAULT_PATTERN, help="pattern file to write (default bench/data/small_query.json)")
    c.add_argument("--partitions", type=int, default=2, help="spark.sql.shuffle.partitions (default 2)")
    c.add_argument("--state-store", choices=("hdfs", "rocksdb"), default="hdfs")
    c.add_argument("--changelog", action="store_true", help="RocksDB changelog checkpointing")
    c.add_argument("--batches", type=int, default=12, help="batches to run; the last one is kept (default 12)")
    c.add_argument("--records-per-batch", type=int, default=500)
    c.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    return p


def _replay_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pattern", default=DEFAULT_PATTERN, help="pattern file (default bench/data/small_query.json)")
    p.add_argument("--queries", type=_ints, default=[1, 6, 10], help="comma-separated N (default 1,6,10)")
    p.add_argument("--modes", type=_modes, default=["sync", "tier"], help="sync,tier (default both)")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per run (default 20)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before the measure (default 3)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between a query's batches (default 1)")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra sos gateway argument (repeat)")
    p.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        metavar="N",
        help="sos gateway --workers N; the gateway's CPU is then that of all its processes (default 1)",
    )
    p.add_argument("--profile", metavar="DIR", help="py-spy the gateway of each run into DIR")
    p.add_argument(
        "--work-dir",
        metavar="DIR",
        help="where the run's directory (servers' data, gateways' caches) goes (default: the temp directory)",
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("replay", "capture", "stat", "-h", "--help"):
        argv.insert(0, "replay")
    args = parser().parse_args(argv)
    if args.command == "capture":
        return run_capture(args)
    if args.command == "stat":
        return run_stat(args)
    return run_replay(args)


if __name__ == "__main__":
    sys.exit(main())
