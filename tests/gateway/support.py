"""The gateway's test helpers: a real ``sos gateway`` to talk to (:class:`Gw`), raw HTTP on a
socket (:func:`connect`, :func:`read_reply`, :func:`closed_after`), ``sos restore`` of what
the gateway journaled, and :class:`CutProxy`, below.

`CutProxy`: an HTTP/1.1 relay between Hadoop's WebHDFS client and a gateway, so that a test
can kill the gateway at a point it chooses instead of wherever a timer happens to fall.

The gateway runs with ``--advertise`` set to the proxy's address, so the two-step redirects
(CREATE/APPEND/OPEN with ``data=true``) come back through it too. The relay parses both sides
with h11 (one request at a time per connection, as Hadoop sends them) and knows at every moment
which requests are in flight at the gateway. Two points it can stop at:

- between two requests (:meth:`hold`, :meth:`wait_quiet`, :meth:`drop_idle`, :meth:`release`):
  new requests wait in the proxy, the ones in flight finish; then the gateway has no request
  at all and the test kills it. The client's idle connections are closed as the dead
  gateway's would be; the requests that wait go to the restarted gateway (:attr:`upstream`)
  on release, so their client sees a slow answer, no error.
- inside a body (:meth:`arm_cut`, :meth:`wait_cut`, :meth:`finish_cut`): the next request that
  matches and has a body reaches the gateway with its head and the first half of its first
  chunk only; the proxy reads the rest from the client and holds every other request. After
  the test killed the gateway, :meth:`finish_cut` closes that client connection before any
  answer, which is what the client sees when a gateway dies while it reads a body.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable

import h11
import pytest
import requests

from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.spark import gateway_conf, sos_command, webhdfs_url
from tests.support import accepted, hadoop_jars, pair_listen, token_for
from tests.support import tree_snapshot as tree_of
from tools.demo import kill_tree
from tools.logtext import as_text

#: tests/
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the namespace of the gateway tests that name none of their own
NS = "gw"
#: a bound no answer on a raw socket should come near, even on a loaded 2-core machine
TIMEOUT = 120


class Gw:
    """A running ``sos gateway`` (a real child process, ``--debug``) for ``namespace`` and a
    requests session with an append token for it."""

    def __init__(
        self,
        server,
        tmp_path,
        *,
        key=None,
        name="gateway",
        cache=None,
        args=(),
        listen="127.0.0.1:0",
        sync=True,
        namespace=NS,
    ):
        self.server = server
        self.namespace = namespace
        self.key = key or server.keygen(namespace, "append")
        self.proc = GatewayProcess(
            namespace,
            str(cache or tmp_path / f"{name}-cache"),
            server.address,
            self.key,
            listen=listen,
            sync=sync,
            extra_args=list(args),
            debug=True,
            log_path=str(tmp_path / f"{name}.log"),
        ).start()
        self.url = self.proc.url
        self.host, _, port = urllib.parse.urlsplit(self.url).netloc.rpartition(":")
        self.port = int(port)
        self.session = requests.Session()
        self.token = token_for(self.url, self.key, namespace)
        self.session.headers["Authorization"] = f"Bearer {self.token}"

    def u(self, path, **params):
        query = urllib.parse.urlencode(params)
        return f"{self.url}/webhdfs/v1{path}" + (f"?{query}" if query else "")

    def put_file(self, path, data, **params):
        r = self.session.put(self.u(path, op="CREATE", **params), allow_redirects=False)
        if r.status_code != 307:
            return r
        return self.session.put(r.headers["Location"], data=data)

    def read(self, path, **params):
        r = self.session.get(self.u(path, op="OPEN", **params))
        assert r.status_code == 200, r.text
        return r.content

    def stop(self):
        self.session.close()
        return self.proc.stop()


def restore(server, key, target, namespace: str = NS):
    """``sos restore`` of ``namespace`` from ``server`` into ``target`` (which it returns)."""
    env = dict(os.environ, SOS_KEY=key)
    subprocess.run(
        [*sos_command(), "restore", "-q", "--server", server.address, namespace, str(target)],
        env=env,
        check=True,
        timeout=300,
        capture_output=True,
    )
    return target


def restored(server, key: str, target, namespace: str = NS) -> dict:
    """What the journal of ``namespace`` holds: :func:`restore` into ``target``, as a tree
    snapshot ({relative path: bytes, or None for a directory})."""
    return tree_of(restore(server, key, target, namespace))


def remote(r):
    """The RemoteException of a WebHDFS error answer (which has no Content-Type, as HDFS's)."""
    assert "content-type" not in r.headers
    return r.json()["RemoteException"]


def chunked_create(gw, path):
    """Start a CREATE data step on a raw connection; the body stays open."""
    conn = http.client.HTTPConnection(gw.host, gw.port, timeout=120)
    conn.putrequest("PUT", f"/webhdfs/v1{path}?op=CREATE&overwrite=true&data=true")
    conn.putheader("Authorization", f"Bearer {gw.token}")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    return conn


def send_chunk(conn, data):
    """One chunk of a chunked body."""
    conn.send(b"%x\r\n%s\r\n" % (len(data), data))


def wait_exit(proc: GatewayProcess, timeout: float = 60.0) -> int | None:
    """The exit status of ``proc`` once it has exited, None if it still runs after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.returncode is None:
        time.sleep(0.1)
    return proc.returncode


def cmdline(p) -> str:
    """A process's (``psutil.Process``) command line, as ``ps`` shows it to any user, its words
    NUL-separated ("" once it is gone)."""
    import psutil

    try:
        return "\0".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def peak_rss(pid: int) -> int:
    """The peak resident memory of the process ``pid`` (its VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def pair_gateway(server, key: str, tmp_path, name: str, *args: str, namespace: str, lease: float = 3, cache=None):
    """A member of a gateway pair (``--lease LEASE``, a free port of its own: pair_listen),
    started: ``args`` on its command line (``--standby``...), its cache
    ``tmp_path/NAME-cache`` unless ``cache``, its log ``tmp_path/NAME.log``."""
    return GatewayProcess(
        namespace,
        str(cache or tmp_path / f"{name}-cache"),
        server.address,
        key,
        listen=pair_listen(),
        extra_args=["--lease", str(lease), *args],
        debug=True,
        log_path=str(tmp_path / f"{name}.log"),
    ).start()


def workers_of(pid: int) -> list[int]:
    """The gateway's worker processes (its children running the workers module)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    found = []
    for child in out:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"spark_plugin.gateway.workers" in f.read():
                    found.append(child)
        except FileNotFoundError:
            continue
    return sorted(found)


def compiled_harness(classes, source: str) -> tuple[str, dict[str, str]]:
    """tests/java/SOURCE compiled with javac against pyspark's jars (Hadoop's client among them)
    into the directory ``classes``: (the classpath that runs it, an environment with UTF-8
    arguments and output whatever the machine's locale). Skips the test without a JDK."""
    if shutil.which("java") is None or shutil.which("javac") is None:
        pytest.skip("no JDK (java and javac) on this machine")
    jars = hadoop_jars()
    subprocess.run(
        ["javac", "-nowarn", "-d", str(classes), "-cp", os.path.join(jars, "*"), os.path.join(TESTS, "java", source)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    env = dict(
        os.environ,
        LC_ALL="C.UTF-8",
        LANG="C.UTF-8",
        JAVA_TOOL_OPTIONS="-Dfile.encoding=UTF-8 -Dsun.stdout.encoding=UTF-8 -Dsun.stderr.encoding=UTF-8 -Xshare:auto",
    )
    return f"{classes}{os.pathsep}{os.path.join(jars, '*')}", env


def hadoop_java(java_env, gateway, base: str, *cases: str | list[str]) -> tuple[dict[str, tuple[str, str]], list]:
    """Run CASES in ONE harness JVM (tests/java/HadoopHarness.java: the ``java_env`` fixture of
    tests/gateway/conftest.py; ``gateway``: a (GatewayProcess, key) pair), in order, against webhdfs://gateway/BASE: a name is one of
    the harness's cases, a list is an FsShell command (argument list; "{u}" is the gateway's
    webhdfs:// URL) run in the JVM as `hadoop fs` runs it (ToolRunner: -D options too).
    ({case: (ok|error, result)}, [(exit code, stdout, stderr) per command])."""
    classpath, env = java_env
    gw, key = gateway
    u = webhdfs_url(gw.url).rstrip("/")
    args = [c if isinstance(c, str) else "shell:" + "|".join(a.replace("{u}", u) for a in c) for c in cases]
    named = [c for c in cases if isinstance(c, str)]
    out = subprocess.run(
        [
            "java",
            "-cp",
            classpath,
            "HadoopHarness",
            webhdfs_url(gw.url, base),
            *[f"{k}={v}" for k, v in gateway_conf(gw.url, gw.namespace, key).items()],
            "--",
            *args,
        ],
        capture_output=True,
        env=env,
        timeout=600,
        check=False,
    )
    text = out.stdout.decode("utf-8", "replace")
    assert out.returncode == 0, text + out.stderr.decode("utf-8", "replace")[-4000:]
    results = {}
    shells = []
    for line in text.splitlines():
        name, _, rest = line.partition("\t")
        if name == "shell":
            code, sout, serr = rest.split("\t")
            unesc = [x.replace("\\n", "\n").replace("\\t", "\t").replace("\\\\", "\\") for x in (sout, serr)]
            shells.append((int(code), unesc[0], unesc[1]))
        elif name in named:
            status, _, value = rest.partition("\t")
            results[name] = (status, value)
    assert set(results) == set(named), text
    assert len(shells) == len(cases) - len(named), text
    return results, shells


def hadoop_harness(java_env, gateway, base: str, *cases: str) -> dict[str, tuple[str, str]]:
    """Run the harness's CASES against webhdfs://gateway/BASE: {case: (ok|error, result)}."""
    return hadoop_java(java_env, gateway, base, *cases)[0]


def hadoop_shell(java_env, gateway, *commands: list[str]) -> list[tuple[int, str, str]]:
    """FsShell COMMANDS (argument lists; "{u}" is the gateway's webhdfs:// URL) run in one
    JVM as `hadoop fs` runs them: [(exit code, stdout, stderr)]."""
    return hadoop_java(java_env, gateway, "shell", *commands)[1]


def port_of(gw: GatewayProcess) -> int:
    """The port a gateway listens on."""
    return int(gw.url.rsplit(":", 1)[1])


def connect(
    port: int, source: str = "127.0.0.1", *, rcvbuf: int | None = None, timeout: float = TIMEOUT
) -> socket.socket:
    """A TCP connection to 127.0.0.1:``port`` from ``source`` (another 127/8 address stands
    for another host), its receive buffer ``rcvbuf`` if given."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    return s


def read_reply(sock: socket.socket, buf: bytearray | None = None) -> tuple[int, dict, bytes]:
    """One HTTP reply (status, lower-case headers, body) read off ``sock``; ``buf`` keeps
    what was read beyond it (pipelined replies)."""
    buf = bytearray() if buf is None else buf
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError(f"closed before a whole reply: {bytes(buf[:200])!r}")
        buf += chunk
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError("closed in a reply body")
        rest += chunk
    buf[:] = rest[length:]
    return status, headers, rest[:length]


def closed_after(sock: socket.socket, timeout: float = TIMEOUT) -> bool:
    """True if the peer closes ``sock`` (EOF or reset) within ``timeout``; what it sends
    meanwhile is discarded."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


# ---------------------------------------------------------------- the Spark query of test_spark
#: the input of the Spark query: records, in files, of which the first run reads the first ones
RECORDS = 500
FILES = 5
FIRST_RUN_FILES = 3

#: The query run once per entry of ``cfg["runs"]`` (one after the other in one driver: the
#: second starts once its "wait_for" file exists and resumes from the checkpoint the first
#: left, as a new query run of it)
TWO_RUNS_DRIVER = textwrap.dedent("""
    import json, os, sys, time
    cfg = json.load(open(sys.argv[1]))
    from tools.demo import write_batch_output
    from spark_plugin.spark import gateway_checkpoint
    from tests.support import dedup_query, spark_builder

    builder = spark_builder("sos-gateway-smoke")
    loc = gateway_checkpoint(builder, cfg["url"], cfg["ns"], os.environ["SOS_KEY"], cfg["checkpoint"])
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    loc.attach(spark)
    os.makedirs(cfg["out"], exist_ok=True)

    for run in cfg["runs"]:
        while run.get("wait_for") and not os.path.exists(run["wait_for"]):
            time.sleep(0.1)
        batches, marked = [], len(loc.listener.written)

        def sink(df, batch_id):
            write_batch_output(cfg["out"], df, batch_id)
            batches.append(batch_id)

        query = dedup_query(spark, cfg["input"], sink, str(loc))
        query.awaitTermination()
        deadline = time.monotonic() + 120  # the listener runs asynchronously
        while set(loc.listener.written[marked:]) < set(batches) and time.monotonic() < deadline:
            time.sleep(0.2)
        with open(run["result"] + ".tmp", "w") as f:
            json.dump({"location": str(loc), "batches": batches, "markers": loc.listener.written[marked:],
                       "errors": loc.listener.errors}, f)
        os.replace(run["result"] + ".tmp", run["result"])
    spark.stop()
""")


class TwoRuns:
    """TWO_RUNS_DRIVER in its own process: ``first()`` waits for the first run's result;
    ``second()`` lets the second run go (the caller added input first) and waits for its
    result and the driver's exit."""

    def __init__(self, tmp_path, cfg, key):
        self.tmp_path = tmp_path
        self.runs = [
            {"result": str(tmp_path / "run1-result.json")},
            {"result": str(tmp_path / "run2-result.json"), "wait_for": str(tmp_path / "run2-go")},
        ]
        script = tmp_path / "driver.py"
        script.write_text(TWO_RUNS_DRIVER)
        cfg_path = tmp_path / "driver.json"
        cfg_path.write_text(json.dumps(dict(cfg, runs=self.runs)))
        env = dict(
            os.environ,
            SOS_KEY=key,
            PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p),
        )
        self.log_path = tmp_path / "driver.log"
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), str(cfg_path)],
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def _result(self, i):
        path = self.runs[i]["result"]
        deadline = time.monotonic() + 900
        while not os.path.exists(path):
            assert self.proc.poll() is None or os.path.exists(path), self.log_path.read_text()[-6000:]
            assert time.monotonic() < deadline, f"run {i + 1}: no result after 900 s"
            time.sleep(0.2)
        with open(path) as f:
            return json.load(f)

    def first(self):
        return self._result(0)

    def second(self):
        (self.tmp_path / "run2-go").touch()
        result = self._result(1)
        assert self.proc.wait(600) == 0, self.log_path.read_text()[-6000:]
        return result

    def kill(self):
        kill_tree(self.proc)


def requests_by_op(gateway_log: str) -> Counter:
    """How many requests of each (method, path, data step, status) a ``--debug`` gateway log shows."""
    ops = Counter()
    for m in re.finditer(r"DEBUG (GET|PUT|POST|DELETE) (\S+) \S+( \[data\])? -> (\d+)", as_text(gateway_log)):
        ops[f"{m.group(1)} {m.group(2)}{' data' if m.group(3) else ''} {m.group(4)}"] += 1
    return ops


class CutProxy:
    def __init__(self, upstream: tuple[str, int] | None = None) -> None:
        self.upstream = upstream  # where new upstream connections go (the restarted gateway's address)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._cond = threading.Condition()
        self._held = False
        self._inflight = 0  # requests forwarded whose answer is not complete
        self._parked: set[socket.socket] = set()  # client connections whose request waits (hold)
        self._generation = 0  # bumped on release: upstream connections of older ones are dropped
        self._cut_match: Callable[[h11.Request], bool] | None = None
        self._cut: dict | None = None  # {"target", "client": socket, "done": bool}
        self._closing = False
        self.requests: list[str] = []  # "METHOD target" of every request seen, in order
        self._threads: list[threading.Thread] = []
        self._socks: set[socket.socket] = set()
        accept = threading.Thread(target=self._accept, name="cut-proxy-accept", daemon=True)
        accept.start()
        self._threads.append(accept)

    # ------------------------------------------------------------------------- test controls
    def hold(self) -> None:
        """New requests wait in the proxy until :meth:`release`."""
        with self._cond:
            self._held = True

    def wait_quiet(self, timeout: float = 120.0) -> None:
        """Until no request is in flight at the gateway (after :meth:`hold`)."""
        with self._cond:
            assert self._held, "wait_quiet without hold"
            assert self._cond.wait_for(lambda: self._inflight == 0, timeout), (
                f"{self._inflight} request(s) still in flight after {timeout:.0f} s"
            )

    def drop_idle(self, idle: float = 1.5) -> int:
        """After :meth:`wait_quiet`: wait *idle* seconds (longer than the gateway's
        ``Keep-Alive: timeout=1``, so Hadoop reuses none of its pooled connections), then close
        every client connection with no request waiting, as the kernel closes a killed
        gateway's; returns how many."""
        time.sleep(idle)
        with self._cond:
            assert self._held and self._inflight == 0
            idle_socks = self._socks - self._parked
        for s in idle_socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        return len(idle_socks)

    def release(self, upstream: tuple[str, int] | None = None) -> None:
        """Let the waiting requests go, to *upstream* (the restarted gateway) if given, each
        on a new upstream connection."""
        with self._cond:
            if upstream is not None:
                self.upstream = upstream
            self._generation += 1
            self._held = False
            self._cond.notify_all()

    def arm_cut(self, match: Callable[[h11.Request], bool]) -> None:
        with self._cond:
            self._cut_match = match

    def wait_cut(self, timeout: float = 300.0) -> str:
        """Until a matching body was cut, its client finished sending it, and no other request
        is in flight; returns the cut request's "METHOD target"."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._cut is not None and self._cut["body_read"] and self._inflight == 1, timeout
            )
            assert ok, f"no body cut after {timeout:.0f} s (cut: {self._cut}, in flight: {self._inflight})"
            return self._cut["target"]

    def finish_cut(self) -> None:
        """Close the cut request's client connection with no answer (after the gateway died)."""
        with self._cond:
            assert self._cut is not None
            self._cut["done"] = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._held = False
            self._cond.notify_all()
            socks = list(self._socks)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=10)

    # ------------------------------------------------------------------------------ the relay
    def _accept(self) -> None:
        for client in accepted(self._listener):
            with self._cond:
                if self._closing:
                    client.close()
                    return
                self._socks.add(client)
            t = threading.Thread(target=self._serve, args=(client,), name="cut-proxy-conn", daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, client: socket.socket) -> None:
        down = h11.Connection(h11.SERVER)
        up: _Upstream | None = None
        try:
            while True:
                req = _next(down, client)
                if req is None or isinstance(req, h11.ConnectionClosed):
                    return
                assert isinstance(req, h11.Request), req
                target = f"{req.method.decode()} {req.target.decode()}"
                with self._cond:
                    self.requests.append(target)
                    self._parked.add(client)
                    self._cond.wait_for(lambda: not self._held or self._closing)
                    self._parked.discard(client)
                    if self._closing:
                        return
                    cut = self._cut is None and self._cut_match is not None and self._cut_match(req)
                    self._inflight += 1
                    generation = self._generation
                try:
                    if up is None or up.generation != generation:
                        if up is not None:
                            up.close()
                        up = _Upstream(self.upstream, generation)
                    if cut and self._relay_cut(req, target, down, client, up):
                        return
                    self._relay(req, down, client, up)
                finally:
                    with self._cond:
                        self._inflight -= 1
                        self._cond.notify_all()
                if down.our_state is h11.MUST_CLOSE or up.conn.our_state is h11.MUST_CLOSE:
                    return
                down.start_next_cycle()
                up.conn.start_next_cycle()
        except (OSError, h11.ProtocolError):
            return
        finally:
            if up is not None:
                up.close()
            with self._cond:
                self._socks.discard(client)
            client.close()

    def _relay(self, req: h11.Request, down: h11.Connection, client: socket.socket, up: _Upstream) -> None:
        """One request to the gateway with its body, then its answer back to the client."""
        if _expects_continue(req):
            client.sendall(down.send(h11.InformationalResponse(status_code=100, headers=[])))
        up.send(_without_expect(req))
        self._relay_rest(down, client, up, _next(down, client))

    def _relay_rest(self, down: h11.Connection, client: socket.socket, up: _Upstream, ev: object) -> None:
        """The rest of a request's body from *ev* on, then the answer."""
        while True:
            assert ev is not None and not isinstance(ev, h11.ConnectionClosed), "client left mid-request"
            up.send(ev)
            if isinstance(ev, h11.EndOfMessage):
                break
            ev = _next(down, client)
        while True:
            ev = up.next()
            if isinstance(ev, h11.InformationalResponse):
                continue  # the proxy answered 100-continue itself
            client.sendall(down.send(ev))
            if isinstance(ev, h11.EndOfMessage):
                return

    def _relay_cut(
        self, req: h11.Request, target: str, down: h11.Connection, client: socket.socket, up: _Upstream
    ) -> bool:
        """The armed cut: the head and half of the first chunk to the gateway, the rest read
        from the client and dropped; False (relayed whole, still armed) if the body is empty."""
        if _expects_continue(req):
            client.sendall(down.send(h11.InformationalResponse(status_code=100, headers=[])))
        first = _next(down, client)
        up.send(_without_expect(req))
        if not (isinstance(first, h11.Data) and first.data):  # no body to cut inside
            self._relay_rest(down, client, up, first)
            return False
        with self._cond:
            self._held = True  # nothing else reaches the gateway from here on
            self._cut = {"target": target, "body_read": False, "done": False}
        up.send(h11.Data(data=first.data[: max(1, len(first.data) // 2)]))
        while not isinstance(ev := _next(down, client), h11.EndOfMessage):
            assert ev is not None and not isinstance(ev, h11.ConnectionClosed), "client left mid-body"
        with self._cond:
            self._cut["body_read"] = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._cut["done"] or self._closing)
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_RDWR)
        return True


class _Upstream:
    def __init__(self, address: tuple[str, int] | None, generation: int) -> None:
        assert address is not None, "CutProxy.upstream not set"
        self.sock = socket.create_connection(address, timeout=600)
        self.conn = h11.Connection(h11.CLIENT)
        self.generation = generation

    def send(self, ev: object) -> None:
        data = self.conn.send(ev)
        if data:
            self.sock.sendall(data)

    def next(self) -> object:
        ev = _next(self.conn, self.sock)
        assert ev is not None and not isinstance(ev, h11.ConnectionClosed), "the gateway closed mid-answer"
        return ev

    def close(self) -> None:
        self.sock.close()


def _next(conn: h11.Connection, sock: socket.socket) -> object | None:
    """The next h11 event from *sock* (ConnectionClosed at EOF between messages)."""
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            conn.receive_data(sock.recv(1 << 16))
            continue
        if ev is h11.PAUSED:
            return None
        return ev


def _expects_continue(req: h11.Request) -> bool:
    return any(k.lower() == b"expect" and v.lower() == b"100-continue" for k, v in req.headers)


def _without_expect(req: h11.Request) -> h11.Request:
    headers = [(k, v) for k, v in req.headers if k.lower() != b"expect"]
    return h11.Request(method=req.method, target=req.target, headers=headers, http_version=req.http_version)


class FreezableRelay:
    """A TCP relay between a gateway's journal writer and the SOS server, so that a test can
    lose what the gateway sends from a chosen moment on: after :meth:`freeze` the bytes its
    connections send are read and dropped, never forwarded (the server's replies still flow).
    That is a gateway whose records never left its machine, deterministically: a SIGSTOPped
    server instead still takes what its kernel buffered and makes it durable once resumed."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._frozen = threading.Event()
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self.dropped = 0  # bytes read from clients after freeze()
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def freeze(self) -> None:
        self._frozen.set()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks, self._socks = set(self._socks), set()
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        for client in accepted(self._listener):
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks |= {client, server}
            for src, dst, from_client in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, from_client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                break
            if not data:
                break
            if from_client and self._frozen.is_set():
                self.dropped += len(data)
                continue
            try:
                dst.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
