"""Durability "tier" (issue 19 item 3, client side): a barrier returns only once the server's
object-store tier (the bucket) holds its records, so a committed batch survives the loss of the
server and its disk.

Real parts: ``sos-server serve --tier`` processes against moto's S3 server on 127.0.0.1
(tests/tier/support.py), the blocking and trio clients' ``tier_wait``, a JournalWriter and
JournaledTree opened by ``open_namespace(durability="tier")`` (what every face calls), the
bucket read with ``sos_tier.scan``, ``sos restore --from URL`` after the server's data directory
is deleted, and a moto server of the test's own stopped and started again (the store down).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import threading

import pytest
import trio

from sos_client import Client, TierUnavailable
from sos_client.aio import open_client
from sos_client.errors import SOSError, SOSNotFound, is_retryable, to_oserror
from sos_journal import JournalTierBehind, JournalTierUnavailable, JournalWriter
from sos_journal.testing import tree_state
from sos_journal.tree.open import open_namespace
from sos_tier import open_store, scan
from sos_wire.errors import ErrorCode
from tests.tier.support import bucket_lengths

pytest_plugins = ["tests.tier.support"]
pytestmark = pytest.mark.slow

WAIT = 120.0  # generous upper bounds: never reached unless something is broken
#: an interval no test waits for: whatever reaches the bucket got there because a TIER_WAIT
#: started the upload round (the server nudges its uploader on a wait, protocol.md 1.11)
NEVER = "1h"


def server_lengths(srv, key: str, ns: str) -> dict[str, int]:
    with Client(srv.address, key, ns, timeout=60) as c:
        return {e.name: e.length for e in c.list("")}


def restore_from(url: str, ns: str, out) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SOS_SERVER", "SOS_KEY", "SOS_KEY_FILE")}
    return subprocess.run(
        [sys.executable, "-m", "sos_client.cli", "restore", "-q", ns, str(out), "--from", url],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=env,
    )


def commit(tree, n: int, body: bytes = b"{}") -> None:
    """What Spark does for batch n: a temporary file renamed onto commits/n (a barrier)."""
    tmp = f"chk/commits/.{n}.tmp"
    tree.create(tmp)
    tree.write(tmp, 0, body)
    tree.rename(tmp, f"chk/commits/{n}", overwrite=False)


# ------------------------------------------------------------------ the clients' tier_wait
def test_tier_wait_returns_once_the_bucket_holds_the_bytes(sos_server_factory, new_bucket):
    url = new_bucket()
    srv = sos_server_factory(args=["--tier", url, "--tier-interval", NEVER])
    key = srv.keygen("tw", "append")
    with Client(srv.address, key, "tw", timeout=10) as c:
        c.fence(1)
        c.append("log", 0, b"a" * 5000, epoch=1)
        assert c.tier_wait("log", 0, timeout=0) >= 0  # offset 0: at once
        # longer than the client's own timeout (10 s) would allow if it did not stretch it
        assert c.tier_wait("log", 5000, timeout=30) == 5000
        assert bucket_lengths(url, "tw", verify=True) == {"log": 5000}
        c.append("log", 5000, b"b" * 10, epoch=1)
        assert c.tier_wait("log", 5010, timeout=60) == 5010
        assert c.tier_wait("log", 10, timeout=0) == 5010  # already there: the run's length

    async def trio_side():
        async with open_client(srv.address, key, "tw", timeout=10) as ac:
            await ac.append("log", 5010, b"c" * 7, epoch=1)
            assert await ac.tier_wait("log", 5017, timeout=30) == 5017
            with pytest.raises(SOSNotFound):
                await ac.tier_wait("nope", 0)
            assert await ac.ping(b"still") == b"still"  # the connection survives the error

    trio.run(trio_side)
    assert bucket_lengths(url, "tw", verify=True) == {"log": 5017}


def test_tier_wait_without_a_tier_raises_tier_unavailable(sos_server):
    key = sos_server.keygen("nt", "append")
    with Client(sos_server.address, key, "nt", timeout=30) as c:
        c.fence(1)
        c.append("x", 0, b"abc", epoch=1)
        with pytest.raises(TierUnavailable) as info:
            c.tier_wait("x", 3, timeout=1)
        e = info.value
        assert e.code == ErrorCode.TIER_UNAVAILABLE and e.tiered == 0 and "no tier configured" in str(e)
        assert is_retryable(e) and to_oserror(e).errno == errno.ETIMEDOUT
        with pytest.raises(SOSError) as info2:
            c.tier_wait("x", 4, timeout=0)  # beyond the durable length
        assert info2.value.code == ErrorCode.BAD_REQUEST
        with pytest.raises(SOSNotFound):
            c.tier_wait("missing", 0)
        with pytest.raises(ValueError):
            c.tier_wait("x", 0, timeout=-1)
        assert c.ping(b"ok") == b"ok"


# ------------------------------------------------------------------ the writer's barrier
def test_durability_tier_refuses_a_server_without_a_tier(sos_server, tmp_path):
    """A configuration error, refused when the opener starts: on a new namespace (nothing on the
    server to ask about when the writer opens: the opener asks once the first snapshot is there)
    and on one that holds a journal (the writer asks at open)."""
    key = sos_server.keygen("nt", "append")
    with pytest.raises(ValueError, match="durability"):
        JournalWriter(lambda: None, "nt", str(tmp_path / "s"), durability="bucket")
    for sync in (True, False):
        with pytest.raises(JournalTierUnavailable, match="--tier") as info:
            open_namespace(
                "nt", str(tmp_path / f"new-{sync}"), server=sos_server.address, key=key, durability="tier", sync=sync
            )
        assert isinstance(info.value.__cause__, TierUnavailable)
    # the namespace now holds a journal: the same refusal, from the writer's open
    w = JournalWriter(
        lambda: Client(sos_server.address, key, "nt", timeout=30), "nt", str(tmp_path / "spool"), durability="tier"
    )
    with pytest.raises(JournalTierUnavailable, match="no object-store tier"):
        w.open()
    assert not w.is_open
    # durability "server" (the default) is unchanged on the same server
    opened = open_namespace("nt", str(tmp_path / "ok"), server=sos_server.address, key=key)
    opened.tree.mkdir("chk")
    opened.tree.mkdir("chk/commits")
    commit(opened.tree, 1)
    opened.close()


def test_a_barrier_means_the_bucket_holds_the_record_restore_after_the_server_is_lost(
    sos_server_factory, new_bucket, tmp_path
):
    """After the rename onto commits/N returns, the bucket holds the journal up to it: the
    server's data directory deleted right after, `sos restore --from URL` gives the tree with
    the rename. The server's interval is an hour: the barrier's own waits brought it there."""
    url = new_bucket()
    srv = sos_server_factory(args=["--tier", url, "--tier-interval", NEVER])
    key = srv.keygen("dur", "append")
    opened = open_namespace("dur", str(tmp_path / "cache"), server=srv.address, key=key, durability="tier")
    tree, writer = opened.tree, opened.writer
    assert writer.durability == "tier" and writer.status()["durability"] == "tier"
    tree.mkdir("chk")
    tree.mkdir("chk/commits")
    tree.mkdir("chk/offsets")
    for n in range(3):
        tree.create(f"chk/offsets/{n}")
        tree.write(f"chk/offsets/{n}", 0, f"offsets of batch {n}".encode())
        commit(tree, n, f"batch {n}".encode())
        # the barrier returned: the bucket holds every segment as far as the server acknowledged it
        have = bucket_lengths(url, "dur", verify=True)
        on_server = server_lengths(srv, key, "dur")
        for name, length in on_server.items():
            if name.endswith(".seg"):
                assert have.get(name, 0) == length, (name, have, on_server)
    waits = writer.tier_waits
    assert waits >= 3
    expected = tree_state(opened.tree_dir)
    assert "chk/commits/2" in expected
    srv.kill()  # the server and its disk are lost right after the barrier
    shutil.rmtree(srv.data_dir)
    opened.writer.abandon()
    r = restore_from(url, "dur", tmp_path / "restored")
    assert r.returncode == 0, r.stderr
    got = tree_state(str(tmp_path / "restored"))
    assert got == expected
    assert got["chk/commits/2"] == b"batch 2"


def test_with_the_store_down_a_barrier_waits_until_it_is_back_or_fails_after_its_patience(
    sos_server_factory, own_moto, tmp_path
):
    import boto3

    boto3.client("s3").create_bucket(Bucket="down")
    url = "s3://down/t"
    srv = sos_server_factory(args=["--tier", url])  # the default interval (1 s)
    key = srv.keygen("dn", "append")
    opened = open_namespace("dn", str(tmp_path / "cache"), server=srv.address, key=key, durability="tier")
    tree, writer = opened.tree, opened.writer
    try:
        tree.mkdir("chk")
        tree.mkdir("chk/commits")
        commit(tree, 0)
        own_moto.stop()
        # the caller's patience: the barrier fails with the typed error, the change stays applied
        tree.create("chk/late")
        tree.write("chk/late", 0, b"written while the store is down")
        with pytest.raises(JournalTierBehind) as info:
            writer.barrier(timeout=3)
        e = info.value
        assert e.segment.endswith(".seg") and e.tiered < e.wanted
        assert "durable on the SOS server" in str(e) and "Nothing is lost" in str(e)
        assert to_oserror(e).errno == errno.ETIMEDOUT
        assert writer.status()["state"] == "ok"  # the server has every record: nothing failed there
        # no patience given (the tree's rename): it does not return while the store is down
        done = threading.Event()
        errors: list[BaseException] = []

        def rename_commit():
            try:
                commit(tree, 1)
            except BaseException as exc:
                errors.append(exc)
            finally:
                done.set()

        t = threading.Thread(target=rename_commit, daemon=True)
        t.start()
        assert not done.wait(5), errors  # the store is down: the rename's barrier is waiting
        assert writer.unshipped_bytes == 0  # ... for the bucket: the server has the record
        own_moto.start()
        assert done.wait(WAIT), "the barrier did not return once the store was back"
        assert errors == []
        assert tree.local_path("chk/commits/1")
        have = bucket_lengths(url, "dn", verify=True)
        for name, length in server_lengths(srv, key, "dn").items():
            if name.endswith(".seg"):
                assert have.get(name, 0) == length, name
    finally:
        opened.close(timeout=WAIT)


def test_tier_wait_on_a_sealed_object_waits_for_its_seal_marker(sos_server_factory, new_bucket):
    """A generation's ``ready`` is an empty sealed object: its bytes (none) are "in the bucket"
    at once, its seal marker is not. TIER_WAIT on a sealed object answers only once the marker
    is there too (protocol.md 1.11 rule 6), so a tier barrier covers a new generation's
    completeness for a reader of the bucket alone."""
    url = new_bucket()
    srv = sos_server_factory(args=["--tier", url, "--tier-interval", NEVER])
    key = srv.keygen("ts", "append")
    with Client(srv.address, key, "ts", timeout=10) as c:
        c.fence(1)
        c.append("gen/ready", 0, b"", epoch=1)
        c.seal("gen/ready", epoch=1)
        assert c.tier_wait("gen/ready", 0, timeout=60) == 0
    store = open_store(url)
    try:
        state = scan(store, "ts").get("ts")
    finally:
        store.close()
    assert state is not None and state.objects["gen/ready"].sealed, state
