"""Issue 17, items 3 and 8, against a real sos-server and a real `sos gateway`:

- item 3: a flood of made-up keys at /oauth2/token (from one address, and from several
  127.0.0.x addresses) no longer makes a real client wait ~32 s for its token behind the
  server's per-address delay of failed AUTHs; the flooding address is answered 429/503 at
  once, malformed keys never reach the server, a refused key is not asked again at once;
- item 8: removing a key on the server stops new tokens at once and the key's existing
  tokens within the --key-recheck interval (CREATE, DELETE and GET alike), also after a
  gateway restart, while a valid token keeps working across the restart.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.parse

import pytest

from tests.support import start_gateway

pytestmark = [pytest.mark.hostile]

NS = "gwtok"


def _bogus_key() -> str:
    return os.urandom(8).hex() + "." + os.urandom(32).hex()


def post_token(
    url: str, secret: str, *, source: str | None = None, timeout: float = 90.0
) -> tuple[int, dict[str, str], dict, float]:
    """(status, headers, JSON body, seconds) of one token request, sent from ``source``."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(
        parts.hostname, parts.port, timeout=timeout, source_address=(source, 0) if source else None
    )
    body = urllib.parse.urlencode({"grant_type": "client_credentials", "client_id": NS, "client_secret": secret})
    started = time.monotonic()
    try:
        conn.request("POST", "/oauth2/token", body=body, headers={"Content-Type": "application/x-www-form-urlencoded"})
        r = conn.getresponse()
        data = r.read()
        elapsed = time.monotonic() - started
        headers = {k.lower(): v for k, v in r.getheaders()}
        return r.status, headers, json.loads(data) if data else {}, elapsed
    finally:
        conn.close()


def token(url: str, secret: str, **kw) -> str:
    status, _, doc, _ = post_token(url, secret, **kw)
    assert status == 200, doc
    return doc["access_token"]


def call(url: str, method: str, path: str, tok: str, *, body: bytes | None = None, **params: str) -> int:
    """Status of one WebHDFS request (CREATE: both steps when the first answers 307)."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.urlencode(params)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=90)
    try:
        conn.request(method, f"/webhdfs/v1{path}?{query}", body=body, headers={"Authorization": f"Bearer {tok}"})
        r = conn.getresponse()
        r.read()
        if r.status == 307:
            loc = urllib.parse.urlsplit(r.getheader("location"))
            conn.request(
                method, f"{loc.path}?{loc.query}", body=body or b"x", headers={"Authorization": f"Bearer {tok}"}
            )
            r = conn.getresponse()
            r.read()
        return r.status
    finally:
        conn.close()


def server_log_count(server, marker: str) -> int:
    return sum(1 for line in server.log_text().splitlines() if marker in line)


class Flood:
    """Threads that POST made-up keys to the token endpoint until stopped, each from its
    source address, one request at a time, pausing ``pause`` s after each answer."""

    def __init__(self, url: str, sources: dict[str, int], pause: float = 1.0) -> None:
        self.url, self.pause = url, pause
        self.stop = threading.Event()
        self.answers: list[tuple[str, int, str | None, float]] = []  # source, status, retry-after, s
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(src,), daemon=True) for src, n in sources.items() for _ in range(n)
        ]

    def _run(self, source: str) -> None:
        while not self.stop.is_set():
            try:
                status, headers, _, elapsed = post_token(self.url, _bogus_key(), source=source)
            except OSError as exc:  # a refused or reset connection is an answer too
                with self._lock:
                    self.errors.append(exc)
                self.stop.wait(self.pause)
                continue
            with self._lock:
                self.answers.append((source, status, headers.get("retry-after"), elapsed))
            self.stop.wait(self.pause)

    def __enter__(self) -> Flood:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


# ---------------------------------------------------------------------------- item 3


@pytest.mark.slow
def test_a_token_flood_from_one_and_from_several_addresses_does_not_delay_a_real_client(sos_server, tmp_path):
    gateway_key = sos_server.keygen(NS, "append")
    known = sos_server.keygen(NS, "append")
    fresh = sos_server.keygen(NS, "append")
    other = sos_server.keygen(NS, "append")
    gw = start_gateway(sos_server, tmp_path, namespace=NS, key=gateway_key)
    try:
        token(gw.url, known)  # a key the gateway saw accepted before the flood
        # 40 connections at a time from one address, 10 from each of four others, each
        # sending again a second after its answer: 80+ requests from 127.0.0.1
        sources = {"127.0.0.1": 40, **{f"127.0.0.{i}": 10 for i in range(2, 6)}}
        with Flood(gw.url, sources) as flood:
            time.sleep(3)  # the flood is at full strength: every check slot taken
            # a client the gateway never saw, from another address
            status, _, doc, elapsed = post_token(gw.url, fresh, source="127.0.0.99")
            assert status == 200, doc
            assert elapsed < 10, f"a real client's token took {elapsed:.1f} s during the flood"
            # a known key from the flooding address itself
            status, _, doc, elapsed = post_token(gw.url, known, source="127.0.0.1")
            assert status == 200, doc
            assert elapsed < 10, f"a known key's token took {elapsed:.1f} s during the flood"
            # another never-seen key from yet another address, a little later
            time.sleep(2)
            status, _, doc, elapsed = post_token(gw.url, other, source="127.0.0.98")
            assert status == 200, doc
            assert elapsed < 10, f"a real client's token took {elapsed:.1f} s during the flood"
        answers = list(flood.answers)  # (a refused connection, in flood.errors, is fine too)
        main = [a for a in answers if a[0] == "127.0.0.1"]
        assert len(main) >= 80, f"only {len(main)} flood requests answered from 127.0.0.1"
        assert {a[1] for a in answers} <= {401, 429, 503}, {a[1] for a in answers}
        throttled = [a for a in main if a[1] in (429, 503)]
        assert len(throttled) >= len(main) // 2, "the flooding address was not throttled"
        assert all(a[2] is not None and int(a[2]) >= 1 for a in throttled), "no Retry-After"
        assert max(a[3] for a in throttled) < 10, "a throttled request was not answered at once"
    finally:
        gw.stop()


@pytest.mark.slow
def test_malformed_and_just_refused_keys_are_answered_without_asking_the_server(sos_server, tmp_path):
    gw = start_gateway(sos_server, tmp_path, namespace=NS, key=sos_server.keygen(NS, "append"))
    try:
        before = server_log_count(sos_server, '"auth failed"')
        for bad in ("not a key", "0123" * 4 + "." + "zz" * 32, "ab" * 8 + "." + "cd" * 31):
            status, headers, doc, _ = post_token(gw.url, bad)
            assert status == 401 and doc["error"] == "invalid_client"
            assert headers["cache-control"] == "no-store"
        bogus = _bogus_key()
        for _ in range(3):  # asked once; the next two come from the negative cache
            status, _, doc, _ = post_token(gw.url, bogus)
            assert status == 401 and doc["error"] == "invalid_client"
        deadline = time.monotonic() + 30
        while server_log_count(sos_server, '"auth failed"') < before + 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        assert server_log_count(sos_server, '"auth failed"') == before + 1
    finally:
        gw.stop()


# ---------------------------------------------------------------------------- item 8


def revoke(server, key: str) -> None:
    """What removing a key on the server is: deleting its file (sos_server.keys)."""
    os.unlink(os.path.join(server.data_dir, "ns", NS, "keys", key.split(".")[0]))


@pytest.mark.slow
def test_a_revoked_key_gets_no_new_token_and_its_tokens_stop_within_the_recheck_interval(sos_server, tmp_path):
    recheck = 2
    gateway_key = sos_server.keygen(NS, "append")
    job = sos_server.keygen(NS, "append")
    job2 = sos_server.keygen(NS, "append")
    stays = sos_server.keygen(NS, "append")
    args = ["--key-recheck", str(recheck)]
    gw = start_gateway(sos_server, tmp_path, *args, namespace=NS, key=gateway_key)
    try:
        old = token(gw.url, job)
        kept = token(gw.url, stays)
        assert call(gw.url, "PUT", "/d/a", old, op="CREATE") == 201
        assert call(gw.url, "PUT", "/d/b", old, op="CREATE") == 201
        assert call(gw.url, "GET", "/d/a", old, op="GETFILESTATUS") == 200

        # between re-checks a request costs no AUTH at the server
        auths = server_log_count(sos_server, '"authenticated"')
        started = time.monotonic()
        for _ in range(20):
            assert call(gw.url, "GET", "/d", old, op="LISTSTATUS") == 200
        took = time.monotonic() - started
        time.sleep(0.5)
        extra = server_log_count(sos_server, '"authenticated"') - auths
        assert extra <= 2 + took / recheck, f"{extra} AUTHs for 20 requests in {took:.1f} s"

        # a key removed on the server gets no new token, at once (no cache)
        token(gw.url, job2)
        revoke(sos_server, job2)
        status, _, doc, _ = post_token(gw.url, job2)
        assert status == 401 and doc["error"] == "invalid_client"

        # and its existing tokens stop within the interval
        revoke(sos_server, job)
        revoked_at = time.monotonic()
        while call(gw.url, "GET", "/d/a", old, op="GETFILESTATUS") == 200:
            assert time.monotonic() - revoked_at < recheck + 20, "the revoked key's token still works"
            time.sleep(0.2)
        assert call(gw.url, "GET", "/d/a", old, op="GETFILESTATUS") == 401
        assert call(gw.url, "GET", "/d/a", old, op="OPEN") == 401
        assert call(gw.url, "PUT", "/d/c", old, op="CREATE") == 401
        assert call(gw.url, "DELETE", "/d/b", old, op="DELETE") == 401
        status, _, _, _ = post_token(gw.url, job)
        assert status == 401
        # the other key's token was never disturbed
        assert call(gw.url, "GET", "/d/b", kept, op="GETFILESTATUS") == 200
        assert call(gw.url, "GET", "/d/c", kept, op="GETFILESTATUS") == 404  # never created
    finally:
        gw.stop()

    # a gateway restarted with the same key: a valid token works, a revoked one does not
    gw = start_gateway(sos_server, tmp_path, *args, namespace=NS, key=gateway_key)
    try:
        assert call(gw.url, "GET", "/d/b", kept, op="GETFILESTATUS") == 200
        assert call(gw.url, "PUT", "/d/after", kept, op="CREATE") == 201
        assert call(gw.url, "DELETE", "/d/after", kept, op="DELETE") == 200
        assert call(gw.url, "GET", "/d/a", old, op="GETFILESTATUS") == 401
        assert call(gw.url, "PUT", "/d/c", old, op="CREATE") == 401
    finally:
        gw.stop()
