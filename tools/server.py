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
import sys
import time
from collections.abc import Sequence

from sos_client.process import ChildStartError, ReadyChild
from tools import child_env

__all__ = ["ServerProcess", "ServerStartError"]

START_TIMEOUT = 60.0  # generous: two shared cores, many processes
STOP_TIMEOUT = 30.0
LISTENING = "sos-server listening on "
METRICS = "sos-server metrics on "


#: what a failed start raises (the message ends with the server's log)
ServerStartError = ChildStartError


class ServerProcess(ReadyChild):
    stop_timeout = STOP_TIMEOUT

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        args: Sequence[object] = (),
        *,
        log_path: str | os.PathLike[str] | None = None,
        port: int = 0,
        fixed_port: bool = False,
        metrics: bool = True,
        profile: str | None = None,
    ) -> None:
        self.data_dir = os.fspath(data_dir)
        super().__init__(
            "sos-server",
            LISTENING,
            os.fspath(log_path) if log_path else self.data_dir.rstrip("/") + "-server.log",
            start_timeout=START_TIMEOUT,
            new_session=True,
        )
        self.args = [str(a) for a in args]
        self.port = port
        self.fixed_port = fixed_port
        self.metrics = metrics
        self.profile = profile
        self.address = ""
        self.metrics_address = ""
        self.starts = 0

    # -- lifecycle -------------------------------------------------------------------
    def command(self) -> list[str]:
        if self.profile:  # cProfile runs a module
            cmd = [sys.executable, "-m", "cProfile", "-o", self.profile, "-m", "sos_server.cli"]
        else:
            cmd = [sys.executable, "-m", "sos_server.cli"]
        cmd += ["serve", "--data", self.data_dir, "--listen", f"127.0.0.1:{self.port}"]
        if self.metrics:
            cmd += ["--metrics", "127.0.0.1:0"]
        return cmd + self.args

    def environment(self) -> dict[str, str]:
        return child_env()

    def start(self, timeout: float | None = None) -> ServerProcess:
        """Start (again): on ``port`` if one is known, else on a free one."""
        deadline = time.monotonic() + (START_TIMEOUT if timeout is None else timeout)
        while True:
            os.makedirs(self.data_dir, exist_ok=True)
            self.starts += 1
            try:
                super().start(max(deadline - time.monotonic(), 0.0))
            except ChildStartError as exc:
                taken = self.port and "cannot listen" in str(exc)
                if not taken or time.monotonic() > deadline:
                    raise
                if not self.fixed_port:
                    self.port = 0  # the old port was taken meanwhile: any free one
                else:
                    time.sleep(0.5)  # wait for the port to be free again
                continue
            self.address = self.ready_line[len(LISTENING) :].strip()
            self.port = int(self.address.rsplit(":", 1)[1])
            for line in self.output().splitlines():
                if line.startswith(METRICS):
                    self.metrics_address = line[len(METRICS) :].strip()
            return self

    def log_text(self) -> str:
        """Everything the server wrote (all its starts), JSON lines."""
        return self.log()

    alive = ReadyChild.running

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
