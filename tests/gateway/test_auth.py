"""The gateway's bearer tokens, one layer alone (a clock we control; no server)."""

from __future__ import annotations

import pytest

from spark_plugin.gateway.http.auth import TokenAuthority
from tests.support import ManualClock


def test_token_grants_its_role_until_it_expires():
    clock = ManualClock()
    auth = TokenAuthority("ns", b"k" * 32, ttl=60, clock=clock)
    token, expires_in = auth.issue("read", "abcd")
    assert expires_in == 60
    info = auth.check(token)
    assert info is not None and info.role == "read" and not info.can_write
    assert info.key_id == "abcd"
    clock.now += 59
    assert auth.check(token) is not None
    clock.now += 1
    assert auth.check(token) is None  # expired exactly at issue + ttl


def test_tokens_are_bound_to_the_gateway_key_and_namespace():
    clock = ManualClock()
    auth = TokenAuthority("ns", b"k" * 32, clock=clock)
    token, _ = auth.issue("append")
    assert TokenAuthority("ns", b"k" * 32, clock=clock).check(token) is not None  # a restart
    assert TokenAuthority("ns", b"x" * 32, clock=clock).check(token) is None  # another key
    assert TokenAuthority("other", b"k" * 32, clock=clock).check(token) is None
    assert TokenAuthority("ns", None, clock=clock).check(token) is None  # random secret


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t + "x",
        lambda t: t.replace("sos2.", "sos1."),  # the old format (no sealed secret) is refused
        lambda t: ".".join([t.split(".")[0], t.split(".")[2], t.split(".")[1]]),
        lambda t: t.split(".")[0] + "." + t.split(".")[1],
        lambda t: "",
        lambda t: "sos2.!!!.###",
    ],
)
def test_malformed_or_tampered_tokens_are_refused(mangle):
    auth = TokenAuthority("ns", b"k" * 32)
    token, _ = auth.issue("append")
    assert auth.check(mangle(token)) is None


def test_a_read_token_cannot_be_turned_into_an_append_token():
    import base64

    auth = TokenAuthority("ns", b"k" * 32)
    token, _ = auth.issue("read")
    prefix, payload, mac = token.split(".")
    raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    forged = raw.replace(b"\nread\n", b"\nappend\n")
    forged_b64 = base64.urlsafe_b64encode(forged).rstrip(b"=").decode()
    assert auth.check(f"{prefix}.{forged_b64}.{mac}") is None


def test_a_token_seals_its_keys_secret_for_a_restarted_gateway_only():
    import base64

    secret = bytes(range(32))
    auth = TokenAuthority("ns", b"k" * 32)
    token, _ = auth.issue("append", "00" * 8, secret)
    info = auth.check(token)
    assert info is not None and info.key_secret == secret
    assert info.key_text == "00" * 8 + "." + secret.hex()
    assert secret.hex() not in repr(info) and repr(secret) not in repr(info)
    restarted = TokenAuthority("ns", b"k" * 32).check(token)  # same gateway key: opens it
    assert restarted is not None and restarted.key_secret == secret
    _, payload, mac = token.split(".")
    raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    for form in (secret, secret.hex().encode(), base64.urlsafe_b64encode(secret).rstrip(b"=")):
        assert form not in raw and form.decode("latin-1") not in token  # never in clear
    # flipping a bit of the sealed secret breaks the MAC (encrypt-then-MAC)
    fields = raw.split(b"\n")
    sealed = bytearray(base64.urlsafe_b64decode(fields[-1] + b"=" * (-len(fields[-1]) % 4)))
    sealed[0] ^= 1
    fields[-1] = base64.urlsafe_b64encode(bytes(sealed)).rstrip(b"=")
    forged = base64.urlsafe_b64encode(b"\n".join(fields)).rstrip(b"=").decode()
    assert auth.check(f"sos2.{forged}.{mac}") is None


def test_key_checks_throttle_an_address_and_answer_refused_keys_from_the_negative_cache():
    import os

    import trio

    from spark_plugin.gateway.http.auth import KeyChecks, Throttled

    asked: list[str] = []

    def verify(key_text: str) -> tuple[str, str]:
        asked.append(key_text)
        if key_text.startswith("aa"):
            return "append", key_text[:16]
        raise PermissionError("AUTH_FAILED")

    async def main() -> None:
        checks = KeyChecks(verify, burst=3, rate=0.001)
        bogus = "bb" * 8 + "." + os.urandom(32).hex()
        good = "aa" * 8 + "." + os.urandom(32).hex()
        for _ in range(2):
            with pytest.raises(PermissionError):
                await checks.for_token(bogus, "10.0.0.1")
        assert len(asked) == 1  # the second answer came from the negative cache
        with pytest.raises(ValueError):
            await checks.for_token("garbage", "10.0.0.1")
        with pytest.raises(Throttled) as exc:  # three charged: the bucket is empty
            await checks.for_token(good, "10.0.0.1")
        assert exc.value.status == 429 and exc.value.retry_after >= 1
        assert await checks.for_token(good, "10.0.0.2") == ("append", "aa" * 8)
        for _ in range(5):  # a good key gives its token back; a known one skips the bucket
            assert await checks.for_token(good, "10.0.0.1") == ("append", "aa" * 8)

    trio.run(main)


def test_key_checks_queue_is_bounded_and_serves_the_least_recently_served_address_first():
    import threading

    import trio

    from spark_plugin.gateway.http.auth import KeyChecks, Throttled

    gate = threading.Event()
    order: list[str] = []

    def verify(key_text: str) -> tuple[str, str]:
        gate.wait(30)
        order.append(key_text[:2])
        raise PermissionError("AUTH_FAILED")

    def key(prefix: str) -> str:
        return prefix * 8 + "." + prefix * 32

    async def main() -> None:
        checks = KeyChecks(verify, slots=1, queue=2, per_address_queue=1)
        outcomes: dict[str, str] = {}

        async def ask(name: str, address: str) -> None:
            try:
                await checks.for_token(key(name), address)
            except Throttled as exc:
                outcomes[name] = str(exc.status)
            except PermissionError:
                outcomes[name] = "401"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "a1", "10.0.0.1")  # runs (blocked in verify)
            await trio.sleep(0.2)
            nursery.start_soon(ask, "a2", "10.0.0.1")  # waits: one check per address
            await trio.sleep(0.2)
            nursery.start_soon(ask, "a3", "10.0.0.1")  # 429: its address already waits
            await trio.sleep(0.2)
            nursery.start_soon(ask, "b1", "10.0.0.2")  # waits
            await trio.sleep(0.2)
            nursery.start_soon(ask, "c1", "10.0.0.3")  # 503: the queue (2) is full
            await trio.sleep(0.2)
            assert outcomes == {"a3": "429", "c1": "503"}
            gate.set()
        # 10.0.0.2 was never served: it goes before 10.0.0.1's second request
        assert order == ["a1", "b1", "a2"]
        assert outcomes == {"a3": "429", "c1": "503", "a1": "401", "a2": "401", "b1": "401"}

    trio.run(main)


def test_key_checks_requests_of_one_key_at_once_are_not_throttled_and_each_asks_the_server():
    import threading

    import trio

    from spark_plugin.gateway.http.auth import KeyChecks

    asked: list[str] = []
    gate = threading.Event()

    def verify(key_text: str) -> tuple[str, str]:
        gate.wait(30)
        asked.append(key_text)
        return "append", key_text[:16]

    async def main() -> None:
        checks = KeyChecks(verify, burst=2, per_address_queue=1)
        good = "ab" * 8 + "." + "cd" * 32
        results = []

        async def ask() -> None:
            results.append(await checks.for_token(good, "10.0.0.1"))

        async with trio.open_nursery() as nursery:
            for _ in range(8):  # eight executors of one node start together
                nursery.start_soon(ask)
            await trio.sleep(0.3)
            gate.set()
        assert results == [("append", "ab" * 8)] * 8
        assert len(asked) == 8  # no answer was reused: every token asked the server

    trio.run(main)
