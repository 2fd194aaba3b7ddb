"""Ranked pins inside a real vLLM server: a waiting call takes no KV a program ahead of it holds.

On the ``ranked_vllm`` server (conftest: ``--scheduling-policy priority --ranked-pins``, a pool of
48 blocks of 32 tokens). A pin's rank is the priority of its session's newest request; the call at
the head of vLLM's waiting queue may take pins ranked with or after it, never one ranked before
it: it waits for that program instead, and the scheduler's ``status`` says so (``held_back``).
Of the pins it may take, the program ranked last goes first.
Nothing here is timed: each step waits for a state the control channel reports.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.vllm.conftest import Vllm, VllmClient, context_len, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_waiting_call_takes_the_pin_ranked_last_not_the_lowest_scored(ranked_vllm: Vllm) -> None:
    async def scenario(c: VllmClient) -> None:
        per_pin = (c.num_gpu_blocks - 1) // 5
        early, mid, late = (c.tokens(context_len(c, per_pin)) for _ in range(3))
        # Unranked, the valve would release "early" first, then "mid": the lowest cache-manager scores.
        await c.complete(early, "early", priority=100, agentlog_hold_s=60, agentlog_score=1.0)
        await c.complete(mid, "mid", priority=250, agentlog_hold_s=60, agentlog_score=2.0)
        await c.complete(late, "late", priority=300, agentlog_hold_s=60, agentlog_score=3.0)
        status = await c.status()
        before, free = len(status["pressure_releases"]), status["num_free_blocks"]
        await c.complete(c.tokens((free + 1) * c.block_size - 1), "big", priority=200)
        status = await c.status()
        assert status["pressure_releases"][before:] == ["late"]
        assert sorted(status["pins"]) == ["early", "mid"]
        assert await c.cached(early + c.tokens(8), "early", priority=100) == per_pin * c.block_size

    run(ranked_vllm, scenario)


def test_a_call_waits_for_the_program_ahead_of_it_until_that_program_ranks_after_it(ranked_vllm: Vllm) -> None:
    async def scenario(c: VllmClient) -> None:
        held = 30  # of 47 usable blocks (the tiny model's window is 32 blocks)
        early = c.tokens(context_len(c, held))
        await c.complete(early, "early", priority=100, agentlog_hold_s=600, agentlog_score=1.0)
        status = await c.status()
        before = len(status["pressure_releases"])
        # "big" needs more than the 17 free blocks, and only "early" holds any: it waits.
        big = asyncio.create_task(c.complete(c.tokens(20 * c.block_size - 1), "big", priority=200))
        status = await c.until("big held back by early", lambda s: s["held_back"] == {"big": ["early"]})
        assert "early" in status["pins"] and status["pressure_releases"][before:] == []
        assert not big.done()
        # early's next call ranks after big now (its program was served enough): the pin goes to
        # big, which runs first; early then recomputes. Neither waits for the other for ever.
        answer = await c.complete(early + c.tokens(8), "early", priority=400)
        await big
        assert (await c.status())["pressure_releases"][before:] == ["early"]
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] < held * c.block_size

    run(ranked_vllm, scenario)
