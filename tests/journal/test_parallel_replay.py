"""Replay in parallel lanes (issue 13 step 4) ends exactly where replay in order ends.

Random journals from a model filesystem (only valid operations, as a journaled tree records
them: Spark-like temp-file-then-rename, overwrites by rename, deletes and re-creates of a
name, directory renames and removals) are replayed with one worker and with several into
real directories; the trees (paths, bytes, modes) must be identical and equal to the model.
"""

from __future__ import annotations

import os
import random
import stat
import zlib

import pytest

from sos_journal.errors import ReplayError
from sos_journal.format.records import (
    Create,
    Delete,
    Mkdir,
    Record,
    Rename,
    Rmdir,
    SnapshotEnd,
    Truncate,
    Write,
)
from sos_journal.rebuild.replay import replay
from tests.support import tree_snapshot


def random_journal(seed: int, n: int = 600) -> tuple[list, dict]:
    """``n`` valid ops and the model's final tree {path: bytes | None}."""
    rnd = random.Random(seed)
    dirs = {""}
    files: dict[str, bytearray] = {}
    ops: list = [SnapshotEnd(1)]
    names = [f"n{i}" for i in range(12)]

    def fresh(parent: str) -> str | None:
        for _ in range(5):
            p = f"{parent}/{rnd.choice(names)}" if parent else rnd.choice(names)
            if p not in dirs and p not in files:
                return p
        return None

    for _ in range(n):
        k = rnd.random()
        parent = rnd.choice(sorted(dirs))
        if k < 0.08:
            p = fresh(parent)
            if p and len(dirs) < 25:
                dirs.add(p)
                ops.append(Mkdir(p, rnd.choice([0o755, 0o700, 0o777])))
        elif k < 0.25:
            p = fresh(parent) or (rnd.choice(sorted(files)) if files else None)
            if p and p not in dirs:
                files[p] = bytearray()
                ops.append(Create(p, rnd.choice([0o644, 0o600, 0o4755])))
        elif k < 0.55 and files:
            p = rnd.choice(sorted(files))
            off = rnd.randint(0, len(files[p]))
            data = rnd.randbytes(rnd.randint(1, 3000))
            f = files[p]
            f[off : off + len(data)] = data
            ops.append(Write(p, off, data))
        elif k < 0.62 and files:
            p = rnd.choice(sorted(files))
            size = rnd.randint(0, len(files[p]) + 100)
            f = files[p]
            if size < len(f):
                del f[size:]
            else:
                f.extend(b"\0" * (size - len(f)))
            ops.append(Truncate(p, size))
        elif k < 0.80 and files:  # a file renamed: to a new name or over another file
            src = rnd.choice(sorted(files))
            if rnd.random() < 0.5 and len(files) > 1:
                dst: str | None = rnd.choice(sorted(set(files) - {src}))
            else:
                dst = fresh(rnd.choice(sorted(dirs)))
            if dst:
                files[dst] = files.pop(src)
                ops.append(Rename(src, dst, True))
        elif k < 0.90 and files:
            p = rnd.choice(sorted(files))
            del files[p]
            ops.append(Delete(p))
        elif k < 0.95:  # a directory removed (only when empty)
            empty = [d for d in dirs if d and not any(x.startswith(d + "/") for x in (*dirs, *files))]
            if empty:
                d = rnd.choice(sorted(empty))
                dirs.discard(d)
                ops.append(Rmdir(d))
        else:  # a directory renamed to a fresh name outside itself
            movable = sorted(d for d in dirs if d)
            if movable:
                src = rnd.choice(movable)
                newparent = rnd.choice(sorted(d for d in dirs if d != src and not d.startswith(src + "/")))
                dst = fresh(newparent)
                if dst:
                    pre = src + "/"
                    for d in sorted(dirs):
                        if d == src or d.startswith(pre):
                            dirs.discard(d)
                            dirs.add(dst + d[len(src) :])
                    for f in sorted(files):
                        if f.startswith(pre):
                            files[dst + f[len(src) :]] = files.pop(f)
                    ops.append(Rename(src, dst, False))
    model: dict = {d: None for d in dirs if d}
    model.update({p: bytes(b) for p, b in files.items()})
    return ops, model


def records(ops) -> list[Record]:
    return [Record(i + 1, 1_700_000_000_000_000_000 + i, op) for i, op in enumerate(ops)]


def modes(root) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_parallel_replay_ends_where_replay_in_order_ends(tmp_path, seed):
    ops, model = random_journal(seed)
    recs = records(ops)
    one = tmp_path / "one"
    stats1 = replay(iter(recs), str(one), snapshot=True, workers=1)
    for workers in (2, 4, 7):
        many = tmp_path / f"many{workers}"
        stats = replay(iter(recs), str(many), snapshot=True, workers=workers)
        assert tree_snapshot(many) == tree_snapshot(one), workers
        assert modes(many) == modes(one), workers
        assert (stats.records, stats.last_seq, stats.bytes_written) == (
            stats1.records,
            stats1.last_seq,
            stats1.bytes_written,
        )
    assert tree_snapshot(one) == model


def test_a_stop_condition_applies_exactly_the_records_before_it(tmp_path):
    ops, _model = random_journal(99)
    recs = records(ops)
    cut = len(recs) // 2
    ref = tmp_path / "ref"
    replay(iter(recs[:cut]), str(ref), snapshot=True, workers=1)
    got = tmp_path / "got"
    stats = replay(iter(recs), str(got), snapshot=True, workers=4, stop=lambda r: r.seq > cut)
    assert stats.stopped and stats.last_seq == cut
    assert tree_snapshot(got) == tree_snapshot(ref)


def test_a_failing_record_in_a_lane_is_reported_with_its_seq(tmp_path):
    """A WRITE to a file the journal never created fails in its lane: replay raises that
    record's ReplayError once everything handed out has finished, in every lane count."""
    ops = [SnapshotEnd(1), Mkdir("d")]
    ops += [op for i in range(40) for op in (Create(f"d/f{i}"), Write(f"d/f{i}", 0, b"x" * 100))]
    ops.insert(30, Write("d/missing", 0, b"y"))
    for workers in (1, 4):
        with pytest.raises(ReplayError) as ei:
            replay(iter(records(ops)), str(tmp_path / f"w{workers}"), snapshot=True, workers=workers)
        assert ei.value.seq == 31
        assert not (tmp_path / f"w{workers}" / "d" / "missing").exists()


def test_a_write_to_a_name_renamed_away_fails_in_every_lane_count(tmp_path):
    """After RENAME a -> b, a WRITE to a (a journal no tree writes) must fail as it does in
    order, not land in b through a descriptor a's lane kept open."""
    a = "a"
    b = next(f"b{i}" for i in range(100) if zlib.crc32(f"b{i}".encode()) % 4 != zlib.crc32(a.encode()) % 4)
    ops = [SnapshotEnd(1), Create(a), Write(a, 0, b"first"), Rename(a, b, True), Write(a, 0, b"stray")]
    for workers in (1, 4):
        with pytest.raises(ReplayError) as ei:
            replay(iter(records(ops)), str(tmp_path / f"w{workers}"), snapshot=True, workers=workers)
        assert ei.value.seq == 5
        assert (tmp_path / f"w{workers}" / b).read_bytes() == b"first"


def test_workers_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        replay(iter([]), str(tmp_path / "x"), workers=0)
