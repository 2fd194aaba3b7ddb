"""What a storage backend must provide: raw records in partitioned, append-only topics.

Backends know nothing of envelopes, chains or actors; ``log.shared_log``
builds all of that once on top of this interface. The implementations:
``log.kafka_backend`` and ``log.rdkafka_backend`` (production, on two Kafka
clients), ``log.postgres_backend`` (the embedded default) and
``log.memory_backend`` (one process's memory: unit tests, golden logs,
one-process tools; ``memory:NAME``). All pass the contract suite in
``tests/contract``.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import Enum

from log.types import Position, RawRecord


@dataclass(frozen=True, slots=True)
class OutRecord:
    """A record to produce. ``seq`` and ``event_id`` are indexing hints (Postgres uses them
    for its unique constraints); they are None for records that are not ours."""

    partition: int
    key: bytes
    value: bytes
    seq: int | None = None
    event_id: str | None = None


class Membership(Enum):
    """What a group member knows of its membership, now (``Subscription.membership``)."""

    CONFIRMED = "confirmed"
    """The group confirmed it recently: no other member can have been given its partitions."""
    IN_DOUBT = "in_doubt"
    """Not confirmed for a third of a session timeout (a broker away, a long pause of this process):
    the group may be dropping it. The next answer says which."""
    LOST = "lost"
    """It must rejoin (a rebalance under way, or the group dropped it): its partitions may be
    another member's already, though its next poll has not said so yet."""


class Subscription(ABC):
    """One member of a consumer group: owns some partitions of the subscribed topics."""

    assignments = 0
    """How many times the group has handed this member its partitions. A Kafka member that
    the group dropped (its session timed out: a pause, a broker outage) and that rejoined
    counts one more, even when it got the same partitions back: meanwhile another member
    may have owned them (``EventConsumer`` tells its log, see ``SharedLog.partitions_moved``)."""

    @abstractmethod
    async def poll(self, timeout_s: float, max_records: int) -> list[RawRecord]:
        """Records after the current position of owned partitions, in offset order per partition.

        Waits up to ``timeout_s`` when there is nothing to read.
        """

    @abstractmethod
    async def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        """Store, per (topic, partition), the offset of the next record to read.

        The offsets only say where a restarted member begins to read (every append is idempotent),
        so a backend whose group cannot answer may return before they are stored, saying so, and
        store them with a later commit (both Kafka clients: ``log.kafka_backend.COMMIT_WAIT_S``): a
        caller waiting for good would never poll again."""

    @abstractmethod
    def assignment(self) -> set[tuple[str, int]]:
        """The (topic, partition) pairs this member owns now."""

    def seek(self, topic: str, partition: int, offset: int) -> bool:
        """Read an owned partition from ``offset`` on (call between polls); False if this
        backend cannot, and the caller skips what comes before ``offset`` itself."""
        return False

    def membership(self) -> Membership:
        """Whether the partitions of ``assignment()`` are surely still this member's. A writer
        appends to an owned partition only while CONFIRMED: Kafka itself fences no producer, so
        a member the group dropped without its knowing (its heartbeats lost in a broker outage)
        would write the chains its successor writes. Backends that refuse a second writer
        themselves (Postgres, memory) say CONFIRMED."""
        return Membership.CONFIRMED

    async def refresh(self) -> None:
        """Hear the group's latest word on this member now, between polls, for ``membership()``.
        A writer waiting for CONFIRMED calls it: librdkafka hands its group reports over only
        inside a poll, which the waiting writer may be holding up (kafka-python's heartbeat
        thread needs nothing of the kind). Records it reads meanwhile come with the next poll."""
        return None

    def writing(self) -> AbstractContextManager[object]:
        """Held by a writer from its last look at ``membership()`` until its records are handed
        to the producer, and by the member when the group takes its partitions back: records
        handed over while it is held are flushed before the partitions go (``KafkaSubscription``).
        Backends that refuse a second writer themselves need no such hold."""
        return nullcontext()

    @abstractmethod
    async def close(self) -> None:
        """Leave the group; owned partitions move to the other members."""


class Backend(ABC):
    """Partitioned append-only topics of raw records."""

    name: str

    @abstractmethod
    async def start(self) -> None:
        """Connect. Topics must exist (see ``create_topics``)."""

    @abstractmethod
    async def close(self) -> None:
        """Flush what was produced and disconnect."""

    @abstractmethod
    async def create_topics(self, num_partitions: int) -> None:
        """Create every topic of ``log.topics`` if missing (idempotent)."""

    @abstractmethod
    async def num_partitions(self) -> int:
        """Partitions per topic (all topics have the same count: they are co-partitioned)."""

    @abstractmethod
    async def produce(self, topic: str, records: Sequence[OutRecord]) -> asyncio.Future[list[Position]]:
        """Enqueue records in order and return a future of their positions.

        When this coroutine returns, the relative order of these records is fixed
        (later calls land after them in each partition); awaiting the future
        waits until they are durable.
        """

    @abstractmethod
    def scan(self, topic: str, partition: int, start: int = 0, end: int | None = None) -> AsyncIterator[RawRecord]:
        """Records of one partition with ``start <= offset < end`` (``end`` None: up to the current end)."""

    async def read_key(self, topic: str, partition: int, key: bytes) -> list[RawRecord]:
        """Every record of one key in one partition, in offset order.

        The default scans the partition; backends with an index override it.
        """
        return [r async for r in self.scan(topic, partition) if r.key == key]

    @abstractmethod
    async def end_offsets(self, topic: str) -> dict[int, int]:
        """Per partition, the offset the next record will get."""

    @abstractmethod
    async def subscribe(
        self, group: str, topics: Sequence[str], *, from_beginning: bool, instance_id: str | None = None
    ) -> Subscription:
        """Join consumer group ``group``.

        ``instance_id`` names a member that restarts under the same name (a static
        member): its replacement takes its partitions back at once instead of
        waiting for the dead member's session to time out.

        A partition newly assigned to this member starts at its committed offset, or at 0 with
        ``from_beginning`` (so a worker that takes a partition over re-reads all of it).
        """
