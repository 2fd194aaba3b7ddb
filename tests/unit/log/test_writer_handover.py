"""A writer whose partition moved to another member and back: its chain tails are stale.

Whoever owns a session's partition in its role's group writes that session's chains. When
the partition comes back (the other member died, or left), the other member's appends are
in the log and not in this writer's memory: it must re-read the partition before it
appends, or it hands out a seq (and prev_hash) a second time. Kafka takes such a record
(``logctl verify``: "repeats seq 2, expected 4", found by the chaos bench); the memory and
Postgres backends refuse it (``ConcurrentWriter``), which is what these tests see.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from log import SharedLog
from log.chain import ChainVerifier
from log.errors import DecodeError
from log.memory_backend import MemoryBackend, MemoryStore
from log.topics import AGENT_ACTIONS, AGENT_DLQ
from log.types import Position, RawRecord
from schemas.events import LLMCallStarted
from tests.unit.log.held_backend import HeldBackend

pytestmark = pytest.mark.unit

ACTIONS = AGENT_ACTIONS.name


def started(turn: int) -> LLMCallStarted:
    return LLMCallStarted(
        call_id=f"llm-{turn}", turn=turn, engine_id="e", prompt_tokens=1, max_output_tokens=1, prompt_digest="d"
    )


def in_partition(log: SharedLog, partition: int) -> str:
    return next(s for s in (f"s{i}" for i in range(100)) if log.partition_for(s) == partition)


async def chain_seqs(log: SharedLog, session: str) -> list[int]:
    """The seqs of ``session`` on agent.actions, each checked against the chain before it."""
    verifier = ChainVerifier()
    seqs = []
    async for record in log.scan(ACTIONS, log.partition_for(session)):
        envelope = log.decode(record)
        if envelope.session_id == session:
            verifier.verify(AGENT_ACTIONS, record.key, envelope, record.position)  # raises on a repeat
            seqs.append(envelope.seq)
    return seqs


def run(scenario: Callable[[MemoryStore], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        store = MemoryStore()
        backend = MemoryBackend(store)
        await backend.start()
        await backend.create_topics(2)
        await backend.close()
        return await asyncio.wait_for(scenario(store), timeout=10)

    return asyncio.run(main())


def test_a_partition_back_from_another_member_is_re_read_before_its_owner_appends() -> None:
    async def scenario(store: MemoryStore) -> None:
        async with (
            SharedLog(MemoryBackend(store), actor="planner") as a,
            SharedLog(MemoryBackend(store), actor="planner") as b,
        ):
            session = in_partition(a, 1)  # the memory group gives partition 1 to its second member
            one = await a.consumer("planner", [ACTIONS], from_beginning=True).start()
            await one.poll(0.0)
            await a.append(session, started(0))  # seq 0: ``a`` now knows this chain
            two = await b.consumer("planner", [ACTIONS], from_beginning=True).start()
            await one.poll(0.0)  # ``a`` gives partition 1 up
            await two.poll(0.0)
            assert (ACTIONS, 1) in two.assignment()
            await b.append(session, started(1))  # seq 1, by the new owner
            await two.close()  # it goes (dies, leaves): partition 1 comes back to ``a``
            await one.poll(0.0)
            assert (ACTIONS, 1) in one.assignment()
            await a.append(session, started(2))  # seq 2, not 1 again
            assert await chain_seqs(a, session) == [0, 1, 2]
            await one.close()

    run(scenario)


def test_a_partition_forgotten_while_a_batch_is_in_flight_is_re_read_after_it_landed() -> None:
    async def main() -> None:
        backend = HeldBackend()
        await backend.start()
        await backend.create_topics(2)
        async with SharedLog(backend, actor="planner") as log:
            session = in_partition(log, 0)
            await log.append(session, started(0))
            backend.hold = True
            first = asyncio.create_task(log.append(session, started(1)))  # seq 1, sent, not acknowledged
            await backend.held_more.wait()
            log.partitions_moved({0})  # a rebalance while it is on its way
            second = asyncio.create_task(log.append(session, started(2)))
            await asyncio.sleep(0.05)
            assert len(backend.held) == 1  # the second waits for the first before re-reading
            backend.held_more.clear()
            backend.release()
            await first
            await backend.held_more.wait()  # the second, sent once the first landed and was read back
            backend.release()
            await second
            assert await chain_seqs(log, session) == [0, 1, 2]

    asyncio.run(asyncio.wait_for(main(), timeout=10))


def test_the_dead_letter_chain_of_a_writer_goes_on_when_partitions_move() -> None:
    async def scenario(store: MemoryStore) -> None:
        async with SharedLog(MemoryBackend(store), actor="planner") as log:
            bad = RawRecord(Position(ACTIONS, 0, 0), b"k", b"junk")
            await log.dead_letter(bad, DecodeError("junk"), "planner")
            log.partitions_moved({0, 1})  # the DLQ chain is the instance's own, in no group's partition
            await log.dead_letter(bad, DecodeError("junk"), "planner")
            verifier = ChainVerifier()
            seqs = []
            for partition in range(2):
                async for record in log.scan(AGENT_DLQ.name, partition):
                    envelope = log.decode(record)
                    verifier.verify(AGENT_DLQ, record.key, envelope, record.position)
                    seqs.append(envelope.seq)
            assert seqs == [0, 1]

    run(scenario)
