"""How a JournalWriter resumes at open: the spool and the server's generations reconciled.

:class:`Resume` (a role of :class:`~sos_journal.writer.writer.JournalWriter`) does the work of
``open()`` over one connection: the spool's segments scanned (empty ones dropped, a torn tail
cut), the server's generations listed and their chain checked (protocol.md 2.1: a namespace
whose generations do not form one chain is refused, e.g. a far-future generation someone else
published, which it would otherwise continue), a spool older than the server's newest segment
refused (another writer took over), every older epoch fenced, then the position (sequence
number, generation, what is acknowledged) taken from the spool, else from the server's last
record. The server's unsealed objects of older writers are left for the replicator to seal.
"""

from __future__ import annotations

from sos_journal.errors import GenerationBreak, JournalError, SpoolStale
from sos_journal.format import layout
from sos_journal.format.records import Record, RecordDecoder
from sos_journal.read.reading import chain_breaks
from sos_journal.store import Fenced, SOSNotFound, StoreClient, fenced_epoch
from sos_journal.writer.auth import WriterAuth
from sos_journal.writer.spool import Spool, SpoolSegment

__all__ = ["Resume", "server_last_record"]


def server_last(client: StoreClient, seg_name: str) -> Record | None:
    """The last record of one server segment (None if empty)."""
    dec = RecordDecoder(seg_name)
    last: Record | None = None
    for chunk in client.read_iter(seg_name, 0, 0):
        dec.feed(chunk)
        for rec in dec:
            last = rec
    return last


def server_last_record(client: StoreClient, seg_name: str, length: int | None = None) -> tuple[int, int] | None:
    """(last seq, last time_ns) of the records in one server segment (None if empty)."""
    last = server_last(client, seg_name)
    return (last.seq, last.time_ns) if last is not None else None


def _drop_empty(spool: Spool, segs: list[SpoolSegment]) -> tuple[list[SpoolSegment], int]:
    """Remove the empty local segments (created, then the writer died before writing);
    returns the others and the sequence number below every removed one's first."""
    floor = 0
    kept = []
    for s in segs:
        if s.written == 0:
            floor = max(floor, s.first_seq - 1)
            spool.remove(s)
        else:
            kept.append(s)
    return kept, floor


class Resume(WriterAuth):
    """The open of a writer (see the module docstring)."""

    def _open_with(self, client: StoreClient) -> None:
        """Resume over one connection: the spool's segments, the server's generations, the
        fence; then the position (sequence, generation) from the spool, else the server."""
        self._close_segments()
        spool = self._open_spool()
        scanned = spool.scan()
        entries = list(client.list(layout.GEN_PREFIX))
        gens = layout.scan_listing(entries)
        self._check_chain(client, gens)
        server_segs = [s for g in gens.values() for s in g.segments]
        max_epoch = max((s.epoch for s in server_segs), default=0)
        # not before the listing and the chain check: an attempt failing there leaves the empty
        # segments (and the floor they give) to the next one
        segs, floor = _drop_empty(spool, scanned)
        if segs:
            self._refuse_stale_spool(spool, segs, server_segs)

        self._check_journal_key(client, gens)  # before fencing anyone (writer_auth.py)
        epoch = self._fence(client, max_epoch + 1)

        if segs:
            self._resume_from_spool(client, spool, segs, gens, floor)
        else:
            self._resume_from_server(client, gens, floor)
        self._foreign_unsealed = [s.name for s in server_segs if not s.sealed and s.name not in {x.name for x in segs}]
        # an empty ready object its writer did not get to seal: that writer saw SNAPSHOT_END
        # acknowledged (it creates ready only then); readers count it once sealed
        self._foreign_unsealed += [
            layout.ready_name(g.generation) for g in gens.values() if g.segments and g.ready_object == (0, False)
        ]
        self._segs = segs
        self._cur = None  # new records go to a new segment named with our epoch
        self.epoch = epoch
        self._adopt_chain()
        if self.durability == "tier":
            self._tier.open(client, entries, gens)

    def _refuse_stale_spool(
        self, spool: Spool, segs: list[SpoolSegment], server_segs: list[layout.SegmentInfo]
    ) -> None:
        """SpoolStale if the server has segments newer than the spool's last: another writer
        took over (continuing the spool would fork the journal)."""
        last = segs[-1]
        newer = [s for s in server_segs if (s.generation, s.first_seq) > (last.generation, last.first_seq)]
        if newer:
            for s in segs:
                s.close()
            raise SpoolStale(
                f"spool {spool.dir} ends at segment {last.name} but the server has newer segment "
                f"{newer[-1].name}: another writer took over namespace {self.namespace!r}; "
                f"move the spool away to start from the server's state"
            )

    def _resume_from_spool(
        self,
        client: StoreClient,
        spool: Spool,
        segs: list[SpoolSegment],
        gens: dict[int, layout.GenerationInfo],
        floor: int,
    ) -> None:
        """The position from the spool's newest segment (completed from the server), and the
        ready objects its finished generations still owe."""
        last = segs[-1]
        # The server may hold more of the newest segment than the spool (spool tail lost
        # with the page cache): fetch it back so that sequence numbers never repeat.
        try:
            slen, _sealed = client.stat(last.name)
        except SOSNotFound:
            slen = 0
        if slen > last.written:
            for chunk in client.read_iter(last.name, last.written, 0):
                last.write(chunk)
        spool.repair(last)
        self._last_auth = (last.generation, last.last_key_id, last.last_tag) if last.records else None
        for s in segs[:-1]:
            s.last_seq = -1  # not needed: only the newest segment is decoded
        self._seq = max(last.last_seq, floor)
        self._last_time = last.last_time
        self.generation = last.generation
        ends = spool.snapshot_ends()
        end = ends.get(self.generation)
        self.generation_complete = end is not None and end <= self._seq
        for g, seq in ends.items():
            if seq > self._seq:
                spool.drop_snapshot_end(g)
            elif not gens.get(g, layout.GenerationInfo(g, [])).ready:
                self._pending_ready.append((g, seq))
        first_unknown = segs[0].first_seq - 1
        self._acked = min(first_unknown, self._seq)
        self.had_spool = True

    def _resume_from_server(self, client: StoreClient, gens: dict[int, layout.GenerationInfo], floor: int) -> None:
        """No spool: the position from the server's newest generation and its last record."""
        self.had_spool = False
        self._last_auth = None
        if not any(g.segments for g in gens.values()):
            self.generation = 0
            self._seq = floor
            self.generation_complete = False
        else:
            # the newest generation written (a ready object without segments is older than all
            # of them, or the chain check refused it)
            self.generation = max(g.generation for g in gens.values() if g.segments)
            self.generation_complete = gens[self.generation].ready
            last_seq, last_time = floor, 0
            for info in reversed(list(gens.values())):
                found = None
                for seg_info in reversed(info.segments):
                    if seg_info.length > 0:
                        found = server_last(client, seg_info.name)
                        if found:
                            break
                if found:
                    last_seq, last_time = max(found.seq, floor), found.time_ns
                    self._last_auth = (info.generation, found.key_id, found.tag)
                    break
            self._seq = last_seq
            self._last_time = last_time
        self._acked = self._seq

    def _check_chain(self, client: StoreClient, gens: dict[int, layout.GenerationInfo]) -> None:
        """Refuse to write after generations that do not form one chain (protocol.md 2.1)."""
        breaks = chain_breaks(client, gens)
        if breaks:
            b = breaks[0]
            raise GenerationBreak(
                b.name,
                f"{b.reason}"
                + "".join(f"; also: {x.reason}" for x in breaks[1:])
                + f". The writer of namespace {self.namespace!r} refuses to open: objects under gen/ were "
                f"written by someone else with an append key (or are damaged) and it would continue them. "
                f"`sos verify` lists every break; the server's operator removes the foreign objects",
                generation=b.generation,
                previous=b.previous or 0,
            )

    def _fence(self, client: StoreClient, start: int) -> int:
        epoch = max(start, 1)
        for _ in range(100):
            try:
                got = client.fence(epoch)
                return int(got) if isinstance(got, int) and got else epoch
            except Fenced as e:  # every FENCED answer is a Fenced (sos_client.errors)
                epoch = max(epoch, fenced_epoch(e)) + 1
        raise JournalError("could not fence the namespace: another writer keeps racing")
