"""The journal writer's view of a server lost in the middle of a round trip, against a REAL
sos-server process behind a small TCP relay the test cuts: the writer's state says "retrying"
and names the error from the first failed round, not after its client's own reconnect patience
(``timeout``, 60 s here: a ``sos_client.Client`` whose connection breaks inside a call
reconnects for up to that long before it raises); it ships everything once the server is
reachable again. No timing assertions: each wait is for an event, with a limit far below the
client's patience and far above what the event takes."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time

from sos_client import Client
from sos_journal import JournalWriter
from sos_journal.format.records import Create

CLIENT_TIMEOUT = 60.0  # the client's reconnect patience, which the writer must not wait out
_ns = itertools.count()


class Relay:
    """127.0.0.1:PORT -> the server. ``cut_next_request()``: the next bytes a client sends are
    swallowed, then the listener and every connection close (the server lost mid-call: the
    request went out, no reply comes, a reconnect is refused). ``restore()`` listens again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self.cut = threading.Event()
        self.listener: socket.socket | None = None
        self.conns: list[socket.socket] = []
        self.listen()

    def listen(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if from_client and self.cut.is_set():
                self._close_all()  # the request is swallowed: no reply will come
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self._close_all()

    def _close_all(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.conns.clear()

    def cut_next_request(self) -> None:
        self.cut.set()

    def restore(self) -> None:
        self.cut.clear()
        self.listen()


def _wait_for(check, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_a_server_lost_inside_a_round_trip_shows_as_retrying_at_once(sos_server, tmp_path):
    ns = f"outage{next(_ns)}-{os.getpid()}"
    key = sos_server.keygen(ns, "append")
    relay = Relay(sos_server.host_port)
    address = f"127.0.0.1:{relay.port}"
    writer = JournalWriter(lambda: Client(address, key, ns, timeout=CLIENT_TIMEOUT), ns, str(tmp_path / "spool"))
    try:
        writer.open()
        writer.rotate([])  # generation 1, empty
        writer.append(Create(path="a", mode=0o644))
        writer.barrier(timeout=60)  # the replicator's connection is up and idle
        assert writer.status()["state"] == "ok"
        relay.cut_next_request()
        writer.append(Create(path="b", mode=0o644))  # its APPEND goes out and is swallowed
        assert _wait_for(lambda: writer.status()["state"] == "retrying", CLIENT_TIMEOUT / 3), writer.status()
        status = writer.status()
        assert status["unshipped_bytes"] > 0 and "ConnectionLost" in (status["error"] or ""), status
        relay.restore()
        writer.barrier(timeout=60)  # everything shipped once the server is reachable again
        status = writer.status()
        assert status["state"] == "ok" and status["unshipped_bytes"] == 0, status
        assert status["acked_seq"] == status["last_seq"]
    finally:
        writer.abandon()  # (everything is shipped when the test passed)
        relay.close()
