"""A worker's fold of its own appends is the fold its readers make of the same records.

The worker folds what it appends at once (it does not wait to read it back). The
time it folds with must be the time the log stamps with its injected clock, or a
time-derived field (a tool call's ``proposed_at``) differs between the writer and
every reader of the log.
"""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime, timedelta

import pytest

from log import Clock, SharedLog
from log.memory_backend import MemoryBackend, MemoryStore
from schemas import events as ev
from services.checkpoint import fold_events, state_to_json
from services.replay import cut_events
from services.session import SessionState
from workers.runtime import SessionWorker

pytestmark = pytest.mark.unit

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def ticking_clock() -> Clock:
    ticks = itertools.count()
    return lambda: T0 + timedelta(seconds=next(ticks))


def test_a_writer_and_a_reader_fold_the_same_appends_to_the_same_state() -> None:
    async def scenario() -> tuple[SessionState, SessionState]:
        store = MemoryStore()
        admin = MemoryBackend(store)
        await admin.start()
        await admin.create_topics(4)
        clock = ticking_clock()
        async with (
            SharedLog(MemoryBackend(store), actor="operator", clock=clock) as operator,
            SharedLog(MemoryBackend(store), actor="planner", clock=clock) as planner_log,
        ):
            await operator.append("s", ev.SessionRequested(program="script", args_json="{}", author="t"))
            writer = SessionWorker(planner_log)
            writer.sessions["s"] = fold_events("s", cut_events(await planner_log.history("s")))
            await writer.append("s", ev.SessionStarted(program="script", args_json="{}"), kind="start")
            proposed = ev.ToolCallProposed(
                call_id="tool-0", tool="search", arguments_json="{}", effect_class=ev.EffectClass.PURE,
                idempotency_key="s/tool-0",
            )  # fmt: skip
            await writer.append("s", proposed, kind="proposed", key="tool-0")
            reader = fold_events("s", cut_events(await planner_log.history("s")))
            return writer.sessions["s"], reader

    written, read = asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert read.tool_calls["tool-0"].proposed_at == T0 + timedelta(seconds=2)  # the log's clock: its third reading
    assert written.tool_calls["tool-0"].proposed_at == read.tool_calls["tool-0"].proposed_at
    assert state_to_json(written) == state_to_json(read)
