"""SharedLog._append with one future per batch: idempotence, in-flight duplicates, failures.

An in-memory backend whose produce() completes only when the test says so makes the
in-flight window visible: re-appends of an event id that is still on its way, from
the same batch or a concurrent append, must get its position (or its error) once the
batch lands, and a failed batch must leave the writer able to append again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

from log import Draft, SharedLog
from log.backend import Backend, OutRecord, Subscription
from log.chain import ChainVerifier
from log.errors import BackendUnavailable
from log.topics import AGENT_ACTIONS
from log.types import Position, RawRecord
from schemas.events import LLMCallStarted, SessionFinished

pytestmark = pytest.mark.unit

NUM_PARTITIONS = 4


def started(turn: int) -> LLMCallStarted:
    return LLMCallStarted(
        call_id=f"llm-{turn}", turn=turn, engine_id="e", prompt_tokens=1, max_output_tokens=1, prompt_digest="d"
    )


class MemoryBackend(Backend):
    """Partitions as lists. With ``hold`` set, produced records land when ``release()`` is called."""

    name = "memory"

    def __init__(self) -> None:
        self.partitions: dict[tuple[str, int], list[RawRecord]] = {}
        self.hold = False
        self.fail_next: BaseException | None = None
        self.held: list[tuple[asyncio.Future[list[Position]], str, Sequence[OutRecord]]] = []
        self.produce_calls = 0
        self.held_more = asyncio.Event()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def create_topics(self, num_partitions: int) -> None:
        pass

    async def num_partitions(self) -> int:
        return NUM_PARTITIONS

    async def produce(self, topic: str, records: Sequence[OutRecord]) -> asyncio.Future[list[Position]]:
        self.produce_calls += 1
        future: asyncio.Future[list[Position]] = asyncio.get_running_loop().create_future()
        if self.hold:
            self.held.append((future, topic, list(records)))
            self.held_more.set()
        else:
            self._land(future, topic, records)
        return future

    def release(self, error: BaseException | None = None) -> None:
        for future, topic, records in self.held:
            if error is None:
                self._land(future, topic, records)
            else:
                future.set_exception(error)
        self.held.clear()

    def _land(self, future: asyncio.Future[list[Position]], topic: str, records: Sequence[OutRecord]) -> None:
        if self.fail_next is not None:
            future.set_exception(self.fail_next)
            self.fail_next = None
            return
        positions = []
        for r in records:
            log = self.partitions.setdefault((topic, r.partition), [])
            position = Position(topic, r.partition, len(log))
            log.append(RawRecord(position, r.key, r.value))
            positions.append(position)
        future.set_result(positions)

    async def scan(
        self, topic: str, partition: int, start: int = 0, end: int | None = None
    ) -> AsyncIterator[RawRecord]:
        for record in self.partitions.get((topic, partition), [])[start:end]:
            yield record

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: len(self.partitions.get((topic, p), [])) for p in range(NUM_PARTITIONS)}

    async def subscribe(self, group: str, topics: Sequence[str], *, from_beginning: bool) -> Subscription:
        raise NotImplementedError

    def records(self) -> list[RawRecord]:
        return [r for (topic, _), log in sorted(self.partitions.items()) if topic == AGENT_ACTIONS.name for r in log]


def run(scenario: Callable[[SharedLog, MemoryBackend], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        backend = MemoryBackend()
        async with SharedLog(backend, actor="planner") as log:
            return await asyncio.wait_for(scenario(log, backend), timeout=10)

    return asyncio.run(main())


async def until_held(backend: MemoryBackend, n: int = 1) -> None:
    while len(backend.held) < n:
        backend.held_more.clear()
        await backend.held_more.wait()


def verified(log: SharedLog, backend: MemoryBackend) -> list[tuple[str, int]]:
    """(session, seq) of every record, after checking every chain as a consumer would."""
    verifier = ChainVerifier()
    out = []
    for record in backend.records():
        envelope = log.codec.decode(record.value)
        verifier.verify(AGENT_ACTIONS, record.key, envelope, record.position)
        out.append((envelope.session_id, envelope.seq))
    return out


def test_a_batch_gets_one_position_per_draft_in_order() -> None:
    async def scenario(log: SharedLog, backend: MemoryBackend) -> None:
        drafts = [Draft(f"s-{i % 3}", started(i), event_id=f"e-{i}") for i in range(9)]
        positions = await log.append_many(drafts)
        assert len(positions) == 9 and len(set(positions)) == 9
        for draft, position in zip(drafts, positions, strict=True):
            assert position.partition == log.partition_for(draft.session_id)
        assert sorted(verified(log, backend)) == sorted((f"s-{i}", seq) for i in range(3) for seq in range(3))
        assert backend.produce_calls == 1

    run(scenario)


def test_duplicates_inside_one_batch_are_written_once() -> None:
    async def scenario(log: SharedLog, backend: MemoryBackend) -> None:
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
        assert len(backend.records()) == 2

    run(scenario)


def test_a_concurrent_append_of_an_event_in_flight_waits_for_its_batch() -> None:
    async def scenario(log: SharedLog, backend: MemoryBackend) -> None:
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
    async def scenario(log: SharedLog, backend: MemoryBackend) -> None:
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
    async def scenario(log: SharedLog, backend: MemoryBackend) -> None:
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
    async def scenario(log: SharedLog, backend: MemoryBackend) -> None:
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
    async def scenario(log: SharedLog, backend: MemoryBackend) -> None:
        await log.append("s", started(0))
        original = backend.produce

        async def refuse(topic: str, records: Sequence[OutRecord]) -> asyncio.Future[list[Position]]:
            raise BackendUnavailable("queue full")

        backend.produce = refuse  # type: ignore[method-assign]
        with pytest.raises(BackendUnavailable):
            await log.append("s", started(1), event_id="x")
        backend.produce = original  # type: ignore[method-assign]
        await log.append("s", started(1), event_id="x")
        assert verified(log, backend) == [("s", 0), ("s", 1)]

    run(scenario)
