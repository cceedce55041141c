"""The tier's Store interface: ONE conformance suite run against every backend (moto's S3 server
on 127.0.0.1 and a local directory, the ``store`` fixture), plus what is particular to each."""

from __future__ import annotations

import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from sos_tier.open import open_store
from sos_tier.store import LocalStore, PutOutcome, StoredKey, TierError, TierNotFound

pytest_plugins = ["tests.tier.support"]  # the fixtures moto, store (both backends) and new_bucket

# ---------------------------------------------------------------------------------------------
# the conformance suite


def test_put_once_created_then_same_then_conflict(store):
    assert store.put_once("a/b/k1", b"hello") is PutOutcome.CREATED
    assert store.put_once("a/b/k1", b"hello") is PutOutcome.ALREADY_SAME
    assert store.put_once("a/b/k1", b"HELLO") is PutOutcome.CONFLICT
    assert store.put_once("a/b/k1", b"") is PutOutcome.CONFLICT
    assert store.get("a/b/k1") == b"hello"  # a conflict never overwrites


def test_put_once_empty_content(store):
    assert store.put_once("x/empty", b"") is PutOutcome.CREATED
    assert store.put_once("x/empty", b"") is PutOutcome.ALREADY_SAME
    assert store.get("x/empty") == b""
    assert list(store.list("x/")) == [StoredKey("x/empty", 0)]


def test_racing_put_once_one_wins(store):
    """Writers racing for one key: exactly one creates it; the others learn whether their
    bytes are the winner's."""
    contents = [b"same"] * 4 + [b"other-%d" % i for i in range(4)]
    barrier = threading.Barrier(len(contents))

    def put(data):
        barrier.wait()
        return data, store.put_once("race/k", data)

    with ThreadPoolExecutor(len(contents)) as pool:
        results = list(pool.map(put, contents))
    winners = [d for d, r in results if r is PutOutcome.CREATED]
    assert len(winners) == 1
    final = store.get("race/k")
    assert final == winners[0]
    for data, r in results:
        if r is not PutOutcome.CREATED:
            assert r is (PutOutcome.ALREADY_SAME if data == final else PutOutcome.CONFLICT)


def test_ranged_get(store):
    data = bytes(range(256)) * 4
    store.put_once("r/k", data)
    assert store.get("r/k") == data
    assert store.get("r/k", 0, 1) == data[:1]
    assert store.get("r/k", 10, 20) == data[10:20]
    assert store.get("r/k", 1000) == data[1000:]
    assert store.get("r/k", None, 5) == data[:5]
    assert store.get("r/k", 1020, 2000) == data[1020:]  # a range past the end: what is there
    assert store.get("r/k", 1024) == b""  # from the end: nothing
    assert store.get("r/k", 5000, 6000) == b""
    assert store.get("r/k", 7, 7) == b""
    with pytest.raises(ValueError):
        store.get("r/k", 5, 4)


def test_not_found_is_the_same_everywhere(store):
    with pytest.raises(TierNotFound) as e:
        store.get("nope/k")
    assert e.value.key == "nope/k"
    with pytest.raises(TierNotFound):
        store.get("nope/k", 3, 9)
    with pytest.raises(TierNotFound):
        store.get("nope/k", 3, 3)
    assert isinstance(e.value, TierError)
    assert list(store.list("nope/")) == []


def test_list_order_sizes_and_prefix(store):
    keys = ["p/b", "p/a/2", "p/a/1", "p/a!x", "p/ab", "q/z", "pz"]
    for i, k in enumerate(keys):
        store.put_once(k, b"x" * i)
    listed = list(store.list("p/"))
    assert [k.key for k in listed] == sorted(k for k in keys if k.startswith("p/"))  # byte order
    assert {k.key: k.size for k in listed} == {k: i for i, k in enumerate(keys) if k.startswith("p/")}
    assert [k.key for k in store.list("p/a")] == ["p/a!x", "p/a/1", "p/a/2", "p/ab"]  # not a directory
    assert [k.key for k in store.list("")] == sorted(keys)


def test_list_paginates(store, tmp_path):
    """Listing goes on past a page: a page size of 7 (S3's MaxKeys; a local directory has no
    pages) over 30 keys."""
    small = open_store(store.url, page_size=7)
    try:
        keys = [f"pg/{i:03d}" for i in range(30)]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: small.put_once(k, k.encode()), keys))
        assert [k.key for k in small.list("pg/")] == keys
        assert [k.key for k in small.list("pg/01")] == keys[10:20]
    finally:
        small.close()


def test_delete(store):
    for k in ("d/1", "d/2", "d/sub/3"):
        store.put_once(k, b"x")
    store.delete(["d/1", "d/sub/3", "d/never-was"])  # a missing key is no error
    assert [k.key for k in store.list("d/")] == ["d/2"]
    with pytest.raises(TierNotFound):
        store.get("d/1")
    store.delete([])
    store.delete(["d/2"])
    assert list(store.list("")) == []
    # a deleted key can be created again (retention removes whole objects; names never return
    # in the layout, but the store does not care)
    assert store.put_once("d/1", b"y") is PutOutcome.CREATED


@pytest.mark.parametrize("key", ["", "/a", "a/", "a//b", "a/./b", "a/../b", "a\0b", "a/#tmp.x", "k" * 1025])
def test_bad_keys_refused(store, key):
    with pytest.raises(ValueError):
        store.put_once(key, b"x")
    with pytest.raises(ValueError):
        store.get(key)


# ---------------------------------------------------------------------------------------------
# backend by backend


def test_moto_refuses_a_second_conditional_put(new_bucket):
    """The bucket itself refuses (412 PreconditionFailed): the create is conditional in S3, not
    a check-then-put in our code."""
    import boto3
    import botocore.exceptions

    url = new_bucket("")
    bucket = url.removeprefix("s3://")
    s3 = boto3.session.Session().client("s3")
    s3.put_object(Bucket=bucket, Key="k", Body=b"one", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket=bucket, Key="k", Body=b"two", IfNoneMatch="*")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"one"


def test_s3_more_than_1000_keys(new_bucket):
    """S3 pages at 1000 keys whatever MaxKeys asks: 1001 keys come back in two pages."""
    s = open_store(new_bucket("many"))
    try:
        keys = [f"k/{i:05d}" for i in range(1001)]
        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(lambda k: s.put_once(k, b""), keys)) == {PutOutcome.CREATED}
        assert [k.key for k in s.list("k/")] == keys
        s.delete(keys)  # DeleteObjects takes 1000 at a time
        assert list(s.list("k/")) == []
    finally:
        s.close()


def test_s3_prefix_isolates(new_bucket):
    url = new_bucket("one/two")
    a = open_store(url)
    b = open_store(url.replace("/one/two", "/one"))
    try:
        a.put_once("k", b"x")
        assert [k.key for k in a.list()] == ["k"]
        assert [k.key for k in b.list()] == ["two/k"]
        assert b.get("two/k") == b"x"
    finally:
        a.close()
        b.close()


def test_s3_unreachable_is_tier_error(moto, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    from sos_tier.s3 import S3Store

    s = S3Store("s3://nobucket/p")
    try:
        for call in (
            lambda: s.put_once("k", b"x"),
            lambda: s.get("k"),
            lambda: list(s.list("")),
            lambda: s.delete(["k"]),
        ):
            with pytest.raises(TierError) as e:
                call()
            assert not isinstance(e.value, TierNotFound)
    finally:
        s.close()


def test_s3_takes_no_credentials_or_endpoint_arguments():
    from sos_tier.s3 import S3Store

    assert set(inspect.signature(S3Store).parameters) == {"url", "page_size", "pool"}


def test_open_store_urls(tmp_path, moto):
    from sos_tier.s3 import S3Store

    s = open_store("s3://bucket-name/a/b/")
    assert isinstance(s, S3Store) and s.bucket == "bucket-name" and s.prefix == "a/b"
    s.close()
    local = open_store((tmp_path / "t").as_uri())
    assert isinstance(local, LocalStore) and local.root == str(tmp_path / "t")
    for bad in ("gs://x/y", "s3:///nobucket", "file://host/x", "file:relative", "s3://b/" + "p" * 300):
        with pytest.raises(ValueError):
            open_store(bad)


def test_local_put_never_replaces_and_leaves_no_temp_files(tmp_path):
    s = LocalStore((tmp_path / "t").as_uri())
    s.put_once("a/k", b"one")
    assert s.put_once("a/k", b"two") is PutOutcome.CONFLICT
    assert sorted(os.listdir(tmp_path / "t" / "a")) == ["k"]
    # a temp file a crash left behind is never listed
    (tmp_path / "t" / "a" / "#tmp.1.dead").write_bytes(b"partial")
    assert [k.key for k in s.list("")] == ["a/k"]
    assert os.stat(tmp_path / "t" / "a" / "k").st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / "t" / "a").st_mode & 0o777 == 0o700


def test_local_delete_removes_empty_directories(tmp_path):
    s = LocalStore((tmp_path / "t").as_uri())
    s.put_once("a/b/c/k", b"x")
    s.put_once("a/other", b"x")
    s.delete(["a/b/c/k"])
    assert sorted(os.listdir(tmp_path / "t" / "a")) == ["other"]
    assert os.path.isdir(tmp_path / "t")
