"""A writer's table of the event ids it knows: by offset in the session's own partition,
by Position for a record it found anywhere else (shared_log._Chain.known)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from log import Draft, SharedLog
from log.backend import OutRecord
from log.codec import ZERO_HASH, Codec
from log.memory_backend import MemoryBackend, MemoryStore
from log.partitioner import partition_for
from log.topics import AGENT_ACTIONS
from log.types import Position
from schemas.events import LLMCallStarted, SessionStarted

pytestmark = pytest.mark.unit

ACTIONS = AGENT_ACTIONS.name


def started(turn: int) -> LLMCallStarted:
    return LLMCallStarted(
        call_id=f"llm-{turn}", turn=turn, engine_id="e", prompt_tokens=1, max_output_tokens=1, prompt_digest="d"
    )


def test_a_re_append_of_an_event_found_in_another_partition_returns_where_it_is() -> None:
    async def main() -> None:
        store = MemoryStore()
        backend = MemoryBackend(store)
        await backend.start()
        await backend.create_topics(2)
        session = "s-1"
        own = partition_for(session, 2)
        other = 1 - own
        # A record of the session in the other partition, as a client with another partitioner writes it.
        value, _ = Codec().encode(
            event_id="ev-foreign",
            session_id=session,
            seq=0,
            actor="planner",
            occurred_at=datetime(2026, 12, 2, tzinfo=UTC),
            causation_id=None,
            prev_hash=ZERO_HASH,
            body=SessionStarted(program="p", args_json="{}"),
        )
        (foreign,) = await (await backend.produce(ACTIONS, [OutRecord(other, session.encode(), value)]))
        assert foreign.partition == other
        await backend.close()
        async with SharedLog(MemoryBackend(store), actor="planner") as log:
            neighbour = next(s for s in (f"n{i}" for i in range(100)) if log.partition_for(s) == other)
            await log.append(neighbour, started(0))  # loads the other partition, and the foreign record with it
            assert await log.append(session, SessionStarted(program="p", args_json="{}"), event_id="ev-foreign") == (
                foreign
            )
            # Ids landed in the session's own partition come back as Positions there too.
            mine = await log.append_many([Draft(session, started(0), event_id="ev-mine")])
            assert mine[0].partition == own
            assert await log.append(session, started(0), event_id="ev-mine") == mine[0]
            assert isinstance(mine[0], Position)

    asyncio.run(asyncio.wait_for(main(), timeout=10))
