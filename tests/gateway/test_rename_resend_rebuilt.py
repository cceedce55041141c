"""A resent RENAME reaching a gateway whose cache was rebuilt from the server (protocol.md
3.3, "A resent RENAME"): the replacement of a gateway lost with its disk (a pod rescheduled
with an emptyDir cache) rebuilds its memory of recent RENAMEs from the journal, as HDFS's
NameNode rebuilds its RetryCache from its edit log. Before, it had no memory: the resend of
a checkpoint's rename that the lost gateway applied (and made durable) but never answered got
"does not exist", and the Spark query stopped (seen in a cluster soak: "sources/0/.2...tmp
does not exist").

Real processes: a `sos-server`, `sos gateway` processes (GatewayProcess), each replacement
on a new, empty cache directory; the journal-side collector on real records."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from sos_journal.format.records import Create, Delete, Mkdir, Record, Rename, Write
from spark_plugin.gateway.client import GatewayClient
from spark_plugin.gateway.process import GatewayProcess
from spark_plugin.gateway.webhdfs import renames as rn
from spark_plugin.spark import sos_command
from tests.support import pair_listen
from tests.support import webhdfs_put as _put
from tests.support import webhdfs_rename as _rename

NS = "resend"


def _gateway(server, key, cache, *args):
    return GatewayProcess(
        NS, str(cache), server.address, key, listen=pair_listen(), extra_args=list(args), log_path=str(cache) + ".log"
    ).start()


def test_a_replacement_on_an_empty_cache_answers_a_resent_rename_as_the_first(sos_server, tmp_path):
    key = sos_server.keygen(NS)
    gw = _gateway(sos_server, key, tmp_path / "a")
    try:
        c = GatewayClient(gw.url, NS, key)
        c.call("PUT", "/webhdfs/v1/ck/offsets", op="MKDIRS")
        c.call("PUT", "/webhdfs/v1/ck/into", op="MKDIRS")
        # what Spark's metadata logs do: a temp file, then rename2 onto the batch's name
        _put(c, "/ck/sources/0/.2.abc.tmp", b"v1\n{}")
        assert _rename(c, "/ck/sources/0/.2.abc.tmp", "/ck/sources/0/2", rename2=True) is True
        _put(c, "/ck/commits/.5.def.tmp", b"v1\n{}")
        assert _rename(c, "/ck/commits/.5.def.tmp", "/ck/commits/5", rename2=True) is True
        # HDFS's boolean rename onto a new name
        _put(c, "/ck/.x", b"x")
        assert _rename(c, "/ck/.x", "/ck/x") is True
        # renamed, then its destination replaced by a file of the same size: no resend
        _put(c, "/ck/.y", b"first")
        assert _rename(c, "/ck/.y", "/ck/y", rename2=True) is True
        _put(c, "/ck/y", b"other")
        # renamed, then its destination removed: no resend
        _put(c, "/ck/.z", b"z")
        assert _rename(c, "/ck/.z", "/ck/z") is True
        c.call("DELETE", "/webhdfs/v1/ck/z", op="DELETE")
        # a rename into an existing directory: the journal holds where it went, not what
        # was asked, so the replacement gives HDFS's plain answer to its resend
        _put(c, "/ck/w", b"w")
        assert _rename(c, "/ck/w", "/ck/into") is True
    finally:
        gw.kill()  # lost with its disk: every change above waited, so the server has it
    # the replacement, on a new, empty cache: rebuilt from the server
    gw = _gateway(sos_server, key, tmp_path / "b")
    try:
        c = GatewayClient(gw.url, NS, key)
        assert _rename(c, "/ck/sources/0/.2.abc.tmp", "/ck/sources/0/2", rename2=True) is True
        assert _rename(c, "/ck/commits/.5.def.tmp", "/ck/commits/5", rename2=True) is True
        assert _rename(c, "/ck/.x", "/ck/x") is True
        assert _rename(c, "/ck/.y", "/ck/y", rename2=True) == "FileNotFoundException"
        assert _rename(c, "/ck/.z", "/ck/z") is False
        assert _rename(c, "/ck/w", "/ck/into") is False
        # the adopted memory is the gateway's own from then on: in its log (sources/0/2,
        # commits/5, x, and into/w keyed on where it went), forgotten when a destination changes
        assert (tmp_path / "b" / rn.RENAME_MEMORY_FILE).read_text().count('"rename"') == 4
        _put(c, "/ck/x", b"y")
        assert _rename(c, "/ck/.x", "/ck/x") is False
        # a genuine first rename still works, and nothing was moved by the resends
        assert c.call("GET", "/webhdfs/v1/ck/sources/0/2", op="GETFILESTATUS")["FileStatus"]["length"] == 5
        assert c.call("GET", "/webhdfs/v1/ck/into/w", op="GETFILESTATUS")["FileStatus"]["length"] == 1
    finally:
        gw.kill()


def test_a_promoted_standby_answers_a_resent_rename_of_its_dead_active_as_the_first(sos_server, tmp_path):
    """The pair's case: the standby tails the journal; promoted after its active died between
    applying a RENAME and answering it, it answers the client's resend as the first."""
    key = sos_server.keygen(NS)
    active = _gateway(sos_server, key, tmp_path / "a", "--lease", "60")
    standby = None
    try:
        c = GatewayClient(active.url, NS, key)
        c.call("PUT", "/webhdfs/v1/ck/offsets", op="MKDIRS")
        standby = _gateway(sos_server, key, tmp_path / "s", "--standby", "--lease", "60")
        _put(c, "/ck/offsets/.7.abc.tmp", b"v1\n{}")
        assert _rename(c, "/ck/offsets/.7.abc.tmp", "/ck/offsets/7", rename2=True) is True
        _put(c, "/ck/.m", b"m")
        assert _rename(c, "/ck/.m", "/ck/m") is True
        active.kill()
        done = subprocess.run(
            [*sos_command(), "gateway", "promote", NS, standby.url, "--server", sos_server.address],
            env=dict(os.environ, SOS_KEY=key),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        c = GatewayClient(standby.url, NS, key)
        assert _rename(c, "/ck/offsets/.7.abc.tmp", "/ck/offsets/7", rename2=True) is True
        assert _rename(c, "/ck/.m", "/ck/m") is True
        assert _rename(c, "/ck/.never", "/ck/never") is False  # not a resend: HDFS's answer
    finally:
        active.kill()
        if standby is not None:
            standby.kill()


def _rec(seq: int, op, age: float = 0.0) -> Record:
    return Record(seq, int((time.time() - age) * 1e9), op)


@pytest.mark.parametrize(
    ("later", "kept"),
    [
        ([], True),
        ([Write("d/f", 0, b"!")], False),
        ([Create("d/f")], False),
        ([Delete("d/f")], False),
        ([Delete("d")], False),  # a directory above it
        ([Rename("d", "e", False)], False),  # moved away with its directory
        ([Rename("o", "d/f", True)], False),  # replaced by a rename
        ([Mkdir("d/g"), Write("d/g2", 0, b"!"), Delete("d/f2")], True),  # neighbours only
    ],
)
def test_the_journal_collector_forgets_what_a_later_record_changed(tmp_path, later, kept):
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    (tree / "d" / "f").write_bytes(b"data")
    seen = rn.JournalRenames()
    seen(_rec(10, Rename("d/.f.tmp", "d/f", False)))
    for i, op in enumerate(later):
        seen(_rec(11 + i, op))
    found = [(s, d) for s, d, _, _ in seen.found(str(tree))]
    assert (("d/.f.tmp", "d/f") in found) is kept


def test_the_journal_collector_keeps_the_window_and_the_last_ones_and_starts_over_on_a_second_replay(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for i in range(rn.RENAME_MEMORY + 5):
        (tree / str(i)).write_bytes(b"x")
    seen = rn.JournalRenames()
    seen(_rec(1, Rename(".old", "0", False), age=rn.RENAME_RETRY_WINDOW + 60))
    for i in range(1, rn.RENAME_MEMORY + 5):
        seen(_rec(1 + i, Rename(f".{i}", str(i), False)))
    found = seen.found(str(tree))
    assert len(found) == rn.RENAME_MEMORY
    assert found[0][:2] == (".5", "5") and found[-1][:2] == (f".{rn.RENAME_MEMORY + 4}", str(rn.RENAME_MEMORY + 4))
    # what it counts stays bounded by what it remembers (a standby tails for days)
    assert len(seen._paths) == rn.RENAME_MEMORY + 1  # each destination and the root
    # an older generation replayed after a newer one was given up: its seqs are lower
    seen(_rec(1, Rename(".1", "1", False)))
    assert [f[:2] for f in seen.found(str(tree))] == [(".1", "1")]
