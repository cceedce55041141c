"""Object names of the journal inside a namespace (see protocol.md, Part 2).

    gen/<G:010d>/<S:010d>-<E:010d>.seg   segment of generation G whose first record has
                                         sequence number S, written by writer epoch E
    gen/<G:010d>/ready                   empty sealed object: generation G's snapshot is durable

Generations form one chain (protocol.md 2.1): :func:`continues` says whether one
generation continues the one before it; the readers (restore, verify) and the writer
refuse a journal whose generations do not.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sos_journal.store import ListedObject

GEN_PREFIX = "gen/"
#: Label of the MARKER record a Spark query's batch writes (payload: JSON with checkpoint,
#: query_id, batch_id; protocol.md 2.2); `sos restore --batch` looks for it.
BATCH_LABEL = "spark.batch"
_SEG_RE = re.compile(r"^gen/(\d{10})/(\d{10})-(\d{10})\.seg$")
_READY_RE = re.compile(r"^gen/(\d{10})/ready$")
_MAX = 10**10 - 1
MAX_GENERATION = _MAX  # the last generation number a name can hold: a writer cannot start another


def _check(n: int, what: str) -> int:
    if not isinstance(n, int) or not 0 <= n <= _MAX:
        raise ValueError(f"{what} {n!r} outside 0..{_MAX}")
    return n


def gen_prefix(generation: int) -> str:
    return f"gen/{_check(generation, 'generation'):010d}/"


def segment_name(generation: int, first_seq: int, epoch: int) -> str:
    return f"{gen_prefix(generation)}{_check(first_seq, 'sequence'):010d}-{_check(epoch, 'epoch'):010d}.seg"


def ready_name(generation: int) -> str:
    return gen_prefix(generation) + "ready"


@dataclass(frozen=True, slots=True, order=True)
class SegmentName:
    generation: int
    first_seq: int
    epoch: int

    @property
    def name(self) -> str:
        return segment_name(self.generation, self.first_seq, self.epoch)


def parse_segment_name(name: str) -> SegmentName | None:
    """The parts of a segment name, or None if ``name`` is not a segment."""
    m = _SEG_RE.match(name)
    if not m:
        return None
    return SegmentName(int(m.group(1)), int(m.group(2)), int(m.group(3)))


def parse_ready_name(name: str) -> int | None:
    m = _READY_RE.match(name)
    return int(m.group(1)) if m else None


@dataclass
class SegmentInfo:
    name: str
    generation: int
    first_seq: int
    epoch: int
    length: int
    sealed: bool


@dataclass
class GenerationInfo:
    generation: int
    segments: list[SegmentInfo]  # ordered by first_seq
    ready: bool = False  # complete: gen/<G>/ready exists, is empty and is sealed
    ready_object: tuple[int, bool] | None = None  # (length, sealed) of gen/<G>/ready if it exists

    @property
    def first_seq(self) -> int | None:
        return self.segments[0].first_seq if self.segments else None

    @property
    def ready_problem(self) -> str | None:
        """Why an existing ``ready`` object does not make the generation complete (None: it
        does, or there is none)."""
        if self.ready_object is None:
            return None
        length, sealed = self.ready_object
        if length:
            return f"{ready_name(self.generation)} holds {length} bytes (a ready object is empty)"
        if not sealed:
            return f"{ready_name(self.generation)} is not sealed (its writer was creating it)"
        return None

    @property
    def total_bytes(self) -> int:
        return sum(s.length for s in self.segments)


def scan_listing(entries: Iterable[ListedObject]) -> dict[int, GenerationInfo]:
    """Group LIST entries (objects with name, length, sealed) into generations.

    Unknown names under ``gen/`` are ignored (they are not the journal's). A generation is
    complete (``ready``) only if its ``ready`` object is empty and sealed.
    """
    gens: dict[int, GenerationInfo] = {}
    for e in entries:
        sn = parse_segment_name(e.name)
        if sn is not None:
            g = gens.setdefault(sn.generation, GenerationInfo(sn.generation, []))
            g.segments.append(SegmentInfo(e.name, sn.generation, sn.first_seq, sn.epoch, int(e.length), bool(e.sealed)))
            continue
        rg = parse_ready_name(e.name)
        if rg is not None:
            g = gens.setdefault(rg, GenerationInfo(rg, []))
            g.ready_object = (int(e.length), bool(e.sealed))
            g.ready = g.ready_object == (0, True)
    for g in gens.values():
        g.segments.sort(key=lambda s: (s.first_seq, s.epoch))
    return dict(sorted(gens.items()))


def continues(prev_generation: int, prev_end: int, gen: GenerationInfo) -> str | None:
    """Why ``gen`` does not continue generation ``prev_generation`` whose last whole record
    has sequence number ``prev_end`` (None: it does). protocol.md 2.1: the next generation
    present after G must be G + 1, and its first segment must start with record
    ``prev_end + 1``."""
    if gen.generation != prev_generation + 1:
        return (
            f"generation {gen.generation} does not continue generation {prev_generation}: "
            f"generation numbers grow by 1 (expected generation {prev_generation + 1})"
        )
    if not gen.segments:
        return f"generation {gen.generation} has no segment: it does not continue generation {prev_generation}"
    if gen.first_seq != prev_end + 1:
        return (
            f"generation {gen.generation} does not continue generation {prev_generation}: it starts "
            f"with record {gen.first_seq} ({gen.segments[0].name}) but generation {prev_generation} "
            f"ends with record {prev_end}"
        )
    return None
