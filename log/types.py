"""Small value types shared by the log's modules.

``Position``, ``RawRecord`` and ``LoggedEvent`` are named tuples, not frozen dataclasses:
a consumer builds all three for every record it reads, and a named tuple is built in
about half the time (a frozen dataclass sets each field through ``object.__setattr__``)
and hashed in C. Both are immutable and compare field by field. The loops that build one per
record call ``new_tuple(Position, (topic, partition, offset))``: what a named tuple's own
``__new__`` does, without the Python frame it runs in (half the time again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple, NewType

from schemas.envelope import Envelope
from schemas.events import Event

Offset = NewType("Offset", int)

new_tuple = tuple.__new__
"""``new_tuple(cls, values)``: a named tuple of class ``cls`` from a tuple of all its fields."""

Clock = Callable[[], datetime]
"""Injected time source: returns an aware UTC datetime."""


def system_clock() -> datetime:
    """The wall clock, for processes (never used inside services/)."""
    return datetime.now(UTC)


class Position(NamedTuple):
    """Where a record lives: ``offset`` within ``partition`` of ``topic``.

    Offset convention, used everywhere: a committed offset is the offset of the
    *next* record to read, i.e. ``position.offset + 1`` after processing it.
    """

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


class RawRecord(NamedTuple):
    """A record as the backend stores it: key and value bytes at a position."""

    position: Position
    key: bytes | None
    value: bytes


class LoggedEvent(NamedTuple):
    """A decoded, verified record and where it was read."""

    position: Position
    envelope: Envelope

    @property
    def body(self) -> Event:
        return self.envelope.body

    @property
    def session_id(self) -> str:
        return self.envelope.session_id

    @property
    def seq(self) -> int:
        return self.envelope.seq

    @property
    def topic(self) -> str:
        return self.position.topic


@dataclass(frozen=True, slots=True)
class Draft:
    """An event to append: the log fills in seq, prev_hash, hash and the time.

    Give a deterministic ``event_id`` (e.g. derived from session and call id)
    to make a retried append a no-op.
    """

    session_id: str
    body: Event
    event_id: str | None = None
    causation_id: str | None = None
    occurred_at: datetime | None = None


@dataclass
class ConsumerStats:
    """Counters a consumer keeps about what it has read."""

    num_delivered: int = 0
    num_dead_lettered: int = 0
    dead_lettered_by_error: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PartitionMark:
    """Where a consumer group may start one partition again instead of at offset 0.

    ``start``: per topic, the lowest offset still needed (the low-water mark);
    ``read_to``: per topic, how far the group had read when the mark was made;
    ``sessions``: the sessions that still needed work then, each with the
    checkpoint whose snapshot holds its records below ``start`` (None: every
    record of it is at or after ``start``). Records below ``read_to`` of
    sessions not listed belong to sessions that needed nothing more.
    """

    partition: int
    start: dict[str, int]
    read_to: dict[str, int]
    sessions: dict[str, str | None]
