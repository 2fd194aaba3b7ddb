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

    def __init__(
        self,
        log: SharedLog,
        group: str,
        topics: Sequence[str],
        *,
        from_beginning: bool,
        instance_id: str | None = None,
    ) -> None:
        for name in topics:
            topic_table.topic(name)  # fail early on a typo
        self.log = log
        self.group = group
        self.topics = tuple(topics)
        self.from_beginning = from_beginning
        self.instance_id = instance_id
        self.stats = ConsumerStats()
        self._subscription: Subscription | None = None
        self._verifier = ChainVerifier()
        self._next: dict[tuple[str, int], int] = {}  # next offset expected per partition
        self._uncommitted: dict[tuple[str, int], int] = {}

    async def start(self) -> EventConsumer:
        self._subscription = await self.log.backend.subscribe(
            self.group, self.topics, from_beginning=self.from_beginning, instance_id=self.instance_id
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
        """The (topic, partition) pairs this member owns now."""
        return self._subscription.assignment() if self._subscription else set()

    def position(self, topic: str, partition: int) -> int:
        """The offset of the next record this consumer will hand out (or dead-letter) in a partition."""
        return self._next.get((topic, partition), 0)

    async def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[LoggedEvent]:
        """The next verified events (possibly none after ``timeout_s``)."""
        if self._subscription is None:
            raise RuntimeError("call await consumer.start() first")
        records = await self._subscription.poll(timeout_s, max_records)
        assigned = self._subscription.assignment()
        for tp in [tp for tp in self._next if tp not in assigned]:
            del self._next[tp]  # moved to another member; if it comes back, it is read afresh
        decode = self.log.codec.decode
        verify = self._verifier.verify
        delivered: list[LoggedEvent] = []
        # Backends hand out runs of records of one partition: look its topic up once per run.
        tp = ("", -1)  # the (topic, partition) of the current run; none yet
        topic = topic_table.AGENT_DLQ  # the Topic of the current run (set with the first record)
        for record in records:
            position = record.position
            if position.partition != tp[1] or position.topic != tp[0]:
                tp = (position.topic, position.partition)
                topic = topic_table.topic(position.topic)
            offset = position.offset
            if self._next.get(tp, 0) != offset:
                await self._rebuild_chains(tp, offset)
            # Kept per record, not per run: a concurrent commit() or position() sees each step.
            self._next[tp] = self._uncommitted[tp] = offset + 1
            try:
                envelope = decode(record.value)
                verify(topic, record.key, envelope, position)
            except RecordError as error:
                await self.log.dead_letter(record, error, self.group)
                self.stats.num_dead_lettered += 1
                name = type(error).__name__
                self.stats.dead_lettered_by_error[name] = self.stats.dead_lettered_by_error.get(name, 0) + 1
                continue
            delivered.append(LoggedEvent(position, envelope))
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
