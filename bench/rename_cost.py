"""The gateway's CPU per RENAME (issue 28 item 2: the RENAME memory, issue 26 item 4).

A real `sos-server` and a real `sos gateway` child process on 127.0.0.1; N files created
(one step, `data=true`, 100 bytes each), then N renames, each of its own file to its own
destination (the memory fills up to its 256 entries, as under a Spark query) over one
keep-alive connection. The gateway's CPU time (utime + stime of /proc/PID/stat) is read
before and after the rename phase only; the wall time per rename is printed beside it but
depends on the server's fdatasync and on what else the machine runs.

    python3 bench/rename_cost.py [--renames 2000] [--async]

Prints one JSON line; exit 0. Run on demand, not a test.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import time
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spark_plugin.gateway.process import GatewayProcess
from tools.server import ServerProcess

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def measure(gateway_url: str, pid: int, key: str, renames: int) -> dict[str, object]:
    u = urllib.parse.urlsplit(gateway_url)
    c = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port)
    form = urllib.parse.urlencode({"grant_type": "client_credentials", "client_id": "bench", "client_secret": key})
    c.request("POST", "/oauth2/token", form, {"content-type": "application/x-www-form-urlencoded"})
    headers = {"Authorization": f"Bearer {json.loads(c.getresponse().read())['access_token']}"}

    def call(method: str, path: str, body: bytes | None = None) -> bytes:
        c.request(method, path, body, headers)
        r = c.getresponse()
        data = r.read()
        if r.status not in (200, 201):
            raise RuntimeError(f"{method} {path}: {r.status} {data[:200]!r}")
        return data

    call("PUT", "/webhdfs/v1/d?op=MKDIRS")
    for i in range(renames):
        call("PUT", f"/webhdfs/v1/d/.{i}.tmp?op=CREATE&data=true&overwrite=true", b"x" * 100)
    before, started = cpu_seconds(pid), time.monotonic()
    for i in range(renames):
        if json.loads(call("PUT", f"/webhdfs/v1/d/.{i}.tmp?op=RENAME&destination=/d/{i}")) != {"boolean": True}:
            raise RuntimeError(f"rename {i} answered false")
    cpu, wall = cpu_seconds(pid) - before, time.monotonic() - started
    return {
        "renames": renames,
        "gateway_cpu_s": round(cpu, 3),
        "cpu_ms_per_rename": round(cpu / renames * 1e3, 3),
        "wall_ms_per_rename": round(wall / renames * 1e3, 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--renames", type=int, default=2000)
    p.add_argument("--async", dest="async_", action="store_true", help="the gateway in async mode")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="sos-rename-cost-")
    server = ServerProcess(os.path.join(work, "data"), metrics=False).start()
    try:
        key = server.keygen("bench")
        gw = GatewayProcess("bench", os.path.join(work, "cache"), server.address, key, sync=not args.async_).start()
        try:
            assert gw.url is not None and gw.proc is not None
            result = measure(gw.url, gw.proc.pid, key, args.renames)
        finally:
            gw.stop()
    finally:
        server.stop()
    print(json.dumps({**result, "sync": not args.async_}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
