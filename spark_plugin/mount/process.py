"""`MountProcess`: `sos mount` in a child process (tests, the Spark helpers, the demo and
the crash loop); `is_mounted` and `lazy_unmount` for mount points that may be dead."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time


from ..spark import mount_fstype


log = logging.getLogger("sos.mount")

READY_MARKER = "sos mount: ready"

# ---------------------------------------------------------------------------
# MountProcess: `sos mount` in a child process (tests, Spark demo, crash loops)
# ---------------------------------------------------------------------------

def lazy_unmount(mountpoint: str) -> None:
    """`fusermount3 -u -z`: detach a (possibly dead) mount; quiet if nothing is mounted."""
    subprocess.run(["fusermount3", "-u", "-z", mountpoint], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)


def is_mounted(mountpoint: str) -> bool:
    """True if the kernel lists ``mountpoint`` as a mount, live or dead (no stat of it)."""
    return mount_fstype(mountpoint) is not None


class MountProcess:
    """Run `sos mount NAMESPACE MOUNTPOINT` as a child process.

    ``start()`` (or ``with``) returns once the mount is live: the child printed
    its readiness line and MOUNTPOINT is a mount point. ``stop()`` sends SIGTERM
    and waits (clean unmount, returns the exit code); ``kill()`` sends SIGKILL
    and lazily unmounts the dead mount. The child's stderr goes to
    ``log_path`` (a temp file by default); ``log()`` returns it.
    The key is passed through the environment, never on the command line.
    """

    def __init__(self, namespace: str, mountpoint: str, cache_dir: str, server: str, key: str,
                 sync: bool = True, *, log_path: str | None = None, extra_args=(),
                 env: dict | None = None, start_timeout: float = 120.0) -> None:
        self.namespace = namespace
        self.mountpoint = os.path.abspath(mountpoint)
        self.cache_dir = cache_dir
        self.server = server
        self.key = key
        self.sync = sync
        self.extra_args = list(extra_args)
        self.env = env
        self.start_timeout = start_timeout
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sos-mount-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "spark_plugin.cli_mount", self.namespace, self.mountpoint,
               "--cache", self.cache_dir, "--server", self.server]
        if not self.sync:
            cmd.append("--async")
        return cmd + self.extra_args

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def start(self) -> "MountProcess":
        if self.proc is not None:
            raise RuntimeError("already started")
        if not is_mounted(self.mountpoint):  # a dead mount left here is detached by the child
            os.makedirs(self.mountpoint, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env)
        env["SOS_KEY"] = self.key
        env["SOS_SERVER"] = self.server
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=logf, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                lazy_unmount(self.mountpoint)
                raise RuntimeError(f"sos mount exited with {self.proc.returncode} before it was "
                                   f"ready:\n{self.log()}")
            if READY_MARKER in self.log() and os.path.ismount(self.mountpoint):
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"sos mount not ready after {self.start_timeout}s:\n"
                                   f"{self.log()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the mount (a crash), then lazily unmount what it leaves behind."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        lazy_unmount(self.mountpoint)

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM: clean unmount with everything flushed; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("sos mount did not stop within %ss; killing it", timeout)
                self.kill()
        if is_mounted(self.mountpoint):
            lazy_unmount(self.mountpoint)
        return self.proc.returncode

    def __enter__(self) -> "MountProcess":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if is_mounted(self.mountpoint):
                lazy_unmount(self.mountpoint)
