"""AgentlogScheduler inside a real vLLM server: pins keep a session's prefix through a tool gap.

The server has a small KV pool (48 blocks of 32 tokens); ``churn`` runs other sessions' calls
that cycle the pool twice, which is what a session's tool gap looks like to vLLM's LRU.
"Full blocks of its context" is ``(len(prompt) // block_size) * block_size``: vLLM caches full
blocks only (the prompts here leave room for the 4 output tokens in the last, partial block).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.vllm.conftest import Vllm, VllmClient, context_len, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_without_a_pin_the_next_turn_after_a_gap_recomputes_everything(vllm: Vllm) -> None:
    async def scenario(c: VllmClient) -> None:
        context = c.tokens(context_len(c, 18))
        assert await c.cached(context, "a") == 0
        assert await c.cached(context + c.tokens(8), "a") == 18 * c.block_size, "no gap: the prefix is reused"
        await c.churn()
        assert await c.cached(context + c.tokens(16), "a") == 0, "after the gap vLLM's LRU evicted the session"

    run(vllm, scenario)


def test_a_preserve_decision_keeps_the_full_blocks_of_the_context(vllm: Vllm) -> None:
    async def scenario(c: VllmClient) -> None:
        context = c.tokens(context_len(c, 18))
        await c.complete(context, "a")
        pinned = await c.control.call("pin", session="a", ttl_s=60, score=1.0)  # the decision, after the call
        assert pinned["num_blocks"] == 18
        await c.churn()
        assert (await c.status())["pins"]["a"]["num_blocks"] == 18
        assert await c.cached(context + c.tokens(16), "a") == 18 * c.block_size
        assert "a" not in (await c.status())["pins"], "the session's next call ends its pin"

    run(vllm, scenario)


def test_a_hold_requested_with_the_call_keeps_the_prefix(vllm: Vllm) -> None:
    async def scenario(c: VllmClient) -> None:
        context = c.tokens(context_len(c, 12))
        await c.complete(context, "a", agentlog_hold_s=60)
        assert (await c.status())["pins"]["a"]["num_blocks"] == 12
        await c.churn()
        assert await c.cached(context + c.tokens(16), "a") == 12 * c.block_size

    run(vllm, scenario)


def test_after_a_discard_the_prefix_is_gone_at_once(vllm: Vllm) -> None:
    async def scenario(c: VllmClient) -> None:
        context = c.tokens(context_len(c, 10))
        await c.complete(context, "a", agentlog_hold_s=60)
        discarded = await c.control.call("discard", session="a")
        assert discarded["num_blocks"] == 10
        assert "a" not in (await c.status())["pins"]
        # No churn needed: the blocks were evicted, not just unpinned.
        assert await c.cached(context + c.tokens(16), "a") == 0

    run(vllm, scenario)


def test_a_release_unpins_but_the_blocks_stay_reusable_until_evicted(vllm: Vllm) -> None:
    async def scenario(c: VllmClient) -> None:
        context = c.tokens(context_len(c, 10))
        await c.complete(context, "a", agentlog_hold_s=60)
        assert (await c.control.call("release", session="a"))["num_blocks"] == 10
        assert await c.cached(context + c.tokens(8), "a") == 10 * c.block_size  # still cached (LRU)
        await c.churn()
        assert await c.cached(context + c.tokens(16), "a") == 0

    run(vllm, scenario)


def test_after_the_ttl_the_pin_ends_and_the_prefix_is_evicted(vllm: Vllm) -> None:
    async def scenario(c: VllmClient) -> None:
        context = c.tokens(context_len(c, 10))
        await c.complete(context, "a")
        assert (await c.control.call("pin", session="a", ttl_s=0.3, score=1.0))["num_blocks"] == 10
        for _ in range(200):  # the scheduler expires pins on its own clock, even while vLLM is idle
            if "a" not in (await c.status())["pins"]:
                break
            await asyncio.sleep(0.05)
        assert "a" not in (await c.status())["pins"]
        await c.churn()
        assert await c.cached(context + c.tokens(16), "a") == 0

    run(vllm, scenario)


def test_a_pin_decided_during_the_call_is_taken_when_it_ends(dev_vllm: Vllm) -> None:
    """vLLM is paused while the call is sent, so the call is surely in flight (in vLLM's waiting
    queue) when the pin arrives, whatever the machine's load: a race with a running call was lost
    on a fast, idle machine, where the whole call ended before the pin was sent."""

    async def scenario(c: VllmClient) -> None:
        # The pin (19 blocks) leaves room for churn's calls (25 of the 47 usable blocks).
        output = 360
        context = c.tokens(context_len(c, 8))
        await c.pause()
        try:
            call = asyncio.create_task(c.complete(context, "a", max_tokens=output, ignore_eos=True))
            await c.until("the call waiting", lambda s: "a" in [w[0] for w in s["waiting"]])
            answer = await c.control.call("pin", session="a", ttl_s=60, score=1.0)
            assert answer["pending"] is True and answer["num_blocks"] == 0, answer
            assert (await c.status())["pending"] == ["a"]
        finally:
            await c.resume()
        await call
        # The pin holds every full block of the context the call ended with (its output too; the
        # last output token's KV is never computed).
        status = await c.status()
        assert status["pins"]["a"]["num_blocks"] == (len(context) + output - 1) // c.block_size
        assert status["pending"] == []
        await c.churn()
        assert await c.cached(context + c.tokens(16), "a") == 8 * c.block_size

    run(dev_vllm, scenario)


def test_pins_are_released_under_pressure_in_ranked_order(vllm: Vllm) -> None:
    async def scenario(c: VllmClient) -> None:
        usable = c.num_gpu_blocks - 1  # vLLM keeps one null block
        per_pin = usable // 5
        scores = {"p-high": 3.0, "p-low": 1.0, "p-mid": 2.0}
        contexts = {}
        for session, score in scores.items():
            contexts[session] = c.tokens(context_len(c, per_pin))
            await c.complete(contexts[session], session, agentlog_hold_s=60, agentlog_score=score)
        status = await c.status()
        assert {s: status["pins"][s]["num_blocks"] for s in scores} == dict.fromkeys(scores, per_pin)
        before = len(status["pressure_releases"])
        free = status["num_free_blocks"]
        # A call that needs more than the free blocks plus one pin: two pins must go, lowest scores first.
        need = free + per_pin + 1
        await c.complete(c.tokens(need * c.block_size - 1), "big")
        status = await c.status()
        assert status["pressure_releases"][before:] == ["p-low", "p-mid"]
        assert list(status["pins"]) == ["p-high"]
        assert await c.cached(contexts["p-high"] + c.tokens(8), "p-high") == per_pin * c.block_size

    run(vllm, scenario)


def test_a_running_call_that_outgrows_the_free_blocks_takes_a_pin_instead_of_being_preempted(vllm: Vllm) -> None:
    async def preemptions(c: VllmClient) -> float:
        async with c.http.get(f"{c.vllm.url}/metrics") as response:
            text = await response.text()
        counters = [line for line in text.splitlines() if line.startswith("vllm:num_preemptions_total")]
        return sum(float(line.split()[-1]) for line in counters)

    async def scenario(c: VllmClient) -> None:
        usable = c.num_gpu_blocks - 1
        per_pin = (usable - 7) // 2  # leaves 7 free blocks
        for session, score in (("p-low", 1.0), ("p-high", 2.0)):
            await c.complete(c.tokens(context_len(c, per_pin)), session, agentlog_hold_s=60, agentlog_score=score)
        status = await c.status()
        before, free = len(status["pressure_releases"]), status["num_free_blocks"]
        preempted = await preemptions(c)
        # Admitted with a 4-block prompt, it then decodes past the free blocks.
        prompt = 4 * c.block_size
        await c.complete(c.tokens(prompt), "grows", max_tokens=(free + 1) * c.block_size - prompt, ignore_eos=True)
        status = await c.status()
        assert status["pressure_releases"][before:] == ["p-low"]
        assert list(status["pins"]) == ["p-high"]
        assert await preemptions(c) == preempted, "vLLM preempted (and recomputed) a running call"

    run(vllm, scenario)
