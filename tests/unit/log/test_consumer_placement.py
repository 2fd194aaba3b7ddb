"""Where ``EventConsumer`` reads a partition from, whatever its backend's position is.

A Kafka client's idea of where to read a partition can differ from the consumer's: a
kafka-python member the group dropped forgets its positions and reads the partitions it gets
back from their committed offsets; librdkafka counts a partition revoked and assigned again as
kept, and reads it from its committed offset too. The consumer decides: a partition new to it
is read from its start, or from 0 when it reads from the beginning (the backend is sought
there); a partition it kept goes on from its own position; one read from committed offsets
begins at the backend's. ``Forgetful`` below is a memory backend's member that does what those
clients do (a fake of the client's behaviour, for the consumer's logic alone; the real broker's
case: tests/integration/test_kafka_lost_member.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from log import SharedLog
from log.backend import Subscription
from log.consumer import EventConsumer, StartAt
from log.memory_backend import MemoryBackend, MemoryStore, MemorySubscription
from log.types import RawRecord
from schemas.events import LLMCallStarted
from tests.contract.shared_log_contract import FakeClock

pytestmark = pytest.mark.unit

ACTIONS = "agent.actions"
NUM_PARTITIONS = 4


def started(turn: int) -> LLMCallStarted:
    return LLMCallStarted(
        call_id=f"llm-{turn}", turn=turn, engine_id="e", prompt_tokens=1, max_output_tokens=1, prompt_digest="d"
    )


class Forgetful(Subscription):
    """A memory member that can hide its partitions for a poll (a revocation a poll sees), get them
    back reading from their committed offsets (the client forgot its positions), refuse a seek
    until it has fetched (librdkafka's), and hand out records of a partition it no longer owns."""

    def __init__(self, inner: MemorySubscription) -> None:
        self.inner = inner
        self.hidden = False
        self.unfetched: set[tuple[str, int]] = set()
        self.stray: list[RawRecord] = []

    async def poll(self, timeout_s: float, max_records: int) -> list[RawRecord]:
        if self.hidden:
            return []
        records = await self.inner.poll(timeout_s, max_records)
        self.unfetched.clear()  # fetching: a seek works from the next call on
        stray, self.stray = self.stray, []
        return stray + records

    async def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        await self.inner.commit(offsets)

    def assignment(self) -> set[tuple[str, int]]:
        return set() if self.hidden else self.inner.assignment()

    def back_at_committed_offsets(self) -> None:
        """The same partitions again, as a new assignment, read from their committed offsets."""
        self.hidden = False
        self.assignments += 1
        for tp in self.inner._positions:
            self.inner._positions[tp] = self.inner._group.committed.get(tp, 0)
            self.unfetched.add(tp)

    def seek(self, topic: str, partition: int, offset: int) -> bool:
        if self.hidden or (topic, partition) in self.unfetched:
            return False
        return self.inner.seek(topic, partition, offset)

    async def close(self) -> None:
        await self.inner.close()


Hook = Callable[[str, int], Awaitable[StartAt | None]] | None


async def no_mark(topic: str, partition: int) -> StartAt | None:
    return None


async def a_log() -> SharedLog:
    store = MemoryStore()
    setup = MemoryBackend(store)
    await setup.start()
    await setup.create_topics(NUM_PARTITIONS)
    log = SharedLog(MemoryBackend(store), actor="planner", clock=FakeClock())
    await log.start()
    for i in range(8):
        for turn in range(2):
            await log.append(f"s-{i}", started(turn))
    return log


async def forgetful_consumer(log: SharedLog, *, from_beginning: bool, hook: Hook) -> tuple[EventConsumer, Forgetful]:
    made: list[Forgetful] = []
    subscribe = log.backend.subscribe

    async def wrapped(*args: Any, **kwargs: Any) -> Subscription:
        inner = await subscribe(*args, **kwargs)
        assert isinstance(inner, MemorySubscription)
        made.append(Forgetful(inner))
        return made[-1]

    log.backend.subscribe = wrapped  # type: ignore[method-assign]
    consumer = await EventConsumer(log, "g", [ACTIONS], from_beginning=from_beginning, start_at=hook).start()
    return consumer, made[0]


async def read(consumer: EventConsumer, polls: int = 4) -> list[tuple[str, int]]:
    got: list[tuple[str, int]] = []
    for _ in range(polls):
        got += [(e.session_id, e.seq) for e in await consumer.poll(0.01)]
    return sorted(got)


EVERYTHING = sorted((f"s-{i}", turn) for i in range(8) for turn in range(2))


@pytest.mark.parametrize("hook", [None, no_mark], ids=["no hook", "a hook without a mark"])
def test_a_partition_given_back_at_its_committed_offset_is_read_again_from_0(hook: Hook) -> None:
    async def scenario() -> None:
        log = await a_log()
        consumer, member = await forgetful_consumer(log, from_beginning=True, hook=hook)
        assert await read(consumer) == EVERYTHING
        await consumer.commit()  # the committed offsets are the ends
        member.hidden = True  # revoked: a poll sees no partition
        assert await consumer.poll(0.01) == [] and consumer.assignment_at_poll() == set()
        member.back_at_committed_offsets()
        assert await read(consumer) == EVERYTHING  # anew from 0, whole; before: nothing, positions 0
        ends = await log.end_offsets(ACTIONS)
        assert {p: consumer.position(ACTIONS, p) for p in ends} == ends
        assert consumer.stats.num_dead_lettered == 0
        await consumer.close()
        await log.close()

    asyncio.run(scenario())


def test_a_partition_kept_across_a_rebalance_goes_on_from_the_consumers_position() -> None:
    async def scenario() -> None:
        log = await a_log()
        consumer, member = await forgetful_consumer(log, from_beginning=True, hook=None)
        assert await read(consumer) == EVERYTHING
        # Nothing committed: a client that forgot its positions would read everything again.
        member.back_at_committed_offsets()  # the same partitions, a new assignment, no poll between
        assert await read(consumer) == []
        await log.append("s-0", started(2))
        assert await read(consumer) == [("s-0", 2)]
        assert consumer.stats.num_dead_lettered == 0 and consumer.reads.rebuilt == 0
        await consumer.close()
        await log.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("hook", [None, no_mark], ids=["no hook", "a hook without a mark"])
def test_a_consumer_reading_from_committed_offsets_resumes_there(hook: Hook) -> None:
    async def scenario() -> None:
        log = await a_log()
        first = await log.consumer("g", [ACTIONS], from_beginning=True).start()
        assert await read(first) == EVERYTHING
        await first.commit()
        await first.close()
        consumer, member = await forgetful_consumer(log, from_beginning=False, hook=hook)
        assert await read(consumer) == []
        member.back_at_committed_offsets()
        assert await read(consumer) == []  # not sought to 0 (before, with a hook: everything again)
        await log.append("s-1", started(2))
        assert await read(consumer) == [("s-1", 2)]
        assert consumer.stats.num_dead_lettered == 0  # its chain was rebuilt up to there
        await consumer.close()
        await log.close()

    asyncio.run(scenario())


def test_records_of_a_partition_that_moved_away_are_not_handed_out() -> None:
    async def scenario() -> None:
        log = await a_log()
        consumer, member = await forgetful_consumer(log, from_beginning=True, hook=no_mark)
        assert await read(consumer) == EVERYTHING
        partition = log.partition_for("s-0")
        member.stray = [r async for r in log.backend.scan(ACTIONS, partition, 0, 1)]  # fetched before it went
        del member.inner._positions[(ACTIONS, partition)]  # and the partition went
        assert await read(consumer, polls=1) == []
        assert consumer.reads.dropped == 1 and consumer.position(ACTIONS, partition) == 0
        await consumer.close()
        await log.close()

    asyncio.run(scenario())
