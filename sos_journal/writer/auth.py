"""The journal key on the writer's side (protocol.md 2.5): checked before the writer fences
anyone, and the chain of tags taken up where the journal ends.

:class:`WriterAuth` (a base of :class:`~sos_journal.writer.resume.Resume`) holds the writer's
:class:`~.auth.Signer` (None: no key, the journal is written unauthenticated and the writer
says so in its log). A writer without a key refuses a namespace whose newest generation is
authenticated (JournalKeyRequired), and one with a key refuses a generation authenticated by a
key not in its ring, both before its FENCE, so a misconfigured writer never fences the running
one. A writer with a key whose current generation is not authenticated by its signing key (a
journal written before the key was adopted, or under the ring's older key) starts a new
generation before its first record (``key_rotation_due``; JournaledTree rotates at open).
"""

from __future__ import annotations

import logging

from sos_journal.errors import JournalAuthError, JournalKeyRequired
from sos_journal.format import layout
from sos_journal.format.auth import JOURNAL_KEY_ENV, Signer
from sos_journal.format.records import AUTH_FLAG, HEADER_SIZE, RecordDecoder, peek_header
from sos_journal.store import StoreClient
from sos_journal.writer.state import WriterState

__all__ = ["WriterAuth", "first_record_key"]

log = logging.getLogger(__name__)


def first_record_key(client: StoreClient, seg: layout.SegmentInfo) -> bytes | None:
    """The key fingerprint of the first record of ``seg`` (b"": not authenticated; None: no
    whole first record could be read)."""
    head = b"".join(client.read_iter(seg.name, 0, HEADER_SIZE))
    if len(head) < HEADER_SIZE:
        return None
    length, typ, _seq, _t = peek_header(head)
    if not typ & AUTH_FLAG:
        return b""
    data = b"".join(client.read_iter(seg.name, 0, min(8 + length, seg.length or 8 + length)))
    dec = RecordDecoder(seg.name)
    dec.feed(data)
    try:
        rec = dec.next_record()
    except Exception:  # noqa: BLE001 - a damaged first record: the readers report it
        return None
    return rec.key_id if rec is not None else None


class WriterAuth(WriterState):
    """The writer's journal key (see the module docstring)."""

    signer: Signer | None = None
    #: the generation, key fingerprint and tag of the journal's last record (set by resume)
    _last_auth: tuple[int, bytes, bytes] | None = None
    #: the current generation is not authenticated by the signing key: rotate before appending
    key_rotation_due: bool = False

    def _check_journal_key(self, client: StoreClient, gens: dict[int, layout.GenerationInfo]) -> None:
        """Refuse, before fencing, a newest generation this writer's key cannot continue."""
        written = [g for g in gens.values() if any(s.length for s in g.segments)]
        if not written:
            return
        g = written[-1]
        seg = next(s for s in g.segments if s.length)
        key_id = first_record_key(client, seg)
        if not key_id:
            return
        if self.signer is None:
            raise JournalKeyRequired(
                seg.name,
                0,
                f"generation {g.generation} of namespace {self.namespace!r} is authenticated with journal key "
                f"{key_id.hex()} (fingerprint) and this writer has no journal key: set {JOURNAL_KEY_ENV} or "
                f"--journal-key-file (docs/DEPLOY.md, 'The journal key'); nothing was fenced",
            )
        if self.signer.keys.get(key_id) is None:
            raise JournalAuthError(
                seg.name,
                0,
                f"generation {g.generation} of namespace {self.namespace!r} is authenticated with journal key "
                f"{key_id.hex()}, which is not in this writer's key ring ({self.signer.keys.fingerprints}): "
                f"wrong journal key (to rotate keys give the new key first, then the old one); nothing was fenced",
            )

    def _adopt_chain(self) -> None:
        """Continue the tags of the journal's last record, or plan a new generation."""
        signer = self.signer
        self.key_rotation_due = False
        if signer is None:
            log.warning(
                "namespace %r: no journal key (%s or --journal-key-file): the journal is written "
                "unauthenticated, so whoever can write to the server's storage or its bucket can change "
                "what a restore gives (docs/DEPLOY.md, 'The journal key')",
                self.namespace,
                JOURNAL_KEY_ENV,
            )
            return
        signer.epoch = self.epoch  # the key of the records it encrypts (protocol.md 2.5)
        last = self._last_auth
        if self.generation == 0:
            return  # a new namespace: generation 1 is started by the tree
        if last is not None and last[0] == self.generation and last[1] == signer.key.key_id and last[2]:
            signer.generation, signer.prev = self.generation, last[2]
            return
        self.key_rotation_due = True
        log.warning(
            "namespace %r: generation %d is not authenticated by journal key %s (%s): starting a new "
            "generation under it; restoring a point before it needs %s",
            self.namespace,
            self.generation,
            signer.key.fingerprint,
            "its last record is not authenticated"
            if last is None or not last[1]
            else f"its last record is by key {last[1].hex()}",
            "no journal key" if last is None or not last[1] else "that key",
        )
