"""Container health check: HELLO + PING to the local sos-server, exit 0 on PONG.

Used by the Dockerfile's HEALTHCHECK. Needs no key (PING is allowed before AUTH).
Address: $SOS_HEALTH_ADDR when set; else the ``--listen`` of the running ``sos-server
serve`` (or ``sos gateway``) found in /proc, the container's one SOS process, a wildcard
host (0.0.0.0, ::) checked on loopback; else 127.0.0.1:7070 (9870 for the gateway).
$SOS_HEALTH_TLS=1 (the image's default, its server listens with TLS) speaks TLS; the
certificate is not checked: the check sends no secret and only looks for the PONG. Exit 0
healthy, 1 not.

``healthcheck.py --gateway`` checks a `sos gateway` at $SOS_HEALTH_ADDR instead: an
unauthenticated WebHDFS request must get the gateway's own refusal (HTTP 401 with
``WWW-Authenticate: Bearer realm="sos"``), which shows its HTTP loop answers. It needs no
token either. The gateway listens only once its cache is restored from the server. Without
``--gateway`` the gateway is checked too when the only SOS process running is a gateway
(the image's HEALTHCHECK in a gateway container).
"""

import http.client
import os
import pathlib
import socket
import ssl
import sys

from sos_wire import NEED_DATA, Connection, Hello, Ping, Pong, Role


def check(address: str, timeout: float = 5.0, tls: bool = False) -> bool:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
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
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, int(port), timeout=timeout, context=ctx)
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


WILDCARDS = {"", "0.0.0.0", "::", "[::]", "*"}


def _role(argv: list[str]) -> str | None:
    """'server' for ``... sos-server serve ...``, 'gateway' for ``... sos gateway ...``."""
    names = [os.path.basename(a) for a in argv]
    for i, name in enumerate(names):
        if name == "sos-server" and "serve" in argv[i + 1 :]:
            return "server"
        if name == "sos" and "gateway" in argv[i + 1 :]:
            return "gateway"
    return None


def _listen(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--listen" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--listen="):
            return a.split("=", 1)[1]
    return None


def running(proc: str = "/proc") -> dict[str, str]:
    """Role -> the address a running SOS process listens on (its --listen, a wildcard
    host made loopback; the program's default when it has none)."""
    found: dict[str, str] = {}
    for d in sorted(pathlib.Path(proc).glob("[0-9]*"), key=lambda p: int(p.name)):
        try:
            argv = (d / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except OSError:
            continue
        role = _role(argv)
        if role is None or role in found:
            continue
        listen = _listen(argv) or ("127.0.0.1:7070" if role == "server" else "127.0.0.1:9870")
        host, _, port = listen.rpartition(":")
        if host in WILDCARDS:
            host = "[::1]" if host in ("::", "[::]") else "127.0.0.1"
        found[role] = f"{host}:{port}"
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    gateway = argv == ["--gateway"]
    if argv and not gateway:
        print("usage: healthcheck.py [--gateway]", file=sys.stderr)
        return 2
    address = os.environ.get("SOS_HEALTH_ADDR", "")
    if not address:
        procs = running()
        if not gateway and "gateway" in procs and "server" not in procs:
            gateway = True
        address = procs.get("gateway" if gateway else "server") or ("127.0.0.1:9870" if gateway else "127.0.0.1:7070")
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
