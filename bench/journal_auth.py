"""The journal key's cost per record (protocol.md 2.5): encode, and decode with the chain
check, of 1 MiB WRITEs and of RENAMEs, without a key, authenticated (HMAC-SHA256 tag) and
authenticated + encrypted (ChaCha20-Poly1305 body). CPU time of this process, so a busy
machine changes the figures less than wall time would.

    python -m bench.journal_auth
"""

from __future__ import annotations

import time

from sos_journal.format import layout
from sos_journal.format.auth import ChainCheck, JournalKeys, SegmentKeys, Signer
from sos_journal.format.records import Op, RecordDecoder, Rename, Write, encode

KEYS = JournalKeys.parse("5c" * 32)
SEG = layout.segment_name(1, 1, 1)


def run(label: str, op: Op, n: int, mode: str) -> str:
    sign = None
    if mode != "none":
        sign = Signer(KEYS, "ns", encrypt=mode == "enc")
        sign.restart(1)
        sign.epoch = 1
    t0 = time.process_time()
    out = []
    for i in range(n):
        d = encode(op, i + 1, i, sign)
        if sign is not None:
            sign.prev = d[-16:]
        out.append(d)
    t1 = time.process_time()
    data = b"".join(out)
    dec = RecordDecoder(SEG, keys=SegmentKeys(KEYS, "ns", SEG) if sign is not None else None)
    chk = ChainCheck(KEYS if sign is not None else None, "ns", 1)
    dec.feed(data)
    for r in dec:
        chk.check(r)
    t2 = time.process_time()
    mb = len(data) / 1e6
    return (
        f"{label:9} {mode:5} encode {mb / (t1 - t0):7.0f} MB/s {n / (t1 - t0):8.0f} rec/s"
        f"   decode+check {mb / (t2 - t1):7.0f} MB/s {n / (t2 - t1):8.0f} rec/s"
    )


def main() -> None:
    for mode in ("none", "auth", "enc"):
        print(run("write 1M", Write("chk/state/1/0.delta", 0, b"x" * (1 << 20)), 200, mode))
    for mode in ("none", "auth", "enc"):
        print(run("rename", Rename("chk/commits/.12.tmp", "chk/commits/12", False), 50000, mode))


if __name__ == "__main__":
    main()
