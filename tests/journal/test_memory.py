"""Bounded memory: a 1 GiB file written through JournaledTree (and restored) in a subprocess
against a real, fast sos-server; the subprocess's peak RSS must stay far below the file size.

Every layer between the tree and the socket is bounded: WRITE records of 1 MiB, the spool
read by the replicator in chunk_bytes * pipeline, append_many's window, the restore's
read step and the decoder's buffer (one record plus one read chunk).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import PEAK_RSS_KIB

GIB = 1 << 30
RSS_BOUND = 200 << 20  # honest: measured ~40-45 MB here; the file is 1024 MB


WRITE_SCRIPT = PEAK_RSS_KIB + textwrap.dedent("""
    import hashlib, os, sys
    from sos_client import Client
    from sos_journal import JournalWriter, JournaledTree
    from sos_journal.rebuild.restore import rebuild_cache
    addr, key, ns, spool, cache, total = sys.argv[1:]
    total = int(total)
    fac = lambda: Client(addr, key, ns, timeout=120)
    w = JournalWriter(fac, ns, spool, generation_bytes=1 << 40)
    t = JournaledTree(cache, w, rebuild=rebuild_cache).open()
    t.create("big")
    h = hashlib.sha256()
    block = bytearray(os.urandom(1 << 20))
    for i in range(total >> 20):
        block[:8] = i.to_bytes(8, "big")
        t.write("big", i << 20, block)  # 1 MiB per call; the server acks as fast as it can
        h.update(block)
        if i % 256 == 255:
            t.sync()  # an fsync now and then, like a closing writer would
    t.rename("big", "big.done", overwrite=False)  # carried by the close's flush
    t.close()
    print(h.hexdigest(), peak_rss_kib() * 1024, flush=True)
""")

RESTORE_SCRIPT = PEAK_RSS_KIB + textwrap.dedent("""
    import sys
    from sos_client import Client
    from sos_journal import restore
    addr, key, ns, target = sys.argv[1:]
    s = restore(lambda: Client(addr, key, ns, timeout=120), ns, target)
    print(s.bytes, peak_rss_kib() * 1024, flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_gib_file_streams_in_bounded_memory(sos_server, tmp_path):
    ns = "bigmem"
    key = sos_server.keygen(ns, "append")
    (tmp_path / "w.py").write_text(WRITE_SCRIPT)
    (tmp_path / "r.py").write_text(RESTORE_SCRIPT)
    out = subprocess.run(
        [
            sys.executable,
            str(tmp_path / "w.py"),
            sos_server.address,
            key,
            ns,
            str(tmp_path / "spool"),
            str(tmp_path / "cache"),
            str(GIB),
        ],
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    digest, rss = out.stdout.split()
    print(f"writer peak RSS {int(rss) >> 20} MB")
    assert int(rss) < RSS_BOUND, f"writer peak RSS {int(rss) >> 20} MB"
    assert os.path.getsize(tmp_path / "cache" / "big.done") == GIB
    # the spool keeps only the newest segment once the others are sealed on the server
    spool_bytes = sum(f.stat().st_size for f in (tmp_path / "spool").rglob("*.seg"))
    assert spool_bytes <= 64 << 20
    os.unlink(tmp_path / "cache" / "big.done")  # disk space: the server copy is what matters

    out = subprocess.run(
        [sys.executable, str(tmp_path / "r.py"), sos_server.address, key, ns, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    nbytes, rss = out.stdout.split()
    assert int(nbytes) == GIB
    print(f"restore peak RSS {int(rss) >> 20} MB")
    assert int(rss) < RSS_BOUND, f"restore peak RSS {int(rss) >> 20} MB"
    h = hashlib.sha256()
    with open(tmp_path / "out" / "big.done", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    assert h.hexdigest() == digest
