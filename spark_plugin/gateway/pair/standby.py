"""`sos gateway NS --standby`: a warm standby of a namespace's gateway (protocol.md 3.6).

A standby serves the same WebHDFS address space as the active gateway but writes nothing:

* it keeps its cache's tree equal to the namespace's journal by tailing it from the server
  (:class:`Tailer`: the journal core's reading and replay, record after record, with the
  same sequence checks as restore; a new generation's snapshot restates the tree it already
  holds and is skipped);
* it answers every WebHDFS request (and markers) with 403 StandbyException, as a standby
  NameNode does, so Hadoop's HA client (a ``webhdfs://<nameservice>`` URI) goes to the
  other address; it issues tokens (a token request only needs the key check at the server,
  and tokens sealed with the namespace's gateway key verify on either gateway);
* it watches the active gateway's lease (:class:`~.lease.LeaseWatcher`) and, once the lease
  was silent for ``--lease`` seconds, or when asked (``sos gateway promote``: ``POST
  /sos/v1/promote`` from a loopback address with a token of an append-role key: not a
  token-role key, whose token is an append token too), it is promoted
  (:meth:`Standby.promote`): FENCE (epoch + 1: every later append of the old active is
  refused), the tail finished to the journal's last record, the journal writer opened on its
  cache as a new gateway's is (``open_namespace(replayed_to=...)``: no snapshot, the
  generation continues), a lease of its own, then it serves. Requests that come while the
  active's lease is lapsing or the promotion is under way are held (at most ``hold``
  seconds) and served once it is active, rather than bounced between a dead address and a
  standby until the client's retries run out.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import trio

from sos_client.errors import Fenced, SOSError
from sos_journal.errors import JournalCorrupt, JournalError
from sos_journal.faces.facade import FenceWatch
from sos_journal.format import layout
from sos_journal.format.auth import TailCheck, resolve_journal_keys
from sos_journal.format.records import Record, RecordDecoder, SnapshotEnd
from sos_journal.read.reading import list_generations
from sos_journal.rebuild.replay import Replayer, ReplayError
from sos_journal.rebuild.restore import rebuild_cache
from sos_journal.tree.open import (
    ClientFactory,
    OpenNamespace,
    ReadOnlyTree,
    RoleClient,
    client_factory_for,
    default_cache_dir,
    key_role,
    private_cache_dir,
)
from sos_journal.writer.resume import server_last
from sos_wire.addresses import is_loopback, split_address
from sos_wire.events import KeyRole
from spark_plugin.gateway.client import GatewayClient
from spark_plugin.gateway.http.auth import TokenInfo
from spark_plugin.gateway.http.connection import Conn, Reply, json_body
from spark_plugin.gateway.http.metrics import GatewayMetrics, serve_metrics
from spark_plugin.gateway.http.server import Gateway, standby_reply
from spark_plugin.gateway.options import GatewayOptions
from spark_plugin.gateway.pair.lease import DEFAULT_LEASE, LeaseHolder, LeaseWatcher, lease_url
from spark_plugin.gateway.pair.metrics import StandbyCollector
from spark_plugin.gateway.serving import (
    Serving,
    build_gateway,
    check_serving,
    close_journal,
    final_flush,
    parse_metrics_listen,
    serve_gateway,
    webhdfs_view,
)
from spark_plugin.gateway.webhdfs.hdfs import remote_exception
from spark_plugin.gateway.webhdfs.namespace import WebHdfsNamespace
from spark_plugin.gateway.webhdfs.renames import JournalRenames

__all__ = ["PROMOTE_PATH", "Standby", "Tailer", "promote", "promote_url_refusal", "run_standby"]

log = logging.getLogger(__name__)

PROMOTE_PATH = "/sos/v1/promote"
#: seconds between two looks at the server (journal tail and lease)
POLL = 0.25
#: most seconds a request waits at a standby whose promotion is near or under way
HOLD = 30.0


def _before(client: RoleClient, gens: dict[int, layout.GenerationInfo], seg: layout.SegmentInfo) -> Record | None:
    """The last record of the segment before ``seg`` in its generation (None: none)."""
    earlier = [s for s in gens[seg.generation].segments if s.first_seq < seg.first_seq and s.length]
    return server_last(client, earlier[-1].name) if earlier else None


class Tailer:
    """Keeps ``tree_dir`` equal to the namespace's journal up to record :attr:`seq`."""

    def __init__(self, factory: ClientFactory, namespace: str, tree_dir: str) -> None:
        self.factory = factory
        self.namespace = namespace
        self.tree_dir = tree_dir
        self.seq = 0
        self.needs_rebuild = True
        self.rebuilds = 0
        self._snapshot = False  # skipping a new generation's snapshot (it restates the tree)
        self._cur: layout.SegmentInfo | None = None
        self._dec = RecordDecoder()
        self._read_to = 0
        self._replayer: Replayer | None = None
        self._auth = TailCheck(resolve_journal_keys(), namespace)  # protocol.md 2.5
        #: the RENAMEs of the journal replayed, for the memory of a promotion (resends)
        self.renames = JournalRenames()

    def rebuild(self) -> None:
        """The tree rebuilt from the server (restore's code), the tail from its last record."""
        self.close()
        self.renames = JournalRenames()
        self.seq = rebuild_cache(self.factory, self.namespace, self.tree_dir, observe=self.renames)
        self._cur = None
        self._auth.reset()
        self._snapshot = False
        self._replayer = Replayer(self.tree_dir)
        self.needs_rebuild = False
        self.rebuilds += 1
        log.info("standby cache rebuilt from the server up to record %d", self.seq)

    @staticmethod
    def _locate(gens: dict[int, layout.GenerationInfo], wanted: int) -> tuple[layout.SegmentInfo, bool] | None:
        """The segment that holds record ``wanted`` (the newest one starting at or before
        it: a later segment starting exactly there supersedes the tail of an earlier one)
        and whether it starts a generation."""
        best: tuple[tuple[int, int, int], layout.SegmentInfo, bool] | None = None
        for g in gens.values():
            for i, s in enumerate(g.segments):
                if s.first_seq <= wanted:
                    key = (s.first_seq, s.generation, s.epoch)
                    if best is None or key > best[0]:
                        best = (key, s, i == 0)
        return None if best is None else (best[1], best[2])

    def step(self, client: RoleClient) -> int:
        """Apply every record the server holds beyond :attr:`seq`; returns how many. A
        journal that does not continue the tree (a gap, a record that does not apply)
        raises, and the next step starts with a rebuild."""
        if self.needs_rebuild:
            self.rebuild()
        try:
            return self._step(client)
        except (JournalCorrupt, JournalError, ReplayError):
            self.needs_rebuild = True
            raise

    def _step(self, client: RoleClient) -> int:
        assert self._replayer is not None
        gens = list_generations(client)
        applied = 0
        while True:
            found = self._locate(gens, self.seq + 1)
            if found is None:
                return applied
            seg, starts_generation = found
            if self._cur is None or seg.name != self._cur.name:
                self._cur = seg
                self._dec = RecordDecoder(seg.name, keys=self._auth.for_segment(seg.name))
                self._read_to = 0
                self._auth.enter(seg, starts_generation, self.seq, functools.partial(_before, client, gens, seg))
                # a new generation's snapshot restates the tree this one holds: skipped; the
                # first generation's (seq 0: the tree is empty) is applied like any records
                if starts_generation and seg.first_seq == self.seq + 1 and self.seq > 0:
                    self._snapshot = True
            before = self.seq
            for chunk in client.read_iter(seg.name, self._read_to, 0):
                self._read_to += len(chunk)
                self._dec.feed(chunk)
                for rec in self._dec:
                    if rec.seq <= self.seq:
                        self._auth.seen(rec, self.seq)
                        continue
                    if rec.seq != self.seq + 1:
                        raise JournalCorrupt(
                            seg.name, rec.offset, f"sequence gap: expected record {self.seq + 1}, found {rec.seq}"
                        )
                    self._auth.check(rec)
                    if self._snapshot:
                        if type(rec.op) is SnapshotEnd:
                            self._snapshot = False
                    else:
                        self._replayer.apply(rec)
                        self.renames(rec)
                    self.seq = rec.seq
                    applied += 1
            if self.seq == before:
                return applied  # nothing new here; a segment after it would start at seq + 1

    def close(self) -> None:
        if self._replayer is not None:
            self._replayer.close()
            self._replayer = None


class Standby:
    """A standby gateway's state and its thread (see the module docstring).

    ``open_active()`` opens the namespace as its writer on the standby's cache once fenced
    (``replayed_to``: the last record of the tail) and returns the WebHDFS view to serve."""

    def __init__(
        self,
        gateway: Gateway,
        tailer: Tailer,
        factory: ClientFactory,
        *,
        lease: float,
        open_active: Callable[[int], tuple[OpenNamespace, WebHdfsNamespace]],
        poll: float = POLL,
        hold: float = HOLD,
        lease_url: str = "",
        key_role_of: Callable[[str], KeyRole | None] | None = None,
    ) -> None:
        self.gateway = gateway
        #: the role of a key (its text) at the SOS server: a promotion needs an append key
        self.key_role_of = key_role_of
        self.lease_url = lease_url
        self.tailer = tailer
        self.factory = factory
        self.lease = lease
        self.open_active = open_active
        self.poll = poll
        self.hold = hold
        self.watcher = LeaseWatcher(lease)
        self.state = "standby"  # then "promoting", "active"
        self.opened: OpenNamespace | None = None
        self.holder: LeaseHolder | None = None
        self.promote_reason = ""
        self.promotion_error = ""
        self.epoch = 0
        self.last_tail = 0.0  # Unix time of the last successful tail and lease check
        self.durability = ""  # what it writes with once promoted (run_standby: its options')
        self._compared = ""  # the lease whose durability was compared with it
        self._wanted = threading.Event()  # a promotion by hand was asked
        self._probed: tuple[float, str, bool] | None = None  # (when, address, down)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sos-standby", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.holder is not None:
            self.holder.stop()
        self.tailer.close()

    def _warn_no_lease(self, started: float, first_seq: int) -> bool:
        """Warn that no lease is there to watch (the pair cannot fail over by itself): once the
        standby has seen none for its own ``--lease`` (an active started with it has one by
        then), and every minute after. True when it warned."""
        if time.monotonic() - started < max(self.lease, 2.0):
            return False
        if self.tailer.seq > first_seq:
            what = (
                f"the active gateway is writing the journal (record {self.tailer.seq}) but holds no "
                "lease: it runs without --lease"
            )
        else:
            what = "no active gateway holds a lease under lease/"
        log.warning(
            "standby: %s, so this standby cannot tell when it dies and will never take over by "
            "itself: run the active with --lease (both members of a pair: docs/SPARK.md, "
            '"A gateway pair"), or promote this one by hand with `sos gateway promote`',
            what,
        )
        return True

    def _run(self) -> None:
        client: RoleClient | None = None
        logged = 0.0
        started, first_seq = time.monotonic(), self.tailer.seq
        while not self._stop.is_set() and self.state != "active":
            try:
                if client is None:
                    client = self.factory()
                self.tailer.step(client)
                self.watcher.observe(client)
                self.last_tail = time.time()
                self._compare_durability()
            except (SOSError, OSError, JournalError, JournalCorrupt, ReplayError) as exc:
                log.warning("standby: tail or lease check failed (retrying): %r", exc)
                if client is not None:
                    with contextlib.suppress(SOSError, OSError):
                        client.close()
                client = None
                self._stop.wait(min(2.0, self.poll * 4))
                continue
            silent = self.watcher.silent_for()
            if self._wanted.is_set():
                self._promote(client, self.promote_reason or "asked by hand")
            elif silent is not None and silent >= self.lease:
                self._promote(
                    client,
                    f"the active gateway's lease {self.watcher.current[0] if self.watcher.current else ''} "
                    f"was not renewed for {silent:.1f} s (--lease {self.lease:g})",
                )
            elif silent is None and time.monotonic() - logged > 60 and self._warn_no_lease(started, first_seq):
                logged = time.monotonic()
            self._stop.wait(self.poll)
        if client is not None:
            with contextlib.suppress(SOSError, OSError):
                client.close()

    def _compare_durability(self) -> None:
        """Warn (once per lease) when the active's lease names a durability other than the
        one this standby would write with once promoted (it runs with its own options)."""
        theirs = self.watcher.active_durability
        lease = self.watcher.current[0] if self.watcher.current else ""
        if not theirs or not self.durability or theirs == self.durability or lease == self._compared:
            return
        self._compared = lease
        log.warning(
            "standby: the active gateway (lease %s) runs with --durability %s, this standby with "
            "--durability %s: once promoted it would write with %s. Start it with the active's "
            "options (docs/SPARK.md, A gateway pair)",
            lease,
            theirs,
            self.durability,
            self.durability,
        )

    def _promote(self, client: RoleClient, reason: str) -> None:
        """FENCE, finish the tail, open the writer on the cache, take a lease, serve."""
        self.state = "promoting"
        log.warning("standby: promoting: %s", reason)
        started = time.monotonic()
        try:
            try:
                client.fence(0)  # answers FENCED with the namespace's fence
                current = 0
            except Fenced as exc:
                current = exc.epoch
            epoch = client.fence(current + 1) or current + 1
            # nothing older can append now: what the server holds is the whole journal
            self.tailer.step(client)
            self.tailer.close()
            opened, ns = self.open_active(self.tailer.seq)
            assert opened.writer is not None
            holder = LeaseHolder(
                self.factory,
                opened.writer.epoch,
                self.lease,
                url=self.lease_url,
                bound=lambda: self.gateway.address,
            )
            holder.start()
        except Exception as exc:  # noqa: BLE001 - reported; the loop tries again
            self.state = "standby"
            self.promotion_error = f"{type(exc).__name__}: {exc}"
            self.tailer.needs_rebuild = True
            log.error("standby: promotion failed (the loop tries again): %r", exc)
            self._stop.wait(1.0)
            return
        self.opened, self.holder, self.epoch = opened, holder, opened.writer.epoch
        self.gateway.become_active(ns)  # its gate stays this one: PROMOTE_PATH, then the lease
        self.state = "active"
        self._wanted.clear()
        log.warning(
            "standby: promoted in %.2f s: fenced epoch %d, the writer at epoch %d "
            "continues the journal after record %d%s",
            time.monotonic() - started,
            epoch,
            opened.writer.epoch,
            self.tailer.seq,
            "" if not opened.rebuilt else " (its cache was rebuilt)",
        )

    # ------------------------------------------------------------------ the gate
    async def gate(self, conn: Conn, method: str, path: str, grant: TokenInfo) -> int | None:
        if path == PROMOTE_PATH:
            return await self._promote_request(conn, method, grant)
        if self.state != "active" and (
            self.state == "promoting" or self._wanted.is_set() or self.watcher.lapsing or await self._active_down()
        ):
            await _until(lambda: self.state == "active", self.hold)
        if self.state == "active" and self.holder is not None:
            return await self.holder.gate(conn, method, path, grant)
        raise standby_reply(
            "this sos gateway is a standby (it tails the journal and takes over when the active gateway's lease lapses)"
        )

    async def _active_down(self) -> bool:
        """Does the active gateway's address (its lease's "url") refuse connections, or not
        answer one within a second? A client is sent here by exactly that, or by a standby
        NameNode's answer: while the active is down, hold its request until this standby
        takes over rather than send it back to a dead address (the lease still decides the
        promotion). Remembered for half a second."""
        address = self.watcher.active_address
        if not address or self.watcher.silent_for() is None:
            return False
        now = trio.current_time()
        if self._probed is not None and now - self._probed[0] < 0.5 and self._probed[1] == address:
            return self._probed[2]
        try:
            host, port = split_address(address)
        except ValueError:
            return False
        down = True
        with trio.move_on_after(1.0):
            try:
                stream = await trio.open_tcp_stream(host, port or 9870)
            except OSError:
                pass
            else:
                await stream.aclose()
                down = False
        self._probed = (now, address, down)
        return down

    async def _promote_request(self, conn: Conn, method: str, grant: TokenInfo) -> int:
        if method != "POST":
            raise Reply(
                405,
                remote_exception("UnsupportedOperationException", f"{PROMOTE_PATH} takes POST"),
                [("allow", "POST")],
            )
        host = conn.peer.split("/")[0]
        if not (host and is_loopback(host)) or not grant.can_write:
            raise _promote_refusal("")
        await self._check_append_key(grant)
        was = self.state
        if was != "active":
            self.promote_reason = "asked by hand (sos gateway promote)"
            self.promotion_error = ""
            self._wanted.set()
            await _until(lambda: self.state == "active" or bool(self.promotion_error), 300)
        if self.state != "active":
            self._wanted.clear()
            raise Reply(
                500, remote_exception("IOException", f"promotion failed: {self.promotion_error or 'timed out'}")
            )
        await conn.respond(200, json_body({"promoted": was != "active", "epoch": self.epoch, "seq": self.tailer.seq}))
        return 200

    async def _check_append_key(self, grant: TokenInfo) -> None:
        """403 unless the token's key has the append role at the SOS server now. The gateway
        issues append tokens for token-role keys too (a job's credential, which DEPLOY.md
        says cannot fence the writer): a promotion FENCEs, so it asks the server what the
        key itself may do, as the server does for FENCE. (``--insecure-no-auth``, loopback
        only: no key, every request has every right.)"""
        if not grant.key_secret or self.key_role_of is None:
            return
        try:
            role = await trio.to_thread.run_sync(self.key_role_of, grant.key_text, abandon_on_cancel=True)
        except PermissionError:
            raise _promote_refusal("the SOS server no longer accepts this token's key") from None
        except (SOSError, OSError) as exc:
            raise Reply(
                503, remote_exception("IOException", f"cannot ask the SOS server for the key's role: {exc}")
            ) from None
        if role != KeyRole.APPEND:
            name = role.name.lower() if role is not None else "unknown"
            raise _promote_refusal(f"this token's key has the {name} role, which cannot fence the writer")


def _promote_refusal(why: str) -> Reply:
    """403 AccessControlException for a promotion refused (``why``: more than the rule)."""
    rule = f"{PROMOTE_PATH} is accepted from a loopback address with a token of an append-role key only"
    return Reply(
        403,
        remote_exception(
            "AccessControlException",
            f"{rule}: {why}" if why else rule,
            "org.apache.hadoop.security.AccessControlException",
        ),
    )


async def _until(done: Callable[[], bool], seconds: float) -> None:
    """Wait until ``done()`` (the standby's thread changes the state it reads), at most
    ``seconds``; polled every 50 ms (the thread has no trio token to wake us with)."""
    for _ in range(max(1, int(seconds / 0.05))):
        if done():
            return
        await trio.sleep(0.05)


class PromotedFenceWatch(FenceWatch):
    """run.py's fence watch of a standby: nothing to watch until it is promoted, then its
    writer's (a newer writer fencing the promoted gateway stops it as it stops any)."""

    def __init__(self, standby: Standby, interval: float) -> None:
        self.standby = standby
        self.interval = interval
        self._inner: FenceWatch | None = None

    def check(self) -> str | None:
        opened = self.standby.opened
        if opened is None or opened.writer is None:
            return None
        if self._inner is None:
            self._inner = FenceWatch(
                opened.namespace, opened.writer, opened.client_factory, self.interval, who="this gateway"
            )
        return self._inner.check()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()


def prepare_cache(cache_dir: str) -> str:
    """The standby's cache: private, its tree emptied (it is rebuilt from the server), and
    a spool left by an earlier gateway on it moved aside (its writer was fenced or stopped;
    a newer writer's journal is the truth). Returns the tree's directory."""
    private_cache_dir(cache_dir, {"tree": 0o755})
    spool = os.path.join(cache_dir, "spool")
    if os.path.isdir(spool) and os.listdir(spool):
        aside = f"{spool}.replaced-{int(time.time())}"
        os.rename(spool, aside)
        log.warning(
            "the cache's spool of an earlier gateway was moved to %s (a standby starts from the server's journal)",
            aside,
        )
    return os.path.join(cache_dir, "tree")


def run_standby(options: GatewayOptions, *, poll: float = POLL) -> int:
    """What ``sos gateway NS --standby`` runs: ``options`` as run_gateway's (``lease``:
    seconds of silence of the active's lease before taking over, None: DEFAULT_LEASE;
    ``metrics``: the endpoint serves the standby's series from the start and the writer's
    once promoted (:mod:`.standby_metrics`); ``restore_batch`` is the active's own), ``poll``:
    seconds between two looks at the server. Promoted, it is the writer with ``options``
    (durability, sync, generation bytes, TLS, lease...): logged as it opens the journal."""
    serving = check_serving(options)
    if options.metrics is not None:
        parse_metrics_listen(options.metrics)  # a bad address: refused before anything is opened
    cache_dir = os.path.abspath(options.cache_dir or default_cache_dir(options.namespace))
    factory = options.client_factory or client_factory_for(
        options.server, options.key, options.namespace, timeout=options.timeout, tls=options.tls_client
    )
    if key_role(factory, options.timeout) != KeyRole.APPEND:
        raise PermissionError(
            f"a standby gateway needs a key of namespace {options.namespace!r} with the "
            f"append role: it becomes the namespace's writer when promoted"
        )
    tailer = Tailer(factory, options.namespace, prepare_cache(cache_dir))
    tailer.rebuild()
    view = OpenNamespace(
        options.namespace,
        cache_dir,
        tailer.tree_dir,
        "",
        ReadOnlyTree(tailer.tree_dir, options.namespace),
        None,
        factory,
        read_only=True,
    )
    tail_view = webhdfs_view(view, options.sync)
    gateway = build_gateway(options, serving, tail_view)
    exported: list[GatewayMetrics] = []

    def open_active(replayed_to: int) -> tuple[OpenNamespace, WebHdfsNamespace]:
        log.warning("standby: promoting: the namespace's writer opens with %s", runs_as(options, serving))
        # a RENAME the active applied and died before answering is resent here: answered as
        # the first was (protocol.md 3.3), from the RENAMEs of the journal the tail replayed
        tailer.renames.save(cache_dir, tailer.tree_dir)
        opened = options.open_journal(cache_dir, client_factory=factory, replayed_to=replayed_to)
        ns = webhdfs_view(opened, options.sync)
        for metrics in exported:  # the endpoint now reports the writer (and its commits)
            metrics.ns = ns
            ns.observer = metrics
        return opened, ns

    standby = Standby(
        gateway,
        tailer,
        factory,
        lease=DEFAULT_LEASE if options.lease is None else options.lease,
        open_active=open_active,
        poll=poll,
        lease_url=lease_url(options.advertise, options.listen),
        key_role_of=lambda text: key_role(
            client_factory_for(
                options.server, text, options.namespace, timeout=options.timeout, tls=options.tls_client
            ),
            options.timeout,
        ),
    )
    standby.durability = options.durability
    gateway.gate = standby.gate
    if options.metrics is not None:
        exported.append(serve_standby_metrics(options.metrics, standby, tail_view))
    return serve_standby(options, serving, standby, exported[0] if exported else None)


def runs_as(options: GatewayOptions, serving: Serving) -> str:
    """What a gateway serves with, in a few words (a promoted standby logs it: it becomes the
    writer with its own command line's options, not the old active's)."""
    mode = "sync" if options.sync else f"async (max lag {options.max_lag_bytes} bytes)"
    words = [mode, f"durability {options.durability}"]
    if options.durability == "tier":
        patience = options.tier_patience
        words.append(f"tier patience {'none' if not patience else f'{patience:g} s'}")
    if options.generation_bytes:
        words.append(f"generation bytes {options.generation_bytes}")
    words.append("HTTPS" if serving.tls is not None else "plain HTTP")
    if options.advertise:
        words.append(f"advertised as {options.advertise}")
    words.append(f"lease {DEFAULT_LEASE if options.lease is None else options.lease:g} s")
    words.append(f"token ttl {options.token_ttl} s")
    if options.metrics:
        words.append(f"metrics on {options.metrics}")
    return ", ".join(words)


def serve_standby_metrics(listen: str, standby: Standby, tail_view: WebHdfsNamespace) -> GatewayMetrics:
    """The standby's Prometheus endpoint on ``listen``: the gateway's series (no writer until
    promoted) and the standby's (:class:`~.standby_metrics.StandbyCollector`)."""
    try:
        metrics = serve_metrics(standby.gateway, tail_view, listen, parse_metrics_listen)
    except OSError as exc:
        standby.tailer.close()
        raise OSError(exc.errno, f"cannot listen for metrics on {listen}: {exc.strerror or exc}") from None
    metrics.registry.register(StandbyCollector(standby))
    return metrics


def serve_standby(
    options: GatewayOptions, serving: Serving, standby: Standby, exported: GatewayMetrics | None = None
) -> int:
    """Serve ``standby``'s gateway (its thread tailing and watching the lease) until it
    stops, then flush and close the journal of a promoted one; returns the exit code."""
    gateway = standby.gateway
    about = f"(namespace {options.namespace}, standby, lease {standby.lease:g} s, tail at record {standby.tailer.seq})"
    log.info("standby: once promoted, the writer runs with %s", runs_as(options, serving))
    code = 0
    standby.start()
    try:
        trio.run(
            serve_gateway,
            gateway,
            serving.host,
            serving.port,
            about,
            options.drain_timeout,
            PromotedFenceWatch(standby, options.fence_check),
        )
    finally:
        standby.stop()
        code = final_flush(gateway, standby.opened, options.flush_timeout)
        if exported is not None:
            exported.close()
        if standby.opened is not None and close_journal(gateway, standby.opened):
            code = 1
    log.info("stopped (%s); requests served:\n%s", standby.state, gateway.summary() or "(none)")
    return code


def promote_url_refusal(url: str) -> str:
    """Why ``sos gateway promote`` refuses ``url`` before connecting ("" if it does not): one
    ``http://`` or ``https://`` URL, and plain ``http://`` only to a loopback host
    (:func:`sos_wire.addresses.is_loopback`, no name resolved), as the gateway serves plain
    HTTP only there: the token request carries the key (``client_secret``) in the body."""
    if "," in url:
        return f"one URL (the standby's), not a list: {url!r}"
    parts = urllib.parse.urlsplit(url.strip())
    try:
        host = parts.hostname or ""
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
    except ValueError as exc:
        return f"not a URL {url!r}: {exc}"
    if parts.scheme not in ("http", "https") or not host:
        return f"expected http[s]://HOST:PORT of the standby, not {url!r}"
    if parts.scheme == "http" and not is_loopback(host):
        return (
            f"refusing to send the key in clear over http:// to {host}, which is not a loopback "
            f"address (the token request carries it): run the command on the standby's node (or "
            f"through a port forward to it) against http://127.0.0.1:PORT, or use https:// (with --tls-ca)"
        )
    return ""


def promote(
    url: str, namespace: str, key: str, *, timeout: float = 300.0, context: ssl.SSLContext | None = None
) -> dict[str, Any]:
    """``sos gateway promote``: ask the standby at ``url`` (``http[s]://127.0.0.1:PORT``) to
    take over now; returns its answer (``promoted``, ``epoch``, ``seq``). ValueError, before
    anything is sent, for a URL :func:`promote_url_refusal` refuses."""
    refusal = promote_url_refusal(url)
    if refusal:
        raise ValueError(refusal)
    client = GatewayClient(url.strip(), namespace, key, timeout=timeout, context=context)
    return client.call("POST", PROMOTE_PATH)
