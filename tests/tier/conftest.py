"""Fixtures the tier's test modules share: a moto server of a test's own (``own_moto``), and a
real journal copied into a bucket, its server gone (``journal``). Both stand on the ``moto``
fixture of tests/tier/support.py, which each module takes with ``pytest_plugins``."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from sos_client import Client
from sos_journal import JournaledTree, JournalWriter, restore, verify
from sos_journal.format import layout
from sos_journal.format.records import RecordDecoder
from sos_journal.rebuild.restore import rebuild_cache
from sos_journal.testing import tree_state
from tests.tier.support import Journal, OwnMoto, copy_to, make_bucket
from tools.server import ServerProcess


@pytest.fixture
def own_moto(moto, monkeypatch):
    """An :class:`OwnMoto` the tier's clients reach ($AWS_ENDPOINT_URL), stopped at the end."""
    m = OwnMoto()
    monkeypatch.setenv("AWS_ENDPOINT_URL", m.endpoint)
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def journal(moto, tmp_path_factory) -> Journal:
    """A journal with several generations and batches, its server's restores of four points, its
    objects in a bucket; the server is then stopped and its data directory deleted."""
    base = tmp_path_factory.mktemp("tier-restore")
    srv = ServerProcess(base / "data", log_path=base / "server.log").start()
    ns = f"tr{os.getpid()}"
    key = srv.keygen(ns, "append")

    def fac():
        return Client(srv.address, key, ns, timeout=60)

    try:
        w = JournalWriter(fac, ns, str(base / "spool"), segment_bytes=2048, generation_bytes=2500)
        t = JournaledTree(str(base / "cache"), w, rebuild=rebuild_cache).open()
        states: dict[int, dict] = {0: {}}

        def step(fn, *a, **kw):
            before = w.last_seq
            fn(*a, **kw)
            states[before + 1] = tree_state(t.local_path(""))

        step(t.mkdir, "chk")
        step(t.mkdir, "chk/offsets")
        step(t.mkdir, "chk/commits")
        for n in range(12):
            if n == 6:
                w.generation_bytes = 1 << 30  # the newest generation: a long run after its snapshot
            tmpn = f"chk/offsets/.{n}.tmp"
            step(t.create, tmpn)
            step(t.write, tmpn, 0, (b"batch %d " % n) * (40 + 30 * n))
            step(t.rename, tmpn, f"chk/offsets/{n}", overwrite=False)
            step(t.create, f"chk/commits/.{n}.tmp")
            step(t.rename, f"chk/commits/.{n}.tmp", f"chk/commits/{n}", overwrite=False)
            step(t.marker, "spark.batch", json.dumps({"checkpoint": "chk", "query_id": "q", "batch_id": n}).encode())
            if n >= 2:
                step(t.unlink, f"chk/offsets/{n - 2}")
        t.sync()
        t.close()
        objects: dict[str, tuple[bytes, bool]] = {}
        records = []
        with fac() as c:
            for e in c.list(""):
                objects[e.name] = (c.read(e.name), bool(e.sealed))
            gens = layout.scan_listing(c.list("gen/"))
        assert len(gens) >= 3 and all(g.ready for g in gens.values()), gens
        for name in sorted(objects):
            if layout.parse_segment_name(name):
                d = RecordDecoder(name)
                d.feed(objects[name][0])
                records.extend(d)
        j = Journal(ns, objects, states, records)
        mid = records[len(records) // 2]
        j.at_ns, j.position = mid.time_ns, records[len(records) // 3].seq
        points = {
            "latest": {},
            "batch": {"batch": "chk:9"},
            "at": {"at": j.at_ns},
            "position": {"position": j.position},
        }
        for label, opts in points.items():
            out = base / f"server-{label}"
            restore(fac, ns, str(out), **opts)
            j.points[label] = tree_state(str(out))
        assert verify(fac, ns).ok
    finally:
        srv.stop()
    shutil.rmtree(base / "data")  # the server's disk is gone: only the bucket is left
    j.url = make_bucket("tier")
    from sos_tier.s3 import S3Store

    store = S3Store(j.url)
    try:
        copy_to(store, ns, objects)
    finally:
        store.close()
    return j
