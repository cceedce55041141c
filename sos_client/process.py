"""`ReadyChild`: the one launcher of a child process that says on stderr when it is ready.

``sos-server serve`` prints "sos-server listening on HOST:PORT", ``sos gateway`` "sos gateway:
ready on URL ...", ``sos mount`` "sos mount: ready: ...". The tests, the Spark helpers, the
demos, the crash loop and the benches start them through subclasses of :class:`ReadyChild`
(``tools.server.ServerProcess``, ``spark_plugin.gateway.process.GatewayProcess``,
``spark_plugin.mount.process.MountProcess``), which add the command line and what is
particular to each (a port kept across restarts, a mount point to detach).

The child's stdout and stderr go to a log file (appended across restarts); :meth:`start`
polls what the child wrote since it started for a line beginning with the ready prefix (and
the subclass's own condition, :meth:`ready_yet`), and raises :class:`ChildStartError` with the
end of that output if the child exits first or is not ready in time (then it is killed).
Only the standard library: the Spark image runs nothing of it, but ``tools`` imports it
without trio.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Self

__all__ = ["ChildStartError", "ReadyChild", "child_log_path"]

#: how much of the child's output a start failure quotes
_TAIL = 4000


class ChildStartError(RuntimeError):
    """The child exited, or was not ready in time; the message ends with its output."""


class ReadyChild:
    """A child process started from ``command()`` that is ready once its log shows a line
    beginning with ``ready_prefix``. ``name`` names it in errors; ``new_session``: the child
    gets a session of its own (a Ctrl-C of the terminal reaches it through the parent only).
    """

    #: seconds :meth:`stop` waits after SIGTERM before SIGKILL
    stop_timeout = 120.0

    def __init__(
        self, name: str, ready_prefix: str, log_path: str, *, start_timeout: float = 120.0, new_session: bool = False
    ) -> None:
        self.name = name
        self.ready_prefix = ready_prefix
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.new_session = new_session
        self.proc: subprocess.Popen[bytes] | None = None
        #: the line that said the child is ready (its last start)
        self.ready_line = ""
        self._log_offset = 0

    # -- what a subclass gives ----------------------------------------------------------
    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> Mapping[str, str] | None:
        """The child's environment (None: this process's)."""
        return None

    def ready_yet(self, line: str) -> bool:
        """Called with the ready line; False to keep waiting (e.g. for a mount to appear)."""
        return True

    # -- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> Self:
        """Start the child and wait until it is ready (see the class docstring)."""
        if self.running():
            raise ChildStartError(f"{self.name} already running")
        timeout = self.start_timeout if timeout is None else timeout
        self._spawn(self.command(), self.environment())
        deadline = time.monotonic() + timeout
        while True:
            text = self.output()
            for line in text.splitlines():
                if line.startswith(self.ready_prefix) and self.ready_yet(line):
                    self.ready_line = line
                    return self
            if self.proc is not None and self.proc.poll() is not None:
                raise ChildStartError(
                    f"{self.name} exited with {self.proc.returncode} before it was ready:\n{text[-_TAIL:]}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise ChildStartError(f"{self.name} was not ready after {timeout:.0f} s:\n{text[-_TAIL:]}")
            time.sleep(0.05)

    def _spawn(self, command: Sequence[str], env: Mapping[str, str] | None) -> None:
        with open(self.log_path, "ab") as logf:
            self._log_offset = logf.tell()
            self.proc = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                env=None if env is None else dict(env),
                start_new_session=self.new_session,
            )

    def output(self) -> str:
        """What the child wrote since its last start."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def log(self) -> str:
        """Everything the child wrote, all its starts."""
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(60)

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM and wait (at most ``timeout``, default :attr:`stop_timeout`), then SIGKILL;
        returns the exit code (None if it never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def __enter__(self) -> Self:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def child_log_path(prefix: str) -> str:
    """A new empty log file for a child, in the temporary directory."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.close(fd)
    return path
