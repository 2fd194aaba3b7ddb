"""The planner's view of the cache manager's decisions (workers/cache_view.py), on a memory log."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from log import SharedLog
from log.memory_backend import MemoryBackend
from schemas.events import CacheAction, CacheDecisionMade
from workers.cache_view import CacheDecisions

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def decision(action: CacheAction, engine: str) -> CacheDecisionMade:
    return CacheDecisionMade(engine_id=engine, action=action, score=1.0, num_blocks=4, reason="test")


def test_a_discard_after_the_last_call_drops_the_prefix_on_that_engine_only() -> None:
    async def run() -> None:
        now = [T0]
        log = SharedLog(MemoryBackend(), actor="cache-manager", clock=lambda: now[0])
        await log.backend.start()
        await log.backend.create_topics(4)
        await log.start()
        view = CacheDecisions(log, refresh_s=0.0)
        partition = log.partition_for("s")
        await log.append("s", decision(CacheAction.PRESERVE, "e0"))
        await view.refresh(partition)
        assert not view.dropped("s", "e0", T0)
        now[0] = T0 + timedelta(seconds=5)
        await log.append("s", decision(CacheAction.DISCARD, "e0"))
        await log.append("s", decision(CacheAction.PRESERVE, "e1"))
        await view.refresh(partition)
        assert view.dropped("s", "e0", T0 + timedelta(seconds=1))  # discarded after its last call
        assert not view.dropped("s", "e0", T0 + timedelta(seconds=9))  # a later call stored it again
        assert not view.dropped("s", "e1", T0) and not view.dropped("other", "e0", T0)
        # Only new records are read on the next refresh, and a refresh comes at most every refresh_s.
        slow = CacheDecisions(log, refresh_s=3600.0)
        await slow.refresh(partition)
        now[0] = T0 + timedelta(seconds=20)
        await log.append("s", decision(CacheAction.DISCARD, "e1"))
        await slow.refresh(partition)
        assert not slow.dropped("s", "e1", T0)
        await view.refresh(partition)
        assert view.dropped("s", "e1", T0)

    asyncio.run(run())
