"""The gateway routes by the planner's views (workers/cache_view.py) and rules, on a memory log."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from log import SharedLog
from log.memory_backend import MemoryBackend
from schemas import events as ev
from schemas.events import CacheAction, CacheDecisionMade
from workers.cache_view import CacheDecisions
from workers.engines.pool import EnginePool, parse_engines
from workers.gateway import GatewayWorker

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)
BODY: dict[str, Any] = {"model": "sim", "messages": [{"role": "user", "content": "x" * 40}]}


def served(engine: str) -> ev.GatewayLLMCallServed:
    return ev.GatewayLLMCallServed(
        call_id="llm-0",
        turn=0,
        model="sim",
        engine_id=engine,
        request_digest="r",
        prompt_digest="p",
        prompt_tokens=300,
        cached_tokens=0,
        output_tokens=20,
        max_output_tokens=0,
        output_text="t",
        tool_calls_json="[]",
        finish_reason="stop",
        response_id="s/llm-0",
        created=0,
        queue_ms=0.0,
        prefill_ms=0.0,
        decode_ms=0.0,
        engine_ms=0.0,
        stream=False,
    )


async def started(now: list[datetime]) -> tuple[SharedLog, GatewayWorker]:
    log = SharedLog(MemoryBackend(), actor="cache-manager", clock=lambda: now[0])
    await log.backend.start()
    await log.backend.create_topics(4)
    await log.start()
    pool = EnginePool(parse_engines("sim-0=http://a;sim-1=http://b"), clients={})
    worker = GatewayWorker(log, engine_url="http://a", pool=pool)
    worker.cache_view = CacheDecisions(log, refresh_s=0.0)
    return log, worker


def test_a_discard_after_the_sessions_last_record_sends_its_next_call_by_load_and_says_why() -> None:
    async def run() -> None:
        now = [T0]
        log, worker = await started(now)
        session = worker.session("s")
        session.record(served("sim-0"), T0 + timedelta(seconds=1))
        engine = await worker._route(session, BODY, 1)
        first = session.routes[-1]
        assert (engine, first.reason, first.expected_cached_tokens) == ("sim-0", "locality", 320)
        # A discard before the record is of an older context: it changes nothing.
        await log.append("s", CacheDecisionMade(engine_id="sim-0", action=CacheAction.DISCARD, score=1.0,
                                                num_blocks=20, reason="test"))  # fmt: skip
        now[0] = T0 + timedelta(seconds=5)
        later = worker.session("later")
        later.record(served("sim-0"), T0 + timedelta(seconds=1))
        await log.append("later", CacheDecisionMade(engine_id="sim-0", action=CacheAction.DISCARD, score=1.0,
                                                    num_blocks=20, reason="test"))  # fmt: skip
        await worker._route(later, BODY, 1)
        route = later.routes[-1]
        assert route.expected_cached_tokens == 0 and route.reason != "locality", route
        assert "kv.decisions: discarded on sim-0" in route.detail, route.detail
        # The first session's discard came before its record: it still routes to its prefix.
        await worker._route(session, BODY, 1)
        assert session.routes[-1].reason == "locality" and session.routes[-1].expected_cached_tokens == 320
        if worker.kv_view is not None:
            await worker.kv_view.aclose()

    asyncio.run(run())


def test_a_view_that_cannot_be_read_leaves_the_route_to_the_records() -> None:
    async def run() -> None:
        log, worker = await started([T0])

        async def away(*_: object, **__: object) -> dict[int, int]:
            raise ConnectionError("the broker is away")

        log.end_offsets = away  # type: ignore[method-assign]
        session = worker.session("s")
        session.record(served("sim-1"), T0)
        assert await worker._route(session, BODY, 1) == "sim-1"
        route = session.routes[-1]
        assert (route.reason, route.expected_cached_tokens) == ("locality", 320)
        assert worker.kv_view is not None
        await worker.kv_view.aclose()

    asyncio.run(run())
