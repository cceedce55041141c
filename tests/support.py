"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools.demo_common import tree_of

#: {relative path: bytes for a file, None for a directory} of everything below root (the demos' own)
tree_snapshot = tree_of


def client_expecting(reply_op, request_id: int):
    """A client Connection with a request in flight that ``reply_op`` answers (ERROR: a
    STAT), sent through its public ``send`` as a real client would, so that feeding it the
    reply's bytes is legal. For codec tests of replies."""
    import dataclasses
    import typing

    from sos_wire import events as ev
    from sos_wire.connection import OP_OF, Connection, Role
    from sos_wire.frames import Op

    conn = Connection(Role.CLIENT)
    if not request_id:
        return conn
    want = Op.STAT if reply_op == Op.ERROR else Op(reply_op & 0x7F)
    cls = next(c for c, op in OP_OF.items() if op == want)
    hints = typing.get_type_hints(cls, vars(ev))
    fields = {
        f.name: {int: 0, str: "x", bytes: b"", ev.Payload: b"", bool: False}.get(hints[f.name], 0)
        for f in dataclasses.fields(cls)
    }
    fields["request_id"] = request_id
    if want == Op.AUTH:
        fields.update(key_id=b"\0" * 8, proof=b"\0" * 32)
    conn.send(cls(**fields))
    return conn


def server_cli(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``sos-server ARGS`` (``python -m sos_server.cli``) run to its end: keygen, quota, keys..."""
    return subprocess.run(
        [sys.executable, "-m", "sos_server.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def server_metric(srv, name: str, default: float | None = None, *, timeout: float = 60) -> float:
    """The value of the unlabelled series ``name`` on a server's Prometheus page (``default``
    when it is absent; without one, absence fails the test)."""
    with urllib.request.urlopen(f"http://{srv.metrics_address}/metrics", timeout=timeout) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    if default is not None:
        return default
    raise AssertionError(f"no metric {name}")


@contextlib.contextmanager
def tmpfs_mount(where: Path, size: str | int) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on the new directory ``where`` (a small disk to fill), unmounted
    after; the test is skipped where mounting is not allowed (needs root or CAP_SYS_ADMIN)."""
    where.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield where
    finally:
        for _ in range(50):
            if subprocess.run(["umount", str(where)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)  # a process may still be closing files on it
        else:
            subprocess.run(["umount", "-l", str(where)], check=True)


def self_signed_cert(directory: Path, name: str = "cert", cn: str | None = None) -> tuple[str, str]:
    """A self-signed certificate and its unencrypted key, ``directory/NAME.crt`` and
    ``directory/NAME.key`` (``openssl req -x509``, RSA 2048, two days), for CN ``cn`` (default
    ``name``) and valid for 127.0.0.1 and localhost; skips the test where openssl is missing."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = Path(directory) / f"{name}.crt", Path(directory) / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            f"/CN={cn or name}",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return str(cert), str(key)


def pair_listen(host: str = "127.0.0.1") -> str:
    """``HOST:PORT`` on a port free now, for a member of a gateway pair (``--lease``). Not port 0:
    the lease names the gateway's ``--listen`` address for the standby's probe of the active,
    and ``HOST:0`` names no one, so a standby would find the active "down" and hold every
    request it refuses for its 30 s (spark_plugin.gateway.pair.standby.HOLD) before answering."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


# The peak resident memory of the process that runs this snippet, in KiB.  VmHWM belongs to the
# process's own address space; ru_maxrss does not: Linux carries the parent's high-water mark
# across fork/vfork + exec, so a child of a big pytest worker reports the worker's peak (seen:
# 333 MB and 523 MB in full CI runs for a child that used 38 MB).
PEAK_RSS_KIB = """
def peak_rss_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
"""


def webhdfs_put(c, path: str, data: bytes) -> None:
    """CREATE (overwrite) ``path`` with ``data`` through a GatewayClient ``c``."""
    c.call("PUT", "/webhdfs/v1" + path, data, op="CREATE", data="true", overwrite="true")


def webhdfs_rename(c, src: str, dst: str, *, rename2: bool = False) -> bool | str:
    """HDFS's boolean rename's answer, or rename2's (``renameoptions=NONE``): True (200) or
    the name of the exception it answered."""
    from spark_plugin.gateway.client import GatewayError

    if not rename2:
        return c.call("PUT", "/webhdfs/v1" + src, op="RENAME", destination=dst)["boolean"]
    try:
        assert c.call("PUT", "/webhdfs/v1" + src, op="RENAME", destination=dst, renameoptions="NONE") == {}
    except GatewayError as exc:
        return exc.exception
    return True
