"""SimEngine: deterministic output, prefix hits over prompt and output, queueing,
swap versus recompute, and the events of each call."""

from __future__ import annotations

import pytest

from services.engine.cost import CostModel
from services.engine.kv_cache import OutOfBlocks, PagedKVCache
from services.engine.sim import SimEngine
from tests.unit.services.engine.helpers import A, B, cached, replay

pytestmark = pytest.mark.unit

COST = CostModel(block_size=4)


def engine(num_gpu_blocks: int = 16, num_host_blocks: int = 8) -> SimEngine:
    return SimEngine(PagedKVCache(4, num_gpu_blocks, num_host_blocks), COST)


def test_output_is_a_deterministic_function_of_the_prompt() -> None:
    one, other = engine(), engine()
    first = one.call(A, [1, 2, 3], 40, now=0.0)
    assert first.output_token_ids == other.call(B, [1, 2, 3], 40, now=0.0).output_token_ids
    assert len(first.output_token_ids) == 40
    assert all(0 <= token < 128_256 for token in first.output_token_ids)
    assert first.output_token_ids != one.call(A, [1, 2, 4], 40, now=10.0).output_token_ids
    assert one.call(A, [1, 2, 3], 0, now=20.0).output_token_ids == ()


def test_the_next_turn_hits_the_prompt_and_the_generated_blocks() -> None:
    sim = engine()
    prompt = list(range(10))
    first = sim.call(A, prompt, 3, now=0.0)  # KV of 10 + 2 tokens: 3 full blocks
    assert (first.cached_tokens, first.computed_tokens) == (0, 10)

    second = sim.call(A, [*prompt, *first.output_token_ids, 7, 7, 7], 3, now=10.0)
    assert (second.prompt_tokens, second.cached_tokens, second.computed_tokens) == (16, 12, 4)
    assert second.prefill_ms == COST.prefill_ms(4, 12)
    assert second.decode_ms == COST.decode_ms(3, 16)
    assert second.swap_ms == 0.0


def test_the_last_generated_token_is_not_cached() -> None:
    sim = engine()
    first = sim.call(A, list(range(8)), 4, now=0.0)  # KV of 8 + 3 tokens: block 2 is not full
    second = sim.call(A, [*range(8), *first.output_token_ids, 7, 7, 7, 7], 1, now=10.0)
    assert second.cached_tokens == 8


def test_a_call_waits_for_the_previous_one() -> None:
    sim = engine()
    first = sim.call(A, list(range(10)), 5, now=0.0)
    assert first.queue_ms == 0.0
    assert first.finished_at == pytest.approx(first.total_ms / 1000)
    second = sim.call(B, list(range(100, 110)), 5, now=0.0)
    assert second.started_at == first.finished_at
    assert second.queue_ms == pytest.approx(first.total_ms)
    later = sim.call(B, list(range(100, 110)), 5, now=100.0)
    assert later.queue_ms == 0.0


def test_swap_in_replaces_recompute_and_costs_swap_time() -> None:
    swapped, discarded = engine(), engine()
    prompt = list(range(10))
    for sim in (swapped, discarded):
        output = sim.call(A, prompt, 3, now=0.0).output_token_ids
    assert swapped.cache.swap_out(A) == 3
    discarded.cache.discard(A)
    next_prompt = [*prompt, *output, 7, 7, 7]

    result = swapped.call(A, next_prompt, 1, now=10.0)
    assert (result.cached_tokens, result.swapped_in_blocks, result.computed_tokens) == (0, 3, 4)
    assert result.swap_ms == COST.swap_ms(3) > 0
    assert result.prefill_ms == COST.prefill_ms(4, 12)

    recomputed = discarded.call(A, next_prompt, 1, now=10.0)
    assert (recomputed.swapped_in_blocks, recomputed.computed_tokens) == (0, 16)
    assert result.swap_ms + result.prefill_ms < recomputed.prefill_ms


def test_each_result_carries_the_events_that_rebuild_the_cache() -> None:
    sim = engine(num_gpu_blocks=8, num_host_blocks=8)
    results = [sim.call(A, list(range(10)), 3, now=0.0), sim.call(B, list(range(100, 121)), 3, now=1.0)]
    sim.cache.swap_out(B)
    results.append(sim.call(A, list(range(30)), 2, now=2.0))
    folded = replay(event for result in results for event in result.events)
    assert folded == cached(sim.cache)
    sim.cache.check_invariants()


def test_a_call_that_does_not_fit_changes_nothing() -> None:
    sim = engine(num_gpu_blocks=4)
    with pytest.raises(OutOfBlocks):
        sim.call(A, list(range(20)), 1, now=0.0)
    assert sim.call(A, list(range(8)), 1, now=0.0).queue_ms == 0.0
    assert sim.cache.session_ids() == [A]


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="block size"):
        SimEngine(PagedKVCache(4, 8), CostModel(block_size=16))
    assert SimEngine(PagedKVCache(4, 8)).cost.block_size == 4
    with pytest.raises(ValueError, match="empty"):
        engine().call(A, [], 1, now=0.0)
    with pytest.raises(ValueError, match="negative"):
        engine().call(A, [1], -1, now=0.0)
