"""A replacement server's data directory, rebuilt from the tier (protocol.md 4.8).

:func:`bootstrap` runs before ``sos-server serve --tier URL`` opens its Storage, on a data
directory that holds no namespace yet (:func:`needs_bootstrap`): for every namespace the
bucket's listing names (:func:`sos_tier.layout.scan`) it writes

- the fence file: the highest fence marker, or the highest epoch in a journal segment name it
  rebuilt if that is higher (a writer fenced off before the server was lost stays fenced);
- every object as an object file in the server's own format, made by the server's own code
  (:meth:`Namespace.create_file` for the header, :meth:`StoredObject.append` for frames of at
  most :data:`FRAME_BYTES`, :meth:`StoredObject.write_seal`): exactly the file a run of APPENDs
  of those bytes and a SEAL would have left, then fsynced. The bytes come from
  :func:`sos_tier.layout.iter_object` (every piece's CRC32C checked, memory bounded by a few
  pieces), never from anywhere else: an object is rebuilt up to its good length and no further;
- the seal where the bucket holds the object sealed and whole, with the file's mtime set to
  the seal marker's ``sealed_at_ns`` (the server dates a seal by its file's mtime: retention's
  ``completed_at``); an unsealed object, or a seal with no time, gets the time of the bootstrap
  (retention then waits ``--min-age`` more, never less).

Keys and quotas are not in the bucket: the operator copies ``DATA/ns/<ns>/keys`` from a backup
or makes new keys with ``sos-server keygen`` (docs/DEPLOY.md, "Replacing a lost server"), before
or after the bootstrap: a namespace directory that holds only keys (and a quota) does not count
as a namespace here.

Crash safety: everything is built under ``DATA/tier-bootstrap.partial/`` (``ns/<ns>/...``, the
layout of ``DATA/ns``). When it is whole it is renamed ``DATA/tier-bootstrap.done`` (the commit
point, one rename), then moved into ``DATA/ns`` namespace by namespace (fence file first, then
the objects directory; each a rename) and removed. A rerun after a crash before the commit
**starts clean** (the partial tree is deleted: the bucket may have changed meanwhile, a zombie
server may still be copying, and a file half-written from one listing must not be finished
from another); a rerun after the commit **finishes the moves** (local renames of a tree built
from one listing). Either way no file of two runs is ever mixed, and ``DATA/ns`` never shows a
namespace whose objects are partly rebuilt.

A write-ahead log left in ``DATA/wal`` by an earlier server is replayed first, as a start-up
would: no object file exists, so every record is skipped, and the logs are emptied, so they can
never be replayed onto the rebuilt files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from sos_tier.layout import (
    NamespaceState,
    ObjectState,
    Problem,
    TierConflict,
    TierDamage,
    believe_fence,
    get_piece,
    iter_object,
    scan,
    seal_time,
)
from sos_tier.store import Store, TierError, TierNotFound
from sos_wire.crc import crc32c
from sos_wire.names import BadName, validate_namespace

from .durable import StorageError, fsync_dir, makedirs_durable, write_file_durable
from .objfile import encode_header, object_file_name, segment_epoch
from .storage import Namespace, Storage, StoredObject
from .wal import replay

__all__ = [
    "DONE",
    "FRAME_BYTES",
    "PARTIAL",
    "BootstrapError",
    "BootstrapRefused",
    "BootstrapReport",
    "NamespaceReport",
    "ObjectReport",
    "bootstrap",
    "holds_namespaces",
    "needs_bootstrap",
]

log = logging.getLogger(__name__)

PARTIAL = "tier-bootstrap.partial"  # being built; deleted by a rerun
DONE = "tier-bootstrap.done"  # whole; a rerun moves what is left of it into ns/
REPORT = "report.json"  # in the staging tree: the report, for a rerun that finishes the moves
#: the largest frame a rebuilt object file gets: what APPENDs of 1 MiB would have written (the
#: server's READ streams frames of at most this much, and recovery never mistakes one for a
#: torn APPEND: MAX_APPEND_FRAME is 8 MiB + 4 KiB)
FRAME_BYTES = 1 << 20

Progress = Callable[[str], None]


class BootstrapError(Exception):
    """The bootstrap could not finish (the store failed, the disk failed). Nothing was put
    into ``DATA/ns`` unless the message says the moves began; a rerun starts clean or finishes."""


class BootstrapRefused(BootstrapError):
    """The data directory is not one to bootstrap into: it holds a namespace with objects or a
    fence, or another process holds its lock. Nothing was changed."""


@dataclass
class ObjectReport:
    namespace: str
    name: str
    length: int  # bytes rebuilt (the object's length on the new server)
    sealed: bool  # sealed on the new server
    bucket_length: int  # the furthest byte any key of the object names (a piece's end, its seal)
    seal_length: int | None  # the bucket's seal marker, None if none
    cut: bool  # shorter than that (a gap, damage, a conflict), or its seal not applied


@dataclass
class NamespaceReport:
    namespace: str
    fence: int
    bucket_fence: int  # the highest fence marker
    objects: int = 0
    bytes: int = 0


@dataclass
class BootstrapReport:
    data_dir: str
    store: str
    namespaces: dict[str, NamespaceReport] = field(default_factory=dict)
    objects: dict[tuple[str, str], ObjectReport] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    restarted: bool = False  # a crashed earlier run's partial tree was deleted first
    finished_moves: bool = False  # an earlier run had committed; this one only moved its tree in
    wal_records_skipped: int = 0  # records of an earlier server's log (none applied)
    seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(o.length for o in self.objects.values())

    @property
    def cut(self) -> list[ObjectReport]:
        """Objects the new server holds shorter than the bucket's keys reach, or unsealed
        although the bucket has a seal marker: each has its problems in :attr:`problems`."""
        return [o for o in self.objects.values() if o.cut]

    def problems_of(self, namespace: str, name: str) -> list[Problem]:
        return [p for p in self.problems if p.namespace == namespace and p.name == name]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "data_dir": self.data_dir,
                "store": self.store,
                "restarted": self.restarted,
                "wal_records_skipped": self.wal_records_skipped,
                "seconds": self.seconds,
                "namespaces": [asdict(n) for n in self.namespaces.values()],
                "objects": [asdict(o) for o in self.objects.values()],
                "problems": [asdict(p) for p in self.problems],
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> BootstrapReport:
        d = json.loads(raw)
        r = cls(
            d["data_dir"],
            d["store"],
            restarted=d["restarted"],
            wal_records_skipped=d["wal_records_skipped"],
            seconds=d["seconds"],
        )
        for n in d["namespaces"]:
            r.namespaces[n["namespace"]] = NamespaceReport(**n)
        for o in d["objects"]:
            r.objects[(o["namespace"], o["name"])] = ObjectReport(**o)
        r.problems = [Problem(**p) for p in d["problems"]]
        return r


# ---------------------------------------------------------------------------------------------
# what the data directory holds


def _namespace_holds_data(path: str) -> bool:
    """A namespace directory with a fence file or anything under ``objects/`` (keys and a
    quota alone are what an operator puts there before a bootstrap)."""
    if os.path.lexists(os.path.join(path, "fence")):
        return True
    objdir = os.path.join(path, "objects")
    return os.path.isdir(objdir) and bool(os.listdir(objdir))


def holds_namespaces(data_dir: str) -> list[str]:
    """The namespaces of *data_dir* that hold objects or a fence (sorted)."""
    base = os.path.join(data_dir, "ns")
    if not os.path.isdir(base):
        return []
    out = []
    for entry in sorted(os.listdir(base)):
        try:
            validate_namespace(entry)
        except BadName:
            continue
        if os.path.isdir(os.path.join(base, entry)) and _namespace_holds_data(os.path.join(base, entry)):
            out.append(entry)
    return out


def needs_bootstrap(data_dir: str) -> bool:
    """True if ``serve --tier`` should call :func:`bootstrap` before opening its Storage: no
    namespace of *data_dir* holds objects or a fence, or an earlier bootstrap committed and did
    not finish moving its tree in."""
    return os.path.isdir(os.path.join(data_dir, DONE)) or not holds_namespaces(data_dir)


# ---------------------------------------------------------------------------------------------
# the bootstrap


def bootstrap(
    data_dir: str, store: Store, *, progress: Progress | None = None, lock: bool = True, workers: int = 4
) -> BootstrapReport:
    """Rebuild *data_dir*'s namespaces from *store* (see the module docstring). *progress* gets
    one line per object and per piece read (bytes and objects done of the totals) and one per
    namespace moved in. With ``lock=False`` the caller holds ``DATA/LOCK`` already (``serve``
    after ``Storage.lock()``); otherwise it is taken for the duration.

    BootstrapRefused: the directory holds a namespace with data, or is in use.
    BootstrapError: the store or the disk failed (chained); rerun to start clean or finish."""
    t0 = time.monotonic()
    root = os.path.abspath(data_dir)
    say = progress or (lambda _msg: None)
    storage = Storage(root)
    if lock:
        try:
            storage.lock()
        except StorageError as exc:
            raise BootstrapRefused(f"cannot bootstrap {root}: {exc.message}") from None
    try:
        done = os.path.join(root, DONE)
        if os.path.isdir(done):
            return _finish_moves(root, done, store, say, t0)
        _refuse_held(root)
        report = BootstrapReport(root, store.url)
        partial = os.path.join(root, PARTIAL)
        _prepare(root, partial, storage, report)
        try:
            states = scan(store, workers=workers)
        except TierError as exc:
            raise BootstrapError(f"cannot list the tier {store.url}: {exc}") from exc
        _build_and_commit(root, partial, done, store, states, report, say, workers)
        _install(root, done, say)
        report.seconds = time.monotonic() - t0
        _log_done(report, store, say)
        return report
    finally:
        if lock:
            storage.close()


def _finish_moves(root: str, done: str, store: Store, say: Progress, t0: float) -> BootstrapReport:
    """A rerun after the commit point: the tree in *done* is whole; move the rest of it in."""
    report = _load_report(done, root, store)
    report.finished_moves = True
    log.warning("tier bootstrap: an earlier run committed its tree in %s; moving the rest in", done)
    _install(root, done, say)
    report.seconds = time.monotonic() - t0
    return report


def _refuse_held(root: str) -> None:
    """A bootstrap starts on a data directory without namespaces (key files alone are fine)."""
    held = holds_namespaces(root)
    if held:
        raise BootstrapRefused(
            f"cannot bootstrap {root} from the tier: it already holds namespace(s) {', '.join(held)} "
            "(objects or a fence file); a replacement server starts on an empty data directory "
            "(key files alone are fine)"
        )


def _prepare(root: str, partial: str, storage: Storage, report: BootstrapReport) -> None:
    """Start clean: delete a staging tree left by a run that did not finish, skip the WAL's
    records (there is no file for them), make the empty staging tree."""
    try:
        if os.path.lexists(partial):
            log.warning("tier bootstrap: deleting %s, left by a run that did not finish; starting clean", partial)
            shutil.rmtree(partial)
            fsync_dir(root)
            report.restarted = True
        wal = replay(storage.wal_dir, storage.object_path)  # onto no file: every record skipped
        report.wal_records_skipped = wal.skipped
        makedirs_durable(os.path.join(partial, "ns"))
    except OSError as exc:
        raise BootstrapError(f"cannot prepare {root} for the bootstrap: {exc}") from exc


def _build_and_commit(
    root: str,
    partial: str,
    done: str,
    store: Store,
    states: dict[str, NamespaceState],
    report: BootstrapReport,
    say: Progress,
    workers: int,
) -> None:
    """Build every namespace listed in *states* under *partial*, write the report beside them,
    and rename *partial* to *done*: the commit point. A failure leaves nothing in ``ns/``."""
    total_objects = sum(len(s.objects) for s in states.values())
    total_bytes = sum(o.length for s in states.values() for o in s.objects.values())
    say(
        f"tier bootstrap from {store.url}: {len(states)} namespaces, {total_objects} objects, "
        f"{total_bytes} bytes listed"
    )
    counter = _Counter(say, total_objects, total_bytes)
    try:
        for ns in sorted(states):
            try:
                validate_namespace(ns)
            except BadName:  # only keys the layout cannot have made (scan calls them foreign)
                for p in states[ns].all_problems():
                    _report_problem(report, p)
                continue
            _build_namespace(partial, store, states[ns], report, counter, workers)
        write_file_durable(os.path.join(partial, REPORT), report.to_json())
        os.rename(partial, done)  # the commit point
        fsync_dir(root)
    except TierError as exc:
        raise BootstrapError(
            f"reading the tier {store.url} failed: {exc}; nothing was put into {root}/ns: run again (it starts clean)"
        ) from exc
    except (OSError, StorageError) as exc:
        raise BootstrapError(
            f"writing {partial} failed: {exc}; nothing was put into {root}/ns: run again (it starts clean)"
        ) from exc


def _log_done(report: BootstrapReport, store: Store, say: Progress) -> None:
    cut = report.cut
    log.info(
        "tier bootstrap done: %d namespaces, %d objects, %d bytes from %s in %.1f s; %d objects cut, %d problems",
        len(report.namespaces),
        len(report.objects),
        report.total_bytes,
        store.url,
        report.seconds,
        len(cut),
        len(report.problems),
    )
    say(
        f"tier bootstrap done: {len(report.objects)} objects, {report.total_bytes} bytes; "
        f"{len(cut)} cut, {len(report.problems)} problems"
    )


class _Counter:
    def __init__(self, say: Progress, objects: int, total: int) -> None:
        self.say, self.objects, self.total = say, objects, total
        self.done_objects = 0
        self.done_bytes = 0

    def bytes(self, ns: str, name: str, n: int, at: int, length: int) -> None:
        self.done_bytes += n
        self.say(
            f"{ns}/{name}: {at}/{length} bytes; total {self.done_bytes}/{self.total} bytes, "
            f"{self.done_objects}/{self.objects} objects"
        )

    def object(self, ns: str, name: str, length: int, sealed: bool) -> None:
        self.done_objects += 1
        self.say(
            f"{ns}/{name}: rebuilt, {length} bytes{', sealed' if sealed else ''}; total "
            f"{self.done_bytes}/{self.total} bytes, {self.done_objects}/{self.objects} objects"
        )


def _build_namespace(
    partial: str, store: Store, state: NamespaceState, report: BootstrapReport, counter: _Counter, workers: int
) -> None:
    ns_name = state.namespace
    path = os.path.join(partial, "ns", ns_name)
    ns = Namespace(ns_name, path)
    makedirs_durable(ns.objects_dir)
    makedirs_durable(os.path.join(path, "keys"))
    for p in state.problems:  # foreign keys, unreadable long names
        _report_problem(report, p)
    # the fence markers are believed up to FENCE_SLACK above the highest segment epoch (4.8)
    seen = max((e for e in map(segment_epoch, state.objects) if e is not None), default=0)
    verdict = believe_fence(store, ns_name, state.fence_markers, known=seen)
    for p in verdict.ignored:
        _report_problem(report, p)
    nsr = NamespaceReport(ns_name, fence=verdict.epoch, bucket_fence=verdict.epoch)
    for name in sorted(state.objects):
        obj = state.objects[name]
        orep = _build_object(ns, store, obj, report, counter, workers)
        report.objects[(ns_name, name)] = orep
        nsr.objects += 1
        nsr.bytes += orep.length
        e = segment_epoch(name)
        if e is not None and e > nsr.fence:
            nsr.fence = e
    if nsr.fence != verdict.epoch:
        log.warning(
            "tier bootstrap: %s: the highest fence marker is %d, a segment name carries epoch %d: the fence is %d",
            ns_name,
            verdict.epoch,
            nsr.fence,
            nsr.fence,
        )
    if nsr.fence:
        ns.set_fence(nsr.fence)  # the server's own fence file (decimal, replaced atomically)
    report.namespaces[ns_name] = nsr


def _report_problem(report: BootstrapReport, p: Problem) -> None:
    if any((q.kind, q.key, q.offset) == (p.kind, p.key, p.offset) for q in report.problems):
        return  # found again while writing an object a second time
    report.problems.append(p)
    (log.info if p.kind == "foreign" else log.error)("tier bootstrap: %s: %s", p.kind, p.message)


def _build_object(
    ns: Namespace, store: Store, obj: ObjectState, report: BootstrapReport, counter: _Counter, workers: int
) -> ObjectReport:
    """The object file of *obj*, up to its good length (less if reading finds damage or a
    conflict the listing could not show), sealed if the bucket holds it sealed and whole."""
    for p in obj.problems:  # what the listing shows: gaps, sizes that lie, conflicting seals
        _report_problem(report, p)
    end = obj.length
    while True:
        length, cut_at = _write_object(ns, store, obj, end, counter, workers, report)
        if cut_at is None:
            cut_at = _check_others(ns, store, obj, length, report)
        if cut_at is None or cut_at >= length:
            break
        # reading found a bad piece or a conflict starting before what was already written
        # (pieces of the run overlap): the good length stops there (protocol.md 4.4 step 5);
        # write the object again up to it, from pieces that were all checked
        end = cut_at
    sealed = obj.seal_length is not None and not obj.problems and length == obj.seal_length
    at = seal_time(store, obj) if sealed else None
    path, _ = _paths(ns, obj.name)
    so = _reopen(ns, obj.name, length)
    try:
        if sealed:
            so.write_seal()
    finally:
        so.close()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if at is not None:
            os.utime(fd, ns=(at, at))  # the server dates a seal by its file's mtime (completed_at)
        os.fsync(fd)
    finally:
        os.close(fd)
    furthest = max([p.end for p in (*obj.pieces, *obj.extra)] + [obj.seal_length or 0])
    cut = length < furthest or (obj.seal_length is not None and not sealed)
    if cut:
        why = "; ".join(p.message for p in report.problems_of(obj.namespace, obj.name)) or "see the problems"
        log.error(
            "tier bootstrap: %s/%s rebuilt up to byte %d only%s (%s); nothing past it is served",
            obj.namespace,
            obj.name,
            length,
            f", not sealed although the bucket has a seal marker at {obj.seal_length}"
            if obj.seal_length is not None and not sealed
            else "",
            why,
        )
    counter.object(obj.namespace, obj.name, length, sealed)
    return ObjectReport(obj.namespace, obj.name, length, sealed, furthest, obj.seal_length, cut)


def _paths(ns: Namespace, name: str) -> tuple[str, int]:
    h2, h = object_file_name(name)
    return os.path.join(ns.objects_dir, h2, h), len(encode_header(name))


def _reopen(ns: Namespace, name: str, length: int) -> StoredObject:
    """The StoredObject of a file this module wrote (*length* bytes of data in it)."""
    path, hsize = _paths(ns, name)
    so = StoredObject(ns.name, name, path, hsize)
    so.file_size = os.stat(path).st_size
    so.length = length
    return so


def _write_object(
    ns: Namespace, store: Store, obj: ObjectState, end: int, counter: _Counter, workers: int, report: BootstrapReport
) -> tuple[int, int | None]:
    """Create the object's file (replacing one an earlier attempt of this run wrote) and append
    its bytes [0, end) in frames of at most FRAME_BYTES. Returns (bytes written, where reading
    found the good length to stop: None if it did not)."""
    path, _ = _paths(ns, obj.name)
    if os.path.exists(path):
        os.unlink(path)
    ns.create_file(obj.name)  # the header, written as the server creates an object
    so = _reopen(ns, obj.name, 0)
    written = 0
    cut_at: int | None = None
    try:
        for chunk in iter_object(store, obj, 0, end, workers=workers):
            view = memoryview(chunk)
            for i in range(0, len(view), FRAME_BYTES):
                part = view[i : i + FRAME_BYTES]
                so.append(part, crc32c(part))  # one frame, as an APPEND of these bytes writes it
            written += len(view)
            counter.bytes(obj.namespace, obj.name, len(view), written, end)
    except TierDamage as exc:
        bad = next((p for p in obj.pieces if p.key == exc.key), None)
        cut_at = bad.begin if bad is not None else written
        _report_problem(
            report, Problem("damage", obj.namespace, obj.name, exc.key, cut_at, f"{obj.namespace}/{obj.name}: {exc}")
        )
    except TierConflict as exc:
        cut_at = exc.offset
        _report_problem(
            report,
            Problem("conflict", obj.namespace, obj.name, exc.key, exc.offset, f"{obj.namespace}/{obj.name}: {exc}"),
        )
    finally:
        so.close()
    return written, cut_at


def _check_others(ns: Namespace, store: Store, obj: ObjectState, length: int, report: BootstrapReport) -> int | None:
    """The pieces not in the run that overlap what was written must hold the same bytes (4.4
    step 5): the first byte where one differs, None if all agree. A damaged one is reported."""
    cut: int | None = None
    so = _reopen(ns, obj.name, length)
    try:
        for q in obj.extra:
            hi = min(q.end, length)
            if q.begin >= hi:
                continue
            try:
                theirs = get_piece(store, q)[: hi - q.begin]
            except TierDamage as exc:
                _report_problem(
                    report,
                    Problem("damage", obj.namespace, obj.name, q.key, q.begin, f"{obj.namespace}/{obj.name}: {exc}"),
                )
                continue
            except TierNotFound:
                continue  # deleted since the listing: a larger piece of the run holds its bytes
            ours = so.read_bytes(q.begin, hi - q.begin, limit=length)
            if ours != theirs:
                at = q.begin + next(
                    (i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs))
                )
                _report_problem(
                    report,
                    Problem(
                        "conflict",
                        obj.namespace,
                        obj.name,
                        q.key,
                        at,
                        f"{obj.namespace}/{obj.name}: piece {q.key} differs from the run at byte {at}",
                    ),
                )
                cut = at if cut is None else min(cut, at)
    finally:
        so.close()
    return cut


# ---------------------------------------------------------------------------------------------
# moving the committed tree in


def _install(root: str, done: str, say: Progress) -> None:
    """Move every namespace of the committed tree *done* into ``root/ns`` (idempotent: each step
    is a rename, and a rerun skips what is already moved), then remove *done*."""
    base = os.path.join(root, "ns")
    makedirs_durable(base)
    src_base = os.path.join(done, "ns")
    for ns in sorted(os.listdir(src_base)) if os.path.isdir(src_base) else []:
        src, dst = os.path.join(src_base, ns), os.path.join(base, ns)
        say(f"moving namespace {ns} into {base}")
        if not os.path.lexists(dst):
            os.rename(src, dst)
            fsync_dir(base)
            fsync_dir(src_base)
            continue
        # the operator's key-only directory is there: the fence first, then the objects
        if os.path.lexists(os.path.join(src, "fence")):
            os.rename(os.path.join(src, "fence"), os.path.join(dst, "fence"))
            fsync_dir(dst)
        src_obj, dst_obj = os.path.join(src, "objects"), os.path.join(dst, "objects")
        if os.path.isdir(src_obj):
            if os.path.isdir(dst_obj):
                try:
                    os.rmdir(dst_obj)  # keygen makes an empty one
                except OSError as exc:
                    raise BootstrapError(
                        f"cannot move the rebuilt objects of {ns} in: {dst_obj} is not "
                        f"empty ({exc.strerror}); the rebuilt tree is kept in {done}"
                    ) from None
            os.rename(src_obj, dst_obj)
            fsync_dir(dst)
        makedirs_durable(os.path.join(dst, "keys"))
    shutil.rmtree(done)
    fsync_dir(root)


def _load_report(done: str, root: str, store: Store) -> BootstrapReport:
    try:
        with open(os.path.join(done, REPORT), "rb") as f:
            return BootstrapReport.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return BootstrapReport(root, store.url)
