"""A hostile journal: what if the server (or whoever holds an append key) serves crafted
records with valid checksums? ``sos restore`` must stay inside its target directory, stop
before the first record it cannot trust, say where, and exit non-zero -- never write
outside the target, never crash with a traceback.

Segments are written with raw APPENDs through ``sos_client.Client`` (the server stores
bytes; it does not parse journal records), so each hostile record carries a correct CRC.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import crc32c
import pytest

from sos_client import Client
from sos_journal import JournalCorrupt, JournalError, restore
from sos_journal.format.records import Create, Mkdir, SnapshotEnd, Write, encode

pytestmark = [pytest.mark.hostile]

TIMEOUT = 120
SEG = "gen/0000000001/0000000001-0000000001.seg"
READY = "gen/0000000001/ready"
CREATE, WRITE, RENAME = 3, 4, 6


def _s(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogateescape")
    return struct.pack(">H", len(raw)) + raw


def _raw_record(typ: int, seq: int, body: bytes) -> bytes:
    """A record with a valid length and CRC whatever its body says (encode() would refuse)."""
    head = struct.pack(">BQQ", typ, seq, 1_700_000_000_000_000_000 + seq)
    return struct.pack(">II", len(head) + len(body), crc32c.crc32c(head + body)) + head + body


def _good_prefix() -> bytes:
    ops = [Mkdir("d"), Create("d/ok"), Write("d/ok", 0, b"fine"), SnapshotEnd(1)]
    return b"".join(encode(op, i + 1, 1_700_000_000_000_000_000 + i) for i, op in enumerate(ops))


@pytest.fixture(scope="module")
def sos_server(server):
    """The module's shared server (conftest)."""
    return server


@pytest.fixture
def victim(sos_server, tmp_path):
    """(server, tmp dir, publish(ns, hostile_record_bytes) -> key)"""

    def publish(ns: str, hostile: bytes) -> str:
        key = sos_server.keygen(ns, "append")
        with Client(sos_server.address, key, ns, timeout=TIMEOUT) as c:
            c.append(SEG, 0, _good_prefix() + hostile + encode(Create("after"), 6, 1_700_000_000_000_000_006))
            c.append(READY, 0, b"")
            c.seal(READY)
        return key

    return sos_server, tmp_path, publish


ESCAPE = "escaped-file"

HOSTILE = {
    "create_dotdot": lambda tmp: _raw_record(CREATE, 5, _s(f"../{ESCAPE}") + struct.pack(">I", 0o644)),
    "create_deep_dotdot": lambda tmp: _raw_record(CREATE, 5, _s(f"d/../../{ESCAPE}") + struct.pack(">I", 0o644)),
    "create_absolute": lambda tmp: _raw_record(CREATE, 5, _s(str(tmp / ESCAPE)) + struct.pack(">I", 0o644)),
    "create_nul": lambda tmp: _raw_record(CREATE, 5, _s("d/x\x00y") + struct.pack(">I", 0o644)),
    "rename_out": lambda tmp: _raw_record(RENAME, 5, _s("d/ok") + _s(f"../{ESCAPE}") + b"\x01"),
    "write_dotdot": lambda tmp: _raw_record(WRITE, 5, _s(f"../{ESCAPE}") + struct.pack(">QI", 0, 4) + b"evil"),
    "write_huge_offset": lambda tmp: _raw_record(WRITE, 5, _s("d/ok") + struct.pack(">QI", (1 << 64) - 1, 4) + b"evil"),
    "write_blob_over_limit": lambda tmp: _raw_record(
        WRITE, 5, _s("d/ok") + struct.pack(">QI", 0, (1 << 20) + 1) + b"evil"
    ),
}


CLI_CASES = {"create_dotdot", "rename_out", "write_huge_offset"}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_crafted_records_never_escape_the_target(victim, case):
    srv, tmp, publish = victim
    ns = "j" + case.replace("_", "-")
    key = publish(ns, HOSTILE[case](tmp))
    target = tmp / "target" / "restored"
    target.parent.mkdir()

    def factory():
        return Client(srv.address, key, ns, timeout=TIMEOUT)

    # the library: a typed journal error (or a clean OS error), never a stray exception
    with pytest.raises((JournalError, OSError)) as ei:
        restore(factory, ns, str(target))
    if isinstance(ei.value, JournalCorrupt):
        assert ei.value.segment == SEG and ei.value.offset == len(_good_prefix())
    targets = [target]
    if case in CLI_CASES:  # the command line: non-zero exit, one "sos:" line, no traceback
        cli_target = tmp / "target" / "cli"
        targets.append(cli_target)
        env = dict(os.environ, SOS_SERVER=srv.address, SOS_KEY=key)
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from sos_client.cli import main; sys.exit(main())",
                "restore",
                "-q",
                ns,
                str(cli_target),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert r.returncode != 0, r.stderr
        assert "Traceback" not in r.stderr and "sos:" in r.stderr, r.stderr
    # nothing outside the targets, nothing after the hostile record
    assert not (tmp / ESCAPE).exists() and not (tmp / "target" / ESCAPE).exists()
    assert sorted(os.listdir(tmp / "target")) == sorted(t.name for t in targets)
    for t in targets:
        assert not (t / "after").exists()
        if (t / "d" / "ok").exists():
            assert (t / "d" / "ok").read_bytes() == b"fine"
