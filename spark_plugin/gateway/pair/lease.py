"""The lease of a gateway pair (protocol.md 3.6): how an active gateway says it is alive,
through the SOS server alone, and how a standby watches it.

The active gateway (``sos gateway NS --lease S``, and a promoted standby) appends one line to
the object ``lease/<epoch>`` of its namespace every ``S/4`` seconds, with its writer's epoch
(:class:`LeaseHolder`): the server takes it only while that epoch is the namespace's fence, so
the append that follows a standby's FENCE is refused, and the holder knows it lost the
namespace. Before each request (the gateway's gate) it checks its own lease: if no renewal
succeeded within ``S - S/4`` seconds of being sent (the process was paused, the server is
unreachable), it answers StandbyException instead of serving, so a paused and resumed
("zombie") gateway never serves stale reads, and its clients fail over.

A standby (:class:`LeaseWatcher`) lists ``lease/`` and notes when the newest lease object
last grew, by its own monotonic clock; the lease has expired once it saw no growth for ``S``
seconds while it could reach the server. No clocks are compared between machines, and the
server needs nothing new: leases are ordinary objects outside ``gen/``, which readers of the
journal ignore.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable

from sos_client.errors import Fenced, OffsetMismatch, SOSError, SOSNotFound
from sos_journal.tree.open import ClientFactory, OpenNamespace, RoleClient
from sos_wire.addresses import is_wildcard, split_address
from spark_plugin.gateway.http.auth import TokenInfo
from spark_plugin.gateway.http.connection import Conn
from spark_plugin.gateway.http.server import Gateway, standby_reply

__all__ = [
    "DEFAULT_LEASE",
    "LEASE_PREFIX",
    "LeaseHolder",
    "LeaseWatcher",
    "hold_lease",
    "last_renewals",
    "lease_name",
    "lease_url",
    "parse_lease_name",
]

log = logging.getLogger(__name__)

LEASE_PREFIX = "lease/"
#: seconds without a renewal after which a standby takes over (``--lease``)
DEFAULT_LEASE = 10.0


def lease_name(epoch: int) -> str:
    return f"{LEASE_PREFIX}{epoch:010d}"


def parse_lease_name(name: str) -> int | None:
    tail = name[len(LEASE_PREFIX) :] if name.startswith(LEASE_PREFIX) else ""
    return int(tail) if len(tail) == 10 and tail.isdigit() else None


class LeaseHolder:
    """The active side: renews ``lease/<epoch>`` every ``lease / 4`` seconds in a thread.

    ``factory``: connected clients of the namespace; ``epoch``: the writer's; ``url``: the
    gateway's address, written in each line for operators. ``lost`` is set (for good) once
    the server refuses a renewal as fenced. :meth:`gate` is the gateway's gate."""

    def __init__(
        self,
        factory: ClientFactory,
        epoch: int,
        lease: float,
        *,
        url: str = "",
        clock: Callable[[], float] = time.monotonic,
        durability: str = "",
        bound: Callable[[], tuple[str, int] | None] | None = None,
    ) -> None:
        if lease <= 0:
            raise ValueError("the lease must be more than 0 s")
        self.factory = factory
        self.epoch = epoch
        self.lease = lease
        self.interval = lease / 4
        self.url = url
        self._bound = bound  # the gateway's bound address: the port of a HOST:0 ``url``
        self.durability = durability  # named in each line (a standby compares it with its own)
        self.name = lease_name(epoch)
        self._clock = clock
        self._offset: int | None = None
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: RoleClient | None = None
        #: why this gateway no longer holds the namespace (a newer writer fenced it), or None
        self.lost: str | None = None
        self.renewals = 0

    @property
    def valid(self) -> bool:
        return self.lost is None and self._clock() < self._valid_until

    @property
    def valid_until(self) -> float:
        """When the lease lapses without a renewal (its clock's time: time.monotonic by
        default); what ``sos gateway --workers`` shows its read workers."""
        return self._valid_until

    def served_url(self) -> str:
        """``url``, with the port the gateway bound when ``url`` names port 0 (``--listen
        HOST:0``): a standby's probe of the active must reach it."""
        address = self._bound() if self._bound is not None else None
        head, sep, port = self.url.rpartition(":")
        if sep and port == "0" and address is not None and address[1]:
            return f"{head}:{address[1]}"
        return self.url

    def renew(self) -> bool:
        """One renewal (blocking); True if the server took it."""
        sent = self._clock()
        doc: dict[str, object] = {"t": int(time.time() * 1000), "url": self.served_url()}
        if self.durability:
            doc["durability"] = self.durability
        line = json.dumps(doc, separators=(",", ":")).encode() + b"\n"
        try:
            if self._client is None:
                self._client = self.factory()
            if self._offset is None:
                try:
                    self._offset = self._client.stat(self.name)[0]
                except SOSNotFound:
                    self._offset = 0
            self._offset = self._client.append(self.name, self._offset, line, epoch=self.epoch)
        except Fenced as exc:
            self.lost = f"a newer writer fenced namespace at epoch {exc.epoch} (this gateway's epoch is {self.epoch})"
            log.error("lease %s: %s: this gateway no longer serves", self.name, self.lost)
            return False
        except OffsetMismatch as exc:
            self._offset = exc.length
            return False
        except (SOSError, OSError) as exc:
            log.warning("lease %s: renewal failed: %r", self.name, exc)
            self._drop()
            return False
        self._valid_until = sent + self.lease - self.interval
        self.renewals += 1
        return True

    def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(SOSError, OSError):
                client.close()

    def start(self) -> None:
        """The first renewal now (a gateway serves only once it holds the lease), then one
        every ``interval`` seconds in a thread."""
        self.renew()
        self._thread = threading.Thread(target=self._run, name="sos-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval) and self.lost is None:
            self.renew()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
        self._drop()

    async def gate(self, conn: Conn, method: str, path: str, grant: TokenInfo) -> int | None:
        """Serve only while holding the lease: a fenced or lapsed holder answers as a standby
        NameNode, so clients go to the other gateway."""
        if self.lost is not None:
            raise standby_reply(f"this sos gateway is no longer the namespace's writer: {self.lost}")
        if not self.valid:
            raise standby_reply(
                f"this sos gateway could not renew its lease {self.name} for "
                f"{self.lease:g} s (paused, or the SOS server is unreachable)"
            )
        return None


def hold_lease(gateway: Gateway, opened: OpenNamespace, lease: float, url: str, durability: str = "") -> LeaseHolder:
    """``sos gateway --lease``: renew a lease with the writer's epoch from now on; the gateway
    serves only while it holds it (its gate). ``durability``: named in the lease's lines."""
    if opened.writer is None or opened.client_factory is None:
        raise ValueError("a lease needs the namespace opened as its writer")
    holder = LeaseHolder(
        opened.client_factory,
        opened.writer.epoch,
        lease,
        url=url,
        durability=durability,
        bound=lambda: gateway.address,
    )
    holder.start()
    gateway.gate = holder.gate
    return holder


def _last_line(client: RoleClient, name: str, length: int) -> dict[str, object]:
    """The last whole line of lease object ``name`` ({} if none)."""
    if length <= 0:
        return {}
    try:
        tail = b"".join(bytes(c) for c in client.read_iter(name, max(0, length - 1024), 0))
    except (SOSError, OSError):
        return {}
    for line in reversed(tail.split(b"\n")):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        return doc if isinstance(doc, dict) else {}
    return {}


def last_renewals(client: RoleClient, epoch: int) -> list[float]:
    """The Unix times (s) of the last renewals of ``lease/<epoch>`` (at most a few, oldest
    first; [] if that writer held no lease or it cannot be read): a gateway that takes a
    namespace over tells by them whether the previous writer was still alive."""
    name = lease_name(epoch)
    try:
        length = int(client.stat(name)[0])
        tail = b"".join(bytes(c) for c in client.read_iter(name, max(0, length - 1024), 0))
    except (SOSError, OSError):
        return []
    times = []
    for line in tail.split(b"\n"):
        with contextlib.suppress(ValueError, TypeError, KeyError):
            times.append(float(json.loads(line)["t"]) / 1000)
    return times[-4:]


def lease_url(advertise: str | None, listen: str) -> str:
    """What a lease line names: the address clients (and a standby's probe) reach the gateway
    at: ``--advertise``, else the listen address unless it is a wildcard ("")."""
    if advertise:
        return advertise
    try:
        host, _port = split_address(listen)
    except ValueError:
        return ""
    return "" if is_wildcard(host) else listen


class LeaseWatcher:
    """The standby side: :meth:`observe` (every poll) notes whether the newest ``lease/``
    object grew; :meth:`silent_for` is how long, by this process's clock, it did not while the
    server could be reached (None: no lease seen yet: an active without ``--lease`` is never
    taken over automatically)."""

    def __init__(self, lease: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease = lease
        self._clock = clock
        self.current: tuple[str, int] | None = None  # (name, length) last seen
        #: HOST:PORT the newest lease's holder serves on (its last line's "url"), or ""
        self.active_address = ""
        #: the durability the newest lease's holder names ("" if its lines do not say)
        self.active_durability = ""
        self._since: float | None = None  # when it was last seen to change (or contact came back)
        self._contact = True

    def observe(self, client: RoleClient) -> None:
        try:
            newest = None
            for entry in client.list(LEASE_PREFIX):
                epoch = parse_lease_name(entry.name)
                if epoch is not None and (newest is None or epoch > newest[0]):
                    newest = (epoch, entry.name, int(entry.length))
        except (SOSError, OSError):
            self._contact = False
            raise
        now = self._clock()
        if not self._contact:  # the server was away: silence counts again from now
            self._contact = True
            self._since = now
        if newest is None:
            return
        seen = (newest[1], newest[2])
        if seen != self.current:
            self.current = seen
            self._since = now
            last = _last_line(client, seen[0], seen[1])
            self.active_address = str(last.get("url", ""))
            self.active_durability = str(last.get("durability", ""))

    def forget(self) -> None:
        """After a promotion: the old active's silence counts no more."""
        self.current = None
        self._since = None

    def silent_for(self) -> float | None:
        if self._since is None:
            return None
        return self._clock() - self._since

    @property
    def expired(self) -> bool:
        silent = self.silent_for()
        return silent is not None and silent >= self.lease

    @property
    def lapsing(self) -> bool:
        """No renewal for more than two renewal intervals: the active is probably gone."""
        silent = self.silent_for()
        return silent is not None and silent > self.lease / 2
