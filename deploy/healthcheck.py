"""Container health check: HELLO + PING to the local sos-server, exit 0 on PONG.

Used by the Dockerfile's HEALTHCHECK. Needs no key (PING is allowed before AUTH).
Address: $SOS_HEALTH_ADDR (default 127.0.0.1:7070). $SOS_HEALTH_TLS=1 (the image's
default, its server listens with TLS) speaks TLS; the certificate is not checked: the
check sends no secret and only looks for the PONG. Exit 0 healthy, 1 not.

``healthcheck.py --gateway`` checks a `sos gateway` at $SOS_HEALTH_ADDR instead: an
unauthenticated WebHDFS request must get the gateway's own refusal (HTTP 401 with
``WWW-Authenticate: Bearer realm="sos"``), which shows its HTTP loop answers. It needs no
token either. The gateway listens only once its cache is restored from the server.
"""

import http.client
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


def check_gateway(address: str, timeout: float = 5.0, tls: bool = False) -> bool:
    """True if ``sos gateway`` at ``address`` answers a request without a token with its
    401 (the certificate is not checked: nothing secret is sent)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if tls:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, int(port), timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", "/webhdfs/v1/?op=GETHOMEDIRECTORY")
        resp = conn.getresponse()
        resp.read(65536)
        challenge = resp.getheader("WWW-Authenticate") or ""
        return resp.status == 401 and challenge.startswith('Bearer realm="sos"')
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    gateway = argv == ["--gateway"]
    if argv and not gateway:
        print("usage: healthcheck.py [--gateway]", file=sys.stderr)
        return 2
    address = os.environ.get("SOS_HEALTH_ADDR", "127.0.0.1:9870" if gateway else "127.0.0.1:7070")
    tls = os.environ.get("SOS_HEALTH_TLS", "0") not in ("", "0")
    try:
        ok = (check_gateway if gateway else check)(address, tls=tls)
    except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print("unhealthy: " + ("not the gateway's 401" if gateway else "no PONG"), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
