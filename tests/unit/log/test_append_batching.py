"""SharedLog._append with one future per batch: idempotence, in-flight duplicates, failures.

The in-memory backend, with produce() completing only when the test says so, makes the
in-flight window visible: re-appends of an event id that is still on its way, from
the same batch or a concurrent append, must get its position (or its error) once the
batch lands, and a failed batch must leave the writer able to append again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from log import Draft, SharedLog
from log.chain import ChainVerifier
from log.errors import BackendUnavailable
from log.topics import AGENT_ACTIONS
from schemas.events import LLMCallStarted, SessionFinished
from tests.unit.log.held_backend import HeldBackend

pytestmark = pytest.mark.unit

NUM_PARTITIONS = 4


def started(turn: int) -> LLMCallStarted:
    return LLMCallStarted(
        call_id=f"llm-{turn}", turn=turn, engine_id="e", prompt_tokens=1, max_output_tokens=1, prompt_digest="d"
    )


def run(scenario: Callable[[SharedLog, HeldBackend], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        backend = HeldBackend()
        await backend.start()
        await backend.create_topics(NUM_PARTITIONS)
        async with SharedLog(backend, actor="planner") as log:
            return await asyncio.wait_for(scenario(log, backend), timeout=10)

    return asyncio.run(main())


async def until_held(backend: HeldBackend, n: int = 1) -> None:
    while len(backend.held) < n:
        backend.held_more.clear()
        await backend.held_more.wait()


def verified(log: SharedLog, backend: HeldBackend) -> list[tuple[str, int]]:
    """(session, seq) of every record, after checking every chain as a consumer would."""
    verifier = ChainVerifier()
    out = []
    for record in backend.records(AGENT_ACTIONS.name):
        envelope = log.codec.decode(record.value)
        verifier.verify(AGENT_ACTIONS, record.key, envelope, record.position)
        out.append((envelope.session_id, envelope.seq))
    return out


def test_a_batch_gets_one_position_per_draft_in_order() -> None:
    async def scenario(log: SharedLog, backend: HeldBackend) -> None:
        drafts = [Draft(f"s-{i % 3}", started(i), event_id=f"e-{i}") for i in range(9)]
        positions = await log.append_many(drafts)
        assert len(positions) == 9 and len(set(positions)) == 9
        for draft, position in zip(drafts, positions, strict=True):
            assert position.partition == log.partition_for(draft.session_id)
        assert sorted(verified(log, backend)) == sorted((f"s-{i}", seq) for i in range(3) for seq in range(3))
        assert backend.produce_calls == 1

    run(scenario)


def test_duplicates_inside_one_batch_are_written_once() -> None:
    async def scenario(log: SharedLog, backend: HeldBackend) -> None:
        positions = await log.append_many(
            [
                Draft("s", started(0), event_id="a"),
                Draft("s", started(1), event_id="b"),
                Draft("s", started(0), event_id="a"),
            ]
        )
        assert positions[0] == positions[2] != positions[1]
        assert verified(log, backend) == [("s", 0), ("s", 1)]
        # And again later, from the log's memory of it.
        assert await log.append("s", started(0), event_id="a") == positions[0]
        assert len(backend.records(AGENT_ACTIONS.name)) == 2

    run(scenario)


def test_a_concurrent_append_of_an_event_in_flight_waits_for_its_batch() -> None:
    async def scenario(log: SharedLog, backend: HeldBackend) -> None:
        backend.hold = True
        first = asyncio.create_task(log.append_many([Draft("s", started(0), event_id="a"), Draft("s", started(1))]))
        await until_held(backend)
        again = asyncio.create_task(log.append_many([Draft("s", started(2)), Draft("s", started(0), event_id="a")]))
        await until_held(backend, 2)
        await asyncio.sleep(0)
        assert not first.done() and not again.done()
        backend.release()
        first_positions, again_positions = await first, await again
        assert again_positions[1] == first_positions[0]
        assert verified(log, backend) == [("s", 0), ("s", 1), ("s", 2)]

    run(scenario)


def test_cancelling_a_waiter_does_not_cancel_the_batch_it_waits_for() -> None:
    async def scenario(log: SharedLog, backend: HeldBackend) -> None:
        backend.hold = True
        first = asyncio.create_task(log.append("s", started(0), event_id="a"))
        await until_held(backend)
        waiter = asyncio.create_task(log.append("s", started(0), event_id="a"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        backend.release()
        position = await first
        assert await log.append("s", started(0), event_id="a") == position
        assert verified(log, backend) == [("s", 0)]

    run(scenario)


def test_a_failed_batch_fails_its_waiters_and_the_writer_recovers() -> None:
    async def scenario(log: SharedLog, backend: HeldBackend) -> None:
        await log.append("s", started(0), event_id="before")
        backend.hold = True
        first = asyncio.create_task(log.append("s", started(1), event_id="a"))
        await until_held(backend)
        waiter = asyncio.create_task(log.append("s", started(1), event_id="a"))
        await asyncio.sleep(0)
        backend.release(BackendUnavailable("broker went away"))
        for task in (first, waiter):
            with pytest.raises(BackendUnavailable):
                await task
        # Nothing landed: the writer re-reads the partition and continues the chain at seq 1.
        backend.hold = False
        position = await log.append("s", started(1), event_id="a")
        assert position.offset == 1
        assert verified(log, backend) == [("s", 0), ("s", 1)]

    run(scenario)


def test_an_encode_failure_halfway_leaves_no_hole_in_the_chain() -> None:
    async def scenario(log: SharedLog, backend: HeldBackend) -> None:
        await log.append("s", started(0))
        # seq 2**63 does not fit an Avro long; a body with a value out of range fails the same way.
        too_big = SessionFinished(output_json="{}", num_llm_calls=2**63, num_tool_calls=0)
        with pytest.raises(OverflowError):
            await log.append_many([Draft("s", started(1), event_id="ok"), Draft("s", too_big)])
        assert backend.produce_calls == 1  # the failed batch was never produced
        await log.append("s", started(1), event_id="ok")
        await log.append("s", started(2))
        assert verified(log, backend) == [("s", 0), ("s", 1), ("s", 2)]

    run(scenario)


def test_a_produce_that_raises_leaves_the_writer_usable() -> None:
    async def scenario(log: SharedLog, backend: HeldBackend) -> None:
        await log.append("s", started(0))
        backend.refuse = BackendUnavailable("queue full")
        with pytest.raises(BackendUnavailable):
            await log.append("s", started(1), event_id="x")
        backend.refuse = None
        await log.append("s", started(1), event_id="x")
        assert verified(log, backend) == [("s", 0), ("s", 1)]

    run(scenario)
