"""The gateway's bearer tokens, one layer alone (a clock we control; no server)."""

from __future__ import annotations

import pytest

from spark_plugin.gateway_auth import TokenAuthority


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_token_grants_its_role_until_it_expires():
    clock = Clock()
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
    clock = Clock()
    auth = TokenAuthority("ns", b"k" * 32, clock=clock)
    token, _ = auth.issue("append")
    assert TokenAuthority("ns", b"k" * 32, clock=clock).check(token) is not None  # a restart
    assert TokenAuthority("ns", b"x" * 32, clock=clock).check(token) is None  # another key
    assert TokenAuthority("other", b"k" * 32, clock=clock).check(token) is None
    assert TokenAuthority("ns", None, clock=clock).check(token) is None  # random secret


@pytest.mark.parametrize("mangle", [
    lambda t: t + "x",
    lambda t: t.replace("sos2.", "sos1."),  # the old format (no sealed secret) is refused
    lambda t: ".".join([t.split(".")[0], t.split(".")[2], t.split(".")[1]]),
    lambda t: t.split(".")[0] + "." + t.split(".")[1],
    lambda t: "",
    lambda t: "sos2.!!!.###",
])
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
