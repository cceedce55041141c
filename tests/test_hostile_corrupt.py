"""A corrupted byte in a stored journal segment, end to end.

The journal is written through the journal core (JournaledTree over a JournalWriter)
against a real ``sos-server``; then one byte of the server's object file is flipped on
disk. Expected: reads raise ``Corrupt``; ``sos verify NS`` names the broken segment and
where, and exits non-zero; ``sos restore NS DIR`` stops before the damage, says where,
and exits non-zero. Nothing after the broken record may be replayed.

Two ways of flipping: while the server runs (bit rot under a live server) and while it is
stopped, then restarted (what an operator's disk does between two runs): start-up must not
mistake a bad frame in the middle of an object for a torn tail.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from sos_client import Client, Corrupt
from sos_client.journal import JournaledTree, JournalWriter

NS = "rot"
N_FILES = 8
BROKEN = 5  # the file whose WRITE record gets the flipped byte
TIMEOUT = 120


def _payload(i: int) -> bytes:
    return (f"PAYLOAD-{i}-" * 50).encode()


def _sos(srv, key, *args):
    """Run the ``sos`` command in a subprocess (its entry point: sos_client.cli:main)."""
    env = dict(os.environ, SOS_SERVER=srv.address, SOS_KEY=key)
    return subprocess.run(
        [sys.executable, "-c", "import sys; from sos_client.cli import main; sys.exit(main())", *args],
        capture_output=True, text=True, env=env, timeout=300,
    )


@pytest.fixture
def journal(sos_server, tmp_path):
    """Write N_FILES files, one durable sync each; returns facts about what was written."""
    key = sos_server.keygen(NS, "append")

    def factory():
        return Client(sos_server.address, key, NS, timeout=TIMEOUT)

    writer = JournalWriter(factory, NS, str(tmp_path / "spool"))
    tree = JournaledTree(str(tmp_path / "cache"), writer)
    try:
        for i in range(N_FILES):
            tree.create(f"f{i}")
            tree.write(f"f{i}", 0, _payload(i))
            tree.sync()  # durable on the server before the next file: one APPEND per file
    finally:
        tree.close()
        writer.close()
    with factory() as c:
        segs = [e for e in c.list("gen/") if e.name.endswith(".seg")]
        assert len(segs) == 1, segs
        seg = segs[0].name
        stored = c.read(seg)
    logical = stored.find(_payload(BROKEN)[:40])
    assert logical > 0
    return {"srv": sos_server, "key": key, "factory": factory, "seg": seg, "stored": stored,
            "logical": logical, "tmp": tmp_path}


def _flip_on_disk(srv, marker: bytes) -> str:
    """Flip one byte of *marker* inside the server's object file; returns the file's path."""
    hits = []
    for path in glob.glob(os.path.join(srv.data_dir, "ns", NS, "objects", "*", "*")):
        with open(path, "rb") as f:
            data = f.read()
        i = data.find(marker)
        if i >= 0:
            hits.append((path, i + 7))
    assert len(hits) == 1, hits
    path, pos = hits[0]
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())
    return path


def _check_damage_reported(j, *, restart: bool) -> tuple[str, str]:
    srv, key, seg = j["srv"], j["key"], j["seg"]
    # reads report it (a range entirely before the damage is still served)
    with j["factory"]() as c:
        assert c.stat(seg)[0] == len(j["stored"]), "acknowledged bytes were cut off"
        with pytest.raises(Corrupt) as ei:
            c.read(seg)
        assert seg in str(ei.value)
        assert c.read(seg, 0, 100) == j["stored"][:100]
    verify = _sos(srv, key, "verify", "-q", NS)
    vout = verify.stdout + verify.stderr
    assert verify.returncode != 0, vout
    assert seg in vout and "BROKEN" in vout, vout
    target = j["tmp"] / ("restored-restart" if restart else "restored")
    restore = _sos(srv, key, "restore", "-q", NS, str(target))
    rout = restore.stdout + restore.stderr
    assert restore.returncode != 0, rout
    assert seg in rout and "offset" in rout, rout
    restored = sorted(os.listdir(target)) if target.exists() else []
    # nothing after the damage was replayed
    assert not {f"f{i}" for i in range(BROKEN + 1, N_FILES)} & set(restored), restored
    if f"f{BROKEN}" in restored:
        assert (target / f"f{BROKEN}").read_bytes() != _payload(BROKEN)
    return vout, rout


def test_flipped_byte_under_a_running_server_is_reported_by_read_verify_and_restore(journal):
    _flip_on_disk(journal["srv"], _payload(BROKEN)[:40])
    _check_damage_reported(journal, restart=False)


def test_flipped_byte_while_stopped_survives_restart_and_is_reported(journal):
    srv = journal["srv"]
    srv.stop()
    _flip_on_disk(srv, _payload(BROKEN)[:40])
    srv.start()
    _check_damage_reported(journal, restart=True)
    # and the records after the damaged one are still on the server, byte for byte
    with journal["factory"]() as c:
        tail_from = journal["logical"] + len(_payload(BROKEN))
        assert c.read(journal["seg"], tail_from, 0) == journal["stored"][tail_from:]


def test_verify_and_restore_locate_the_damage_precisely(journal):
    """verify names the broken record's offset (not the whole segment from 0); restore
    replays every record before it and none after it."""
    _flip_on_disk(journal["srv"], _payload(BROKEN)[:40])
    vout, rout = _check_damage_reported(journal, restart=False)
    starts = [int(m) for m in re.findall(re.escape(journal["seg"]) + r" \[(\d+),", vout)]
    assert starts, vout
    assert 0 < starts[0] <= journal["logical"], vout
    target = journal["tmp"] / "restored"
    for i in range(BROKEN):
        assert (target / f"f{i}").read_bytes() == _payload(i), (i, rout)
