"""The one launcher of a real ``sos-server serve`` child process, for the tests
(tests/conftest.py), the demos, the crash loop and the benches.

It listens on 127.0.0.1: a port the kernel picks, or ``port=`` given. ``start()`` waits for
the server's "listening" line in its log; ``restart()`` (after ``kill()`` or ``stop()``)
comes back on the same port, so clients, mounts and gateways configured with the address
find it again. With ``fixed_port=True`` the same port is waited for (a crash loop whose
mounts know the address); otherwise a port taken meanwhile is replaced by a free one and
``address`` follows. Metrics are on a kernel-chosen port (``metrics_address``) unless
``metrics=False``; ``profile=FILE`` runs the server under cProfile. The child imports
this checkout (``tools.child_env``) in a session of its own (a Ctrl-C of the demo reaches
it through the demo, not twice).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from tools import child_env

__all__ = ["ServerProcess", "ServerStartError"]

START_TIMEOUT = 60.0  # generous: two shared cores, many processes
STOP_TIMEOUT = 30.0
LISTENING = "sos-server listening on "
METRICS = "sos-server metrics on "


class ServerStartError(RuntimeError):
    """The server exited or did not listen in time; the message ends with its log."""


class ServerProcess:
    def __init__(self, data_dir: str | os.PathLike[str], args: Sequence[object] = (), *,
                 log_path: str | os.PathLike[str] | None = None, port: int = 0, fixed_port: bool = False,
                 metrics: bool = True, profile: str | None = None) -> None:
        self.data_dir = os.fspath(data_dir)
        self.args = [str(a) for a in args]
        self.log_path = os.fspath(log_path) if log_path else self.data_dir.rstrip("/") + "-server.log"
        self.port = port
        self.fixed_port = fixed_port
        self.metrics = metrics
        self.profile = profile
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.metrics_address = ""
        self.starts = 0
        self._log_offset = 0

    # -- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float = START_TIMEOUT) -> ServerProcess:
        """Start (again): on ``port`` if one is known, else on a free one."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._start(deadline)
            except ServerStartError as exc:
                taken = self.port and "cannot listen" in str(exc)
                if not taken or time.monotonic() > deadline:
                    raise
                if not self.fixed_port:
                    self.port = 0  # the old port was taken meanwhile: any free one
                else:
                    time.sleep(0.5)  # wait for the port to be free again

    def _start(self, deadline: float) -> ServerProcess:
        if self.running():
            raise ServerStartError("server already running")
        os.makedirs(self.data_dir, exist_ok=True)
        if self.profile:  # cProfile runs a module
            cmd = [sys.executable, "-m", "cProfile", "-o", self.profile, "-m", "sos_server.cli"]
        else:
            cmd = [sys.executable, "-m", "sos_server.cli"]
        cmd += ["serve", "--data", self.data_dir, "--listen", f"127.0.0.1:{self.port}"]
        if self.metrics:
            cmd += ["--metrics", "127.0.0.1:0"]
        with open(self.log_path, "ab") as logf:
            self._log_offset = logf.tell()
            self.proc = subprocess.Popen(cmd + self.args, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                         start_new_session=True, env=child_env())
        self.starts += 1
        while True:
            text = self._new_log()
            for line in text.splitlines():
                if line.startswith(LISTENING):
                    self.address = line.rsplit(" ", 1)[1].strip()
                    self.port = int(self.address.rsplit(":", 1)[1])
                if line.startswith(METRICS):
                    self.metrics_address = line.rsplit(" ", 1)[1].strip()
            if LISTENING in text:
                return self
            if self.proc.poll() is not None:
                raise ServerStartError(f"sos-server exited with {self.proc.returncode} before listening:\n"
                                       f"{text[-4000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise ServerStartError(f"sos-server did not listen in time:\n{text[-4000:]}")
            time.sleep(0.05)

    def _new_log(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            return f.read().decode("utf-8", "replace")

    def log_text(self) -> str:
        """Everything the server wrote (all its starts), JSON lines."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    log = log_text

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    alive = running

    def kill(self) -> None:
        """SIGKILL: a crash. Only acknowledged bytes are promised to survive."""
        if self.proc is not None and self.running():
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

    def restart(self) -> ServerProcess:
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
