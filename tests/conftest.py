"""Shared test fixtures.

``sos_server``: a REAL ``sos-server`` process on 127.0.0.1:<free port> with its data in
a temporary directory. The yielded :class:`ServerProcess` has

- ``.address``      "127.0.0.1:PORT" (updated by ``restart``)
- ``.data_dir``     the data directory
- ``.keygen(ns, role="append") -> str``   a key (what ``sos-server keygen`` prints)
- ``.kill()``       SIGKILL and wait (a crash: only acknowledged bytes must survive)
- ``.stop()``       SIGTERM and wait (a clean stop)
- ``.restart()``    stop it if running (SIGTERM) and start it again on the same port
                    (a free one if that port was taken meanwhile; ``.address`` follows)
- ``.start()``      start it again after ``kill()``/``stop()`` (same port rule)
- ``.log_text()``   everything the server wrote on stderr (JSON lines)
- ``.metrics_address``   "127.0.0.1:PORT" of the Prometheus endpoint

``sos_server_factory(data_dir=None, args=())`` starts more servers, e.g. with
``--keep-generations``. Every server is stopped at the end of the test.

``RawClient`` (import it with ``from conftest import RawClient`` only inside this
directory's tests) speaks the protocol through ``sos_wire.Connection`` over a blocking
socket, one frame at a time: for server tests that need byte-level control.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import pytest

# the checkout's tooling (tools.demo, tools.soak, tools.cluster) is not in the wheel
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NO_SKIP = os.environ.get("SOS_TEST_NO_SKIP") == "1"  # .ci/run sets it: CI here has FUSE, Spark, tmpfs


#: Fixtures that start a process of a test's own (a server, a FUSE mount): a test using one
#: is in the slow lane. `./scripts/test -m "not slow"` is the fast lane for day-to-day work
#: (tests sharing the module's server, unit tests); CI runs everything.
OWN_PROCESS_FIXTURES = {"sos_server", "sos_server_factory", "mounts"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if OWN_PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under SOS_TEST_NO_SKIP=1 a skipped test fails: a skip is only allowed where the machine
    truly lacks something (no /dev/fuse, no Java), and CI's machine lacks none of it."""
    outcome = yield
    report = outcome.get_result()
    if NO_SKIP and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, but SOS_TEST_NO_SKIP=1 forbids skips: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same for a whole module skipped at import (pytest.importorskip, allow_module_level)."""
    outcome = yield
    report = outcome.get_result()
    if NO_SKIP and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"module skipped, but SOS_TEST_NO_SKIP=1 forbids skips: {reason}"


START_TIMEOUT = 60.0  # generous: two shared cores, many test processes
STOP_TIMEOUT = 30.0


class ServerProcess:
    def __init__(self, data_dir: str | os.PathLike, args=(), *, log_path: str | os.PathLike | None = None) -> None:
        self.data_dir = str(data_dir)
        self.args = [str(a) for a in args]
        self.log_path = str(log_path or Path(self.data_dir).parent / f"{Path(self.data_dir).name}-server.log")
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.metrics_address: str | None = None
        self._port = 0
        self._log_offset = 0
        self.starts = 0

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> "ServerProcess":
        """Start (again) on the previous port if there was one, else on a free port."""
        try:
            return self._start()
        except RuntimeError as exc:
            if not self._port or "cannot listen" not in str(exc):
                raise
            self._port = 0  # the old port was taken meanwhile: any free one
            return self._start()

    def _start(self) -> "ServerProcess":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("server already running")
        os.makedirs(self.data_dir, exist_ok=True)
        cmd = [
            sys.executable, "-m", "sos_server.cli", "serve",
            "--data", self.data_dir,
            "--listen", f"127.0.0.1:{self._port}",
            "--metrics", "127.0.0.1:0",
            *self.args,
        ]
        with open(self.log_path, "ab") as logf:
            self._log_offset = logf.tell()
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)
        self.starts += 1
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            text = self._new_log()
            for line in text.splitlines():
                if line.startswith("sos-server listening on "):
                    self.address = line.rsplit(" ", 1)[1].strip()
                    self._port = int(self.address.rsplit(":", 1)[1])
                if line.startswith("sos-server metrics on "):
                    self.metrics_address = line.rsplit(" ", 1)[1].strip()
            if self.address and "sos-server listening on" in text:
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"sos-server exited with {self.proc.returncode} before listening:\n{text[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"sos-server did not start within {START_TIMEOUT}s:\n{text[-4000:]}")
            time.sleep(0.05)

    def _new_log(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            return f.read().decode("utf-8", "replace")

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash. Only acknowledged bytes are promised to survive."""
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(STOP_TIMEOUT)

    def stop(self) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not stop in time. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
        return self.proc.returncode

    def restart(self) -> "ServerProcess":
        self.stop()
        return self.start()

    # -- helpers ---------------------------------------------------------------------
    def keygen(self, namespace: str, role: str = "append") -> str:
        from sos_server.storage import Storage

        return Storage(self.data_dir).keygen(namespace, role)

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.address.rsplit(":", 1)
        return host, int(port)


@pytest.fixture
def sos_server_factory(tmp_path_factory):
    servers: list[ServerProcess] = []

    def make(data_dir=None, args=(), *, start=True) -> ServerProcess:
        base = tmp_path_factory.mktemp("sos-server")
        srv = ServerProcess(data_dir or base / "data", args, log_path=base / "server.log")
        servers.append(srv)
        return srv.start() if start else srv

    yield make
    for srv in servers:
        srv.stop()


@pytest.fixture
def sos_server(sos_server_factory) -> ServerProcess:
    return sos_server_factory()


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    """One real ``sos-server`` shared by the tests of a module (each test uses namespaces of
    its own); ``sos_server`` is the per-test one, for tests that stop, crash or reconfigure it."""
    base = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    srv = ServerProcess(base / "data", log_path=base / "server.log").start()
    yield srv
    srv.stop()


class RawClient:
    """A blocking, frame-at-a-time client over sos_wire.Connection (server tests)."""

    def __init__(self, address: str | None, *, timeout: float = 60.0, sock: socket.socket | None = None) -> None:
        """Connect to *address*, or speak over an already connected *sock* (e.g. TLS)."""
        from sos_wire.connection import Connection, Role

        if sock is None:
            host, port = address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock = sock
        self.conn = Connection(Role.CLIENT)
        self._events: deque = deque()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RawClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rid(self) -> int:
        return self.conn.next_request_id()

    def send(self, event) -> None:
        self.sock.sendall(self.conn.send(event))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def next(self):
        """The next reply event; EOFError if the server closed the connection."""
        from sos_wire.connection import NEED_DATA

        while True:
            ev = self.conn.next_event()
            if ev is not NEED_DATA:
                return ev
            data = self.sock.recv(1 << 20)
            if not data:
                raise EOFError("server closed the connection")
            self.conn.receive_data(data)

    def recv_raw_until_eof(self) -> bytes:
        out = bytearray()
        while True:
            data = self.sock.recv(1 << 20)
            if not data:
                return bytes(out)
            out += data

    def call(self, event):
        """Send one request and return its reply (READ: the list of frames, or an Error)."""
        from sos_wire import events as ev

        self.send(event)
        if isinstance(event, ev.Read):
            frames = []
            while True:
                r = self.next()
                if isinstance(r, ev.Error):
                    return r
                frames.append(r)
                if r.last:
                    return frames
        return self.next()

    def login(self, key: str, namespace: str):
        """HELLO + AUTH; returns the AUTH reply (AuthOk or Error)."""
        from sos_wire import events as ev
        from sos_wire.auth import Key

        hello = self.call(ev.Hello(self.rid(), "test", 1, 1))
        assert isinstance(hello, ev.HelloOk), hello
        k = Key.parse(key)
        binding = b""
        if hasattr(self.sock, "getpeercert"):  # inside TLS the proof is bound to the certificate
            from sos_wire.auth import tls_server_end_point

            binding = tls_server_end_point(self.sock.getpeercert(binary_form=True))
        return self.call(ev.Auth(self.rid(), k.key_id, namespace, k.proof(hello.nonce, namespace, binding)))

    # conveniences
    def append(self, name: str, offset: int, data: bytes, epoch: int = 0, crc: int | None = None):
        from sos_wire import events as ev
        from sos_wire.crc import crc32c

        return self.call(ev.Append(self.rid(), name, offset, epoch, crc32c(data) if crc is None else crc, data))

    def read(self, name: str, offset: int = 0, length: int = 0):
        """bytes, or the Error event."""
        from sos_wire import events as ev

        r = self.call(ev.Read(self.rid(), name, offset, length))
        if isinstance(r, ev.Error):
            return r
        return b"".join(f.data for f in r)

    def stat(self, name: str):
        from sos_wire import events as ev

        return self.call(ev.Stat(self.rid(), name))
