"""The Postgres backend's produce on a real server: the one-statement path (a batch of one partition)
and the transaction path (several partitions) have the same effects and the same refusals."""

from __future__ import annotations

import asyncio

import pytest

from log import ConcurrentWriter
from log.backend import OutRecord
from log.errors import BackendUnavailable
from log.postgres_backend import PostgresBackend
from log.topics import AGENT_ACTIONS

pytestmark = pytest.mark.integration

ACTIONS = AGENT_ACTIONS.name


async def _backend(pg_url: str, namespace: str) -> PostgresBackend:
    backend = PostgresBackend(pg_url, namespace=namespace)
    await backend.start()
    await backend.create_topics(4)
    return backend


def test_one_partition_batches_get_gapless_offsets_in_order(pg_url: str, namespace: str) -> None:
    async def scenario() -> None:
        backend = await _backend(pg_url, namespace)
        try:
            first = [OutRecord(1, b"s", f"v{i}".encode(), seq=i, event_id=f"e{i}") for i in range(3)]
            positions = await (await backend.produce(ACTIONS, first))
            assert [p.offset for p in positions] == [0, 1, 2]
            # Concurrent one-record batches (the gateway's): the head's row lock serializes them.
            one = [[OutRecord(1, f"k{i}".encode(), b"x", seq=0, event_id=f"x{i}")] for i in range(8)]
            landed = await asyncio.gather(*(backend.produce(ACTIONS, r) for r in one))
            offsets = sorted([(await f)[0].offset for f in landed])
            assert offsets == list(range(3, 11))
            assert (await backend.end_offsets(ACTIONS))[1] == 11
            assert [r.value for r in await backend.read_key(ACTIONS, 1, b"s")] == [b"v0", b"v1", b"v2"]
        finally:
            await backend.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("partitions", [(0, 0), (0, 2)], ids=["one-statement", "transaction"])
def test_a_second_writer_of_a_chain_or_an_event_is_refused_for_the_whole_batch(
    pg_url: str, namespace: str, partitions: tuple[int, int]
) -> None:
    async def scenario() -> None:
        backend = await _backend(pg_url, namespace)
        try:
            await (await backend.produce(ACTIONS, [OutRecord(0, b"s", b"v0", seq=0, event_id="e0")]))
            p, q = partitions
            twice = [OutRecord(q, b"t", b"t0", seq=0, event_id="t0"), OutRecord(p, b"s", b"v0'", seq=0, event_id="y")]
            with pytest.raises(ConcurrentWriter, match="another writer appended to agent.actions first"):
                await backend.produce(ACTIONS, twice)
            with pytest.raises(ConcurrentWriter, match="another writer"):
                await backend.produce(ACTIONS, [OutRecord(0, b"s", b"v1", seq=1, event_id="e0")])
            ends = await backend.end_offsets(ACTIONS)
            assert (ends[0], ends[2]) == (1, 0)  # nothing of either batch landed
            # The head was not advanced by the refused batches: the next offset is 1.
            (position,) = await (await backend.produce(ACTIONS, [OutRecord(0, b"s", b"v1", seq=1, event_id="e1")]))
            assert position.offset == 1
        finally:
            await backend.close()

    asyncio.run(scenario())


def test_a_partition_without_a_head_is_refused_and_nothing_is_written(pg_url: str, namespace: str) -> None:
    async def scenario() -> None:
        backend = await _backend(pg_url, namespace)
        try:
            with pytest.raises(BackendUnavailable, match=r"agent.actions\[9\] does not exist: run `logctl init`"):
                await backend.produce(ACTIONS, [OutRecord(9, b"s", b"v", seq=0, event_id="e")])
            assert [r async for r in backend.scan(ACTIONS, 9)] == []
        finally:
            await backend.close()

    asyncio.run(scenario())
