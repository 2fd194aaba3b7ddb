"""The planner's view of the cache manager's decisions (workers/cache_view.py), on a memory log."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from log import SharedLog
from log.memory_backend import MemoryBackend
from schemas.events import (
    CacheAction,
    CacheDecisionMade,
    KVAllBlocksCleared,
    KVBlocksRemoved,
    KVBlocksStored,
    KVCacheHit,
    KVTier,
)
from services.placement import Holding
from workers.cache_view import CacheDecisions, KVEvents

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def stored(hashes: list[str], parent: str | None = None) -> KVBlocksStored:
    """An engine e0's store of blocks of 16 tokens (``parent``: the block they follow)."""
    return KVBlocksStored(
        engine_id="e0", block_hashes=hashes, parent_block_hash=parent, num_tokens=16 * len(hashes),
        block_size=16, tier=KVTier.GPU,
    )  # fmt: skip


async def memory_log(clock: Callable[[], datetime]) -> SharedLog:
    """A started SharedLog on a memory backend with 4 partitions per topic."""
    log = SharedLog(MemoryBackend(), actor="engine-bridge", clock=clock)
    await log.backend.start()
    await log.backend.create_topics(4)
    await log.start()
    return log


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


def test_kv_events_are_read_from_every_partition_and_only_new_records_on_a_refresh() -> None:

    async def run() -> None:
        log = await memory_log(lambda: T0)
        # The parent and its fork in different partitions; the fork's store continues the parent's blocks.
        parent, fork = "p", next(f"f{i}" for i in range(100) if log.partition_for(f"f{i}") != log.partition_for("p"))
        await log.append(parent, stored(["a", "b", "c"]))
        await log.append(fork, stored(["x"], parent="c"))
        await log.append(fork, KVCacheHit(engine_id="e0", call_id="llm-2", cached_tokens=48, prompt_tokens=60,
                                          tier=KVTier.GPU))  # fmt: skip
        view = KVEvents(log, refresh_s=0.0)
        assert view.holding(fork, ["e0"]) == {}  # nothing before the first read is done
        await view.wait_caught_up()
        assert view.caught_up
        assert view.holding(fork, ["e0", "e1"]) == {"e0": Holding(64, "llm-2")}
        assert view.holding(parent, ["e0", "e1"]) == {"e0": Holding(48, None)}
        # The engine evicts the parent's b, reported for the fork (it held it last): both lose what follows.
        await log.append(fork, KVBlocksRemoved(engine_id="e0", block_hashes=["b"], tier=KVTier.GPU))
        await view.refresh()
        assert view.num_events == 4
        assert view.holding(fork, ["e0"]) == {"e0": Holding(16, "llm-2")}
        assert view.holding(parent, ["e0"]) == {"e0": Holding(16, None)}
        assert view.holding("nobody", ["e0"]) == {}
        await view.aclose()

    asyncio.run(run())


def test_the_first_kv_events_read_runs_in_the_background_and_routes_do_not_wait_for_it() -> None:

    async def run() -> None:
        log = await memory_log(lambda: T0)
        for i in range(50):
            body = KVBlocksStored(engine_id="e0", block_hashes=[f"h{i}"], num_tokens=16, block_size=16, tier=KVTier.GPU)
            await log.append(f"s{i}", body)
        view = KVEvents(log, refresh_s=0.0)
        await view.refresh()  # starts the catch-up and returns at once
        assert not view.caught_up and view.holding("s0", ["e0"]) == {}
        await view.wait_caught_up()
        assert view.num_events == 50 and view.holding("s0", ["e0"]) == {"e0": Holding(16, None)}
        # A view closed while catching up cancels the read, and answers nothing.
        closing = KVEvents(log, refresh_s=0.0)
        await closing.refresh()
        await closing.aclose()
        assert not closing.caught_up and closing.holding("s0", ["e0"]) == {}

    asyncio.run(run())


def test_a_failed_kv_events_read_is_logged_and_tried_again_and_routing_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> None:
        log = await memory_log(lambda: T0)
        body = KVBlocksStored(engine_id="e0", block_hashes=["a"], num_tokens=16, block_size=16, tier=KVTier.GPU)
        await log.append("s", body)
        real = log.end_offsets
        failures = [RuntimeError("TOPIC_AUTHORIZATION_FAILED"), RuntimeError("broker away")]

        async def flaky(topic: str) -> dict[int, int]:
            if failures:
                raise failures.pop(0)
            return await real(topic)

        log.end_offsets = flaky  # type: ignore[method-assign]
        view = KVEvents(log, refresh_s=0.0)
        await view.wait_caught_up()  # the catch-up fails
        await view.refresh()  # logged; nothing known, no error raised
        assert not view.caught_up and view.holding("s", ["e0"]) == {}
        await view.wait_caught_up()  # tried again: fails again, then succeeds
        await view.refresh()
        await view.wait_caught_up()
        assert view.caught_up and view.holding("s", ["e0"]) == {"e0": Holding(16, None)}

    with caplog.at_level("ERROR", logger="workers.cache_view"):
        asyncio.run(run())
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["reading kv.events failed"] * 2
    assert "TOPIC_AUTHORIZATION_FAILED" in caplog.records[0].getMessage()


def test_kv_events_are_folded_in_the_order_the_engine_reported_them_whatever_their_partitions() -> None:
    """A removal reported for a fork, or an engine's clear, in a partition read before the store it
    follows: folded partition by partition, the store came last and counted blocks the engine had
    evicted (every planner or gateway start reads the whole topic in one pass)."""

    async def run() -> None:
        now = [T0]
        log = await memory_log(lambda: now[0])
        parent = next(f"p{i}" for i in range(100) if log.partition_for(f"p{i}") == 3)
        fork = next(f"f{i}" for i in range(100) if log.partition_for(f"f{i}") == 0)
        other = next(f"o{i}" for i in range(100) if log.partition_for(f"o{i}") == 2)
        engine = next(f"engine/e{i}" for i in range(100) if log.partition_for(f"engine/e{i}") == 1)
        await log.append(parent, stored(["a", "b"]))
        now[0] += timedelta(seconds=1)
        await log.append(fork, stored(["x"], parent="b"))
        now[0] += timedelta(seconds=1)
        await log.append(fork, KVBlocksRemoved(engine_id="e0", block_hashes=["a", "b", "x"], tier=KVTier.GPU))
        view = KVEvents(log, refresh_s=0.0)
        await view.wait_caught_up()
        assert view.holding(parent, ["e0"]) == {"e0": Holding(0, None)}
        assert view.holding(fork, ["e0"]) == {"e0": Holding(0, None)}
        await log.append(other, stored(["c", "d"]))
        now[0] += timedelta(seconds=1)
        await log.append(engine, KVAllBlocksCleared(engine_id="e0"))
        now[0] += timedelta(seconds=1)
        await log.append(other, stored(["e"], parent="d"))  # after the clear: its start is gone
        await view.refresh()
        fresh = KVEvents(log, refresh_s=0.0)
        await fresh.wait_caught_up()
        for v in (view, fresh):
            assert v.num_events == 6
            assert v.holding(other, ["e0"]) == {"e0": Holding(0, None)}
            assert v.holding(parent, ["e0"]) == {} and v.holding(fork, ["e0"]) == {}  # the clear forgot them
        await view.aclose()
        await fresh.aclose()

    asyncio.run(run())
