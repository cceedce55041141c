"""Name rules and the HMAC handshake helpers."""

import hashlib
import hmac

import pytest

from sos_wire import BadKey, BadName, Key, proof, validate_name, validate_namespace, verify_proof


@pytest.mark.parametrize(
    "name",
    [
        "a",
        "a/b",
        "gen/0000000001/0000000000-0000000001.seg",
        ".hidden",
        "x=1+2,y@z~w_-.",
        "a" * 255,
        "/".join(["abc"] * 256)[:1024].rstrip("/"),
    ],
)
def test_valid_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name,match",
    [
        ("", "empty"),
        ("/a", "start with"),
        ("a/", "empty segment"),
        ("a//b", "empty segment"),
        ("a/./b", "'.' segment"),
        ("../etc/passwd", "'..' segment"),
        ("a\x00b", "forbidden character"),
        ("a b", "forbidden character"),
        ("a\\b", "forbidden character"),
        ("é", "forbidden character"),
        ("a" * 256, "segment of 256"),
        ("a/" * 600 + "a", "limit is 1024"),
        ("\udcff", "not valid UTF-8"),
        (b"bytes", "must be str"),
        (None, "must be str"),
    ],
)
def test_invalid_names(name, match):
    with pytest.raises(BadName, match=match):
        validate_name(name)
    assert issubclass(BadName, ValueError)


@pytest.mark.parametrize("ns", ["a", "ns1", "my-app_2", "0", "a" * 63])
def test_valid_namespaces(ns):
    assert validate_namespace(ns) == ns


@pytest.mark.parametrize("ns", ["", "A", "-a", "_a", "a/b", "a" * 64, "a.b", "ns\n", None])
def test_invalid_namespaces(ns):
    with pytest.raises(BadName):
        validate_namespace(ns)


def test_key_text_round_trip_and_secret_hidden():
    key = Key.generate()
    text = str(key)
    assert len(text) == 16 + 1 + 64
    assert Key.parse(text) == key
    assert Key.parse("  " + text + "\n") == key
    assert Key.parse(key) is key
    assert key.secret.hex() not in repr(key)
    assert key.key_id.hex() in repr(key)
    assert Key.generate() != key


@pytest.mark.parametrize(
    "text", ["", "abc", "0" * 16 + "." + "0" * 63, "0" * 16 + ":" + "0" * 64, "g" * 16 + "." + "0" * 64, 42]
)
def test_bad_key_text(text):
    with pytest.raises(BadKey) as info:
        Key.parse(text)
    assert "0" * 63 not in str(info.value)


def test_proof_is_hmac_sha256_of_nonce_namespace_key_id():
    key = Key.parse("0123456789abcdef." + "11" * 32)
    nonce = bytes(range(32))
    want = hmac.new(b"\x11" * 32, nonce + b"ns1" + bytes.fromhex("0123456789abcdef"), hashlib.sha256).digest()
    assert proof(key.secret, nonce, "ns1", key.key_id) == want == key.proof(nonce, "ns1")
    assert verify_proof(key.secret, nonce, "ns1", key.key_id, want)
    assert not verify_proof(key.secret, nonce, "ns2", key.key_id, want)
    assert not verify_proof(key.secret, bytes(32), "ns1", key.key_id, want)
    # pinned value (protocol.md's handshake example uses it)
    assert want.hex() == "0196ea254d70cc0c25bc07f8405aaab77382e33c1a1743791fc77e65fe1fdaf2"
