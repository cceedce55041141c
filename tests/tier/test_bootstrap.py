"""A replacement server rebuilt from the tier (issue 19.4, protocol.md 4.8): a real sos-server
holds objects, the uploader copies them into a bucket (moto's S3 server, and a directory),
the data directory is deleted, :func:`sos_server.tier_bootstrap.bootstrap` rebuilds a new one
from the bucket alone, and a real sos-server on it, with the old key files copied in, serves
the same bytes, seals and fence; writers carry on; a gap or a damaged piece in the bucket
gives an object cut there and a report naming it; a crash midway never mixes two runs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from sos_client.blocking import Client
from sos_client.errors import Fenced, SealedError
from sos_server.storage import Storage
from sos_server.tier_bootstrap import (
    DONE,
    PARTIAL,
    BootstrapRefused,
    bootstrap,
    holds_namespaces,
    needs_bootstrap,
)
from sos_tier.layout import scan, seal_time
from sos_tier.store import LocalStore, Store
from sos_tier.uploader import Uploader
from tests.support import PEAK_RSS_KIB
from tools.server import ServerProcess

pytest_plugins = ["tests.tier.support"]

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIECE = 256 * 1024  # the uploader's max_piece here: several pieces per object
EPOCH = 3
SEG = "gen/0000000001/0000000001-0000000003.seg"
READY = "gen/0000000001/ready"


def _bytes(n: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


#: namespace -> name -> (bytes, sealed); "jobs" is fenced at EPOCH, "other" never fenced
CONTENT = {
    "jobs": {
        "big": (_bytes(3 * 1024 * 1024 + 12345, 1), False),
        "log": (_bytes(600 * 1024 + 7, 2), True),
        SEG: (_bytes(100_000, 3), True),
        READY: (b"", True),
        "empty": (b"", False),
    },
    "other": {"a": (_bytes(1000, 4), False)},
}


class Origin:
    """What the lost server held, and where its copies are."""

    def __init__(self, keys: str, pristine: str, s3_url: str, mtimes: dict[tuple[str, str], int]) -> None:
        self.keys = keys  # a backup of DATA/ns/<ns>/keys, one directory per namespace
        self.pristine = pristine  # a LocalStore root the tests copy before damaging it
        self.s3_url = s3_url
        self.mtimes = mtimes  # (ns, name) -> the object file's mtime (ns) on the lost server: its seal time
        self.key: dict[str, str] = {}


def _upload(store: Store, client_of, origin_seal_ns: dict[tuple[str, str], int]) -> None:
    """Copy every object of the running server into *store* with the uploader, as the server's
    own ``--tier`` would: fence marker, then pieces of at most PIECE bytes, then seal markers."""
    up = Uploader(store, max_piece=PIECE)
    for ns, objects in CONTENT.items():
        c = client_of(ns)
        if ns == "jobs":
            up.check_fence(ns, EPOCH)
        for name in objects:
            length, sealed = c.stat(name)

            def read(b: int, e: int, c=c, name=name) -> bytes:
                return c.read(name, b, e - b)

            up.sync(ns, name, read, length, sealed, origin_seal_ns.get((ns, name)))
            assert up.uploaded(ns, name) == length
        assert up.pending(ns) == []


@pytest.fixture(scope="module")
def origin(tmp_path_factory, moto) -> Origin:
    base = tmp_path_factory.mktemp("origin")
    data = base / "data"
    srv = ServerProcess(data, log_path=base / "server.log").start()
    try:
        keys = {ns: srv.keygen(ns) for ns in CONTENT}
        clients = {ns: Client(srv.address, keys[ns], ns, timeout=60) for ns in CONTENT}
        try:
            jobs = clients["jobs"]
            jobs.fence(EPOCH)
            for ns, objects in CONTENT.items():
                c = clients[ns]
                epoch = EPOCH if ns == "jobs" else 0
                for name, (blob, sealed) in objects.items():
                    if not blob:
                        c.append(name, 0, b"", epoch=epoch)
                    else:
                        step = 700 * 1024
                        c.append_many(name, 0, (blob[i : i + step] for i in range(0, len(blob), step)), epoch=epoch)
                    if sealed:
                        c.seal(name, epoch=epoch)
            st = Storage(str(data))
            mtimes = {
                (ns, n): os.stat(st.object_path(ns, n)).st_mtime_ns
                for ns, objs in CONTENT.items()
                for n, (_b, s) in objs.items()
                if s
            }
            from sos_tier.s3 import S3Store
            from tests.tier.support import make_bucket

            s3_url = make_bucket("sos/replaced")
            pristine = LocalStore((base / "tier").as_uri())
            s3 = S3Store(s3_url)
            try:
                for store in (s3, pristine):
                    _upload(store, clients.__getitem__, mtimes)
            finally:
                s3.close()
        finally:
            for c in clients.values():
                c.close()
    finally:
        srv.stop()
    backup = base / "keys-backup"
    for ns in CONTENT:
        shutil.copytree(data / "ns" / ns / "keys", backup / ns)
    shutil.rmtree(data)  # the server's disk is lost
    o = Origin(str(backup), pristine.root, s3_url, mtimes)
    o.key = keys
    return o


def _copy_keys(origin: Origin, data_dir) -> None:
    """The operator's step (docs/DEPLOY.md "Replacing a lost server"): the key files back."""
    for ns in CONTENT:
        shutil.copytree(os.path.join(origin.keys, ns), os.path.join(data_dir, "ns", ns, "keys"), dirs_exist_ok=True)


def _local_copy(origin: Origin, tmp_path) -> LocalStore:
    root = tmp_path / "tier"
    shutil.copytree(origin.pristine, root)
    return LocalStore(root.as_uri())


def _piece_keys(store: Store, ns: str, name: str) -> list[str]:
    return [p.key for p in scan(store, ns)[ns].objects[name].pieces]


def _serve(data_dir, tmp_path) -> ServerProcess:
    return ServerProcess(data_dir, log_path=tmp_path / "server-b.log").start()


def test_replacement_server_serves_what_the_bucket_holds_and_writers_carry_on(origin, tmp_path):
    from sos_tier.s3 import S3Store

    data = tmp_path / "data"
    _copy_keys(origin, data)  # before the bootstrap: key-only namespace directories are fine
    assert needs_bootstrap(str(data)) and holds_namespaces(str(data)) == []
    store = S3Store(origin.s3_url)
    lines: list[str] = []
    report = bootstrap(str(data), store, progress=lines.append)
    assert report.problems == [] and report.cut == []
    assert not os.path.exists(data / PARTIAL) and not os.path.exists(data / DONE)
    total = sum(len(b) for objs in CONTENT.values() for b, _s in objs.values())
    assert report.total_bytes == total
    assert any(f"total {total}/{total} bytes, 6/6 objects" in line for line in lines), lines[-3:]
    assert report.namespaces["jobs"].fence == EPOCH and report.namespaces["other"].fence == 0
    # the fence file, as storage.py writes it
    assert (data / "ns" / "jobs" / "fence").read_text() == f"{EPOCH}\n"
    assert not (data / "ns" / "other" / "fence").exists()
    # the seal time is the file's mtime, as on the lost server (retention's completed_at)
    st = Storage(str(data))
    for (ns, name), mtime in origin.mtimes.items():
        assert os.stat(st.object_path(ns, name)).st_mtime_ns == mtime
    # the uploader of the new server learns from the listing that nothing is pending
    up = Uploader(store, max_piece=PIECE)
    for ns, objects in CONTENT.items():
        up.learn(ns)
        for name, (blob, sealed) in objects.items():
            up.note(ns, name, len(blob), sealed)
        assert up.pending(ns) == [] and up.lag(ns).bytes == 0 and up.lag(ns).pending_seals == 0

    srv = _serve(data, tmp_path)
    try:
        assert '"repairs": 0, "damaged": 0' in srv.log_text()  # every rebuilt file loads whole
        with (
            Client(srv.address, origin.key["jobs"], "jobs", timeout=60) as c,
            Client(srv.address, origin.key["other"], "other", timeout=60) as o,
        ):
            for ns, cl in (("jobs", c), ("other", o)):
                assert sorted(e.name for e in cl.list()) == sorted(CONTENT[ns])
                for name, (blob, sealed) in CONTENT[ns].items():
                    assert cl.stat(name) == (len(blob), sealed), name
                    assert cl.read(name) == blob, name
            # a writer with the namespace's epoch appends at the end; a stale epoch is fenced
            big = CONTENT["jobs"]["big"][0]
            assert c.append("big", len(big), b"after the replacement", epoch=EPOCH) == len(big) + 21
            with pytest.raises(Fenced):
                c.append("big", len(big) + 21, b"zombie", epoch=EPOCH - 1)
            with pytest.raises(SealedError):
                c.append("log", len(CONTENT["jobs"]["log"][0]), b"x", epoch=EPOCH)
            assert c.fence(EPOCH + 1) == EPOCH + 1  # the next writer takes over as usual
            assert c.append("big", len(big) + 21, b"!", epoch=EPOCH + 1) == len(big) + 22
            assert o.append("a", 1000, b"more") == 1004
            assert c.read("big", len(big)) == b"after the replacement!"
    finally:
        srv.stop()
    store.close()


def test_a_gap_in_the_bucket_cuts_the_object_there_and_is_reported(origin, tmp_path):
    store = _local_copy(origin, tmp_path)
    big_pieces = _piece_keys(store, "jobs", "big")
    log_pieces = _piece_keys(store, "jobs", "log")
    store.delete([big_pieces[1], log_pieces[2]])  # a middle piece of each
    data = tmp_path / "data"
    report = bootstrap(str(data), store)
    cut = {(o.namespace, o.name): o for o in report.cut}
    assert set(cut) == {("jobs", "big"), ("jobs", "log")}
    assert cut[("jobs", "big")].length == PIECE and not cut[("jobs", "big")].sealed
    assert cut[("jobs", "log")].length == 2 * PIECE and not cut[("jobs", "log")].sealed
    assert cut[("jobs", "log")].seal_length == len(CONTENT["jobs"]["log"][0])
    gaps = [p for p in report.problems if p.kind == "gap"]
    assert {(p.name, p.offset) for p in gaps} >= {("big", PIECE), ("log", 2 * PIECE)}
    assert any(p.key == big_pieces[2] for p in gaps)  # names where the bucket continues
    _copy_keys(origin, data)
    srv = _serve(data, tmp_path)
    try:
        with Client(srv.address, origin.key["jobs"], "jobs", timeout=60) as c:
            assert c.stat("big") == (PIECE, False)
            assert c.read("big") == CONTENT["jobs"]["big"][0][:PIECE]
            assert c.stat("log") == (2 * PIECE, False)  # not sealed: the bytes before the seal are missing
            assert c.read("log") == CONTENT["jobs"]["log"][0][: 2 * PIECE]
            assert c.stat(SEG) == (len(CONTENT["jobs"][SEG][0]), True)  # the others are whole
            # the writer that still has the bytes (its spool) sends them again at the cut
            blob = CONTENT["jobs"]["big"][0]
            assert c.append("big", PIECE, blob[PIECE : 2 * PIECE], epoch=EPOCH) == 2 * PIECE
    finally:
        srv.stop()


def test_a_damaged_piece_is_named_and_nothing_past_it_is_served(origin, tmp_path, clobber):
    store = _local_copy(origin, tmp_path)
    key = _piece_keys(store, "jobs", "log")[1]
    good = store.get(key)
    clobber(store, key, good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])  # same size: the listing cannot tell
    data = tmp_path / "data"
    report = bootstrap(str(data), store)
    damage = [p for p in report.problems if p.kind == "damage"]
    assert [(p.name, p.key, p.offset) for p in damage] == [("log", key, PIECE)]
    assert key in damage[0].message and "CRC32C" in damage[0].message
    [cut] = report.cut
    assert (cut.name, cut.length, cut.sealed, cut.bucket_length) == (
        "log",
        PIECE,
        False,
        len(CONTENT["jobs"]["log"][0]),
    )
    _copy_keys(origin, data)
    srv = _serve(data, tmp_path)
    try:
        with Client(srv.address, origin.key["jobs"], "jobs", timeout=60) as c:
            assert c.stat("log") == (PIECE, False)
            assert c.read("log") == CONTENT["jobs"]["log"][0][:PIECE]
            assert c.read("big") == CONTENT["jobs"]["big"][0]
    finally:
        srv.stop()


def test_a_data_directory_with_namespaces_is_refused_and_left_alone(origin, tmp_path):
    store = _local_copy(origin, tmp_path)
    data = tmp_path / "data"
    bootstrap(str(data), store)
    before = _tree(data)
    assert not needs_bootstrap(str(data)) and holds_namespaces(str(data)) == ["jobs", "other"]
    with pytest.raises(BootstrapRefused, match="already holds namespace"):
        bootstrap(str(data), store)
    assert _tree(data) == before
    # a namespace with only a fence file is a namespace too
    fenced = tmp_path / "fenced"
    (fenced / "ns" / "x").mkdir(parents=True)
    (fenced / "ns" / "x" / "fence").write_text("5\n")
    with pytest.raises(BootstrapRefused, match="x"):
        bootstrap(str(fenced), store)
    assert not (fenced / PARTIAL).exists()
    # a data directory in use (its lock held) is refused too
    busy = tmp_path / "busy"
    holder = Storage(str(busy))
    holder.lock()
    try:
        with pytest.raises(BootstrapRefused, match="in use"):
            bootstrap(str(busy), store)
    finally:
        holder.close()


def test_keys_the_layout_cannot_have_made_are_reported_and_ignored(origin, tmp_path):
    store = _local_copy(origin, tmp_path)
    store.put_once("v1/ns/Not_A_Namespace/o/x/seal-0000000000000000", b"{}")
    store.put_once("v1/ns/jobs/junk/x", b"?")
    data = tmp_path / "data"
    report = bootstrap(str(data), store)
    assert sorted(p.key for p in report.problems if p.kind == "foreign") == [
        "v1/ns/Not_A_Namespace/o/x/seal-0000000000000000",
        "v1/ns/jobs/junk/x",
    ]
    assert report.cut == [] and sorted(os.listdir(data / "ns")) == ["jobs", "other"]
    assert len(report.objects) == 6


def _tree(root) -> dict[str, bytes]:
    out = {}
    for d, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            if f != "LOCK":
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = fh.read()
    return out


_CRASHER = """
import os, signal, sys
from sos_server.tier_bootstrap import bootstrap
from sos_tier.store import LocalStore
data, url, needle, nth = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
seen = 0
def progress(line):
    global seen
    if needle in line:
        seen += 1
        if seen == nth:
            os.kill(os.getpid(), signal.SIGKILL)
bootstrap(data, LocalStore(url), progress=progress)
"""


@pytest.mark.parametrize(
    "needle, nth, left",
    [
        ("jobs/big: ", 5, PARTIAL),  # SIGKILL while rebuilding: the rerun starts clean
        ("moving namespace other", 1, DONE),  # SIGKILL after the commit, between namespaces: it finishes
    ],
)
def test_a_crash_midway_is_rerun_without_mixing(origin, tmp_path, needle, nth, left):
    store = _local_copy(origin, tmp_path)
    reference = tmp_path / "reference"
    bootstrap(str(reference), store)
    data = tmp_path / "data"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHER, str(data), store.url, needle, str(nth)],
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert os.path.isdir(data / left)
    assert needs_bootstrap(str(data))
    if left == PARTIAL:
        assert holds_namespaces(str(data)) == []  # nothing half-built is visible
    else:
        assert holds_namespaces(str(data)) == ["jobs"]  # moved in whole; "other" still to move
    report = bootstrap(str(data), store)
    assert report.restarted == (left == PARTIAL) and report.finished_moves == (left == DONE)
    assert not (data / PARTIAL).exists() and not (data / DONE).exists()
    assert _tree(data) == _tree(reference)
    assert len(report.objects) == 6 and report.problems == []
    st = Storage(str(data))
    st.lock()
    try:
        st.open()
        assert not st.repairs and not st.corruptions
        for ns, objects in CONTENT.items():
            for name, (blob, sealed) in objects.items():
                obj = st.namespaces[ns].objects[name]
                assert (obj.length, obj.sealed) == (len(blob), sealed)
                assert obj.read_bytes(0, 0) == blob
        assert st.namespaces["jobs"].fence == EPOCH
    finally:
        st.close()


def test_seal_time_is_what_the_marker_says(origin):
    store = LocalStore("file://" + origin.pristine)
    jobs = scan(store, "jobs")["jobs"]
    assert seal_time(store, jobs.objects[READY]) == origin.mtimes[("jobs", READY)]


_MEASURE = (
    PEAK_RSS_KIB
    + """
import sys
from sos_tier.store import LocalStore
from sos_server.tier_bootstrap import bootstrap
base = peak_rss_kib()
r = bootstrap(sys.argv[1], LocalStore(sys.argv[2]), workers=2)
print(r.total_bytes, base, peak_rss_kib())
"""
)


def test_a_large_object_is_rebuilt_in_bounded_memory(tmp_path):
    """320 MiB in pieces of 8 MiB (the uploader's default): the bootstrap's peak memory grows by
    far less than the object (measured here: about 80 MiB with 2 workers, the same for 768 MiB)."""
    import random

    store = LocalStore((tmp_path / "tier").as_uri())
    size = 320 << 20
    up = Uploader(store)
    up.sync("big", "huge", lambda b, e: random.Random(b).randbytes(e - b), size, True, 1)
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "data"), store.url],
        env=env,
        capture_output=True,
        timeout=300,
        check=True,
    )
    total, base_kib, peak_kib = map(int, proc.stdout.split())
    assert total == size
    assert (peak_kib - base_kib) << 10 < size // 2, (base_kib, peak_kib)
    st = Storage(str(tmp_path / "data"))
    st.lock()
    try:
        st.open()
        obj = st.namespaces["big"].objects["huge"]
        assert (obj.length, obj.sealed) == (size, True)
        piece = 8 << 20
        assert obj.read_bytes(5 * piece, piece) == random.Random(5 * piece).randbytes(piece)
    finally:
        st.close()
