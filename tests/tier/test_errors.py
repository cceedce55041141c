"""botocore's errors translated in one place (``sos_tier/errors.py``: every row of its tables,
from real botocore exception instances, no network) and the tier's retry policies on tenacity
(``sos_tier/retry.py``: their waits, read through a fake sleep), then both wired into
``S3Store`` (a real boto3 client whose answers botocore's own Stubber gives: no network)."""

from __future__ import annotations

import io

import pytest

botocore_exceptions = pytest.importorskip("botocore.exceptions")

from botocore.exceptions import (  # noqa: E402 - after the importorskip
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from sos_tier.errors import BOTOCORE_TYPES, CODES, STATUSES, classify, translate  # noqa: E402
from sos_tier.retry import (  # noqa: E402
    BACKOFF_MAX,
    BACKOFF_MIN,
    BUSY_TRIES,
    Backoff,
    busy_retrying,
    fence_retryable,
    fence_retrying,
)
from sos_tier.store import (  # noqa: E402
    PutOutcome,
    TierBadRange,
    TierBusy,
    TierDenied,
    TierError,
    TierExists,
    TierNotFound,
)
from sos_tier.uploader import TierFenced, TierMarkerTaken  # noqa: E402


def client_error(code: str | None, status: int | None, op: str = "GetObject") -> ClientError:
    response: dict = {"ResponseMetadata": {}}
    if code is not None:
        response["Error"] = {"Code": code, "Message": f"the store says {code}"}
    if status is not None:
        response["ResponseMetadata"]["HTTPStatusCode"] = status
    return ClientError(response, op)


# ---------------------------------------------------------------------------------------------
# the table


@pytest.mark.parametrize(("code", "cls"), sorted(CODES.items()))
def test_every_code_row(code, cls):
    """The code decides, whatever the status says (400 here, which no row names)."""
    err = client_error(code, 400)
    out = translate(err, context="S3 GET of s3://b/p/k", key="k")
    assert type(out) is cls
    assert out.__cause__ is err
    if cls is TierNotFound:
        assert out.key == "k" and str(out) == "no such key: k"
    else:
        assert str(out).startswith("S3 GET of s3://b/p/k: ") and code in str(out)


@pytest.mark.parametrize(("status", "cls"), sorted(STATUSES.items()))
def test_every_status_row(status, cls):
    """An answer with no code a row names: its HTTP status decides (a HEAD answers a bare
    ``404``: the status as its code), and with no code at all."""
    for err in (
        client_error(str(status), status, "HeadObject"),
        client_error("SomethingNew", status),
        client_error(None, status),
    ):
        out = translate(err, key="k")
        assert type(out) is cls, (err.response, out)
        assert out.__cause__ is err


@pytest.mark.parametrize(("kind", "cls"), BOTOCORE_TYPES)
def test_every_botocore_type_row(kind, cls):
    examples = {
        NoCredentialsError: NoCredentialsError(),
        PartialCredentialsError: PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"),
        botocore_exceptions.BotoCoreError: EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
    }
    err = examples[kind]
    out = translate(err, context="S3 LIST of s3://b/p")
    assert type(out) is cls
    assert out.__cause__ is err and str(out).startswith("S3 LIST of s3://b/p: ")


@pytest.mark.parametrize(
    "err",
    [
        EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),
        ConnectTimeoutError(endpoint_url="http://127.0.0.1:9"),
        ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
    ],
)
def test_no_answer_is_a_plain_tier_error(err):
    """The endpoint unreachable or silent: a TierError (the server retries it), nothing more."""
    out = translate(err, context="S3 GET of s3://b/k", key="k")
    assert type(out) is TierError and "127.0.0.1:9" in str(out)


def test_the_code_decides_before_the_status():
    # a missing bucket is not a missing key, though both are 404
    assert type(translate(client_error("NoSuchBucket", 404), key="k")) is TierError
    assert type(translate(client_error("NoSuchKey", 404), key="k")) is TierNotFound
    # a code no row names: the status
    assert type(translate(client_error("OperationAborted", 409), key="k")) is TierBusy


@pytest.mark.parametrize(
    ("code", "status"), [("InternalError", 500), ("SlowDown", 503), ("BadDigest", 400), (None, None)]
)
def test_what_no_row_names_is_a_plain_tier_error(code, status):
    out = translate(client_error(code, status), key="k")
    assert type(out) is TierError


def test_not_found_needs_a_key():
    """A listing or a batch delete names no key: a 404 there is a TierError, never TierNotFound."""
    out = translate(client_error("NoSuchKey", 404), context="S3 LIST of s3://b/p")
    assert type(out) is TierError and str(out).startswith("S3 LIST of s3://b/p: ")


def test_every_class_is_a_tier_error_and_not_found_is_never_retried_as_busy():
    for cls in [*CODES.values(), *STATUSES.values(), *(c for _, c in BOTOCORE_TYPES)]:
        assert issubclass(cls, TierError)
    assert {TierNotFound, TierExists, TierBusy, TierBadRange, TierDenied} <= set(CODES.values())


def test_classify_is_the_same_table_for_per_key_codes():
    """DeleteObjects reports per key with codes: the same table."""
    assert classify("NoSuchKey") is TierNotFound
    assert classify("AccessDenied") is TierDenied
    assert classify("InternalError") is TierError
    assert classify(None, 412) is TierExists
    assert classify("412") is TierError  # a code is a code; the status is passed as one


def test_an_unexpected_exception_is_still_a_typed_error():
    err = ValueError("odd")
    out = translate(err, context="S3 GET of s3://b/k")
    assert type(out) is TierError and out.__cause__ is err


# ---------------------------------------------------------------------------------------------
# the retry policies


class FakeSleep:
    def __init__(self) -> None:
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


def flaky(errors: list[BaseException]):
    calls = []

    def call():
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return "ok"

    return call, calls


def run(retrying, call):
    for attempt in retrying:
        with attempt:
            result = call()
    return result


def test_busy_is_retried_50ms_doubling_then_succeeds():
    sleep = FakeSleep()
    call, calls = flaky([TierBusy("409")] * (BUSY_TRIES - 1))
    assert run(busy_retrying(sleep), call) == "ok"
    assert sleep.waits == [0.05, 0.1, 0.2, 0.4]
    assert len(calls) == BUSY_TRIES == 5


def test_busy_gives_up_after_five_tries_with_the_last_error():
    sleep = FakeSleep()
    errors = [TierBusy(f"409 #{i}") for i in range(10)]
    call, calls = flaky(list(errors))
    with pytest.raises(TierBusy) as e:
        run(busy_retrying(sleep), call)
    assert e.value is errors[4] and len(calls) == 5 and sleep.waits == [0.05, 0.1, 0.2, 0.4]


@pytest.mark.parametrize(
    "err", [TierExists("412"), TierError("500"), TierDenied("403"), TierNotFound("k"), ValueError()]
)
def test_busy_retries_nothing_else(err):
    sleep = FakeSleep()
    call, calls = flaky([err])
    with pytest.raises(type(err)) as e:
        run(busy_retrying(sleep), call)
    assert e.value is err and len(calls) == 1 and sleep.waits == []


def test_the_servers_backoff_doubles_from_1s_to_30s_and_starts_over():
    b = Backoff()
    assert (BACKOFF_MIN, BACKOFF_MAX) == (1.0, 30.0)
    assert [b.next() for _ in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    b.reset()
    assert [b.next() for _ in range(2)] == [1, 2]


def test_the_server_uses_that_backoff():
    from sos_server import tiering

    assert tiering.BACKOFF_MIN == 1.0 and tiering.BACKOFF_MAX == 30.0
    st = tiering._NsState()
    assert [st.backoff.next() for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]


def test_fence_retries_store_errors_only():
    assert fence_retryable(TierError("x"))
    assert fence_retryable(TierBusy("x"))
    assert fence_retryable(TierDenied("x"))
    assert not fence_retryable(TierFenced("ns", 5, 3))
    assert not fence_retryable(TierMarkerTaken("k", "other bytes"))
    assert not fence_retryable(ValueError("x"))


def test_fence_waits_200ms_doubling_to_2s_and_never_stops_by_itself():
    trio = pytest.importorskip("trio")
    waits: list[float] = []
    seen: list[str] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    def before_sleep(state) -> None:
        seen.append(str(state.outcome.exception()))

    async def main():
        errors = [TierError(f"down #{i}") for i in range(12)]
        tries = 0
        async for attempt in fence_retrying(sleep, before_sleep):
            with attempt:
                tries += 1
                if errors:
                    raise errors.pop(0)
        return tries

    assert trio.run(main) == 13
    assert waits == [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert seen == [f"down #{i}" for i in range(12)]


@pytest.mark.parametrize("err", [TierFenced("ns", 5, 3), TierMarkerTaken("k", "other bytes")])
def test_fence_does_not_retry_what_only_a_higher_epoch_helps(err):
    trio = pytest.importorskip("trio")
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def main():
        async for attempt in fence_retrying(sleep):
            with attempt:
                raise err

    with pytest.raises(type(err)):
        trio.run(main)
    assert waits == []


# ---------------------------------------------------------------------------------------------
# wired into S3Store: a real boto3 client, its answers from botocore's Stubber (no network)


@pytest.fixture
def stubbed(monkeypatch, tmp_path):
    pytest.importorskip("boto3")
    from botocore.stub import Stubber

    from sos_tier.s3 import S3Store

    for var in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    store = S3Store("s3://bkt/pre")
    store.sleep = FakeSleep()
    stub = Stubber(store._s3)
    stub.activate()
    try:
        yield store, stub
        stub.assert_no_pending_responses()
    finally:
        stub.deactivate()
        store.close()


def _body(data: bytes):
    from botocore.response import StreamingBody

    return {"Body": StreamingBody(io.BytesIO(data), len(data))}


def test_put_once_retries_409_then_creates(stubbed):
    store, stub = stubbed
    for _ in range(2):
        stub.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
    stub.add_response("put_object", {})
    assert store.put_once("a/k", b"x") is PutOutcome.CREATED
    assert store.sleep.waits == [0.05, 0.1]


def test_put_once_gives_up_on_409_after_five_tries(stubbed):
    store, stub = stubbed
    for _ in range(5):
        stub.add_client_error("put_object", "ConditionalRequestConflict", http_status_code=409)
    with pytest.raises(TierBusy) as e:
        store.put_once("a/k", b"x")
    assert str(e.value).startswith("S3 conditional PUT of s3://bkt/pre/a/k: ")
    assert isinstance(e.value.__cause__, ClientError)
    assert store.sleep.waits == [0.05, 0.1, 0.2, 0.4]


@pytest.mark.parametrize(("there", "outcome"), [(b"x", PutOutcome.ALREADY_SAME), (b"y", PutOutcome.CONFLICT)])
def test_put_once_412_is_the_write_once_conflict(stubbed, there, outcome):
    store, stub = stubbed
    stub.add_client_error("put_object", "PreconditionFailed", http_status_code=412)
    stub.add_response("get_object", _body(there), {"Bucket": "bkt", "Key": "pre/a/k"})
    assert store.put_once("a/k", b"x") is outcome
    assert store.sleep.waits == []


def test_put_once_denied_is_not_retried(stubbed):
    store, stub = stubbed
    stub.add_client_error("put_object", "AccessDenied", http_status_code=403)
    with pytest.raises(TierDenied):
        store.put_once("a/k", b"x")
    assert store.sleep.waits == []


def test_get_not_found_bad_range_and_missing_bucket(stubbed):
    store, stub = stubbed
    stub.add_client_error("get_object", "NoSuchKey", http_status_code=404)
    with pytest.raises(TierNotFound) as e:
        store.get("a/k")
    assert e.value.key == "a/k"
    stub.add_client_error("get_object", "InvalidRange", http_status_code=416)
    assert store.get("a/k", 5) == b""
    stub.add_client_error("head_object", "404", http_status_code=404)
    with pytest.raises(TierNotFound):
        store.get("a/k", 3, 3)
    stub.add_client_error("get_object", "NoSuchBucket", http_status_code=404)
    with pytest.raises(TierError) as e2:
        store.get("a/k")
    assert type(e2.value) is TierError and "NoSuchBucket" in str(e2.value)


def test_list_and_delete_errors(stubbed):
    store, stub = stubbed
    stub.add_client_error("list_objects_v2", "NoSuchBucket", http_status_code=404)
    with pytest.raises(TierError) as e:
        list(store.list("x/"))
    assert type(e.value) is TierError and str(e.value).startswith("S3 LIST of s3://bkt/pre/x/: ")
    stub.add_response("delete_objects", {"Errors": [{"Key": "pre/a", "Code": "NoSuchKey", "Message": "gone"}]})
    store.delete(["a"])  # a key not there is no error
    stub.add_response(
        "delete_objects",
        {"Errors": [{"Key": "pre/a", "Code": "NoSuchKey"}, {"Key": "pre/b", "Code": "AccessDenied", "Message": "no"}]},
    )
    with pytest.raises(TierDenied) as e2:
        store.delete(["a", "b"])
    assert "1 keys not deleted, first pre/b: AccessDenied no" in str(e2.value)


# ---------------------------------------------------------------------------------------------
# the server's FENCE on that policy: a real Tier on a real directory store whose fence marker
# cannot be written (a file stands where its directory goes) until the test removes it


def _fence(tmp_path, timeout: float, unblock_after: float | None, *, planted: bytes | None = None):
    trio = pytest.importorskip("trio")
    from sos_server.metrics import Metrics
    from sos_server.storage import Storage
    from sos_server.tiering import Tier
    from sos_tier.layout import fence_key, namespace_prefix
    from sos_tier.store import LocalStore

    store = LocalStore((tmp_path / "tier").as_uri())
    blocker = tmp_path / "tier" / namespace_prefix("ns") / "fence"
    blocker.parent.mkdir(parents=True)
    if planted is None:
        blocker.write_bytes(b"not a directory")
    else:
        store.put_once(fence_key("ns", 3), planted)
    metrics = Metrics()
    out: dict = {}

    async def main():
        tier = Tier(store, Storage(str(tmp_path / "data")), metrics, fence_timeout=timeout)
        async with trio.open_nursery() as nursery:
            if unblock_after is not None:

                async def unblock():
                    await trio.sleep(unblock_after)
                    blocker.unlink()

                nursery.start_soon(unblock)
            t0 = trio.current_time()
            try:
                await tier.fence("ns", 3)
            except Exception as exc:
                out["error"] = exc
            out["seconds"] = trio.current_time() - t0

    trio.run(main)
    out["errors_counted"] = metrics.registry.get_sample_value("sos_tier_upload_errors_total")
    out["marker"] = store.get(fence_key("ns", 3)) if (tmp_path / "tier" / fence_key("ns", 3)).exists() else None
    return out


def test_fence_retries_until_the_marker_is_written(tmp_path):
    from sos_tier.layout import fence_content

    out = _fence(tmp_path, timeout=10.0, unblock_after=0.5)
    assert "error" not in out, out
    assert out["marker"] == fence_content("ns", 3)
    # tries at 0, 0.2, 0.6 (failed: counted), 1.4 s (written)
    assert out["errors_counted"] >= 2 and 0.5 <= out["seconds"] < 5, out


def test_fence_gives_up_at_its_deadline_with_the_last_error(tmp_path):
    from sos_server.storage import StorageError
    from sos_wire.errors import ErrorCode

    out = _fence(tmp_path, timeout=1.0, unblock_after=None)
    err = out["error"]
    assert isinstance(err, StorageError) and err.code == ErrorCode.TIER_UNAVAILABLE
    assert "did not reach the tier within 1 s (cannot write" in err.message, err.message
    assert out["errors_counted"] >= 2 and 1.0 <= out["seconds"] < 3, out
    assert out["marker"] is None


def test_fence_does_not_retry_a_marker_key_holding_other_bytes(tmp_path):
    from sos_server.storage import StorageError

    out = _fence(tmp_path, timeout=10.0, unblock_after=None, planted=b"planted")
    err = out["error"]
    assert isinstance(err, StorageError) and err.message.startswith("fence 3 set on this server, but "), err
    assert "fence again with a higher epoch" in err.message and "did not reach" not in err.message, err
    assert out["errors_counted"] == 0 and out["seconds"] < 1, out
