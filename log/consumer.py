"""The typed consumer: decoded, verified events with explicit commits.

Consumers trust nothing. Each record is decoded and checked against the chain
of its (topic, session); a record that fails goes to ``agent.dlq`` with the
reason, is counted, is never handed to the caller, and consumption continues.

When a partition is first read from an offset other than 0 (resuming from a
committed offset, or taking a partition over from another member), the chain
state of that partition is rebuilt by replaying it from offset 0 up to there:
the records before the cut are checked again, not trusted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from log import topics as topic_table
from log.backend import Subscription
from log.chain import ChainVerifier
from log.errors import RecordError
from log.types import ConsumerStats, LoggedEvent

if TYPE_CHECKING:
    from log.shared_log import SharedLog


class EventConsumer:
    """A member of a consumer group that yields ``LoggedEvent``s.

    Offsets are committed only when you call ``commit()``: commit after the
    effect of an event is durable, and a restart resumes right after it.
    """

    def __init__(self, log: SharedLog, group: str, topics: Sequence[str], *, from_beginning: bool) -> None:
        for name in topics:
            topic_table.topic(name)  # fail early on a typo
        self.log = log
        self.group = group
        self.topics = tuple(topics)
        self.from_beginning = from_beginning
        self.stats = ConsumerStats()
        self._subscription: Subscription | None = None
        self._verifier = ChainVerifier()
        self._next: dict[tuple[str, int], int] = {}  # next offset expected per partition
        self._uncommitted: dict[tuple[str, int], int] = {}

    async def start(self) -> EventConsumer:
        self._subscription = await self.log.backend.subscribe(
            self.group, self.topics, from_beginning=self.from_beginning
        )
        return self

    async def close(self) -> None:
        if self._subscription is not None:
            await self._subscription.close()
            self._subscription = None

    async def __aenter__(self) -> EventConsumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def assignment(self) -> set[tuple[str, int]]:
        return self._subscription.assignment() if self._subscription else set()

    async def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[LoggedEvent]:
        """The next verified events (possibly none after ``timeout_s``)."""
        if self._subscription is None:
            raise RuntimeError("call await consumer.start() first")
        records = await self._subscription.poll(timeout_s, max_records)
        delivered: list[LoggedEvent] = []
        for record in records:
            tp = (record.position.topic, record.position.partition)
            if self._next.get(tp, 0) != record.position.offset:
                await self._rebuild_chains(tp, record.position.offset)
            self._next[tp] = record.position.offset + 1
            self._uncommitted[tp] = record.position.offset + 1
            topic = topic_table.topic(record.position.topic)
            try:
                envelope = self.log.codec.decode(record.value)
                self._verifier.verify(topic, record.key, envelope, record.position)
            except RecordError as error:
                await self.log.dead_letter(record, error, self.group)
                self.stats.num_dead_lettered += 1
                name = type(error).__name__
                self.stats.dead_lettered_by_error[name] = self.stats.dead_lettered_by_error.get(name, 0) + 1
                continue
            delivered.append(LoggedEvent(record.position, envelope))
        self.stats.num_delivered += len(delivered)
        return delivered

    async def commit(self, through: LoggedEvent | None = None) -> None:
        """Commit everything polled so far, or only up to and including ``through`` in its partition."""
        if self._subscription is None:
            raise RuntimeError("call await consumer.start() first")
        if through is None:
            offsets, self._uncommitted = self._uncommitted, {}
        else:
            tp = (through.position.topic, through.position.partition)
            offsets = {tp: through.position.offset + 1}
            if self._uncommitted.get(tp) == through.position.offset + 1:
                del self._uncommitted[tp]
        if offsets:
            await self._subscription.commit(offsets)

    async def __aiter__(self) -> AsyncIterator[LoggedEvent]:
        """Events forever (until the task is cancelled); commit as you go."""
        while True:
            for event in await self.poll():
                yield event

    async def _rebuild_chains(self, tp: tuple[str, int], offset: int) -> None:
        """Re-derive chain tails of one partition from its records before ``offset``."""
        name, partition = tp
        topic = topic_table.topic(name)
        self._verifier.forget(name, lambda session: self.log.partition_for(session) == partition)
        async for record in self.log.backend.scan(name, partition, 0, offset):
            try:
                envelope = self.log.codec.decode(record.value)
                self._verifier.verify(topic, record.key, envelope, record.position)
            except RecordError:
                continue  # it was dead-lettered when it was first read
