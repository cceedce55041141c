"""The server drives the object-store tier (issue 19 items 1, 2, 3 server side, 5): real
``sos-server serve --tier`` processes against moto's S3 server on 127.0.0.1.

- appends acknowledged reach the bucket within the interval; FENCE's marker is there before
  FENCE_OK; seals and empty objects too; the metrics say so;
- TIER_WAIT: at once when uploaded, waits and answers when the upload lands, does not hold up the
  connection's other requests, TIER_UNAVAILABLE without a tier and after its timeout, errors;
- the store unreachable for ~20 s: appends still acknowledged, the lag metric grows, the log
  says so (and again when it recovers), the backlog drains after;
- SIGKILL of the server mid-upload, restart: nothing lost, duplicated or overwritten (the
  bucket is versioned: every key has exactly one version);
- a zombie: two servers uploading one namespace; the bucket keeps one history, the loser is
  told (metric, log, TIER_WAIT answers TIER_UNAVAILABLE);
- retention removes the pieces of a removed generation; a server started with --tier on a
  data directory that was served without one uploads what is missing.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from sos_server.tiering import FENCE_FRESH
from sos_tier import open_store
from sos_wire import events as ev
from sos_wire.errors import ErrorCode
from tests.conftest import RawClient
from tests.support import scrape, server_metric, wait_for
from tests.tier.support import bucket, bucket_lengths, login, tier_wait

pytest_plugins = ["tests.tier.support"]

pytestmark = pytest.mark.slow

WAIT = 60.0  # generous upper bounds: never reached unless something is broken


def versions(url: str) -> dict[str, int]:
    """key -> number of versions of it in the (versioned) bucket."""
    import boto3

    b = url.split("/")[2]
    out: dict[str, int] = {}
    for page in boto3.client("s3").get_paginator("list_object_versions").paginate(Bucket=b):
        for v in page.get("Versions", []):
            out[v["Key"]] = out.get(v["Key"], 0) + 1
    return out


def versioned_bucket(new_bucket) -> str:
    import boto3

    url = new_bucket()
    boto3.client("s3").put_bucket_versioning(Bucket=url.split("/")[2], VersioningConfiguration={"Status": "Enabled"})
    return url


# ----------------------------------------------------------------------------------------------


def test_appends_reach_the_bucket_within_the_interval(sos_server_factory, new_bucket):
    url = new_bucket()
    srv = sos_server_factory(args=["--tier", url, "--tier-interval", "1s"])
    with login(srv, "job") as c:
        r = c.call(ev.Fence(c.rid(), 1))
        assert isinstance(r, ev.FenceOk) and r.epoch == 1
        # the fence marker is in the bucket before FENCE_OK
        assert bucket(url, "job", verify=False).fence == 1
        data = {"a": b"x" * 100_000, "gen/0000000001/seg": b"hello world", "empty": b""}
        for name, body in data.items():
            r = c.append(name, 0, body, epoch=1)
            assert isinstance(r, ev.AppendOk) and r.length == len(body)
        assert isinstance(c.call(ev.Seal(c.rid(), "gen/0000000001/seg", 1)), ev.SealOk)
        t0 = time.monotonic()
        want = {n: len(b) for n, b in data.items()}
        wait_for(lambda: bucket_lengths(url, "job") == want, what="every acknowledged byte in the bucket")
        took = time.monotonic() - t0
        state = bucket(url, "job")
        assert state.all_problems() == []
        assert state.objects["gen/0000000001/seg"].sealed
        assert state.objects["empty"].exists and state.objects["empty"].length == 0
        # TIER_WAIT answers at once once uploaded
        for name, body in data.items():
            r = tier_wait(c, name, len(body), 0)
            assert isinstance(r, ev.TierWaitOk) and r.tiered == len(body), r
    assert took < 30  # the interval is 1 s; a loaded 2-core machine is slow, never this slow
    # the tier's metrics are refreshed every second: a refresh made between the fence and the
    # appends also says "lag 0", with nothing uploaded yet; wait for one made after the upload
    uploaded = 'sos_tier_uploaded_bytes_total{namespace="job"}'
    m = wait_for(
        lambda: (
            lambda m: m if m.get('sos_tier_lag_bytes{namespace="job"}') == 0.0 and m.get(uploaded, 0) > 0 else None
        )(scrape(srv.metrics_address)),
        what="the lag metric at 0 after the upload",
    )
    assert m["sos_tier_pieces_written_total"] >= 3
    assert m[uploaded] == 100_011
    assert m['sos_tier_lag_seconds{namespace="job"}'] == 0
    assert m["sos_tier_upload_errors_total"] == 0


def test_tier_wait_without_a_tier_and_its_errors(sos_server):
    with login(sos_server, "nt") as c:
        assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
        assert isinstance(c.append("x", 0, b"abc", epoch=1), ev.AppendOk)
        r = tier_wait(c, "x", 3, 1000)
        assert isinstance(r, ev.Error) and r.code == ErrorCode.TIER_UNAVAILABLE and r.length == 0
        assert "no tier configured" in r.message
        r = tier_wait(c, "nope", 0)
        assert isinstance(r, ev.Error) and r.code == ErrorCode.NOT_FOUND
        r = tier_wait(c, "x", 4)
        assert isinstance(r, ev.Error) and r.code == ErrorCode.BAD_REQUEST
        r = tier_wait(c, "bad//name", 0)
        assert isinstance(r, ev.Error) and r.code == ErrorCode.BAD_NAME
        assert isinstance(c.call(ev.Ping(c.rid(), b"alive")), ev.Pong)  # the connection survives all
    with login(sos_server, "nt", role="read") as c:  # READ keys may wait too
        r = tier_wait(c, "x", 3)
        assert isinstance(r, ev.Error) and r.code == ErrorCode.TIER_UNAVAILABLE


def test_store_unreachable_appends_go_on_lag_grows_and_drains(sos_server_factory, own_moto):
    """The store away ~8 s under appends. The server's clocks shortened by its flags (defaults:
    lag warning 30 s, FENCE's wait 10 s, back-off up to 30 s) so that each passes in the outage."""
    import boto3

    boto3.client("s3").create_bucket(Bucket="outage")
    url = "s3://outage/t"
    srv = sos_server_factory(
        args=[
            *("--tier", url, "--tier-interval", "1s", "--tier-lag-warn", "2s"),
            *("--tier-fence-timeout", "2s", "--tier-retry-max", "2s"),
        ]
    )
    with login(srv, "out") as c:
        assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
        assert isinstance(c.append("log", 0, b"a" * 1000, epoch=1), ev.AppendOk)
        r = tier_wait(c, "log", 1000, 30_000)
        assert isinstance(r, ev.TierWaitOk) and r.tiered == 1000
        own_moto.stop()
        t_down = time.monotonic()
        length = 1000
        # appends go on being acknowledged while the store is down
        while time.monotonic() - t_down < 3:
            r = c.append("log", length, b"b" * 1000, epoch=1)
            assert isinstance(r, ev.AppendOk), r
            length += 1000
            time.sleep(0.05)
        # TIER_WAIT times out with TIER_UNAVAILABLE, the bucket's length and the last error
        r = tier_wait(c, "log", length, 1500)
        assert isinstance(r, ev.Error) and r.code == ErrorCode.TIER_UNAVAILABLE, r
        assert r.length == 1000
        assert f"bucket holds 1000 of {length} bytes" in r.message and "last upload error" in r.message
        # FENCE needs its marker in the store: TIER_UNAVAILABLE after 2 s, the connection lives on
        r = c.call(ev.Fence(c.rid(), 2))
        assert isinstance(r, ev.Error) and r.code == ErrorCode.TIER_UNAVAILABLE and "marker" in r.message
        assert isinstance(c.append("log", length, b"c" * 10, epoch=2), ev.AppendOk)  # the fence moved here
        length += 10
        wait_for(lambda: server_metric(srv, "sos_tier_lag_seconds", 0.0, ns="out") > 2, what="the lag metric over 2 s")
        # the metrics are refreshed every second
        wait_for(
            lambda: server_metric(srv, "sos_tier_lag_bytes", 0.0, ns="out") == length - 1000, what="the lag in bytes"
        )
        m = scrape(srv.metrics_address)
        assert m['sos_tier_failing{namespace="out"}'] == 1
        assert m["sos_tier_upload_errors_total"] >= 1
        assert m['sos_tier_last_error_timestamp_seconds{namespace="out"}'] > 0
        wait_for(lambda: "acknowledged bytes not in the store" in srv.log_text(), what="the lag warning")
        assert "uploads fail, appends go on" in srv.log_text()
        # a wait in flight does not hold up the connection's other requests
        wait_rid = c.rid()
        c.send(ev.TierWait(wait_rid, "log", length, 60_000))
        stat_rid = c.rid()
        c.send(ev.Stat(stat_rid, "log"))
        r = c.next()
        assert r == ev.StatOk(stat_rid, length, False), r
        while time.monotonic() - t_down < 8:  # the store is away ~8 s in all
            time.sleep(0.5)
        own_moto.start()
        t_up = time.monotonic()
        r = c.next()  # the wait ends when the upload lands (back-off is at most 2 s here)
        assert r == ev.TierWaitOk(wait_rid, length), r
        assert time.monotonic() - t_up < 45
    wait_for(
        lambda: (
            server_metric(srv, "sos_tier_lag_bytes", 0.0, ns="out") == 0
            and server_metric(srv, "sos_tier_failing", 0.0, ns="out") == 0
        ),
        what="the backlog drained",
    )
    wait_for(lambda: "lag back under" in srv.log_text(), what="the recovery log line")
    assert "uploads work again" in srv.log_text()
    # the marker that failed is written once the store is back (with a flush of its own, which
    # may land after the backlog's)
    wait_for(lambda: bucket(url, "out").fence == 2, what="the fence marker in the store")
    state = bucket(url, "out")
    assert state.all_problems() == [] and state.objects["log"].length == length
    assert state.fence == 2


def test_sigkill_mid_upload_nothing_lost_duplicated_or_overwritten(sos_server_factory, new_bucket):
    url = versioned_bucket(new_bucket)
    srv = sos_server_factory(args=["--tier", url, "--tier-bytes", "256KiB"])
    acked: dict[str, int] = {}
    blob = bytes(range(256)) * 256  # 64 KiB

    def writer(name: str, stop: threading.Event) -> None:
        try:
            with login(srv, "crash") as c:
                n = 0
                while not stop.is_set():
                    r = c.append(name, n, blob, epoch=0)
                    if not isinstance(r, ev.AppendOk):
                        return
                    n = r.length
                    acked[name] = n
        except (EOFError, OSError):  # the server was killed: what was acknowledged is in acked
            return

    with login(srv, "crash"):
        pass
    stop = threading.Event()
    threads = [threading.Thread(target=writer, args=(f"obj{i}", stop), daemon=True) for i in range(3)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: sum(bucket_lengths(url, "crash").values()) > 2 << 20, what="uploads under way")
        srv.kill()  # mid-upload: the writers are still appending
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    before = bucket_lengths(url, "crash")
    srv.start()
    with login(srv, "crash") as c:
        lengths = {n: c.stat(n).length for n in acked}
        for n, a in acked.items():
            assert lengths[n] >= a  # nothing acknowledged was lost on the server
            r = tier_wait(c, n, lengths[n], 60_000)
            assert isinstance(r, ev.TierWaitOk) and r.tiered == lengths[n], r
        state = bucket(url, "crash")
        assert state.all_problems() == []
        for n in acked:
            assert state.objects[n].length == lengths[n]
            store = open_store(url)
            try:
                from sos_tier import read_object

                assert read_object(store, "crash", n) == c.read(n)  # every byte, the server's bytes
            finally:
                store.close()
    # nothing overwritten: every key has one version; nothing the bucket held before is gone
    assert all(v == 1 for v in versions(url).values()), versions(url)
    assert all(state.objects[n].length >= b for n, b in before.items())


def test_zombie_server_is_told_and_the_bucket_keeps_one_history(sos_server_factory, new_bucket, tmp_path):
    url = new_bucket()
    a = sos_server_factory(args=["--tier", url])
    with login(a, "zns") as c:
        assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
        assert isinstance(c.append("log", 0, b"aaaa", epoch=1), ev.AppendOk)
        assert isinstance(tier_wait(c, "log", 4, 30_000), ev.TierWaitOk)
    a.stop()
    shutil.copytree(a.data_dir, tmp_path / "b-data")  # the replacement starts from the same history
    a.start()
    b = sos_server_factory(tmp_path / "b-data", args=["--tier", url])
    with login(b, "zns") as cb, login(a, "zns") as ca:
        assert isinstance(cb.call(ev.Fence(cb.rid(), 2)), ev.FenceOk)  # the writer moved to B
        # B's marker and its copy landed before FENCE_OK: any listing of A's taken before that
        # is older than FENCE_FRESH now, so A lists before its next flush and writes nothing more
        # (within FENCE_FRESH it could write one flush more: tests/tier/test_log.py, the zombie)
        time.sleep(FENCE_FRESH + 0.1)
        assert isinstance(ca.append("log", 4, b"zzzz", epoch=1), ev.AppendOk)  # the old writer, on the zombie
        r = tier_wait(ca, "log", 8, 30_000)
        assert isinstance(r, ev.Error) and r.code == ErrorCode.TIER_UNAVAILABLE, r
        assert "another server took the namespace over" in r.message and r.length == 4
        assert isinstance(cb.append("log", 4, b"bbbb", epoch=2), ev.AppendOk)
        r = tier_wait(cb, "log", 8, 30_000)
        assert isinstance(r, ev.TierWaitOk) and r.tiered == 8
        r = tier_wait(ca, "log", 4, 0)  # even bytes the bucket holds: the zombie answers no more
        assert isinstance(r, ev.Error) and r.code == ErrorCode.TIER_UNAVAILABLE
    wait_for(lambda: server_metric(a, "sos_tier_fenced", 0.0, ns="zns") == 1, what="the zombie's fenced metric")
    assert server_metric(b, "sos_tier_fenced", 0.0, ns="zns") == 0
    assert "stopped uploading the namespace" in a.log_text()
    state = bucket(url, "zns")
    assert state.all_problems() == [] and state.fence == 2
    store = open_store(url)
    try:
        from sos_tier import read_object

        assert read_object(store, "zns", "log") == b"aaaabbbb"
    finally:
        store.close()


def test_retention_removes_the_pieces_of_a_removed_generation(sos_server_factory, new_bucket):
    url = new_bucket()
    srv = sos_server_factory(args=["--tier", url, "--keep-generations", "1", "--min-age", "1s", "--gc-interval", "1s"])
    with login(srv, "ret") as c:
        assert isinstance(c.call(ev.Fence(c.rid(), 1)), ev.FenceOk)
        for g in (1, 2):
            seg, ready = f"gen/{g:010d}/0000000001-0000000001.seg", f"gen/{g:010d}/ready"
            assert isinstance(c.append(seg, 0, b"journal %d" % g, epoch=1), ev.AppendOk)
            assert isinstance(c.append(ready, 0, b"", epoch=1), ev.AppendOk)
            assert isinstance(c.call(ev.Seal(c.rid(), ready, 1)), ev.SealOk)
            assert isinstance(c.call(ev.Seal(c.rid(), seg, 1)), ev.SealOk)
        assert isinstance(c.append("other", 0, b"kept", epoch=1), ev.AppendOk)
        gen1 = "gen/0000000001/0000000001-0000000001.seg"
        wait_for(lambda: isinstance(c.stat(gen1), ev.Error), what="retention to remove generation 1")
    names = set(bucket(url, "ret").objects)
    assert not any(n.startswith("gen/0000000001/") for n in names), names
    wait_for(
        lambda: (
            {"gen/0000000002/0000000001-0000000001.seg", "gen/0000000002/ready", "other"}
            <= set(bucket_lengths(url, "ret"))
        ),
        what="generation 2 in the bucket",
    )
    store = open_store(url)
    try:
        assert not [k.key for k in store.list("v1/ns/ret/o/gen!0000000001")]
    finally:
        store.close()


def test_start_with_a_tier_on_a_data_dir_served_without_one(sos_server_factory, new_bucket):
    url = new_bucket()
    srv = sos_server_factory()
    with login(srv, "late") as c:
        assert isinstance(c.append("old", 0, b"written before the tier", epoch=0), ev.AppendOk)
    srv.stop()
    srv.args += ["--tier", url]
    srv.start()
    wait_for(lambda: bucket_lengths(url, "late") == {"old": 23}, what="the old object uploaded")
    with login(srv, "late") as c:
        r = tier_wait(c, "old", 23)
        assert isinstance(r, ev.TierWaitOk) and r.tiered == 23


def test_a_store_down_from_the_start_and_the_bound_on_waits(sos_server_factory, own_moto, tmp_path):
    """The server restarts with its store unreachable (nothing listens on the endpoint's port):
    it serves, acknowledges appends, holds up to 64 TIER_WAITs per connection (BUSY beyond), and
    answers them all once the store comes up. On an EMPTY data directory it does not start while
    the store is down: it could not tell whether it replaces a lost server (protocol.md 4.8)."""
    import boto3

    from sos_server.session import MAX_TIER_WAITS
    from tools.server import ServerStartError

    boto3.client("s3").create_bucket(Bucket="late")
    srv = sos_server_factory(args=["--tier", "s3://late/x"])
    with login(srv, "down") as c:
        assert isinstance(c.append("log", 0, b"q" * 4000, epoch=0), ev.AppendOk)
    srv.stop()
    own_moto.stop()
    empty = sos_server_factory(tmp_path / "empty", args=["--tier", "s3://late/x"], start=False)
    with pytest.raises(ServerStartError, match="cannot list the tier"):
        empty.start()
    srv.start()
    with login(srv, "down") as c:
        assert isinstance(c.append("log", 4000, b"q" * 1000, epoch=0), ev.AppendOk)
        rids = []
        for _ in range(MAX_TIER_WAITS):
            rids.append(c.rid())
            c.send(ev.TierWait(rids[-1], "log", 5000, 60_000))
        busy = c.rid()
        c.send(ev.TierWait(busy, "log", 5000, 60_000))
        r = c.next()
        assert isinstance(r, ev.Error) and r.request_id == busy and r.code == ErrorCode.BUSY, r
        assert isinstance(c.append("log", 5000, b"r", epoch=0), ev.AppendOk)  # other requests go on
        wait_for(lambda: "uploads fail, appends go on" in srv.log_text(), what="the failure in the log")
        own_moto.start()
        got = [c.next() for _ in rids]
        assert sorted(g.request_id for g in got) == sorted(rids)
        assert all(isinstance(g, ev.TierWaitOk) and g.tiered >= 5000 for g in got), got
    wait_for(lambda: bucket_lengths("s3://late/x", "down") == {"log": 5001}, what="the object in the bucket")


def test_a_replacement_server_on_an_empty_data_dir_serves_the_bucket_and_carries_on(
    sos_server_factory, new_bucket, tmp_path
):
    """`serve --tier` on an empty --data rebuilds it from the bucket (sos_server.tier_bootstrap),
    then uploads on from where the bucket ends: the writer fences above the old epoch, appends,
    and TIER_WAIT sees its bytes land."""
    url = new_bucket()
    old = sos_server_factory(args=["--tier", url])
    with login(old, "rep") as c:
        assert isinstance(c.call(ev.Fence(c.rid(), 3)), ev.FenceOk)
        assert isinstance(c.append("seg", 0, b"before the loss", epoch=3), ev.AppendOk)
        assert isinstance(tier_wait(c, "seg", 15, 30_000), ev.TierWaitOk)
    old.kill()
    shutil.rmtree(old.data_dir)  # the server's disk is lost
    new = sos_server_factory(tmp_path / "new-data", args=["--tier", url], start=False)
    key = new.keygen("rep")  # keys are not in the bucket: the operator hands them out again
    new.start()
    c = RawClient(new.address)
    with c:
        assert isinstance(c.login(key, "rep"), ev.AuthOk)
        assert c.read("seg") == b"before the loss"
        r = tier_wait(c, "seg", 15, 30_000)  # learned from the listing at its first round (not at once)
        assert isinstance(r, ev.TierWaitOk) and r.tiered == 15, r
        r = c.append("seg", 15, b"x", epoch=2)
        assert isinstance(r, ev.Error) and r.code == ErrorCode.FENCED and r.length == 3  # the fence came back
        assert isinstance(c.call(ev.Fence(c.rid(), 4)), ev.FenceOk)  # a new writer takes over
        assert isinstance(c.append("seg", 15, b" and after", epoch=4), ev.AppendOk)
        r = tier_wait(c, "seg", 25, 30_000)
        assert isinstance(r, ev.TierWaitOk) and r.tiered == 25, r
    state = bucket(url, "rep")
    assert state.all_problems() == [] and state.fence == 4 and state.objects["seg"].length == 25
    assert "tier bootstrap" in new.log_text()


def test_an_object_damaged_on_the_servers_disk_stops_alone(sos_server_factory, new_bucket):
    """A byte of an object file flips after its append was acknowledged and before it was
    uploaded: the server never uploads unverified bytes; that object stops (TIER_WAIT says why,
    the log names it), the namespace's other objects go on."""
    from sos_server.storage import Storage

    url = new_bucket()
    srv = sos_server_factory(args=["--tier", url, "--tier-interval", "1h"])  # uploads only when asked
    with login(srv, "dmg") as c:
        assert isinstance(c.append("bad", 0, b"B" * 1000, epoch=0), ev.AppendOk)
        assert isinstance(c.append("good", 0, b"G" * 1000, epoch=0), ev.AppendOk)
        path = Storage(srv.data_dir).object_path("dmg", "bad")
        with open(path, "r+b") as f:
            f.seek(-1, 2)
            last = f.read(1)
            f.seek(-1, 2)
            f.write(bytes([last[0] ^ 0xFF]))
        r = tier_wait(c, "bad", 1000, 30_000)
        assert isinstance(r, ev.Error) and r.code == ErrorCode.TIER_UNAVAILABLE, r
        assert "cannot read the server's copy" in r.message and r.length == 0
        r = tier_wait(c, "good", 1000, 30_000)
        assert isinstance(r, ev.TierWaitOk) and r.tiered == 1000, r
    assert "not uploading it" in srv.log_text()
    assert bucket_lengths(url, "dmg") == {"good": 1000}
