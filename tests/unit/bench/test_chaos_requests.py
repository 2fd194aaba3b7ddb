"""The chaos harness requests its sessions over the fault window, while the faults run.

The wait for the schedule to end had slid inside the request loop: session 0 was requested,
then every fault ran, then the other sessions, on a quiet stack (the scale runs' tables
measured one session under faults).
"""

from __future__ import annotations

import asyncio

import pytest

from bench.chaos_lib import request_over_window

pytestmark = pytest.mark.unit


def test_every_session_is_requested_at_its_offset_while_the_schedule_still_runs() -> None:
    async def main() -> tuple[list[tuple[str, float, bool]], float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        schedule_ends = start + 1.0  # the faults run for 1 s; the requests spread over 0.4 s
        requested: list[tuple[str, float, bool]] = []

        async def request(i: int, session: str) -> None:
            requested.append((session, loop.time() - start, loop.time() < schedule_ends))

        await request_over_window(["a", "b", "c", "d"], 0.4, request, lambda: loop.time() < schedule_ends)
        return requested, loop.time() - start

    requested, took = asyncio.run(main())
    assert [s for s, _, _ in requested] == ["a", "b", "c", "d"]
    assert all(during for _, _, during in requested), requested  # before the fix: only "a"
    assert [at >= i * 0.1 - 0.01 for i, (_, at, _) in enumerate(requested)] == [True] * 4
    assert took >= 1.0  # and it returns once the schedule is over (the canary comes after)


def test_a_request_tried_again_through_a_fresh_log_is_written_once() -> None:
    """The requester's retry opens a fresh log; a first try that landed must make it a no-op
    (with a random event id, a 300-session run wrote two requests at seq 0 of one session)."""
    from bench.chaos_lib import Operator, request_event_id
    from log import SharedLog
    from log.memory_backend import MemoryBackend, MemoryStore

    async def main() -> list[str]:
        store = MemoryStore()
        setup = MemoryBackend(store)
        await setup.start()
        await setup.create_topics(4)
        operator = Operator("memory://", "ns", "postgresql://unused", stack=None, sessions=[])  # type: ignore[arg-type]
        for _ in range(2):  # the first try, then the retry through a log of its own
            async with SharedLog(MemoryBackend(store), actor="operator") as log:
                await operator.request(log, 0, "s-1")
        async with SharedLog(MemoryBackend(store), actor="auditor") as log:
            partition = log.partition_for("s-1")
            return [log.codec.decode(r.value).event_id async for r in log.backend.scan("ops.commands", partition)]

    assert asyncio.run(main()) == [request_event_id("s-1")]
