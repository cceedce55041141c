"""Container health check: HELLO + PING to the local sos-server, exit 0 on PONG.

Used by the Dockerfile's HEALTHCHECK. Needs no key (PING is allowed before AUTH).
Address: $SOS_HEALTH_ADDR (default 127.0.0.1:7070). $SOS_HEALTH_TLS=1 (the image's
default, its server listens with TLS) speaks TLS; the certificate is not checked: the
check sends no secret and only looks for the PONG. Exit 0 healthy, 1 not.
"""

import os
import socket
import ssl
import sys

from sos_wire import NEED_DATA, Connection, Hello, Ping, Pong, Role


def check(address: str, timeout: float = 5.0, tls: bool = False) -> bool:
    host, _, port = address.rpartition(":")
    conn = Connection(Role.CLIENT)
    sock = socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout)
    if tls:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        try:
            sock = ctx.wrap_socket(sock)
        except BaseException:
            sock.close()
            raise
    with sock:
        sock.sendall(conn.send(Hello(1, "sos-healthcheck")) + conn.send(Ping(2, b"health")))
        while True:
            event = conn.next_event()
            if event is NEED_DATA:
                data = sock.recv(65536)
                if not data:
                    return False
                conn.receive_data(data)
            elif isinstance(event, Pong):
                return event.payload == b"health"
            elif getattr(event, "request_id", None) == 2:
                return False  # an ERROR reply to the ping


def main() -> int:
    address = os.environ.get("SOS_HEALTH_ADDR", "127.0.0.1:7070")
    tls = os.environ.get("SOS_HEALTH_TLS", "0") not in ("", "0")
    try:
        ok = check(address, tls=tls)
    except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print("unhealthy: no PONG", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
