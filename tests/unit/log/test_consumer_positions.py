"""What ``EventConsumer.poll`` says of its position in a partition, record by record.

The common path of ``poll`` (the next record of a run it needs nothing special for) keeps a
partition's position in locals and writes it back before anything awaits and at the end. These
tests check what a caller can see: the position and the offsets a commit sends, after a poll and
while a bad record is being dead-lettered (the one await inside a run), and the read counts.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from log import SharedLog
from log.backend import OutRecord
from log.consumer import EventConsumer
from log.errors import RecordError
from log.memory_backend import MemoryBackend, MemoryStore
from log.types import Position, RawRecord
from schemas.events import LLMCallStarted
from tests.contract.shared_log_contract import FakeClock

pytestmark = pytest.mark.unit

ACTIONS = "agent.actions"
SESSION = "s-1"


def started(turn: int) -> LLMCallStarted:
    return LLMCallStarted(
        call_id=f"llm-{turn}", turn=turn, engine_id="e", prompt_tokens=1, max_output_tokens=1, prompt_digest="d"
    )


class Watching(SharedLog):
    """A SharedLog whose dead-letter write notes what the consumer says of its position meanwhile."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumer: EventConsumer | None = None
        self.seen: list[tuple[int, int, int]] = []  # (bad record's offset, position then, decoded then)

    async def dead_letter(self, record: RawRecord, error: RecordError, group: str) -> Position | None:
        assert self.consumer is not None
        topic, partition, offset = record.position
        await asyncio.sleep(0)  # a real write awaits: let anything else run
        self.seen.append((offset, self.consumer.position(topic, partition), self.consumer.reads.decoded))
        return await super().dead_letter(record, error, group)


async def scenario() -> None:
    store = MemoryStore()
    setup = MemoryBackend(store)
    await setup.start()
    await setup.create_topics(2)
    log = Watching(MemoryBackend(store), actor="planner", clock=FakeClock())
    await log.start()
    partition = log.partition_for(SESSION)
    await log.append(SESSION, started(0))  # offset 0
    await log.append(SESSION, started(1))  # 1
    await (await log.backend.produce(ACTIONS, [OutRecord(partition, SESSION.encode(), b"\x00\x00junk")]))  # 2
    await log.append(SESSION, started(2))  # 3
    await log.append(SESSION, started(3))  # 4
    consumer = log.consumer = await EventConsumer(log, "g", [ACTIONS], from_beginning=True).start()

    events = await consumer.poll(0.01, max_records=4)
    assert [e.seq for e in events] == [0, 1, 2]
    # While the bad record at offset 2 was set aside, the position was already past it.
    assert log.seen == [(2, 3, 3)]
    assert consumer.position(ACTIONS, partition) == 4
    assert consumer.reads.decoded == 4
    assert consumer.stats.num_dead_lettered == 1

    await consumer.commit()
    assert store.groups["g"].committed[(ACTIONS, partition)] == 4

    events = await consumer.poll(0.01)
    assert [e.seq for e in events] == [3]
    assert consumer.position(ACTIONS, partition) == 5
    assert consumer.reads.decoded == 5
    await consumer.commit()
    assert store.groups["g"].committed[(ACTIONS, partition)] == 5
    assert consumer.stats.num_delivered == 4
    await consumer.close()
    await log.close()


def test_the_position_moves_record_by_record_and_is_written_back_before_a_dead_letter() -> None:
    asyncio.run(scenario())
