"""vLLM's priority scheduling (``--scheduling-policy priority``) serves agentlog's priorities.

The server has 48 KV blocks of 32 tokens and a 1024-token window. Every call of a test needs 32
blocks (a 31-block prompt and 4 output tokens), so no two run at once, nor beside a blocker (17
blocks at its start, 32 when done): the order in which they complete is the order vLLM chose to
serve them (counted, not timed). A test first sends ``BLOCKERS`` long calls (a 16-block prompt,
decoding to the end of the window) with the most urgent priorities, which hold the engine for a
few seconds, then its own calls, which queue behind them, in an order that is not their
priorities' (first come first served would fail each test). It checks that its last call was sent
well before the last blocker completed: otherwise its calls did not all wait together, and the
order would measure nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from services.scheduling import ProgramProgress, SchedulingConfig, call_priority
from tests.integration.vllm.conftest import Vllm, VllmClient, _unavailable, vllm_client

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT_BLOCKS = 31  # + 4 output tokens: 32 of the 48 blocks
BLOCKER_PROMPT_BLOCKS = 16  # + 488 output tokens: the whole window
BLOCKERS = 5  # 488 tokens of decoding each, partly batched: 4-6 s on 2 loaded cores
SEND_GAP_S = 0.03  # between two calls of a test
IN_ORDER_GAP_S = 0.25  # where they must reach vLLM in the order sent (a loaded API server reorders 30 ms)
MOST_URGENT = -(10**15)


def needs_priority_policy(vllm: Vllm) -> None:
    if vllm.scheduling_policy != "priority":
        _unavailable(f"the vLLM server runs --scheduling-policy {vllm.scheduling_policy}, not priority")


class Queue:
    """Blockers, then the test's calls, and the order in which the test's calls complete."""

    def __init__(self, c: VllmClient) -> None:
        self.c = c
        self.finished: list[str] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.blockers: list[asyncio.Task[Any]] = []
        self.last_sent = 0.0
        self.blocked_until = 0.0  # when the last blocker completed

    async def _call(self, name: str, priority: int | None) -> None:
        c = self.c
        blocker = name.startswith("blocker")
        prompt = c.tokens((BLOCKER_PROMPT_BLOCKS if blocker else PROMPT_BLOCKS) * c.block_size + c.block_size // 2)
        body: dict[str, Any] = {
            "model": c.vllm.model,
            "prompt": prompt,
            "max_tokens": 1024 - len(prompt) - 8 if blocker else 4,
            "ignore_eos": True,
            "temperature": 0,
            "session_id": f"prio-{name}-{c.rng.getrandbits(32):x}",
        }
        if priority is not None:
            body["priority"] = priority
        c.sessions.add(body["session_id"])
        async with c.http.post(f"{c.vllm.url}/v1/completions", json=body) as response:
            answer = await response.json()
            assert response.status == 200, answer
        if blocker:
            self.blocked_until = max(self.blocked_until, time.monotonic())
        else:
            self.finished.append(name)

    async def block(self) -> None:
        c = self.c
        assert c.num_gpu_blocks == 48 and c.block_size == 32, "the sizes above are for 48 blocks of 32 tokens"
        for i in range(BLOCKERS):
            self.blockers.append(asyncio.create_task(self._call(f"blocker{i}", MOST_URGENT + i)))
        await asyncio.sleep(0.1)

    async def send(self, name: str, priority: int | None, *, gap_s: float = SEND_GAP_S) -> None:
        self.tasks.append(asyncio.create_task(self._call(name, priority)))
        await asyncio.sleep(gap_s)
        self.last_sent = time.monotonic()

    async def drain(self) -> list[str]:
        await asyncio.gather(*self.blockers, *self.tasks)
        assert self.blocked_until - self.last_sent > 0.3, (
            f"the blockers held the engine only {self.blocked_until - self.last_sent:.2f} s after the last call "
            "was sent: the calls may not have waited together"
        )
        return self.finished


def run(vllm: Vllm, scenario: Any) -> Any:
    async def main() -> Any:
        async with vllm_client(vllm) as client:
            return await scenario(client)

    return asyncio.run(main())


def test_vllm_serves_waiting_requests_lowest_priority_first(vllm: Vllm) -> None:
    needs_priority_policy(vllm)

    async def scenario(c: VllmClient) -> list[str]:
        queue = Queue(c)
        await queue.block()
        for name, priority in [("p50", 50), ("p40", 40), ("p30", 30), ("p20", 20), ("p10", 10)]:
            await queue.send(name, priority)  # latest first: fcfs would serve them p50 ... p10
        return await queue.drain()

    assert run(vllm, scenario) == ["p10", "p20", "p30", "p40", "p50"]


def test_requests_without_a_priority_are_served_first_come_first_served(vllm: Vllm) -> None:
    """What every other vLLM test sends (no priority) is served as under fcfs: vLLM's default
    priority (0) for all, ties in arrival order."""
    needs_priority_policy(vllm)

    async def scenario(c: VllmClient) -> list[str]:
        queue = Queue(c)
        await queue.block()
        for name in ["a", "b", "c", "d"]:
            await queue.send(name, None, gap_s=IN_ORDER_GAP_S)
        return await queue.drain()

    assert run(vllm, scenario) == ["a", "b", "c", "d"]


# A policy whose bounded-wait window (max_wait_ms) is short enough to run through in a test.
WINDOW = SchedulingConfig(max_age_credit_ms=0.0, max_level_ms=300.0, warm_credit_ms=0.0)


def test_a_heavy_programs_call_is_passed_only_by_calls_ready_within_the_window(vllm: Vllm) -> None:
    """Bounded wait on the real engine: a call of a program that has attained a lot of service
    (ranked ``max_level_ms`` behind its ready time) is passed by new programs' calls that became
    ready within the window after it, and by none that became ready after the window. The
    priorities are the policy's (``services.scheduling``) for ready times on the log's clock 50 ms
    apart (given, not slept: a loaded machine's event loop can oversleep the whole window)."""
    needs_priority_policy(vllm)
    t0 = time.time()
    ready = {"heavy": t0, **{f"new{i}": t0 + 0.05 + 0.1 * i for i in range(6)}}  # the window ends at t0 + 0.3

    async def scenario(c: VllmClient) -> list[str]:
        queue = Queue(c)
        await queue.block()
        heavy = ProgramProgress(attained_ms=50_000.0, elapsed_ms=60_000.0)
        await queue.send("heavy", call_priority(ready["heavy"], heavy, config=WINDOW))
        for name in [n for n in ready if n != "heavy"]:
            await queue.send(name, call_priority(ready[name], ProgramProgress(), config=WINDOW))
        return await queue.drain()

    order = run(vllm, scenario)
    assert WINDOW.max_wait_ms == 300.0
    # First come first served would serve the heavy call first; least attained service alone (no
    # bound) would serve it last.
    assert order == ["new0", "new1", "new2", "heavy", "new3", "new4", "new5"]
