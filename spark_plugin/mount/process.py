"""`MountProcess`: `sos mount` in a child process (tests, the Spark helpers, the demo and
the crash loop), on :class:`sos_client.process.ReadyChild`; `is_mounted` and
`lazy_unmount` for mount points that may be dead."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from sos_client.process import ChildStartError, child_log_path
from sos_journal.faces.command import FaceChild

from ..mounttable import mount_fstype

__all__ = ["READY_MARKER", "MountProcess", "is_mounted", "lazy_unmount"]

log = logging.getLogger(__name__)

READY_MARKER = "sos mount: ready"


def lazy_unmount(mountpoint: str) -> None:
    """`fusermount3 -u -z`: detach a (possibly dead) mount; quiet if nothing is mounted."""
    subprocess.run(
        ["fusermount3", "-u", "-z", mountpoint], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
    )


def is_mounted(mountpoint: str) -> bool:
    """True if the kernel lists ``mountpoint`` as a mount, live or dead (no stat of it)."""
    return mount_fstype(mountpoint) is not None


class MountProcess(FaceChild):
    """Run `sos mount NAMESPACE MOUNTPOINT` as a child process.

    ``start()`` (or ``with``) returns once the mount is live: the child printed
    its readiness line and MOUNTPOINT is a mount point. ``stop()`` sends SIGTERM
    and waits (clean unmount, returns the exit code); ``kill()`` sends SIGKILL
    and lazily unmounts the dead mount. The child's stderr goes to
    ``log_path`` (a temp file by default); ``log()`` returns it.
    The key is passed through the environment, never on the command line.
    ``durability``: ``--durability`` ("tier": barriers also wait for the server's bucket);
    ``tier_patience``: ``--tier-patience`` in seconds (None: the default).
    """

    def __init__(
        self,
        namespace: str,
        mountpoint: str,
        cache_dir: str,
        server: str,
        key: str,
        sync: bool = True,
        *,
        log_path: str | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
        env: dict[str, str] | None = None,
        start_timeout: float = 120.0,
        durability: str = "server",
        tier_patience: float | None = None,
    ) -> None:
        super().__init__(
            "sos mount",
            READY_MARKER,
            log_path or child_log_path("sos-mount-"),
            namespace=namespace,
            cache_dir=cache_dir,
            server=server,
            key=key,
            sync=sync,
            extra_args=extra_args,
            durability=durability,
            tier_patience=tier_patience,
            start_timeout=start_timeout,
            new_session=True,
        )
        self.mountpoint = os.path.abspath(mountpoint)
        self.env = env

    def command(self) -> list[str]:
        head = [sys.executable, "-m", "spark_plugin.mount.cli", self.namespace, self.mountpoint]
        return [*head, *self.journal_args(), *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ if self.env is None else self.env)
        env["SOS_KEY"] = self.key
        env["SOS_SERVER"] = self.server
        return env

    def ready_yet(self, line: str) -> bool:
        return os.path.ismount(self.mountpoint)

    def start(self, timeout: float | None = None) -> MountProcess:
        if self.proc is not None:
            raise ChildStartError("already started")
        if not is_mounted(self.mountpoint):  # a dead mount left here is detached by the child
            os.makedirs(self.mountpoint, exist_ok=True)
        try:
            return super().start(timeout)
        except ChildStartError:
            lazy_unmount(self.mountpoint)
            raise

    def kill(self) -> None:
        """SIGKILL the mount (a crash), then lazily unmount what it leaves behind."""
        super().kill()
        lazy_unmount(self.mountpoint)

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM: clean unmount with everything flushed; returns the exit code."""
        code = super().stop(timeout)
        if is_mounted(self.mountpoint):
            lazy_unmount(self.mountpoint)
        return code
