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
