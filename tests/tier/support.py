"""The object-store tier's test helpers. Fixtures: moto's S3 server on 127.0.0.1 and a local
directory, behind one ``store`` fixture so that every test runs against both backends
(Litestream's one-conformance-suite-per-backend).

A test module, of any component, takes the fixtures (``moto``, ``store``, ``new_bucket``,
``clobber``) with ``pytest_plugins = ["tests.tier.support"]``; the helpers below them (a moto
server of a test's own to stop and start, what a bucket holds, a journal's objects copied into
one, TIER_WAIT) it imports. The fixtures shared by the tier's own modules only (``own_moto``,
``journal``) are in tests/tier/conftest.py.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from sos_tier import Uploader, open_store, scan
from sos_tier.store import LocalStore, Store
from sos_wire import events as ev
from tests.conftest import RawClient
from tests.support import run_sos

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")

_bucket_ids = itertools.count(1)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# moto's server in a child process of its own: its request handling runs outside the pytest
# process, so pytest-cov's tracer (CI measures the pytest processes) does not slow every S3 call,
# and it runs beside the test rather than taking the test's GIL. The child exits when its stdin
# closes (the fixture's end, or the pytest process's death).
#
# Its conditional writes are atomic, as S3's are (tools/moto_s3.py says why).
_MOTO_CHILD = """
import sys
from tools.moto_s3 import moto_server
server = moto_server()
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()
server.stop()
"""


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 (a port the kernel picks, in a child process), with the
    environment a tier reads: AWS_ENDPOINT_URL, dummy credentials, a region, and no shared config
    files (so the developer's own ~/.aws plays no part). Yields the endpoint URL."""
    empty = tmp_path_factory.mktemp("aws")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE"):
            mp.delenv(var, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", str(empty / "config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty / "credentials"))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        child = subprocess.Popen(
            [sys.executable, "-c", _MOTO_CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,  # where tools/ is, whatever a test's own directory
        )
        try:
            assert child.stdout is not None
            endpoint = child.stdout.readline().strip()
            assert endpoint.startswith("http://127.0.0.1:"), f"moto did not start: {endpoint!r}"
            mp.setenv("AWS_ENDPOINT_URL", endpoint)
            yield endpoint
        finally:
            assert child.stdin is not None
            child.stdin.close()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            assert child.stdout is not None
            child.stdout.close()


@pytest.fixture
def new_bucket(moto):
    """A function that makes a fresh bucket on the moto server and returns its s3:// URL."""
    return make_bucket


_clients: dict[str, object] = {}


def make_bucket(prefix: str = "tier/test") -> str:
    """A fresh bucket on the moto server; returns its s3:// URL with *prefix*. One boto3 client
    per endpoint makes them all (a client costs ~0.5 s of CPU to set up under coverage)."""
    name = f"sos-tier-{os.getpid()}-{next(_bucket_ids)}"
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    client = _clients.get(endpoint)
    if client is None:
        client = _clients[endpoint] = boto3.session.Session().client("s3")
    client.create_bucket(Bucket=name)  # type: ignore[attr-defined]
    return f"s3://{name}/{prefix}" if prefix else f"s3://{name}"


@pytest.fixture(params=["s3", "local"])
def store(request, tmp_path):
    """A fresh, empty store of each backend."""
    if request.param == "s3":
        request.getfixturevalue("moto")
        from sos_tier.s3 import S3Store

        s: Store = S3Store(make_bucket())
    else:
        s = LocalStore((tmp_path / "tier").as_uri())
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def clobber():
    """A function that replaces a key's content behind the store's back."""
    return clobber_key


def clobber_key(store: Store, key: str, data: bytes) -> None:
    """Replace a key's content behind the store's back (damage, or a zombie's unconditional write)."""
    if isinstance(store, LocalStore):
        path = os.path.join(store.root, *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        return
    from sos_tier.s3 import S3Store

    assert isinstance(store, S3Store)
    store._s3.put_object(Bucket=store.bucket, Key=store._full(key), Body=data)


class OwnMoto:
    """A moto server of the test's own on a fixed port, to stop (the store unreachable) and start
    again on the same port; moto's state is the process's, so the bucket survives."""

    def __init__(self) -> None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.server = None
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        from tools.moto_s3 import moto_server

        self.server = moto_server(self.port)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def login(srv, ns: str, role: str = "append") -> RawClient:
    """A RawClient logged in to ``srv`` with a new key of ``role`` for ``ns``."""
    c = RawClient(srv.address)
    assert isinstance(c.login(srv.keygen(ns, role), ns), ev.AuthOk)
    return c


def tier_wait(c: RawClient, name: str, offset: int, timeout_ms: int = 0):
    """The server's answer to TIER_WAIT ``name`` up to ``offset`` (waiting up to ``timeout_ms``)."""
    return c.call(ev.TierWait(c.rid(), name, offset, timeout_ms))


def bucket(url: str, ns: str, verify: bool = True):
    """What the bucket at ``url`` holds of ``ns`` (``sos_tier.scan``'s state, None if nothing)."""
    store = open_store(url)
    try:
        return scan(store, ns, verify=verify).get(ns)
    finally:
        store.close()


def bucket_lengths(url: str, ns: str, *, verify: bool = False) -> dict[str, int]:
    """name -> length of each of ``ns``'s objects in the bucket ({} for none); ``verify``: the
    pieces' checksums read too, and any problem the scan finds fails the test."""
    state = bucket(url, ns, verify=verify)
    if state is None:
        return {}
    if verify:
        assert state.all_problems() == []
    return {n: o.length for n, o in state.objects.items()}


#: no server: the bucket alone
NO_SERVER = ("SOS_SERVER", "SOS_KEY", "SOS_KEY_FILE")
#: `sos` without this process's server and key
bucket_sos = functools.partial(run_sos, drop=NO_SERVER)


PIECE = 512  # small pieces: every segment is several keys, so one can be damaged or missing


@dataclass
class Journal:
    """A journal as the ``journal`` fixture (tests/tier/conftest.py) left it in a bucket."""

    ns: str
    objects: dict[str, tuple[bytes, bool]]  # name -> (bytes, sealed), as the server held them
    states: dict[int, dict]  # seq -> the tree right after that record
    records: list  # every record of every segment, in name order
    points: dict[str, dict] = field(default_factory=dict)  # restore from the server, per point
    at_ns: int = 0
    position: int = 0
    url: str = ""  # the bucket everything was copied to


def copy_to(store: Store, ns: str, objects: dict[str, tuple[bytes, bool]], piece: int = PIECE) -> None:
    """What a tiering server would have uploaded: every object in pieces of *piece* bytes, then its seal."""
    up = Uploader(store, max_piece=piece)
    for name, (data, sealed) in objects.items():
        up.sync(ns, name, lambda b, e, d=data: d[b:e], len(data), sealed)
        assert up.uploaded(ns, name) == len(data)
