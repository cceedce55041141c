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

``RawClient`` (import it with ``from tests.conftest import RawClient``) speaks the protocol through ``sos_wire.Connection`` over a blocking
socket, one frame at a time: for server tests that need byte-level control.
"""

from __future__ import annotations

import io
import os
import socket
import sys
from collections import deque

import pytest

# the checkout's tooling (tools.demo, tools.soak, tools.cluster) is not in the wheel
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.server import ServerProcess

# The shared helpers' asserts report their operands as a test module's do: pytest rewrites test
# modules, conftests and plugins by itself, a module they import only if it is named here first.
pytest.register_assert_rewrite("tests.support", "tests.tier.support", "tests.gateway.support", "tests.deploy.support")

NO_SKIP = os.environ.get("SOS_TEST_NO_SKIP") == "1"  # .ci/run sets it: CI here has FUSE, Spark, tmpfs


#: Fixtures that start a process of a test's own (a server, a FUSE mount): a test using one
#: is in the slow lane. `./scripts/test -m "not slow"` is the fast lane for day-to-day work
#: (tests sharing the module's server, unit tests); CI runs everything.
OWN_PROCESS_FIXTURES = {"sos_server", "sos_server_factory", "mounts"}


#: Module-scoped fixtures cheap enough to start once per xdist worker (a server process);
#: a module using any other (a built image, a compiled Hadoop harness, a cluster demo run whose
#: result several tests read) stays on one worker: ``--dist loadgroup`` with its module as group.
CHEAP_MODULE_FIXTURES = {"server"}

#: A rough cost per marker, to hand the longest work to the xdist workers first (the run ends
#: when the last worker does; a cluster test dealt last would run alone at the end).
MARK_COST = {"container": 40, "spark": 30, "hadoop": 8, "fuse": 4, "own_server": 2, "slow": 2}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which names each test's group in its id
def pytest_collection_modifyitems(config, items):
    for item in items:
        if OWN_PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    cost: dict[str, int] = {}
    unit = {}
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = fixtures.name2fixturedefs if fixtures is not None else {}
        shared = any(d and d[-1].scope == "module" and n not in CHEAP_MODULE_FIXTURES for n, d in defs.items())
        if shared or item.get_closest_marker("xdist_group"):
            group = item.get_closest_marker("xdist_group")
            name = group.args[0] if group and group.args else item.module.__name__
            if not group:
                item.add_marker(pytest.mark.xdist_group(name))
            unit[item] = f"group {name}"
        else:
            unit[item] = item.nodeid
        own = 1 + max((c for m, c in MARK_COST.items() if item.get_closest_marker(m)), default=0)
        cost[unit[item]] = cost.get(unit[item], 0) + own
    if hasattr(config, "workerinput"):  # an xdist worker: the costliest work first (stable)
        items.sort(key=lambda item: -cost[unit[item]])


@pytest.hookimpl(tryfirst=True)  # before xdist's, which sends the ids to the controller
def pytest_collection_finish(session):
    """``--dist loadgroup`` deals the tests by id: xdist 3.8 appends ``@GROUP`` to the id of a
    test marked ``xdist_group`` by setting ``item._nodeid``, which pytest >= 9.2 no longer
    reads (the id lives in ``item._id``); without it every test of a group could go to a
    different worker. Name the group here when xdist's own way left the id as it was."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        marks = [m.args[0] if m.args else m.kwargs.get("name", "default") for m in item.iter_markers("xdist_group")]
        if not marks or "@" in item.nodeid.rpartition("]")[2].rpartition("::")[2]:
            continue
        want = f"{item.nodeid}@{'_'.join(sorted(set(map(str, marks))))}"
        if hasattr(item, "_id"):
            from _pytest.nodeid import coerce_node_id

            item._id = coerce_node_id(want)
        else:
            item._nodeid = want


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


def pytest_terminal_summary(terminalreporter, config):
    """With pytest-cov on and no table asked for (``.ci/run``: ``--cov=PKG ... --cov-branch
    --cov-report=``), one line with the total, just before pytest's closing line."""
    cov = config.pluginmanager.getplugin("_cov")
    ctl = getattr(cov, "cov_controller", None)
    if ctl is None:
        return
    from coverage.exceptions import CoverageException

    try:  # the Coverage object the `cov` fixture hands out, its data combined at the end
        total = ctl.cov.report(ignore_errors=True, output_format="total", file=io.StringIO())
    except CoverageException as exc:  # e.g. no data
        terminalreporter.write_line(f"coverage: no total ({exc})")
        return
    what = ", ".join(cov.options.cov_source or ()) or "the measured code"
    kind = "branch coverage" if cov.options.cov_branch else "line coverage"
    terminalreporter.write_line(
        f"{kind} of {what}: {total:.1f} % (in the pytest processes; the "
        f"servers, mounts and gateways the tests start are not measured)"
    )


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

    def __enter__(self) -> RawClient:
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


@pytest.fixture
def tmpfs(request, tmp_path):
    """A tmpfs of the test module's ``TMPFS_SIZE`` mounted on a new directory (a small disk to
    fill), unmounted after; skipped where mounting is not allowed (tests.support.tmpfs_mount)."""
    from tests.support import tmpfs_mount

    with tmpfs_mount(tmp_path / "disk", request.module.TMPFS_SIZE) as d:
        yield d
