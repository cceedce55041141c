"""moto's S3 server on 127.0.0.1 for the demos, the tests and the benches, with S3's atomic
conditional writes.

moto checks a conditional PUT's precondition (``If-None-Match: *``, ``If-Match``) and then
writes, with no lock between: two writers racing for one key could both be told 200 (seen once
in ~40 test runs under four xdist workers). S3 makes the check and the write one step, and the
tier's guarantees (protocol.md Part 4: write-once objects, a lease won by one gateway) rest on
that; so the server made here runs the requests that carry a precondition one at a time. The
others run concurrently, as in moto.
"""

from __future__ import annotations

import threading
from typing import Any


def moto_server(port: int = 0) -> Any:
    """An unstarted ``moto.server.ThreadedMotoServer`` on 127.0.0.1:*port* (0: the kernel
    picks) whose conditional writes are atomic. Needs ``moto[server]``."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    class AtomicPreconditions(DomainDispatcherApplication):  # type: ignore[misc]
        precondition_lock = threading.Lock()  # (moto's own is self.lock)

        def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
            if "HTTP_IF_NONE_MATCH" in environ or "HTTP_IF_MATCH" in environ:
                with self.precondition_lock:  # the check, the write and the response before the next one
                    return list(super().__call__(environ, start_response))
            return super().__call__(environ, start_response)

    class Server(ThreadedMotoServer):  # type: ignore[misc]
        def _server_entry(self) -> None:  # moto's own, with the application above
            app = AtomicPreconditions(create_backend_app)
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    return Server(ip_address="127.0.0.1", port=port, verbose=False)


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.moto_s3 [--port N]``: the server above in the foreground until SIGINT
    or SIGTERM (the benches' object store, a process of its own); prints its endpoint URL."""
    import argparse
    import logging
    import signal

    ap = argparse.ArgumentParser(description="moto's S3 server on 127.0.0.1 with atomic conditional writes")
    ap.add_argument("--port", type=int, default=0, help="the port (default: one the kernel picks)")
    args = ap.parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # before the server's threads: they inherit it
    server = moto_server(args.port)
    server.start()
    host, port = server.get_host_and_port()
    print(f"http://{host}:{port}", flush=True)
    signal.sigwait(stop)
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
