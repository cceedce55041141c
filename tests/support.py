"""Helpers shared by the test modules of several components (fixtures live in conftest.py).

Each component's own helpers sit in its folder's ``support.py`` (``tests.tier.support``,
``tests.gateway.support``, ``tests.deploy.support``) and its fixtures in that folder's
``conftest.py``. Here: running the ``sos`` and ``sos-server`` commands, reading Prometheus
pages, waiting for a condition, certificates, a small disk, WebHDFS calls, a gateway run to its
refusal, a server thread's accept loop, the Spark query drivers' builder and query."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tools import child_env
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


def client_factory(server, ns: str, key: str):
    """What a JournalWriter or restore calls for a connection: a new ``sos_client.Client`` of
    ``ns`` on ``server`` with ``key``."""
    from sos_client import Client

    return lambda: Client(server.address, key, ns, timeout=60)


def flip_byte(path, at: int, mask: int = 0x5A) -> None:
    """Damage the byte at offset ``at`` of the file ``path`` (XOR with ``mask``)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


def output_ids(out_dir) -> collections.Counter:
    """How many times each ``id`` occurs in the JSON lines of the files in ``out_dir`` (a
    streaming query's output: every id once when it ran exactly once)."""
    import json

    ids: collections.Counter = collections.Counter()
    for name in os.listdir(out_dir):
        with open(os.path.join(out_dir, name)) as f:
            ids.update(json.loads(line)["id"] for line in f)
    return ids


def protocol_part(title: str) -> str:
    """protocol.md from the heading ``title`` on (its worked examples, for tests that check them)."""
    root = Path(__file__).resolve().parents[1]
    return (root / "protocol.md").read_text(encoding="utf-8").split(title, 1)[1]


def frame(opcode: int, rid: int, body: bytes = b"", *, version: int = 1, body_len: int | None = None) -> bytes:
    """A frame built by hand as protocol.md lays it out: the 12-byte header (magic, ``version``,
    opcode, request id, body length, CRC-32C of those), then ``body``. ``body_len``: the length
    the header claims (default: the body's), to send a header alone or lie about it."""
    import struct

    from sos_wire.crc import crc32c

    h = b"SO" + bytes([version, opcode]) + struct.pack(">II", rid, len(body) if body_len is None else body_len)
    return h + struct.pack(">I", crc32c(h)) + body


class ManualClock:
    """A clock a test moves by hand: call it for the time, set ``now`` to move it."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def hadoop_jars() -> str:
    """The directory of pyspark's jars, Hadoop's client among them; skips the test without them."""
    import glob

    pyspark = pytest.importorskip("pyspark")
    jars = os.path.join(os.path.dirname(pyspark.__file__), "jars")
    if not glob.glob(os.path.join(jars, "hadoop-client-api-*.jar")):
        pytest.skip("pyspark has no Hadoop client jars")
    return jars


def server_cli(*args: object, timeout: float = 120, **kw) -> subprocess.CompletedProcess[str]:
    """``sos-server ARGS`` (``python -m sos_server.cli``) run to its end, its output captured as
    text: keygen, quota, keys, gc...; ``kw`` goes to subprocess.run (``env``, ``cwd``)."""
    return subprocess.run(
        [sys.executable, "-m", "sos_server.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw
    )


#: argv of the ``sos`` command run with this interpreter
SOS = [sys.executable, "-m", "sos_client.cli"]


def run_sos(
    *args: object,
    env: dict[str, str] | None = None,
    drop: tuple[str, ...] = (),
    ok: bool = False,
    timeout: float = 300,
    **kw,
) -> subprocess.CompletedProcess[str]:
    """``sos ARGS`` run to its end, its output captured as text. Its environment: this
    process's (the checkout first on PYTHONPATH) without the variables named in ``drop``
    (``"SOS_*"``: every one that starts with SOS_), then ``env`` laid over it. ``kw`` goes to
    subprocess.run (``input``, ``cwd``). ``ok``: fail the test unless it exits 0."""
    base = {k: v for k, v in os.environ.items() if not any(_named(k, d) for d in drop)}
    done = subprocess.run(
        [*SOS, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env({**base, **(env or {})}),
        **kw,
    )
    assert not ok or done.returncode == 0, (args, done.stdout, done.stderr)
    return done


def _named(var: str, pattern: str) -> bool:
    return var.startswith(pattern[:-1]) if pattern.endswith("*") else var == pattern


def run_sos_as(
    server, key: str, *args: object, env: dict[str, str] | None = None, **kw
) -> subprocess.CompletedProcess[str]:
    """:func:`run_sos` against ``server`` (its ``address`` in $SOS_SERVER) with ``key`` in
    $SOS_KEY (and no $SOS_KEY_FILE of this process's)."""
    env = {"SOS_SERVER": server.address, "SOS_KEY": key, **(env or {})}
    return run_sos(*args, env=env, drop=("SOS_KEY_FILE", *kw.pop("drop", ())), **kw)


def gateway_refused(
    server, key: str, namespace: str, cache, *args: object, listen: str = "127.0.0.1:0", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``sos gateway NAMESPACE --listen LISTEN --server SERVER --cache CACHE ARGS`` run to its
    exit, for the tests of what a gateway refuses at its start (its output captured as text),
    with ``key`` in $SOS_KEY and no $SOS_KEY_FILE of this process's."""
    return run_sos(
        "gateway",
        namespace,
        "--listen",
        listen,
        "--server",
        server.address,
        "--cache",
        cache,
        *args,
        env={"SOS_KEY": key},
        drop=("SOS_KEY_FILE",),
        timeout=timeout,
    )


def scrape(where: str, *, timeout: float = 60) -> dict[str, float]:
    """A Prometheus text page as ``name{labels}`` -> value (comments left out); ``where`` is the
    endpoint's URL (``http://HOST:PORT``) or its ``HOST:PORT``, without the ``/metrics``."""
    url = where if "://" in where else f"http://{where}"
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metrics_url(log: str) -> str:
    """The URL (``http://HOST:PORT``) a gateway's log says it serves its metrics on."""
    import re

    found = re.search(r"metrics on (http://[^/\s]+)/metrics", log)
    assert found, log[-3000:]
    return found.group(1)


def server_metric(srv, name: str, default: float | None = None, *, ns: str | None = None, timeout: float = 60) -> float:
    """The value of the series ``name`` (``ns``: its ``{namespace="NS"}`` one, else the
    unlabelled one) on a server's Prometheus page (``default`` when it is absent; without one,
    absence fails the test)."""
    key = f'{name}{{namespace="{ns}"}}' if ns else name
    value = scrape(srv.metrics_address, timeout=timeout).get(key, default)
    if value is None:
        raise AssertionError(f"no metric {key}")
    return value


def wait_for(cond, timeout: float = 180, what: str = "the condition"):
    """``cond()``'s first true value, asked every 0.1 s; fails the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.1)


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


def accepted(listener: socket.socket, stop: Callable[[], bool] = lambda: False) -> Iterator[socket.socket]:
    """The connections a server thread's ``listener`` accepts, one by one, until it is closed
    (accept raises OSError) or, checked before each accept, ``stop()`` is true."""
    while not stop():
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        yield conn


def spark_builder(
    app: str, *, conf: dict[str, str] | None = None, shuffle_partitions: int | None = 2, jvm: str | None = None
):
    """The SparkSession builder of the tests' query drivers (scripts run in a process of their
    own, which import this from there): ``local[2]``, the app name ``app``, no UI and no
    console progress, ``shuffle_partitions`` (None: Spark's default), the settings ``conf``,
    the driver JVM's options ``jvm`` (default: tools.demo's DRIVER_JVM_OPTIONS)."""
    from pyspark.sql import SparkSession

    from tools.demo import DRIVER_JVM_OPTIONS

    settings = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", **(conf or {})}
    if shuffle_partitions is not None:
        settings["spark.sql.shuffle.partitions"] = str(shuffle_partitions)
    settings["spark.driver.extraJavaOptions"] = DRIVER_JVM_OPTIONS if jvm is None else jvm
    builder = SparkSession.builder.master("local[2]").appName(app)
    for name, value in settings.items():
        builder = builder.config(name, value)
    return builder


def dedup_query(spark, source: str, sink, checkpoint: str):
    """The query of the tests' drivers, started: JSON records (id, payload) read from the
    directory ``source`` a file per batch, duplicates of an id dropped (state), each batch to
    ``foreachBatch(sink)``, checkpoint at ``checkpoint``, until the input is used up."""
    return (
        spark.readStream.schema("id LONG, payload STRING")
        .option("maxFilesPerTrigger", 1)
        .json(source)
        .dropDuplicates(["id"])
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )


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


def start_gateway(
    server,
    tmp_path,
    *args: str,
    namespace: str,
    name: str = "gateway",
    key: str | None = None,
    prefix: tuple[str, ...] | list[str] = (),
    **kw,
):
    """A real ``sos gateway`` child for ``namespace`` on ``server``, started: its cache
    ``tmp_path/NAME-cache``, its log ``tmp_path/NAME.log``, ``args`` on its command line, run
    under ``prefix`` (a command such as prlimit) if given; ``kw`` goes to GatewayProcess
    (``listen``, ``debug``, ``durability``...). ``key``: a new append key if none; the process
    keeps it as ``.key``."""
    from spark_plugin.gateway.process import GatewayProcess

    class Prefixed(GatewayProcess):
        def command(self) -> list[str]:
            return [*prefix, *super().command()]

    key = key or server.keygen(namespace, "append")
    gw = Prefixed(
        namespace,
        str(tmp_path / f"{name}-cache"),
        server.address,
        key,
        extra_args=list(args),
        log_path=str(tmp_path / f"{name}.log"),
        **kw,
    )
    gw.key = key  # type: ignore[attr-defined]
    return gw.start()


def token_for(url: str, key: str, namespace: str, *, verify: bool | str = True, timeout: float = 60) -> str:
    """A bearer token from the gateway at ``url`` for ``key`` of ``namespace`` (its
    ``/oauth2/token``, client credentials); fails the test unless it is granted."""
    import requests

    r = requests.post(
        url + "/oauth2/token",
        data={"grant_type": "client_credentials", "client_id": namespace, "client_secret": key},
        verify=verify,
        timeout=timeout,
    )
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["token_type"] == "Bearer" and doc["expires_in"] > 0, doc
    return doc["access_token"]


def webhdfs_create(url: str, token: str, path: str, data: bytes, verify: bool | str = True):
    """CREATE (overwrite) ``path`` with ``data`` at the gateway ``url`` over plain requests, both
    steps (the 307 and the data); the last answer."""
    import requests

    h = {"Authorization": f"Bearer {token}"}
    r = requests.put(
        f"{url}/webhdfs/v1{path}?op=CREATE&overwrite=true", headers=h, allow_redirects=False, verify=verify, timeout=60
    )
    if r.status_code != 307:
        return r
    return requests.put(r.headers["Location"], data=data, headers=h, verify=verify, timeout=60)


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
