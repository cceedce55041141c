"""`sos restore` and `sos verify` as a user runs them: subprocesses against a REAL server,
asserting exit codes, what is printed and what is (not) written.

Exit codes (RESTORE_EXIT_CODES / VERIFY_EXIT_CODES in sos_journal/cli.py):
0 ok, 1 failed (incl. a point the journal does not hold, a non-empty target without
--force), 2 usage, 3 corrupt data, 4 no journal in this namespace.
"""

from __future__ import annotations

import datetime as _dt
import io
import itertools
import os
import subprocess
import sys

from sos_client import Client
from sos_journal import JournaledTree, JournalWriter
from sos_journal import cli as jcli
from sos_journal.format import layout
from sos_journal.format.records import Create, RecordDecoder, SnapshotEnd, Write, encode
from sos_journal.rebuild.restore import format_time, rebuild_cache
from sos_journal.testing import tree_state
from tests.journal.support import new_ns
from tests.support import ManualClock, run_sos_as

WAIT = 180
_n = itertools.count()


def one_line(text: str) -> str:
    assert text.count("\n") == 1 and text.startswith("sos: "), text
    return text


def write_files(server, ns, key, tmp_path, names):
    """One CREATE and one WRITE per name; returns the live tree."""
    w = JournalWriter(lambda: Client(server.address, key, ns, timeout=60), ns, str(tmp_path / f"spool-{ns}"))
    t = JournaledTree(str(tmp_path / f"cache-{ns}"), w, rebuild=rebuild_cache).open()
    for name in names:
        t.create(name)
        t.write(name, 0, name.encode() * 100)
    t.sync(wait=True)
    live = tree_state(t.local_path(""))
    t.close()
    return live


def journal_records(server, ns, key):
    out = []
    with Client(server.address, key, ns) as c:
        for name in sorted(e.name for e in c.list("gen/") if layout.parse_segment_name(e.name)):
            d = RecordDecoder(name)
            d.feed(c.read(name))
            out.extend(d)
    return out


# ---------------------------------------------------------------- nothing to restore
def test_a_namespace_without_journal_exits_4_and_writes_nothing(server, tmp_path):
    ns, key = new_ns(server, "empty")
    target = tmp_path / "target"
    r = run_sos_as(server, key, "restore", ns, str(target))
    assert r.returncode == 4, r.stderr
    assert one_line(r.stderr) == (
        f"sos: namespace '{ns}' has no journal (no objects under gen/): nothing to "
        f"restore; check the namespace and the server (server {server.address})\n"
    )
    assert r.stdout == "" and not target.exists()
    target.mkdir()
    (target / "keep").write_text("precious")
    r = run_sos_as(server, key, "restore", "--force", ns, str(target))
    assert r.returncode == 4 and (target / "keep").read_text() == "precious"  # not wiped for nothing
    v = run_sos_as(server, key, "verify", ns)
    assert v.returncode == 4, v.stdout + v.stderr
    assert v.stdout == ""  # no "OK" for nothing
    assert "has no journal" in one_line(v.stderr)


def test_a_namespace_whose_first_snapshot_never_finished_exits_4(server, tmp_path):
    ns, key = new_ns(server, "halfway")
    with Client(server.address, key, ns) as c:  # generation 1 without its ready object
        c.append(layout.segment_name(1, 1, 1), 0, encode(SnapshotEnd(1), 1, 1) + encode(Create("x"), 2, 2))
    r = run_sos_as(server, key, "restore", "-q", ns, str(tmp_path / "t"))
    assert r.returncode == 4 and "has no complete generation" in one_line(r.stderr)
    assert not (tmp_path / "t").exists()
    v = run_sos_as(server, key, "verify", "-q", ns)
    assert v.returncode == 4
    assert "NO COMPLETE GENERATION" in v.stdout and "OK" not in v.stdout
    assert "has no complete generation" in one_line(v.stderr)


# ---------------------------------------------------------------- points not in the journal
def test_position_past_the_end_fails_naming_the_last_record(server, tmp_path):
    ns, key = new_ns(server, "r")
    live = write_files(server, ns, key, tmp_path, ["a", "b"])
    last = journal_records(server, ns, key)[-1].seq
    r = run_sos_as(server, key, "restore", "-q", "--position", str(last), ns, str(tmp_path / "end"))
    assert r.returncode == 0, r.stderr
    assert tree_state(str(tmp_path / "end")) == live
    r = run_sos_as(server, key, "restore", "-q", "--position", str(last + 1), ns, str(tmp_path / "past"))
    assert r.returncode == 1
    assert f"position {last + 1} is past the end of the journal: the last record is {last}" in one_line(r.stderr)
    assert not (tmp_path / "past").exists()


def state_at(recs, time_ns):
    """The tree (of a journal of CREATEs and WRITEs at offset 0) after every record stamped
    at or before time_ns."""
    out = {}
    for r in recs:
        if r.time_ns > time_ns:
            break
        if isinstance(r.op, Create):
            out[r.op.path] = b""
        elif isinstance(r.op, Write):
            out[r.op.path] = r.op.data
    return out


def in_zone(ns, hours):
    """ISO-8601 of the instant ns in the time zone UTC+hours, to the nanosecond."""
    s, frac = divmod(ns, 1_000_000_000)
    d = _dt.datetime.fromtimestamp(s, _dt.timezone(_dt.timedelta(hours=hours)))
    return d.strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}" + d.strftime("%z")[:3] + ":" + d.strftime("%z")[3:]


def test_restore_at_a_time(server, tmp_path):
    ns, key = new_ns(server, "r")
    names = ["f0", "f1", "f2", "f3"]
    live = write_files(server, ns, key, tmp_path, names)
    recs = journal_records(server, ns, key)
    creates = {r.op.path: r for r in recs if isinstance(r.op, Create)}
    cut = creates["f2"]
    target = tmp_path / "at"
    r = run_sos_as(server, key, "restore", "-q", "--at", format_time(cut.time_ns), ns, str(target))
    assert r.returncode == 0, r.stderr
    assert tree_state(str(target)) == state_at(recs, cut.time_ns)
    assert {"f0", "f1", "f2"} <= set(tree_state(str(target)))
    last = [x for x in recs if x.time_ns <= cut.time_ns][-1]
    assert f"last record {last.seq} at {format_time(last.time_ns)}" in r.stderr  # the summary line
    # the same instant in another time zone; a naive time is UTC
    t1 = creates["f1"].time_ns
    for i, text in enumerate([in_zone(t1, 1), in_zone(t1, -5), format_time(t1)[:-1]]):
        r = run_sos_as(server, key, "restore", "-q", "--at", text, ns, str(tmp_path / f"tz{i}"))
        assert r.returncode == 0, r.stderr
        assert tree_state(str(tmp_path / f"tz{i}")) == state_at(recs, t1), text
    # after the last record: the latest state; before the first: an error, nothing written
    r = run_sos_as(server, key, "restore", "-q", "--at", "2999-01-01T00:00:00Z", ns, str(tmp_path / "late"))
    assert r.returncode == 0 and tree_state(str(tmp_path / "late")) == live
    r = run_sos_as(server, key, "restore", "-q", "--at", "2001-01-01T00:00:00Z", ns, str(tmp_path / "early"))
    assert r.returncode == 1
    assert (
        f"time 2001-01-01T00:00:00.000000000Z is before the first record of the journal (generation 1, "
        f"first record at {format_time(recs[0].time_ns)})"
    ) in one_line(r.stderr)
    assert not (tmp_path / "early").exists()
    r = run_sos_as(server, key, "restore", "-q", "--at", "yesterday", ns, str(tmp_path / "bad"))
    assert r.returncode == 2 and "bad time 'yesterday'" in r.stderr and not (tmp_path / "bad").exists()


# ---------------------------------------------------------------- --force
def test_a_non_empty_target_needs_force(server, tmp_path):
    ns, key = new_ns(server, "r")
    live = write_files(server, ns, key, tmp_path, ["a", "d"])
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "precious").write_text("keep me")
    (target / "sub" / "x").write_text("me too")
    before = tree_state(str(target))
    r = run_sos_as(server, key, "restore", "-q", ns, str(target))
    assert r.returncode == 1 and r.stdout == ""
    assert f"restore target {target} is not empty (2 entries); use force (--force)" in one_line(r.stderr)
    assert tree_state(str(target)) == before  # nothing written, nothing removed
    r = run_sos_as(server, key, "restore", "-q", "--force", ns, str(target))
    assert r.returncode == 0, r.stderr
    assert tree_state(str(target)) == live  # exactly the namespace: the old contents are gone
    (tmp_path / "file").write_text("x")
    r = run_sos_as(server, key, "restore", "-q", "--force", ns, str(tmp_path / "file"))
    assert r.returncode == 1 and "is not a directory" in one_line(r.stderr)


def test_help_documents_exit_codes_and_querydir(capsys):
    from sos_client import cli

    assert cli.main(["restore", "--help"]) == 0
    out = capsys.readouterr().out
    assert "QUERYDIR is the checkpoint directory's path relative to the namespace root" in " ".join(out.split())
    assert jcli.RESTORE_EXIT_CODES in out
    assert "4   no journal in this namespace" in out and "--force" in out
    assert cli.main(["verify", "--help"]) == 0
    assert jcli.VERIFY_EXIT_CODES in capsys.readouterr().out


# ---------------------------------------------------------------- progress
class Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_in_a_log_is_a_line_every_interval_and_nothing_for_a_quick_run():
    out, clock = Stream(False), ManualClock(1000.0)
    bar = jcli.ProgressBar("restore ns", out, clock=clock)
    assert bar.interval == 10.0
    bar(0, 4_000_000)
    bar(4_000_000, 4_000_000)  # done within the interval: no line at all
    bar.finish()
    assert out.getvalue() == ""
    out, clock = Stream(False), ManualClock(1000.0)
    bar = jcli.ProgressBar("restore ns", out, clock=clock)
    bar(0, 4_000_000)
    clock.now += 10
    bar(1_000_000, 4_000_000)
    clock.now += 5
    bar(2_000_000, 4_000_000)  # too soon after the previous line
    clock.now += 5
    bar(3_000_000, 4_000_000)
    bar.finish()
    lines = out.getvalue().splitlines()
    assert lines == [bar.meter(1_000_000, 4_000_000, 10), bar.meter(3_000_000, 4_000_000, 20)]
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("restore ns:  25%") and "/3.81M" in lines[0]  # binary units
    assert lines[1].startswith("restore ns:  75%")


def test_progress_on_a_terminal_redraws_one_line_per_pass_and_ends_it():
    out = Stream(True)
    bar = jcli.ProgressBar("verify ns", out)
    assert bar.interval == 0.2
    bar(0, 2_000_000)
    bar(1_000_000, 2_000_000)
    bar(2_000_000, 2_000_000)
    bar(0, 1_000_000)  # a second pass (restore --batch: the scan, then the replay): a new line
    bar(500_000, 1_000_000)
    bar.finish()
    bar.finish()
    drawn = out.getvalue()
    passes = drawn.split("\n")
    assert len(passes) == 3 and passes[2] == ""  # two lines, each ended
    assert passes[0].startswith("\rverify ns:   0%") and "verify ns: 100%" in passes[0].rsplit("\r", 1)[1]
    assert passes[1].rsplit("\r", 1)[1].startswith("verify ns:  50%")


def run_in_pty(server, key, *args):
    """Run `sos ARGS` with its stderr on a terminal; returns (exit code, what it drew)."""
    import pty
    import select

    master, slave = pty.openpty()
    env = dict(os.environ, SOS_SERVER=server.address, SOS_KEY=key)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sos_client.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    data = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], WAIT)
            assert ready, "no output and no exit"
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(master)
        proc.stdout.close()
        rc = proc.wait(WAIT)
    return rc, data.decode().replace("\r\n", "\n")  # the terminal turns \n into \r\n


def test_progress_of_the_commands(server, tmp_path):
    ns, key = new_ns(server, "p")
    write_files(server, ns, key, tmp_path, ["a", "b"])
    # not a terminal: a quick run prints the summary only (a slow one a line every 10 s)
    r = run_sos_as(server, key, "restore", ns, str(tmp_path / "log"))
    assert r.returncode == 0 and "\r" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith(f"restored {ns} into ")
    assert all(line.startswith((f"restore {ns}: ", f"restored {ns} ")) for line in r.stderr.splitlines())
    # a terminal: a bar redrawn in place, at 100% at the end, its line ended before the summary
    rc, drawn = run_in_pty(server, key, "restore", ns, str(tmp_path / "tty"))
    assert rc == 0, drawn
    assert drawn.startswith(f"\rrestore {ns}:")
    bar, summary = drawn.rsplit("\n", 2)[:2]
    assert bar.rsplit("\r", 1)[1].startswith(f"restore {ns}: 100%")
    assert summary.startswith(f"restored {ns} into ")
    rc, drawn = run_in_pty(server, key, "verify", ns)
    assert rc == 0 and drawn.startswith(f"\rverify {ns}:") and "\n" in drawn
    # -q: nothing but the summary, even on a terminal
    rc, drawn = run_in_pty(server, key, "restore", "-q", ns, str(tmp_path / "quiet"))
    assert rc == 0 and drawn.startswith(f"restored {ns} into ") and "\r" not in drawn
