"""One classification of errors (issue 12, point 1): ``retryable`` / ``is_retryable``,
``to_oserror`` and ``is_fenced`` in sos_client.errors, and what the journal writer, the
opener, fsspec, the mount and the gateway do with them.

The table tests are unit tests of sos_client.errors. The writer tests use the in-memory
store with a fault injected in one call (unit tests of the writer's retry policy) and a
real sos-server (a malformed key, a refused key, a BAD_REQUEST refusal).
"""

from __future__ import annotations

import errno
import os
import shutil
import ssl

import pytest

from sos_client import Client
from sos_client import errors as cerr
from sos_client.errors import is_fenced, is_retryable, to_oserror
from sos_journal import JournaledTree, JournalWriter
from sos_journal.errors import (
    JournalCorrupt,
    JournalError,
    JournalNotFound,
    SpoolStale,
    TargetNotEmpty,
    WriterClosed,
    WriterFenced,
)
from sos_journal.memstore import MemStore
from sos_journal.rebuild.restore import rebuild_cache
from sos_journal.tree.open import open_namespace
from sos_wire import events as ev
from sos_wire.errors import ErrorCode

WAIT = 120  # generous: never reached unless something is broken


# ------------------------------------------------------------------------------ the table
# code: (retryable, errno a filesystem reports)
CODE_TABLE = {
    ErrorCode.BAD_FRAME: (False, errno.EPROTO),
    ErrorCode.UNSUPPORTED_VERSION: (False, errno.EPROTO),
    ErrorCode.UNKNOWN_OP: (False, errno.EOPNOTSUPP),
    ErrorCode.NOT_AUTHENTICATED: (False, errno.EACCES),
    ErrorCode.AUTH_FAILED: (False, errno.EACCES),
    ErrorCode.FORBIDDEN: (False, errno.EACCES),
    ErrorCode.BAD_NAME: (False, errno.EINVAL),
    ErrorCode.NOT_FOUND: (False, errno.ENOENT),
    ErrorCode.OFFSET_MISMATCH: (False, errno.EIO),
    ErrorCode.CHECKSUM_MISMATCH: (True, errno.EIO),
    ErrorCode.SEALED: (False, errno.EROFS),
    ErrorCode.FENCED: (False, errno.EROFS),
    ErrorCode.TOO_LARGE: (False, errno.EFBIG),
    ErrorCode.QUOTA_EXCEEDED: (True, errno.EDQUOT),
    ErrorCode.NO_SPACE: (True, errno.ENOSPC),
    ErrorCode.BUSY: (True, errno.EBUSY),
    ErrorCode.CORRUPT: (False, errno.EIO),
    ErrorCode.INTERNAL: (True, errno.EIO),
    ErrorCode.BAD_REQUEST: (False, errno.EINVAL),
    ErrorCode.TIER_UNAVAILABLE: (True, errno.ETIMEDOUT),  # the bucket behind or unreachable: it catches up
}


def test_the_table_covers_every_error_code():
    assert set(CODE_TABLE) == set(ErrorCode)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_server_refusal_is_classified(code):
    retryable, want_errno = CODE_TABLE[code]
    exc = cerr.error_from_reply(ev.Error(1, code, 7, "why"), "append to ns/obj", name="obj")
    assert exc.retryable is retryable and is_retryable(exc) is retryable
    err = to_oserror(exc)
    assert type(err) is not type(exc) and isinstance(err, OSError)
    assert err.errno == want_errno, (code, err)
    assert "why" in err.strerror and err.filename == "obj"


def test_a_code_this_client_does_not_know_is_not_retried():
    exc = cerr.error_from_reply(ev.Error(1, 999, 0, "new refusal"), "stat ns/obj")
    assert not exc.retryable and not is_retryable(exc)
    assert to_oserror(exc).errno == errno.EIO


@pytest.mark.parametrize(
    "cls,retryable,want_errno",
    [
        (cerr.SOSPermissionError, False, errno.EACCES),  # e.g. a malformed key, refused before connecting
        (cerr.BadNameError, False, errno.EINVAL),
        (cerr.SOSNotFound, False, errno.ENOENT),
        (cerr.Corrupt, False, errno.EIO),  # the client found a damaged copy itself
        (cerr.TooLarge, False, errno.EFBIG),
        (cerr.Fenced, False, errno.EROFS),
        (cerr.SealedError, False, errno.EROFS),
        (cerr.OffsetMismatch, False, errno.EIO),
        (cerr.SOSError, False, errno.EIO),
        (cerr.ChecksumMismatch, True, errno.EIO),
        (cerr.NoSpace, True, errno.ENOSPC),
        (cerr.QuotaExceeded, True, errno.EDQUOT),
        (cerr.ServerBusy, True, errno.EBUSY),
        (cerr.TierUnavailable, True, errno.ETIMEDOUT),
        (cerr.ConnectionLost, True, errno.ECONNRESET),
    ],
)
def test_errors_without_a_code_are_classified_by_class(cls, retryable, want_errno):
    exc = cls("found by the client")
    assert exc.code is None
    assert is_retryable(exc) is retryable
    assert to_oserror(exc).errno == want_errno


def test_connection_lost_is_retryable_unless_the_certificate_failed():
    assert is_retryable(cerr.ConnectionLost("reset", ErrorCode.AUTH_FAILED))  # a new connection decides
    try:
        try:
            raise ssl.SSLCertVerificationError(1, "certificate verify failed")
        except ssl.SSLError as inner:
            raise cerr.ConnectionLost(f"TLS handshake failed: {inner}") from inner
    except cerr.ConnectionLost as exc:
        assert not is_retryable(exc)
    assert not is_retryable(cerr.ConnectionLost("no certificate", retryable=False))
    try:
        try:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        except OSError as inner:
            raise cerr.ConnectionLost(f"cannot connect: {inner}") from inner
    except cerr.ConnectionLost as exc:
        assert is_retryable(exc)
        assert to_oserror(exc).errno == errno.ECONNREFUSED


@pytest.mark.parametrize(
    "exc,retryable",
    [
        (PermissionError(errno.EACCES, "Permission denied"), False),
        (FileNotFoundError(errno.ENOENT, "No such file"), False),
        (IsADirectoryError(errno.EISDIR, "Is a directory"), False),
        (OSError(errno.EIO, "I/O error"), False),
        (OSError(errno.ENOSPC, "disk full (local)"), False),
        (PermissionError(), False),
        (ConnectionResetError(errno.ECONNRESET, "reset"), True),
        (ConnectionRefusedError(), True),
        (BrokenPipeError(), True),
        (TimeoutError(), True),
        (OSError(errno.EHOSTUNREACH, "No route to host"), True),
        (OSError(errno.ENETUNREACH, "Network is unreachable"), True),
        (OSError(errno.EAGAIN, "try again"), True),
        (ssl.SSLCertVerificationError(1, "certificate verify failed"), False),
        (ssl.SSLError(1, "wrong version number"), False),
        (ssl.SSLEOFError(8, "EOF occurred in violation of protocol"), True),
        (JournalError("the spool and the server disagree"), False),
        (WriterFenced("fenced"), False),
        (JournalCorrupt("seg", 3, "bad checksum"), False),
        (ValueError("bad argument"), False),
        (RuntimeError("a bug"), False),
    ],
)
def test_is_retryable_of_any_exception(exc, retryable):
    assert is_retryable(exc) is retryable


def test_to_oserror_of_journal_and_builtin_errors():
    f = to_oserror(WriterFenced("writer epoch 3 was fenced"))
    assert isinstance(f, PermissionError) and f.errno == errno.EROFS and "fenced" in f.strerror
    s = to_oserror(SpoolStale("another writer took over"))
    assert isinstance(s, PermissionError) and s.errno == errno.EROFS
    assert to_oserror(cerr.Fenced("epoch 1 fenced")).errno == errno.EROFS
    # a sealed object is read-only, not a takeover of the namespace
    sealed = to_oserror(cerr.SealedError("sealed", ErrorCode.SEALED))
    assert sealed.errno == errno.EROFS and not isinstance(sealed, PermissionError)
    assert to_oserror(WriterClosed("closed")).errno == errno.EIO
    assert type(to_oserror(JournalError("x"))) is OSError and to_oserror(JournalError("x")).errno == errno.EIO
    assert to_oserror(JournalNotFound("ns", "nothing")).errno == errno.ENOENT
    assert to_oserror(TargetNotEmpty("not empty")).errno == errno.ENOTEMPTY
    assert to_oserror(ValueError("bad name")).errno == errno.EINVAL
    assert to_oserror(RuntimeError("?")).errno == errno.EIO
    assert to_oserror(FileExistsError()).errno == errno.EEXIST
    assert isinstance(to_oserror(FileNotFoundError()), FileNotFoundError)
    # an OSError with an errno comes back as it is; with a context, as a new one
    orig = OSError(errno.ENOTEMPTY, "Directory not empty", "a/b")
    assert to_oserror(orig) is orig
    ctx = to_oserror(orig, "rmdir")
    assert ctx.errno == errno.ENOTEMPTY and ctx.strerror == "rmdir: Directory not empty" and ctx.filename == "a/b"
    nf = to_oserror(cerr.SOSNotFound("stat ns/x: NOT_FOUND", ErrorCode.NOT_FOUND, name="x"))
    assert isinstance(nf, FileNotFoundError) and nf.filename == "x"


def test_is_fenced_follows_the_chain():
    try:
        try:
            raise cerr.Fenced("epoch 2 fenced", ErrorCode.FENCED)
        except cerr.Fenced as inner:
            raise JournalError("replicator stopped") from inner
    except JournalError as exc:
        assert is_fenced(exc)
        assert isinstance(to_oserror(exc), OSError)
    assert is_fenced(WriterFenced("x")) and is_fenced(SpoolStale("x"))
    assert not is_fenced(JournalError("x")) and not is_fenced(OSError(errno.EROFS, "read-only cache"))
    assert not is_fenced(cerr.SealedError("sealed")) and not is_fenced(None)


# ------------------------------------------------------------------ the writer's retry policy
class _Faulty:
    """A MemStore client whose ``method`` raises ``exc`` once; a second call of it raises
    AssertionError (the writer must not have retried)."""

    def __init__(self, client, method, exc, calls):
        self._c, self._method, self._exc, self._calls = client, method, exc, calls

    def __getattr__(self, name):
        fn = getattr(self._c, name)
        if name != self._method:
            return fn

        def faulty(*args, **kwargs):
            self._calls.append(name)
            if len(self._calls) == 1:
                raise self._exc
            raise AssertionError(f"{name} was called again after {self._exc!r}: the writer retried it")

        return faulty


@pytest.mark.parametrize(
    "exc",
    [
        PermissionError(errno.EACCES, "Permission denied", "gen/"),
        FileNotFoundError(errno.ENOENT, "No such file or directory", "gen/"),
    ],
)
def test_writer_open_does_not_retry_a_permission_or_not_found_error(tmp_path, exc):
    store, calls = MemStore(), []
    w = JournalWriter(
        lambda: _Faulty(store.client(), "list", exc, calls), "ns", str(tmp_path / "spool"), open_timeout=3600
    )
    with pytest.raises(type(exc)) as info:
        w.open()
    assert info.value is exc and calls == ["list"]
    assert not w.is_open


@pytest.mark.parametrize(
    "exc",
    [
        PermissionError(errno.EACCES, "Permission denied"),
        FileNotFoundError(errno.ENOENT, "No such file or directory"),
        cerr.SOSError("append to ns/x: BAD_REQUEST: no", ErrorCode.BAD_REQUEST),
    ],
)
def test_replicator_stops_on_an_error_that_is_not_retryable(tmp_path, exc):
    store, calls = MemStore(), []
    w = JournalWriter(lambda: _Faulty(store.client(), "append", exc, calls), "ns", str(tmp_path / "spool"), sync=False)
    t = JournaledTree(
        str(tmp_path / "cache"), w, rebuild=rebuild_cache
    ).open()  # opens the writer; the first snapshot waits in the spool
    try:
        with pytest.raises(JournalError, match="replicator stopped") as info:
            w.barrier(timeout=WAIT)
        assert info.value.__cause__ is exc
        assert calls == ["append"] and w.reconnects == 0
        with pytest.raises(JournalError):
            t.mkdir("more")  # the tree refuses further changes: nothing is lost silently
    finally:
        t.close()


def test_replicator_retries_a_connection_loss(tmp_path):
    """The other side of the policy: a lost connection is retried (and the records arrive)."""
    store = MemStore()
    store.fail_appends = 2  # the first two appends land but their acks are lost
    w = JournalWriter(store.factory, "ns", str(tmp_path / "spool"))
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.mkdir("d")
    t.sync(wait=True)
    assert w.reconnects == 2
    t.close()


# ------------------------------------------------------------------ against a real server
def _ns(server, prefix):
    ns = f"{prefix}-{os.getpid()}"
    return ns, server.keygen(ns, "append")


class _Counting:
    """A client factory that counts its calls and refuses a third one (the writer must
    not retry: before the fix it retried a malformed key until open_timeout)."""

    def __init__(self, make):
        self.make, self.calls = make, 0

    def __call__(self):
        self.calls += 1
        if self.calls > 2:
            raise RuntimeError("the factory was called again: the writer retried a refused key")
        return self.make()


@pytest.mark.parametrize("which", ["malformed", "refused"])
def test_writer_with_a_bad_key_fails_at_once(sos_server, tmp_path, which):
    ns, key = _ns(sos_server, f"badkey-{which}")
    bad = "not-a-key" if which == "malformed" else sos_server.keygen(f"other-{ns}", "append")
    factory = _Counting(lambda: Client(sos_server.address, bad, ns, timeout=60))
    w = JournalWriter(factory, ns, str(tmp_path / "spool"), open_timeout=3600)
    with pytest.raises(PermissionError) as info:
        w.open()
    assert isinstance(info.value, cerr.SOSPermissionError) and factory.calls == 1
    assert to_oserror(info.value).errno == errno.EACCES


@pytest.mark.parametrize("which", ["malformed", "refused"])
def test_opener_with_a_bad_key_fails_at_once(sos_server, tmp_path, which):
    """The opener of fsspec, the mount and the gateway: with the caller's own factory too."""
    ns, key = _ns(sos_server, f"open-{which}")
    bad = "not-a-key" if which == "malformed" else sos_server.keygen(f"other-{ns}", "append")
    factory = _Counting(lambda: Client(sos_server.address, bad, ns, timeout=60))
    with pytest.raises(PermissionError):
        open_namespace(ns, str(tmp_path / "cache"), client_factory=factory, timeout=3600)
    assert factory.calls == 1
    with pytest.raises(PermissionError):
        open_namespace(ns, str(tmp_path / "cache2"), server=sos_server.address, key=bad, timeout=3600)


def test_server_bad_request_stops_the_writer_with_a_journal_error(sos_server, tmp_path):
    """A spool whose newest segment is in generation 2, without its record of where
    generation 1 ended (``<spool>/gen/<G>/snapshot_end``, lost), pointed at a namespace
    without a journal (a reset server, a mistyped namespace): the server refuses to create
    generation 2 there (generations grow by one: BAD_REQUEST). The writer stops with a
    JournalError saying so; before, it retried the refused append forever."""
    ns_a, key_a = _ns(sos_server, "badreq-a")
    spool = str(tmp_path / "spool")
    w = JournalWriter(lambda: Client(sos_server.address, key_a, ns_a, timeout=60), ns_a, spool, generation_bytes=200)
    t = JournaledTree(str(tmp_path / "cache"), w, rebuild=rebuild_cache).open()
    t.create("f")
    t.write("f", 0, b"x" * 300)  # starts generation 2: the spool's current segment belongs to it
    t.sync(wait=True)
    assert w.generation == 2
    t.close()
    shutil.rmtree(os.path.join(spool, "gen", f"{1:010d}"))  # the marker of generation 1 is lost

    ns_b, key_b = _ns(sos_server, "badreq-b")
    w2 = JournalWriter(lambda: Client(sos_server.address, key_b, ns_b, timeout=60), ns_b, spool, sync=False)
    w2.open()
    try:
        with pytest.raises(JournalError, match="BAD_REQUEST") as info:
            w2.barrier(timeout=WAIT)
        assert "replicator stopped" in str(info.value)
        assert isinstance(info.value.__cause__, cerr.SOSError)
        assert info.value.__cause__.code == ErrorCode.BAD_REQUEST and not is_retryable(info.value.__cause__)
        assert w2.reconnects == 0
        with Client(sos_server.address, key_b, ns_b, timeout=60) as c:
            assert list(c.list("gen/")) == []  # nothing of the foreign generation landed
    finally:
        w2.close()


def test_writer_does_not_retry_a_server_certificate_it_does_not_trust(sos_server_factory, tmp_path):
    """A TLS server whose certificate the client's context does not trust: the client raises
    ConnectionLost (from SSLCertVerificationError), which is not retried; before, the
    writer retried it until open_timeout."""
    from tests.support import self_signed_cert

    cert, cert_key = self_signed_cert(tmp_path, "server")
    other, _ = self_signed_cert(tmp_path, "other")
    srv = sos_server_factory(args=["--tls-cert", cert, "--tls-key", cert_key], start=False)
    key = srv.keygen("tlsns", "append")
    srv.start()
    wrong = ssl.create_default_context(cafile=other)
    factory = _Counting(lambda: Client(srv.address, key, "tlsns", timeout=60, tls=wrong))
    w = JournalWriter(factory, "tlsns", str(tmp_path / "spool"), open_timeout=3600)
    with pytest.raises(cerr.ConnectionLost) as info:
        w.open()
    assert isinstance(info.value.__cause__, ssl.SSLCertVerificationError) and factory.calls == 1
    assert not is_retryable(info.value)
    with Client(srv.address, key, "tlsns", timeout=60, tls=ssl.create_default_context(cafile=cert)) as c:
        assert c.ping(b"up") == b"up"  # the server itself is fine: trusting its certificate connects
