"""What the in-memory backend does beyond the contract suite (tests/contract/test_memory.py):
one owner per partition while members come and go, static members, the writers' unique
constraints, named stores by URL."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from log import ConcurrentWriter, backend_for
from log.backend import OutRecord
from log.errors import BackendUnavailable
from log.memory_backend import MemoryBackend, MemoryStore
from log.types import Position

pytestmark = pytest.mark.unit

ACTIONS = "agent.actions"


def run(scenario: Callable[[MemoryBackend], Awaitable[Any]], num_partitions: int = 4) -> Any:
    async def main() -> Any:
        backend = MemoryBackend()
        await backend.start()
        await backend.create_topics(num_partitions)
        return await asyncio.wait_for(scenario(backend), timeout=10)

    return asyncio.run(main())


async def produce(backend: MemoryBackend, partition: int, *values: bytes) -> list[Position]:
    return await (await backend.produce(ACTIONS, [OutRecord(partition, b"k", v) for v in values]))


def test_a_joining_member_takes_a_partition_only_once_its_owner_gave_it_up() -> None:
    async def scenario(backend: MemoryBackend) -> None:
        a = await backend.subscribe("g", [ACTIONS], from_beginning=False)
        assert a.assignment() == {(ACTIONS, p) for p in range(4)}
        b = await backend.subscribe("g", [ACTIONS], from_beginning=False)
        assert b.assignment() == set()  # 1 and 3 are b's to take, but a still holds them
        assert await b.poll(0.0, 10) == [] and b.assignment() == set()
        await a.poll(0.0, 10)  # a rebalances: it gives 1 and 3 up
        assert a.assignment() == {(ACTIONS, 0), (ACTIONS, 2)}
        await b.poll(0.0, 10)
        assert b.assignment() == {(ACTIONS, 1), (ACTIONS, 3)}
        await b.close()
        await a.poll(0.0, 10)
        assert len(a.assignment()) == 4

    run(scenario)


def test_a_waiting_poll_wakes_for_a_record_and_a_taken_over_partition_starts_at_the_commit() -> None:
    async def scenario(backend: MemoryBackend) -> None:
        await produce(backend, 1, b"r0", b"r1", b"r2")
        a = await backend.subscribe("g", [ACTIONS], from_beginning=False)
        assert [r.value for r in await a.poll(0.0, 10)] == [b"r0", b"r1", b"r2"]
        await a.commit({(ACTIONS, 1): 2})  # processed r0 and r1 only
        waiting = asyncio.ensure_future(a.poll(30.0, 10))
        await asyncio.sleep(0)
        await produce(backend, 1, b"r3")
        assert [r.value for r in await waiting] == [b"r3"]  # long before the 30 s
        await a.close()
        b = await backend.subscribe("g", [ACTIONS], from_beginning=False)
        assert [r.value for r in await b.poll(0.0, 10)] == [b"r2", b"r3"]
        c = await backend.subscribe("other", [ACTIONS], from_beginning=True)
        assert len(await c.poll(0.0, 10)) == 4

    run(scenario)


def test_a_static_member_back_under_its_instance_id_takes_its_place_and_fences_the_old_one() -> None:
    async def scenario(backend: MemoryBackend) -> None:
        old = await backend.subscribe("g", [ACTIONS], from_beginning=False, instance_id="planner-0")
        other = await backend.subscribe("g", [ACTIONS], from_beginning=False, instance_id="planner-1")
        await old.poll(0.0, 10)
        await other.poll(0.0, 10)
        held = old.assignment()
        assert held == {(ACTIONS, 0), (ACTIONS, 2)}
        new = await backend.subscribe("g", [ACTIONS], from_beginning=False, instance_id="planner-0")
        assert new.assignment() == held  # at once: no wait for the old one to time out
        assert old.assignment() == set()
        with pytest.raises(RuntimeError, match="replaced by a newer member"):
            await old.poll(0.0, 10)
        with pytest.raises(RuntimeError, match="replaced by a newer member"):
            await old.commit({(ACTIONS, 0): 1})
        await old.close()  # a no-op now
        await other.poll(0.0, 10)
        assert other.assignment() == {(ACTIONS, 1), (ACTIONS, 3)}

    run(scenario)


def test_a_second_writer_of_a_chain_or_an_event_is_refused_for_the_whole_batch() -> None:
    async def scenario(backend: MemoryBackend) -> None:
        await (await backend.produce(ACTIONS, [OutRecord(0, b"s", b"v0", seq=0, event_id="e0")]))
        twice = [OutRecord(0, b"s", b"v1", seq=1, event_id="e1"), OutRecord(0, b"s", b"v0'", seq=0, event_id="x")]
        with pytest.raises(ConcurrentWriter, match="seq 0 of s"):
            await backend.produce(ACTIONS, twice)
        with pytest.raises(ConcurrentWriter, match="event e0"):
            await backend.produce(ACTIONS, [OutRecord(0, b"s", b"v1", seq=1, event_id="e0")])
        assert (await backend.end_offsets(ACTIONS))[0] == 1  # nothing of either batch landed
        # Records that are not ours carry no seq nor event id: never refused.
        await produce(backend, 0, b"junk", b"junk")
        assert [r.value for r in await backend.read_key(ACTIONS, 0, b"s")] == [b"v0"]

    run(scenario)


def test_a_store_is_used_only_between_start_and_close_and_keeps_its_partition_count() -> None:
    async def main() -> None:
        store = MemoryStore()
        backend = MemoryBackend(store)
        with pytest.raises(RuntimeError, match="not started"):
            await backend.end_offsets(ACTIONS)
        await backend.start()
        with pytest.raises(BackendUnavailable, match="logctl init"):
            await backend.num_partitions()
        await backend.create_topics(2)
        again = MemoryBackend(store)
        await again.start()
        await again.create_topics(8)
        assert await again.num_partitions() == 2
        await backend.close()
        with pytest.raises(RuntimeError, match="not started"):
            await produce(backend, 0, b"v")

    asyncio.run(main())


def test_memory_urls_name_a_store_of_this_process_per_namespace() -> None:
    one, same = backend_for("memory:golden", namespace="n"), backend_for("memory:golden", namespace="n")
    assert isinstance(one, MemoryBackend) and isinstance(same, MemoryBackend)
    assert one.store is same.store
    other_namespace = backend_for("memory:golden", namespace="m")
    assert isinstance(other_namespace, MemoryBackend) and other_namespace.store is not one.store
    default = backend_for("memory", namespace="n")
    assert isinstance(default, MemoryBackend) and default.store is not one.store
    assert default.store is backend_for("memory:", namespace="n").store  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="memory:NAME"):
        backend_for("memory://golden")
