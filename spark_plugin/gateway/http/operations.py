"""The WebHDFS operations the gateway serves: one table from (method, op) to its handler.

:data:`OPERATIONS` maps each supported ``(HTTP method, op)`` to a method of
:class:`Operations`; :func:`check_operation` answers what is not in it (an operation Hadoop
knows that the gateway refuses, with why: :data:`UNSUPPORTED`; an unknown one; a change with a
read-only token). The handlers turn parameters into calls of the WebHDFS semantics
(:class:`~spark_plugin.gateway.webhdfs.namespace.WebHdfsNamespace`, run in worker threads) and answer
through the connection layer (:mod:`.http`): a JSON document, or for CREATE, APPEND and OPEN
the two steps (a redirect to the data step, then the body streamed piece by piece into the
journal, or the file read from the cache in pieces within a gateway-wide memory budget).
"""

from __future__ import annotations

import contextlib
import os
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
import trio

from sos_journal.writer.loop_ship import LoopShipper
from spark_plugin.gateway.http.auth import TokenInfo
from spark_plugin.gateway.http.connection import Conn, Drop, Reply, json_body, remote_error
from spark_plugin.gateway.webhdfs.changes import WRITE_PIECE
from spark_plugin.gateway.webhdfs.hdfs import WebHdfsError, parse_permission
from spark_plugin.gateway.webhdfs.namespace import WebHdfsNamespace

__all__ = ["OPERATIONS", "SERVER_DEFAULTS_BODY", "UNSUPPORTED", "Call", "Operations", "check_operation"]

WEBHDFS_PREFIX = "/webhdfs/v1"
#: an OPEN reply is read from the cache and sent in pieces of this size ...
OPEN_PIECE = 128 << 10
#: ... and the pieces waiting for slow readers hold at most this much, gateway-wide
OPEN_MEMORY = 64 << 20
#: a new OPEN data step waits this long for room in OPEN_MEMORY, then answers 503
OPEN_MEMORY_WAIT = 10.0
_MUTATING_METHODS = {"PUT", "POST", "DELETE"}
#: the journal bytes a metadata change (a RENAME, the start of a CREATE with its missing
#: parents) is counted at when deciding whether it may run inline (Operations.quick)
QUICK_CHANGE = 64 << 10

SERVER_DEFAULTS = {
    "FsServerDefaults": {
        "blockSize": 128 << 20,
        "bytesPerChecksum": 512,
        "writePacketSize": 64 << 10,
        "replication": 1,
        "fileBufferSize": 4096,
        "encryptDataTransfer": False,
        "trashInterval": 0,
        "checksumType": 2,
        "keyProviderUri": "",
        "defaultStoragePolicyId": 7,
    }
}

#: GETSERVERDEFAULTS' reply body, encoded once
SERVER_DEFAULTS_BODY = json_body(SERVER_DEFAULTS)

#: operations Hadoop's WebHdfsFileSystem knows that the gateway refuses
#: (UnsupportedOperationException, 400), with why
UNSUPPORTED: dict[str, dict[str, str]] = {
    "GET": {
        **dict.fromkeys(
            [
                "GETDELEGATIONTOKEN",
                "GETACLSTATUS",
                "GETXATTRS",
                "LISTXATTRS",
                "GETALLSTORAGEPOLICY",
                "GETSTORAGEPOLICY",
                "GETSNAPSHOTDIFF",
                "GETSNAPSHOTDIFFLISTING",
                "GETSNAPSHOTTABLEDIRECTORYLIST",
                "GETSNAPSHOTLIST",
                "GETECPOLICY",
                "GETECPOLICIES",
                "GETECCODECS",
                "GETLINKTARGET",
                "GETQUOTAUSAGE",
            ],
            "the gateway serves files and directories only (no delegation tokens, ACLs, "
            "xattrs, storage or erasure-coding policies, snapshots, quotas, links)",
        ),
        "GET_BLOCK_LOCATIONS": "the gateway has no datanodes or block ids to name; "
        "GETFILEBLOCKLOCATIONS answers the block locations",
    },
    "PUT": {
        **dict.fromkeys(
            [
                "CREATESYMLINK",
                "RENEWDELEGATIONTOKEN",
                "CANCELDELEGATIONTOKEN",
                "MODIFYACLENTRIES",
                "REMOVEACLENTRIES",
                "REMOVEDEFAULTACL",
                "REMOVEACL",
                "SETACL",
                "SETXATTR",
                "REMOVEXATTR",
                "ENABLEECPOLICY",
                "DISABLEECPOLICY",
                "SETECPOLICY",
                "ALLOWSNAPSHOT",
                "DISALLOWSNAPSHOT",
                "CREATESNAPSHOT",
                "RENAMESNAPSHOT",
                "SETSTORAGEPOLICY",
                "SETQUOTA",
                "SETQUOTABYSTORAGETYPE",
                "SATISFYSTORAGEPOLICY",
            ],
            "the journal has no record for links, ACLs, xattrs, policies, snapshots or quotas",
        ),
    },
    "POST": {
        "CONCAT": "the journal has no concat record",
        "UNSETSTORAGEPOLICY": "the gateway has no storage policies",
        "UNSETECPOLICY": "the gateway has no erasure-coding policies",
    },
    "DELETE": {"DELETESNAPSHOT": "the gateway has no snapshots"},
}


def bool_param(params: dict[str, str], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None or value == "":
        return default
    low = value.lower()
    if low not in ("true", "false"):
        raise WebHdfsError(
            "IllegalArgumentException", f'Invalid value for webhdfs parameter "{name}": {value!r} is not true or false'
        )
    return low == "true"


def int_param(params: dict[str, str], name: str, default: int | None) -> int | None:
    value = params.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise WebHdfsError(
            "IllegalArgumentException", f'Invalid value for webhdfs parameter "{name}": {value!r} is not an integer'
        ) from None


#: Hadoop's CreateFlag names (the ``createflag`` parameter: a comma-separated set)
CREATE_FLAGS = frozenset(
    {
        "CREATE",
        "OVERWRITE",
        "APPEND",
        "SYNC_BLOCK",
        "LAZY_PERSIST",
        "NEW_BLOCK",
        "NO_LOCAL_WRITE",
        "SHOULD_REPLICATE",
        "IGNORE_CLIENT_LOCALITY",
        "NO_LOCAL_RACK",
    }
)


def create_flags(params: dict[str, str]) -> tuple[bool, bool]:
    """(overwrite, append) of a CREATE, as HDFS's DataNode reads them: ``overwrite=true``
    or OVERWRITE in ``createflag`` replaces an existing file; APPEND in ``createflag``
    appends to an existing one (CreateFlag.validate refuses both at once); the other flags
    are hints about blocks and placement, nothing to the gateway."""
    flags = {f.strip().upper() for f in params.get("createflag", "").split(",") if f.strip()}
    unknown = flags - CREATE_FLAGS
    if unknown:
        raise WebHdfsError(
            "IllegalArgumentException",
            f'Invalid value for webhdfs parameter "createflag": '
            f"{','.join(sorted(unknown))} is not one of {sorted(CREATE_FLAGS)}",
        )
    overwrite = bool_param(params, "overwrite", False) or "OVERWRITE" in flags
    append = "APPEND" in flags
    if overwrite and append:
        raise WebHdfsError("HadoopIllegalArgumentException", "Both append and overwrite options cannot be enabled.")
    return overwrite, append


#: quote_plus of the parameter names and values of recent redirects (the same few, request
#: after request: op=CREATE, user.name=spark, overwrite=true, ...), at most QUOTED_MEMORY
_QUOTED: dict[str, str] = {}
QUOTED_MEMORY = 4096


def urlencode(query: dict[str, str]) -> str:
    """``urllib.parse.urlencode(query)``, each name and value quoted once per process."""
    parts = []
    for pair in query.items():
        quoted = []
        for text in pair:
            got = _QUOTED.get(text)
            if got is None:
                got = urllib.parse.quote_plus(text)
                if len(_QUOTED) >= QUOTED_MEMORY:
                    _QUOTED.clear()
                _QUOTED[text] = got
            quoted.append(got)
        parts.append("=".join(quoted))
    return "&".join(parts)


@dataclass
class Call:
    """One WebHDFS request, parsed: what a handler gets."""

    conn: Conn
    method: str
    op: str
    #: the path below WEBHDFS_PREFIX, relative (rel_path)
    rel: str
    params: dict[str, str]
    headers: dict[str, str]
    grant: TokenInfo


def check_operation(method: str, op: str, grant: TokenInfo) -> None:
    """A WebHdfsError for a request the table does not serve (or not with this token)."""
    if not op:
        raise WebHdfsError("IllegalArgumentException", 'Invalid value for webhdfs parameter "op": no op given')
    if (method, op) not in OPERATIONS:
        why = UNSUPPORTED.get(method, {}).get(op)
        if why is not None:
            raise WebHdfsError("UnsupportedOperationException", f"{op} is not supported by sos gateway: {why}")
        raise WebHdfsError(
            "IllegalArgumentException",
            f'Invalid value for webhdfs parameter "op": {op} is not a valid {method} operation.',
        )
    if method in _MUTATING_METHODS and not grant.can_write:
        raise WebHdfsError(
            "AccessControlException",
            f"Permission denied: {op} needs a token of a key with the append role; this token is read-only",
        )


def _document(fn: Callable[[Operations, Call], Awaitable[dict | None]]) -> Handler:
    """A handler from a function of the request to its JSON document (None: no body): the
    request's small body is read first, the reply is 200."""

    async def handler(self: Operations, call: Call) -> int:
        await call.conn.read_small_body()
        doc = await fn(self, call)
        await call.conn.respond(200, json_body(doc) if doc is not None else b"")
        return 200

    handler.__name__ = handler.__qualname__ = fn.__name__
    handler.__doc__ = fn.__doc__
    return handler


@dataclass(eq=False)
class _Wait:
    """One wait of :class:`SharedBarrier` in a worker thread: for every record up to ``target``."""

    target: int
    done: trio.Event
    error: BaseException | None = None


class SharedBarrier:
    """The barriers of concurrent requests share waits: a request whose records an ongoing
    wait covers waits for that one; otherwise it starts one, for every record journaled so
    far (so the requests that come meanwhile find it covering theirs). Each request tells the
    observer how long it waited, and gets the wait's failure (quota, fenced, tier behind) as
    its own.

    A wait is made in the event loop while the writer is healthy and its durability is
    "server": it asks the writer without blocking (``durable_now``); if the writer has a
    client for the loop (``loop_client_factory``: the gateway's own writer) it ships the
    round itself (:class:`~sos_journal.writer.loop_ship.LoopShipper`: no thread between a
    record and its acknowledgement), else, or when only the replicator's thread may ship
    now, it sleeps until the thread reports progress (``progress_listener``, which wakes the
    loop through the trio token), asking again at least every second as the blocking barrier
    does. In any other state (durability "tier", whose server part the loop ships first when
    it can; the quota state, a failed or stopped writer) the wait is the namespace's blocking
    one in a worker thread, so its answers and failures are exactly those of
    ``wait_durable``."""

    #: a wait in the event loop asks the writer again at least this often
    RECHECK = 1.0

    def __init__(self, ns: WebHdfsNamespace, run: Callable[..., Awaitable[Any]]) -> None:
        self.ns = ns
        self.run = run
        #: every record up to this one is durable (a wait that passed said so)
        self.covered = 0
        self._ongoing: _Wait | None = None
        #: set by the replicator's next report of progress (None: nobody is listening)
        self._progress: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._listening = False
        #: ships the rounds a wait needs from this loop (None: the replicator thread does)
        self.shipper: LoopShipper | None = None

    async def wait(self, seq: int | None = None) -> None:
        """The barrier of :meth:`NamespaceCore.barrier`: every record up to ``seq`` (default:
        all so far) durable, in sync mode."""
        ns = self.ns
        if not ns.waits:
            return
        target = ns._last_seq() if seq is None else seq
        started = time.perf_counter()
        try:
            while target > self.covered:
                ongoing = self._ongoing
                if ongoing is None:
                    await self._wait_for_all()
                    continue
                await ongoing.done.wait()
                if ongoing.error is not None and ongoing.target >= target:
                    raise ongoing.error
        finally:
            if ns.observer is not None:
                ns.observer.barrier_waited(time.perf_counter() - started)

    async def _wait_for_all(self) -> None:
        ongoing = self._ongoing = _Wait(self.ns._last_seq(), trio.Event())
        try:
            await self._wait_durable(ongoing.target)
            self.covered = max(self.covered, ongoing.target)
        except Exception as exc:  # the wait's verdict, every waiter's (a cancellation of the
            ongoing.error = exc  # task that started it is its own: the others wait again)
            raise
        finally:
            self._ongoing = None
            ongoing.done.set()

    async def _wait_durable(self, target: int) -> None:
        """``ns.wait_durable(target)``, in the event loop while the writer can say so without
        blocking (class docstring), else in a worker thread."""
        writer = self.ns.writer
        if writer is None:  # (a namespace that waits always has one: then its own answer)
            await self.run(self.ns.wait_durable, target)
            return
        self._listen(writer)
        shipper = self.shipper
        if shipper is not None and writer.durability != "server":
            await self._ship_then_wait(writer, shipper, target)
            return
        while True:
            progress = self._progress = trio.Event()  # before asking: no report is missed
            try:
                durable = writer.durable_now(target) if shipper is None else writer.durable_now(target, wake=False)
                if durable is False:
                    if shipper is not None and await shipper.ship(target):
                        continue  # (a round acknowledged here: ask again)
                    with trio.move_on_after(self.RECHECK):
                        await progress.wait()
                    continue
            finally:
                self._progress = None
            if durable is None:
                await self.run(self.ns.wait_durable, target)
            return

    async def _ship_then_wait(self, writer: Any, shipper: LoopShipper, target: int) -> None:
        """Durability "tier": the server's part shipped from the loop while it can be (as
        for "server"), then the namespace's blocking wait in a worker thread, which finds
        the server's part done and waits for the bucket (TIER_WAIT): its answers and
        failures are exactly those of ``wait_durable``."""
        while writer.durable_now(target, wake=False, server_part=True) is False:
            if not await shipper.ship(target):
                break  # (the thread ships it: the blocking wait waits for it)
        await self.run(self.ns.wait_durable, target)

    def _listen(self, writer: Any) -> None:
        """Be the writer's progress listener, and its shipper if it has a client for the
        loop (once; the loop's token taken here, in trio)."""
        if self._listening:
            return
        self._token = trio.lowlevel.current_trio_token()
        writer.progress_listener = self._reported
        factory = getattr(writer, "loop_client_factory", None)
        if factory is not None:
            self.shipper = LoopShipper(writer, factory)
        self._listening = True

    async def aclose(self) -> None:
        """The loop's connection to the server closed (the gateway stops serving)."""
        if self.shipper is not None:
            await self.shipper.aclose()

    def _reported(self, *_: Any) -> None:
        """The replicator's thread: progress. Wakes the loop only if a wait listens."""
        if self._progress is not None and self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._wake)

    def _wake(self) -> None:
        progress = self._progress
        if progress is not None:
            progress.set()


class Operations:
    """The handlers (see the module docstring). ``ns``: the WebHDFS view of the namespace;
    ``run(fn, *args)``: a blocking call in a worker thread; ``quick(fn, *args, change=)``:
    a call that is microseconds of system calls, made at once when it cannot block (a read
    of the cache; a change when the namespace lock is free and the writer has room for
    ``change`` bytes), else as ``run`` (default: ``run``); ``base_url()``: the
    ``scheme://host:port`` the redirects of the two-step operations name; ``open_memory``:
    room for OPEN pieces (one token each); ``send_timeout``: see http.SEND_TIMEOUT."""

    def __init__(
        self,
        ns: WebHdfsNamespace,
        run: Callable[..., Awaitable[Any]],
        base_url: Callable[[], str],
        *,
        open_memory: int = OPEN_MEMORY,
        send_timeout: float,
        quick: Callable[..., Awaitable[Any]] | None = None,
    ) -> None:
        self.ns = ns
        self.run = run
        self.quick = quick if quick is not None else self._slow
        self.base_url = base_url
        #: one token per OPEN_PIECE of OPEN reply held in memory
        self.open_memory = trio.CapacityLimiter(max(1, open_memory // OPEN_PIECE))
        self.send_timeout = send_timeout
        self.barriers = SharedBarrier(ns, run)

    async def _slow(self, fn: Callable[..., Any], *args: Any, change: int | None = None) -> Any:
        return await self.run(fn, *args)

    # ------------------------------------------------------------------ JSON documents
    @_document
    async def file_status(self, call: Call) -> dict | None:
        return await self.quick(self.ns.get_file_status, call.rel)

    @_document
    async def list_status(self, call: Call) -> dict | None:
        return await self.run(self.ns.list_status, call.rel)

    @_document
    async def list_status_batch(self, call: Call) -> dict | None:
        return await self.run(self.ns.list_status_batch, call.rel, call.params.get("startafter", ""))

    @_document
    async def content_summary(self, call: Call) -> dict | None:
        return await self.run(self.ns.content_summary, call.rel)

    @_document
    async def home_directory(self, call: Call) -> dict | None:
        return {"Path": f"/user/{self._user(call)}"}

    def _user(self, call: Call) -> str:
        """The user a request names (``user.name``, what Hadoop's client sends on a cluster
        without Kerberos), else the gateway's --owner: home and trash directories."""
        return call.params.get("user.name") or self.ns.owner

    @_document
    async def block_locations(self, call: Call) -> dict | None:
        return await self.run(
            self.ns.block_locations,
            call.rel,
            int_param(call.params, "offset", 0) or 0,
            int_param(call.params, "length", None),
        )

    @_document
    async def file_checksum(self, call: Call) -> dict | None:
        return await self.run(self.ns.file_checksum, call.rel)

    @_document
    async def fs_status(self, call: Call) -> dict | None:
        return await self.run(self.ns.fs_status)

    @_document
    async def trash_root(self, call: Call) -> dict | None:
        return self.ns.trash_root(self._user(call))

    @_document
    async def trash_roots(self, call: Call) -> dict | None:
        return await self.run(self.ns.trash_roots, self._user(call), bool_param(call.params, "allusers", False))

    @_document
    async def set_owner(self, call: Call) -> dict | None:
        await self.run(self.ns.set_owner, call.rel, call.params.get("owner", ""), call.params.get("group", ""))
        return None

    async def server_defaults(self, call: Call) -> int:
        await call.conn.read_small_body()
        await call.conn.respond(200, SERVER_DEFAULTS_BODY)
        return 200

    @_document
    async def check_access(self, call: Call) -> dict | None:
        await self.run(self.ns.check_access, call.rel, call.params.get("fsaction", ""), call.grant.can_write)
        return None

    @_document
    async def mkdirs(self, call: Call) -> dict | None:
        mode = parse_permission(call.params.get("permission"), 0o755)
        return await self.run(self.ns.mkdirs, call.rel, mode)

    @_document
    async def rename(self, call: Call) -> dict | None:
        params = call.params
        dst = params.get("destination")
        if not dst:
            raise WebHdfsError("IllegalArgumentException", 'Invalid value for webhdfs parameter "destination": missing')
        options = None
        if "renameoptions" in params:
            options = {o.strip().upper() for o in params["renameoptions"].split(",") if o.strip()}
            unknown = options - {"NONE", "OVERWRITE", "TO_TRASH"}
            if unknown:
                raise WebHdfsError(
                    "IllegalArgumentException",
                    f'Invalid value for webhdfs parameter "renameoptions": {sorted(unknown)}',
                )
        result, seq = await self.quick(self.ns.rename_now, call.rel, dst, options, change=QUICK_CHANGE)
        if result is not False:
            if seq is not None:  # None: acknowledged early (protocol.md 3.4, --barrier commit)
                await self.barriers.wait(seq)
            self.ns.renamed(dst)
        return {"boolean": result} if options is None else None

    @_document
    async def delete(self, call: Call) -> dict | None:
        return await self.run(self.ns.delete, call.rel, bool_param(call.params, "recursive", False))

    @_document
    async def set_permission(self, call: Call) -> dict | None:
        await self.run(self.ns.set_permission, call.rel, parse_permission(call.params.get("permission"), 0o755))
        return None

    @_document
    async def set_times(self, call: Call) -> dict | None:
        await self.run(
            self.ns.set_times,
            call.rel,
            int_param(call.params, "modificationtime", -1),
            int_param(call.params, "accesstime", -1),
        )
        return None

    @_document
    async def set_replication(self, call: Call) -> dict | None:
        return await self.run(self.ns.set_replication, call.rel)

    @_document
    async def truncate(self, call: Call) -> dict | None:
        new_length = int_param(call.params, "newlength", None)
        if new_length is None:
            raise WebHdfsError("IllegalArgumentException", 'Invalid value for webhdfs parameter "newlength": missing')
        return await self.run(self.ns.truncate, call.rel, new_length)

    # ------------------------------------------------------------------ CREATE / APPEND / OPEN
    def _location(self, call: Call) -> str:
        """The data step's URL: this same request with ``data=true``, on the gateway's own
        address (:attr:`base_url`), never the client's Host header (a client could name any
        host there)."""
        query = {k: v for k, v in call.params.items() if k not in ("noredirect", "data")}
        query["data"] = "true"
        path = WEBHDFS_PREFIX + "/" + call.rel
        return f"{self.base_url()}{urllib.parse.quote(path, errors='surrogateescape')}?{urlencode(query)}"

    async def _redirect(self, call: Call) -> int:
        """Step 1 (no ``data=true``), checked: 307 to this same URL with ``data=true``
        (``noredirect=true``: 200 + ``{"Location": ...}``)."""
        location = self._location(call)
        if bool_param(call.params, "noredirect", False):
            await call.conn.respond(200, json_body({"Location": location}))
            return 200
        await call.conn.respond(307, b"", [("location", location)])
        return 307

    async def create(self, call: Call) -> int:
        if call.params.get("data") == "true":
            return await self._receive_file(call)
        await call.conn.read_small_body()
        overwrite, append = create_flags(call.params)
        create_parent = bool_param(call.params, "createparent", True)
        await self.quick(self._check_create, call.rel, overwrite, append, create_parent)
        return await self._redirect(call)

    def _check_create(self, rel: str, overwrite: bool, append: bool, create_parent: bool) -> None:
        if not (append and self.ns.is_file(rel)):
            self.ns.check_create(rel, overwrite=overwrite, create_parent=create_parent)
        self.ns.check_lease(rel)

    async def append(self, call: Call) -> int:
        if call.params.get("data") == "true":
            return await self._receive_file(call)
        await call.conn.read_small_body()
        await self.quick(self._check_append, call.rel)
        return await self._redirect(call)

    def _check_append(self, rel: str) -> None:
        self.ns.check_append(rel)
        self.ns.check_lease(rel)

    async def open(self, call: Call) -> int:
        await call.conn.read_small_body()
        if call.params.get("data") == "true":
            return await self._send_file(call)
        await self.quick(self.ns.check_append, call.rel)  # an existing file
        return await self._redirect(call)

    async def _receive_file(self, call: Call) -> int:
        ns, conn, op, rel, params = self.ns, call.conn, call.op, call.rel, call.params
        try:
            offset = await self.quick(self._begin, op, rel, params, change=QUICK_CHANGE)
        except WebHdfsError:
            if not conn.h11.they_are_waiting_for_100_continue:
                await conn.drain()  # Hadoop's client sends the whole body before it reads a reply
            raise
        failure: WebHdfsError | None = None
        try:
            pending: list[bytes] = []
            size = 0
            while True:
                event = await conn.next_event()
                if isinstance(event, h11.Data):
                    if failure is not None:
                        continue  # drain the rest, then answer
                    pending.append(bytes(event.data))
                    size += len(event.data)
                    if size < WRITE_PIECE:
                        continue
                elif isinstance(event, h11.ConnectionClosed):
                    raise Drop("closed in the middle of a file body")
                elif not isinstance(event, h11.EndOfMessage):
                    continue
                if pending and failure is None:
                    data = b"".join(pending)
                    pending, size = [], 0
                    try:
                        await self.quick(ns.write, rel, offset, data, change=len(data))
                        offset += len(data)
                    except WebHdfsError as exc:
                        failure = exc
                if isinstance(event, h11.EndOfMessage):
                    break
        finally:
            ns.release(rel)  # a set under its own lock: nothing to wait for
        if failure is not None:
            raise failure
        # sync mode: the file's contents are durable before the writer is told so (the
        # RENAME that follows may reach a replacement gateway that never saw them), but for
        # a checkpoint's state and temp files with --barrier commit (protocol.md 3.4)
        if self.ns.body_waits(rel):
            await self.barriers.wait()
        if op == "CREATE":
            await conn.respond(201)
            return 201
        await conn.respond(200)
        return 200

    def _begin(self, op: str, rel: str, params: dict[str, str]) -> int:
        """The start of a CREATE or APPEND data step (its lease taken): the offset its body
        is written at."""
        overwrite, append = create_flags(params) if op == "CREATE" else (False, True)
        if op == "CREATE" and not (append and self.ns.is_file(rel)):
            mode = parse_permission(params.get("permission"), 0o644)
            create_parent = bool_param(params, "createparent", True)
            self.ns.begin_create(rel, mode, overwrite=overwrite, create_parent=create_parent)
            return 0
        return self.ns.begin_append(rel)

    async def _send_file(self, call: Call) -> int:
        """The data step of OPEN, in pieces of OPEN_PIECE read as the client takes them; each
        piece is counted in the gateway-wide :attr:`open_memory` while it waits to be sent.
        A new reply that finds no room in OPEN_MEMORY_WAIT seconds answers 503 (readers
        that do not read are dropped by the send timeout, which gives their room back)."""
        conn, rel = call.conn, call.rel
        offset = int_param(call.params, "offset", 0) or 0
        length = int_param(call.params, "length", None)
        fd, start, count = await self.quick(self.ns.open_for_read, rel, offset, length)
        held = False
        try:
            if count:
                held = await self._open_room(OPEN_MEMORY_WAIT)
                if not held:
                    raise Reply(
                        503,
                        remote_error(
                            "IOException", "the gateway holds too many replies that are not read yet: try again"
                        ),
                        [("retry-after", "1")],
                    )
            await conn.send(h11.Response(status_code=200, headers=[(b"content-length", str(count).encode())]))
            pos, end = start, start + count
            while pos < end:
                if not held:
                    held = await self._open_room(self.send_timeout)
                    if not held:
                        raise Drop("no room to send an OPEN reply")
                chunk = await self.run(os.pread, fd, min(OPEN_PIECE, end - pos), pos)
                if not chunk:  # cannot happen on a snapshot, unless truncated meanwhile
                    raise Drop(f"/{rel} shrank while being read")
                await conn.send(h11.Data(data=chunk))
                pos += len(chunk)
                self.open_memory.release()
                held = False
            await conn.send(h11.EndOfMessage())
        finally:
            if held:
                self.open_memory.release()
            os.close(fd)
        return 200

    async def _open_room(self, timeout: float) -> bool:  # noqa: ASYNC109 - its outcome is False, not a cancellation
        """Take room for one OPEN piece; False after ``timeout`` seconds without any."""
        with trio.move_on_after(timeout):
            await self.open_memory.acquire()
            return True
        return False


Handler = Callable[[Operations, Call], Awaitable[int]]

#: every operation the gateway serves: (HTTP method, op) -> its handler
OPERATIONS: dict[tuple[str, str], Handler] = {
    ("GET", "OPEN"): Operations.open,
    ("GET", "GETFILESTATUS"): Operations.file_status,
    ("GET", "GETFILELINKSTATUS"): Operations.file_status,
    ("GET", "LISTSTATUS"): Operations.list_status,
    ("GET", "LISTSTATUS_BATCH"): Operations.list_status_batch,
    ("GET", "GETCONTENTSUMMARY"): Operations.content_summary,
    ("GET", "GETHOMEDIRECTORY"): Operations.home_directory,
    ("GET", "GETSERVERDEFAULTS"): Operations.server_defaults,
    ("GET", "CHECKACCESS"): Operations.check_access,
    ("GET", "GETFILEBLOCKLOCATIONS"): Operations.block_locations,
    ("GET", "GETFILECHECKSUM"): Operations.file_checksum,
    ("GET", "GETSTATUS"): Operations.fs_status,
    ("GET", "GETTRASHROOT"): Operations.trash_root,
    ("GET", "GETTRASHROOTS"): Operations.trash_roots,
    ("PUT", "SETOWNER"): Operations.set_owner,
    ("PUT", "CREATE"): Operations.create,
    ("PUT", "MKDIRS"): Operations.mkdirs,
    ("PUT", "RENAME"): Operations.rename,
    ("PUT", "SETPERMISSION"): Operations.set_permission,
    ("PUT", "SETTIMES"): Operations.set_times,
    ("PUT", "SETREPLICATION"): Operations.set_replication,
    ("POST", "APPEND"): Operations.append,
    ("POST", "TRUNCATE"): Operations.truncate,
    ("DELETE", "DELETE"): Operations.delete,
}
#: every op name a request may carry that the statistics name (the rest count as "other")
KNOWN_OPS = frozenset(op for _, op in OPERATIONS).union(*(ops.keys() for ops in UNSUPPORTED.values()))
