"""`GatewayProcess`: ``sos gateway`` in a child process (tests, the Spark helpers, the demos
and the crash loop), on :class:`sos_client.process.ReadyChild`."""

from __future__ import annotations

import os
import sys
import tempfile

from sos_journal.faces.command import FaceChild

__all__ = ["READY_MARKER", "GatewayProcess"]

#: The gateway prints this, then " URL (namespace NS, sync|async)", on stderr once it serves.
READY_MARKER = "sos gateway: ready on"


class GatewayProcess(FaceChild):
    """Runs ``sos gateway NAMESPACE --listen LISTEN --cache CACHE`` in a child process.

    ``.url`` (``http://host:port``) is known once :meth:`start` returns; ``.stop()``
    (SIGTERM, flushes), ``.kill()`` (SIGKILL, a crash). The key goes by environment.
    ``durability``: ``--durability`` ("server" or "tier": the barriers also wait for the
    server's bucket); ``tier_patience``: ``--tier-patience`` in seconds (None: the default).
    """

    def __init__(
        self,
        namespace: str,
        cache_dir: str,
        server: str,
        key: str,
        *,
        listen: str = "127.0.0.1:0",
        sync: bool = True,
        log_path: str | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
        start_timeout: float = 120.0,
        debug: bool = False,
        durability: str = "server",
        tier_patience: float | None = None,
    ) -> None:
        super().__init__(
            "sos gateway",
            READY_MARKER,
            log_path or os.path.join(tempfile.mkdtemp(prefix="sos-gateway-log-"), "gateway.log"),
            namespace=namespace,
            cache_dir=cache_dir,
            server=server,
            key=key,
            sync=sync,
            extra_args=extra_args,
            durability=durability,
            tier_patience=tier_patience,
            start_timeout=start_timeout,
        )
        self.listen = listen
        self.debug = debug

    def command(self) -> list[str]:
        head = [sys.executable, "-m", "spark_plugin.gateway.cli", self.namespace, "--listen", self.listen]
        return [*head, *self.journal_args(), *(["--debug"] if self.debug else []), *self.extra_args]

    def environment(self) -> dict[str, str]:
        return dict(os.environ, SOS_KEY=str(self.key))

    @property
    def url(self) -> str | None:
        """``scheme://host:port`` of the running gateway (None before it started)."""
        if not self.ready_line:
            return None
        return self.ready_line[len(READY_MARKER) :].split()[0]
