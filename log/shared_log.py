"""The shared log: typed, hash-chained events on top of a raw backend.

A ``SharedLog`` is opened by one principal (its ``actor``) and may append only
to the topics that actor owns (and to the DLQ). For every (topic, session) it
assigns ``seq`` gapless from 0 and links ``prev_hash`` to the previous record.
After a restart it recovers both by re-reading the log: the first append to a
partition replays that partition through a ``ChainVerifier``, the same check
every consumer makes, so a forged record never becomes the tail it links to.

An observer (``on_appended``, e.g. a worker's Prometheus metrics) hears of every
record this instance wrote, once it is durable: its topic, the (session, body,
occurred_at) of each new record (a re-append of a known event id is not new) and
how long the append took.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

from log import topics as topic_table
from log.backend import Backend, OutRecord
from log.chain import ChainVerifier
from log.codec import ZERO_HASH, Codec
from log.consumer import EventConsumer
from log.errors import NotTopicOwner, RecordError
from log.partitioner import partition_for
from log.types import Clock, Draft, LoggedEvent, Position, RawRecord, system_clock
from schemas.envelope import Envelope
from schemas.events import Event, RecordDeadLettered

_log = logging.getLogger(__name__)


_Pending = tuple[asyncio.Future[list[Position]], int]
"""A record in flight: the future of its append's batch, and its index in the batch."""

AppendObserver = Callable[[str, list[tuple[str, Event, float]], float], None]
"""``(topic, [(session id, body, occurred_at as epoch seconds)], seconds the append took)``."""


@dataclass
class _Chain:
    """What a writer knows about one (topic, session) chain."""

    next_seq: int = 0
    last_hash: bytes = ZERO_HASH
    # event_id -> where it landed (or its _Pending while in flight); makes re-appends no-ops.
    # Landed in the session's own partition (always, with our partitioner), just the offset:
    # an int is no object for the garbage collector to scan, and a long-lived writer keeps one
    # entry per event it ever wrote (a Position each made full collections the largest cost
    # of appending, bench/log_throughput.py). A Position only for a record found elsewhere.
    known: dict[str, int | Position | _Pending] = field(default_factory=dict)


class SharedLog:
    """Append typed events as ``actor``; read sessions; consume as a group.

    Use as an async context manager, or call ``start()`` and ``close()``.
    """

    def __init__(self, backend: Backend, *, actor: str, clock: Clock = system_clock) -> None:
        self.backend = backend
        self.actor = actor
        self.clock = clock
        self.codec = Codec()
        self.num_partitions = 0
        self._chains: dict[tuple[str, str], _Chain] = {}
        self._loaded: set[tuple[str, int]] = set()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # The backend's futures of batches sent and not yet acknowledged, per topic: a partition
        # is re-read only once they settled, so that the scan sees every record sent before it.
        self._in_flight: defaultdict[str, set[asyncio.Future[list[Position]]]] = defaultdict(set)
        # Dead letters go to a chain of this instance's own (see dead_letter()).
        self._dlq_session = f"dlq/{actor}/{uuid.uuid4().hex[:12]}"
        self.on_appended: AppendObserver | None = None
        """Told of every record this instance wrote, once durable (see the module docstring)."""

    async def start(self) -> SharedLog:
        await self.backend.start()
        try:
            self.num_partitions = await self.backend.num_partitions()
        except BaseException:
            # Not started, so no one will close it (``async with`` calls no __aexit__ then),
            # also when the caller gave up waiting (cancelled): what the backend opened is closed.
            await self.backend.close()
            raise
        return self

    async def close(self) -> None:
        await self.backend.close()

    async def __aenter__(self) -> SharedLog:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def partition_for(self, session_id: str) -> int:
        return partition_for(session_id, self.num_partitions)

    # ------------------------------------------------------------------ append

    async def append(
        self,
        session_id: str,
        body: Event,
        *,
        event_id: str | None = None,
        causation_id: str | None = None,
    ) -> Position:
        """Append one event to the topic its body belongs on; returns where it landed.

        Appending an ``event_id`` that is already in the log returns its position
        and writes nothing.
        """
        (position,) = await self.append_many([Draft(session_id, body, event_id, causation_id)])
        return position

    async def append_many(
        self, drafts: Sequence[Draft], *, guard: AbstractContextManager[object] | None = None
    ) -> list[Position]:
        """Append events (all for one topic) in order, waiting once for all of them.

        ``guard`` is entered right before the records are handed to the backend, with nothing
        awaited in between, and left once they are: a writer fenced by its group membership
        checks it there, so that the check holds when the records are handed over (a raise
        refuses the append; nothing is written). See ``workers.runtime.SessionWorker.append``.
        """
        if not drafts:
            return []
        topic = topic_table.topic_of(drafts[0].body)
        for draft in drafts:
            if topic_table.topic_of(draft.body) is not topic:
                raise ValueError("append_many takes events of one topic; split the batch by topic")
        if not topic.allows_actor(self.actor):
            raise NotTopicOwner(f"{self.actor!r} may not append to {topic.name}; only {topic.owner!r} may")
        return await self._append(topic, drafts, guard)

    async def dead_letter(self, record: RawRecord, error: RecordError, group: str) -> Position | None:
        """Set a bad record aside on ``agent.dlq`` with the reason.

        Each SharedLog instance writes its dead letters to a chain of its own
        (session ``dlq/<actor>/<instance>``), so concurrent writers of the DLQ
        never share a seq; the bad record's key is kept in the body. A read-only
        principal (the auditor) may not write even the DLQ: the record is only
        logged and counted by its consumer; returns None then.
        """
        if not topic_table.AGENT_DLQ.allows_actor(self.actor):
            _log.warning("%s (read-only) skips %s: %s", self.actor, record.position, error)
            return None
        body = RecordDeadLettered(
            source_topic=record.position.topic,
            source_partition=record.position.partition,
            source_offset=record.position.offset,
            source_session_id=record.key.decode(errors="replace") if record.key is not None else None,
            error_type=type(error).__name__,
            reason=str(error),
            consumer_group=group,
            raw_value=record.value,
        )
        (position,) = await self._append(topic_table.AGENT_DLQ, [Draft(self._dlq_session, body)])
        return position

    async def _append(
        self,
        topic: topic_table.Topic,
        drafts: Sequence[Draft],
        guard: AbstractContextManager[object] | None = None,
    ) -> list[Position]:
        # One future stands for the whole batch; what each record waits for is (that future,
        # its index in the batch). An event_id seen before resolves to its Position, or, while
        # its batch is in flight (earlier in this batch or in a concurrent append), to that pair.
        began = time.perf_counter()
        batch: asyncio.Future[list[Position]] = asyncio.get_running_loop().create_future()
        results: list[int | Position | _Pending] = []
        written: list[tuple[str, Event, float]] = []  # for on_appended: (session, body, occurred_at)
        out: list[OutRecord] = []
        fresh: list[tuple[_Chain, str]] = []  # the chain and event_id of each record of ``out``
        async with self._locks[topic.name]:
            partitions = [self.partition_for(d.session_id) for d in drafts]
            if topic is not topic_table.AGENT_DLQ:
                for partition in set(partitions):
                    if (topic.name, partition) not in self._loaded:
                        await self._load_partition(topic, partition)
            try:
                for draft, partition in zip(drafts, partitions, strict=True):
                    chain = self._chains.setdefault((topic.name, draft.session_id), _Chain())
                    event_id = draft.event_id or str(uuid.uuid4())
                    known = chain.known.get(event_id)
                    if known is not None:
                        results.append(known)
                        continue
                    occurred_at = draft.occurred_at or self.clock()
                    value, digest = self.codec.encode(
                        event_id=event_id,
                        session_id=draft.session_id,
                        seq=chain.next_seq,
                        actor=self.actor,
                        occurred_at=occurred_at,
                        causation_id=draft.causation_id,
                        prev_hash=chain.last_hash,
                        body=draft.body,
                    )
                    pending = (batch, len(out))
                    out.append(OutRecord(partition, draft.session_id.encode(), value, chain.next_seq, event_id))
                    fresh.append((chain, event_id))
                    written.append((draft.session_id, draft.body, occurred_at.timestamp()))
                    chain.next_seq += 1
                    chain.last_hash = digest
                    chain.known[event_id] = pending
                    results.append(pending)
                produced = None
                if out:
                    # A Kafka backend hands every record to its producer before produce() first
                    # yields to the loop: the guard's check and the hand-over are one step.
                    with guard if guard is not None else nullcontext():
                        produced = await self.backend.produce(topic.name, out)
                if produced is not None:
                    in_flight = self._in_flight[topic.name]
                    in_flight.add(produced)
                    produced.add_done_callback(in_flight.discard)
            except BaseException as e:
                self._abandon(topic.name, out, batch, e)
                raise
        try:
            positions = await produced if produced is not None else []
        except BaseException as e:
            self._abandon(topic.name, out, batch, e)
            raise
        batch.set_result(positions)
        for (chain, event_id), position in zip(fresh, positions, strict=True):
            chain.known[event_id] = position.offset  # in the partition we sent it to
        if written and self.on_appended is not None:
            self.on_appended(topic.name, written, time.perf_counter() - began)
        landed: list[Position] = []
        for r, partition in zip(results, partitions, strict=True):
            if isinstance(r, int):
                landed.append(Position(topic.name, partition, r))
            elif isinstance(r, Position):
                landed.append(r)
            elif r[0] is batch:
                landed.append(positions[r[1]])
            else:
                # In flight in a concurrent append. Shielded: if our caller gives up waiting,
                # that must not cancel the other append's batch.
                landed.append((await asyncio.shield(r[0]))[r[1]])
        return landed

    def _abandon(
        self, topic: str, out: Sequence[OutRecord], batch: asyncio.Future[list[Position]], error: BaseException
    ) -> None:
        """A batch failed (or was cancelled) before all of it was known to have landed.

        Some of it may have landed, or none (an encode or a send failed halfway): forget
        what we assumed about its partitions and re-read the log on the next append. Whoever
        waits for one of its event ids gets the error.
        """
        self._forget(topic, {r.partition for r in out})
        if not batch.done():
            batch.set_exception(error)
            batch.exception()  # mark it retrieved: the caller gets the error from _append itself

    async def _load_partition(self, topic: topic_table.Topic, partition: int) -> None:
        """Recover seq, prev_hash and known event ids of every session in one partition."""
        if in_flight := self._in_flight[topic.name]:
            # Sent before the partition was forgotten, maybe not acknowledged (so not read back)
            # yet: a scan now would hand out their seqs again. Settled either way, they are.
            await asyncio.wait(list(in_flight))
        verifier = ChainVerifier()
        num_records = 0
        async for record in self.backend.scan(topic.name, partition):
            num_records += 1
            try:
                envelope = self.codec.decode(record.value)
                verifier.verify(topic, record.key, envelope, record.position)
            except RecordError:
                continue  # consumers dead-letter it; it is not part of any chain
            chain = self._chains.setdefault((topic.name, envelope.session_id), _Chain())
            chain.next_seq = envelope.seq + 1
            chain.last_hash = envelope.hash
            position = record.position
            # By offset when in the session's own partition, where an append looks it up again.
            mine = position.partition == self.partition_for(envelope.session_id)
            chain.known[envelope.event_id] = position.offset if mine else position
        self._loaded.add((topic.name, partition))
        _log.debug("recovered %s[%d] from %d records", topic.name, partition, num_records)

    def partitions_moved(self, partitions: set[int]) -> None:
        """The consumer group moved partitions (``EventConsumer`` calls this at a rebalance).

        Whoever owns a session's partition writes its chains; while this process did not
        own it, another did, and appended. What this writer knew of those chains is stale:
        appended to as it was, a chain would get a seq and a prev_hash twice (Kafka refuses
        nothing; the Postgres and memory backends refuse it as a ``ConcurrentWriter``).
        Forgotten, the next append to the partition re-reads it first. The DLQ chain is this
        instance's alone: kept.
        """
        for topic in {name for name, _ in self._chains} | {name for name, _ in self._loaded}:
            if topic != topic_table.AGENT_DLQ.name:
                self._forget(topic, partitions)

    def _forget(self, topic: str, partitions: Iterable[int]) -> None:
        partitions = set(partitions)
        self._loaded -= {(topic, p) for p in partitions}
        for key in [k for k in self._chains if k[0] == topic and self.partition_for(k[1]) in partitions]:
            del self._chains[key]

    # -------------------------------------------------------------------- read

    async def history(self, session_id: str, topics: Iterable[str] | None = None) -> list[LoggedEvent]:
        """One session's verified events across topics, in order.

        Within a topic the order is the log's. Across topics, events are merged by
        ``occurred_at``, then by topic (DESIGN.md table order), then by seq.
        Records that fail verification are left out (consumers dead-letter them).
        """
        names = list(topics) if topics is not None else [t.name for t in topic_table.TOPICS[:-1]]
        partition = self.partition_for(session_id)
        found: list[LoggedEvent] = []
        for name in names:
            topic = topic_table.topic(name)
            verifier = ChainVerifier()
            for record in await self.backend.read_key(name, partition, session_id.encode()):
                try:
                    envelope = self.codec.decode(record.value)
                    verifier.verify(topic, record.key, envelope, record.position)
                except RecordError as e:
                    _log.warning("history of %s skips %s: %s", session_id, record.position, e)
                    continue
                found.append(LoggedEvent(record.position, envelope))
        found.sort(key=lambda e: (e.envelope.occurred_at, topic_table.TOPIC_ORDER[e.topic], e.seq))
        return found

    def scan(self, topic: str, partition: int, start: int = 0, end: int | None = None) -> AsyncIterator[RawRecord]:
        """Raw records of one partition (for audits and tools)."""
        return self.backend.scan(topic, partition, start, end)

    def decode(self, record: RawRecord) -> Envelope:
        """Decode and self-verify one raw record (raises a RecordError)."""
        return self.codec.decode(record.value)

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return await self.backend.end_offsets(topic)

    def consumer(
        self, group: str, topics: Sequence[str], *, from_beginning: bool = False, instance_id: str | None = None
    ) -> EventConsumer:
        """A typed consumer in consumer group ``group`` (call ``await consumer.start()``).

        Give a stable ``instance_id`` to a process that restarts under the same name.
        """
        return EventConsumer(self, group, topics, from_beginning=from_beginning, instance_id=instance_id)
