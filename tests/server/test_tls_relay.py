"""Issue 9, item 9: an on-path relay must not get an authenticated connection.

A relay that terminates the victim's TLS with a certificate of its own, opens its own TLS
connection to the real server and copies HELLO/AUTH through used to get AUTH_OK, then
injected its own FENCE and APPEND. The AUTH proof is now bound to the server's certificate
(protocol.md 1.6, tls-server-end-point): the relayed AUTH is refused and the injected
requests are answered NOT_AUTHENTICATED. Real server process, real TLS, real sockets.
"""

from __future__ import annotations

import pathlib
import ssl
import struct
import threading
from typing import Self

import pytest
import trio

from sos_client import Client
from sos_client.errors import SOSNotFound, SOSPermissionError
from sos_wire import events as ev
from sos_wire.auth import Key, proof, tls_server_end_point
from sos_wire.connection import decode_body, encode_event
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.frames import HEADER_LEN, Op
from tests.support import self_signed_cert

pytestmark = [pytest.mark.hostile]

NS = "victim"
TIMEOUT = 60


class Relay:
    """An on-path attacker between the victim and the server, run by trio in a thread.

    ``mode="terminate"``: it accepts the victim's TLS with its own certificate, opens its
    own TLS connection to the server and copies the bytes both ways; when the victim is
    gone it sends ``inject`` (already encoded frames) on the server connection and records
    every frame the server sent (``replies``).  ``mode="tcp"``: it copies TCP bytes and
    does not touch TLS (the victim then talks TLS to the real server through it)."""

    def __init__(
        self,
        server: str,
        *,
        mode: str,
        cert: str | None = None,
        key: str | None = None,
        server_ca: str | None = None,
        inject: bytes = b"",
        inject_ids: tuple[int, ...] = (),
    ) -> None:
        self.host, port = server.rsplit(":", 1)
        self.port = int(port)
        self.mode = mode
        self.inject, self.inject_ids = inject, set(inject_ids)
        self.replies: list = []
        self.connections = 0
        if mode == "terminate":
            self.own = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self.own.load_cert_chain(cert, key)
            self.upstream = ssl.create_default_context(cafile=server_ca)
        self._started = threading.Event()
        self._active = 0
        self._idle = threading.Condition()
        self._token = None
        self._scope: trio.CancelScope | None = None
        self.address = ""
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._started.wait(TIMEOUT), "the relay did not start"
        if self.error is not None:
            raise self.error
        return self

    def __exit__(self, *exc) -> None:
        with self._idle:  # let every connection finish (the injection waits for its replies)
            self._idle.wait_for(lambda: self._active == 0, TIMEOUT)
        trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(TIMEOUT)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self.error = exc
            self._started.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self._scope:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            self.address = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
            self._started.set()
            await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, victim: trio.SocketStream) -> None:
        with self._idle:
            self._active += 1
            self.connections += 1
        try:
            await self._relay(victim)
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    async def _relay(self, victim: trio.SocketStream) -> None:
        upstream: trio.abc.Stream = await trio.open_tcp_stream(self.host, self.port)
        if self.mode == "terminate":
            victim = trio.SSLStream(victim, self.own, server_side=True)
            upstream = trio.SSLStream(upstream, self.upstream, server_hostname=self.host)
        replies = bytearray()
        got_injected = trio.Event()

        async def victim_to_server() -> None:
            try:
                while data := await victim.receive_some(65536):
                    await upstream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            if self.mode == "terminate" and self.inject:
                # the victim left: the connection to the server is the attacker's own now
                await upstream.send_all(self.inject)
                await got_injected.wait()
            nursery.cancel_scope.cancel()

        async def server_to_victim() -> None:
            try:
                while data := await upstream.receive_some(65536):
                    replies.extend(data)
                    self._parse(replies, got_injected)
                    try:
                        await victim.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # the victim is gone: keep recording what the server says
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            got_injected.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(victim_to_server)
            nursery.start_soon(server_to_victim)
        await trio.aclose_forcefully(upstream)
        await trio.aclose_forcefully(victim)

    def _parse(self, buf: bytearray, got_injected: trio.Event) -> None:
        while len(buf) >= HEADER_LEN:
            _magic, _version, op, rid, body_len = struct.unpack_from(">2sBBII", buf)
            if len(buf) < HEADER_LEN + body_len:
                return
            body = bytes(buf[HEADER_LEN : HEADER_LEN + body_len])
            del buf[: HEADER_LEN + body_len]
            self.replies.append(decode_body(Op(op), rid, body))
            if self.inject_ids and self.inject_ids <= {r.request_id for r in self.replies}:
                got_injected.set()


@pytest.fixture
def tls_setup(sos_server_factory, tmp_path):
    server_cert, server_key = self_signed_cert(tmp_path, "server")
    relay_cert, relay_key = self_signed_cert(tmp_path, "relay")
    srv = sos_server_factory(args=["--tls-cert", server_cert, "--tls-key", server_key], start=False)
    key = srv.keygen(NS, "append")
    srv.start()
    return srv, key, server_cert, (relay_cert, relay_key)


def _no_verify() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


@pytest.mark.parametrize("victim_trust", ["relay-cert", "no-verification"])
def test_relay_terminating_tls_with_its_own_certificate_gets_no_session(tls_setup, victim_trust):
    srv, key, server_cert, (relay_cert, relay_key) = tls_setup
    fence = ev.Fence(100, 7)
    append = ev.Append(101, "injected", 0, 7, crc32c(b"evil"), b"evil")
    victim_ctx = ssl.create_default_context(cafile=relay_cert) if victim_trust == "relay-cert" else _no_verify()
    with Relay(
        srv.address,
        mode="terminate",
        cert=relay_cert,
        key=relay_key,
        server_ca=server_cert,
        inject=encode_event(fence) + encode_event(append),
        inject_ids=(100, 101),
    ) as relay:
        # the victim's own AUTH is refused: its proof names the relay's certificate
        with pytest.raises(SOSPermissionError) as info:
            Client(relay.address, key, NS, timeout=TIMEOUT, tls=victim_ctx)
        assert info.value.code == ErrorCode.AUTH_FAILED
    assert relay.connections == 1
    by_id = {r.request_id: r for r in relay.replies}
    assert isinstance(by_id[1], ev.HelloOk)
    assert isinstance(by_id[2], ev.Error) and by_id[2].code == ErrorCode.AUTH_FAILED, by_id[2]
    # what the relay injected on the connection it passed the handshake through
    for rid in (100, 101):
        assert isinstance(by_id[rid], ev.Error) and by_id[rid].code == ErrorCode.NOT_AUTHENTICATED, by_id[rid]
    # nothing of it reached the namespace: no object, and the epoch is not fenced at 7
    with Client(srv.address, key, NS, timeout=TIMEOUT, tls=ssl.create_default_context(cafile=server_cert)) as c:
        with pytest.raises(SOSNotFound):
            c.stat("injected")
        assert c.fence(1) == 1
        assert c.append("real", 0, b"mine", epoch=1) == 4


def test_tls_through_a_tcp_relay_still_authenticates(tls_setup):
    """The control: the same relay copying TCP bytes (TLS end to end with the real server)
    changes nothing, so it is the certificate that the refusal above depends on."""
    srv, key, server_cert, _ = tls_setup
    ctx = ssl.create_default_context(cafile=server_cert)
    # the relay's address is 127.0.0.1 too: the server's certificate matches it
    with Relay(srv.address, mode="tcp") as relay, Client(relay.address, key, NS, timeout=TIMEOUT, tls=ctx) as c:
        assert c.append("through", 0, b"ok") == 2
        assert c.read("through") == b"ok"
    assert relay.connections == 1


def test_unbound_proof_over_tls_is_refused(tls_setup):
    """A TLS client that sends the plain-TCP proof (no binding) is refused: the server
    accepts only the proof bound to its own certificate."""
    import socket

    from tests.conftest import RawClient

    srv, key, server_cert, _ = tls_setup
    k = Key.parse(key)
    host, port = srv.host_port
    raw = socket.create_connection((host, port), timeout=TIMEOUT)
    ctx = ssl.create_default_context(cafile=server_cert)
    with ctx.wrap_socket(raw, server_hostname=host) as tls:
        c = RawClient(None, sock=tls)
        hello = c.call(ev.Hello(c.rid(), "test", 1, 1))
        r = c.call(ev.Auth(c.rid(), k.key_id, NS, k.proof(hello.nonce, NS)))
        assert isinstance(r, ev.Error) and r.code == ErrorCode.AUTH_FAILED
        binding = tls_server_end_point(tls.getpeercert(binary_form=True))
        r = c.call(ev.Auth(c.rid(), k.key_id, NS, k.proof(hello.nonce, NS, binding)))
        assert isinstance(r, ev.AuthOk)


def test_server_binds_to_the_first_certificate_of_a_chain_file(sos_server_factory, tmp_path):
    leaf, leaf_key = self_signed_cert(tmp_path, "leaf")
    other, _ = self_signed_cert(tmp_path, "other")
    chain = tmp_path / "chain.pem"
    chain.write_bytes(pathlib.Path(leaf).read_bytes() + pathlib.Path(other).read_bytes())
    srv = sos_server_factory(args=["--tls-cert", chain, "--tls-key", leaf_key], start=False)
    key = srv.keygen(NS, "append")
    srv.start()
    with Client(srv.address, key, NS, timeout=TIMEOUT, tls=ssl.create_default_context(cafile=leaf)) as c:
        assert c.append("chain", 0, b"x") == 1


def test_bound_proof_example_in_protocol_md():

    text = (pathlib.Path(__file__).resolve().parents[2] / "protocol.md").read_text(encoding="utf-8")
    binding = b"tls-server-end-point:" + b"\x22" * 32
    want = proof(b"\x11" * 32, bytes(range(32)), "ns1", bytes.fromhex("0123456789abcdef"), binding).hex()
    assert f"bound proof = `{want}`" in text
    assert tls_server_end_point(b"\x30\x00")[:21] == b"tls-server-end-point:"
    assert len(tls_server_end_point(b"\x30\x00")) == 53
    plain = proof(b"\x11" * 32, bytes(range(32)), "ns1", bytes.fromhex("0123456789abcdef"))
    assert plain.hex() != want
