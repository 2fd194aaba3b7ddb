"""The continuous-batching engine model (``services.engine.batching.BatchSim``) on exact small
scenarios, and the pieces it is built from: the batched step time (``CostModel.batch_steps_ms``)
and step-by-step growth of a call (``PagedKVCache.extend_call``, ``blocks_to_begin``)."""

from __future__ import annotations

import pytest

from schemas.events import SessionId
from services.engine.batching import BatchSim
from services.engine.blocks import hash_blocks
from services.engine.cost import CostModel
from services.engine.kv_cache import OutOfBlocks, PagedKVCache
from services.engine.serial import Metrics, Sess, Sim, SimManager
from services.traces.model import Trace, TraceSession, TraceTurn

# Round numbers: a step costs 9 ms once plus 1 ms per sequence, prefill 1 ms per token, no
# per-call overhead, no attention term and (nearly) free KV reads.
COST = CostModel(
    block_size=4,
    call_overhead_ms=0.0,
    prefill_ms_per_token=1.0,
    prefill_attention_ms_per_token_pair=0.0,
    decode_ms_per_token=10.0,
    decode_ms_per_sequence=1.0,
    kv_bytes_per_token=1,
    hbm_bytes_per_s=1e15,
)
EPS = 1e-9


class _NoManager(SimManager):
    """No cache manager (the ``vllm`` baseline): blocks go back to the LRU at the end of every call."""

    name = "none"

    def on_finish(self, s: Sess, now: float) -> None:
        pass


def run_one(trace: Trace, gpu_blocks: int, cost: CostModel, engine: str) -> Metrics:
    """The trace on the engine model without a cache manager; the host tier as large as the GPU's."""
    model = BatchSim if engine == "batch" else Sim
    return model(trace, _NoManager(), gpu_blocks, gpu_blocks, cost).run()


def _session(sid: str, arrival: float, *turns: TraceTurn) -> TraceSession:
    return TraceSession(sid, "test", arrival, turns)


# ------------------------------------------------------------------ cost model


def test_batched_steps_share_the_weight_read_and_reduce_to_decode_at_batch_one() -> None:
    cost = CostModel()
    assert cost.decode_step_fixed_ms == pytest.approx(9.9)
    for steps, context in ((1, 0), (7, 100), (50, 3000)):
        assert cost.batch_steps_ms(steps, 1, context) == pytest.approx(cost.decode_ms(steps, context))
    # Two sequences of 200 and 300 tokens: one weight read, two sequences' compute and KV.
    two = cost.batch_step_ms(2, 500)
    assert two == pytest.approx(9.9 + 2 * 0.1 + 500 * cost.decode_ms_per_context_token)
    assert two < cost.decode_ms(1, 200) + cost.decode_ms(1, 300)
    # Contexts grow by one token per sequence per step.
    assert cost.batch_steps_ms(3, 2, 500) == pytest.approx(
        cost.batch_step_ms(2, 500) + cost.batch_step_ms(2, 502) + cost.batch_step_ms(2, 504)
    )
    assert cost.batch_steps_ms(0, 5, 10) == cost.batch_step_ms(0, 10) == 0.0
    with pytest.raises(ValueError):
        cost.batch_steps_ms(1, -1, 0)


# ------------------------------------------------------------------ KV cache growth


def test_extend_call_grows_one_block_per_block_size_tokens_and_fails_without_changing_anything() -> None:
    cache = PagedKVCache(4, 4)
    a, b = SessionId("a"), SessionId("b")
    hashes = hash_blocks(list(range(8)), 4)
    assert cache.blocks_to_begin(hashes, num_prompt_tokens=8, num_decode_tokens=5) == (4, 4)
    cache.begin_call(a, hashes, num_prompt_tokens=8, now=0.0)
    assert cache.num_free_blocks == 2
    assert cache.extend_call(a, 0) == 0
    assert cache.extend_call(a, 1) == 1  # token 9 opens a third block
    assert cache.extend_call(a, 3) == 0  # tokens 10-12 fit in it
    assert cache.extend_call(a, 4) == 1
    assert cache.num_free_blocks == 0
    with pytest.raises(OutOfBlocks) as error:
        cache.extend_call(a, 1)
    assert (error.value.num_needed, error.value.num_available) == (1, 0)
    assert len(cache.blocks_of(a).gpu_block_ids) == 2 and cache.num_free_blocks == 0
    cache.check_invariants()
    # The prompt's two full blocks are cached: another session with the same prompt would hit them
    # (at most (8 - 1) // 4 = 1 block, the last prompt token is always recomputed).
    assert cache.blocks_to_begin(hashes, num_prompt_tokens=8) == (1, 0)
    cache.end_call(a, 1.0)
    assert cache.blocks_to_begin(hashes, num_prompt_tokens=8) == (1, 3)  # the hit leaves the free queue
    cache.begin_call(b, hashes, num_prompt_tokens=8, now=2.0)
    cache.check_invariants()
    with pytest.raises(ValueError):
        cache.extend_call(b, -1)


# ------------------------------------------------------------------ the batching engine


def test_two_calls_that_fit_run_together_in_the_batched_time() -> None:
    trace = Trace((_session("x", 0.0, TraceTurn(8, 3)), _session("y", 0.0, TraceTurn(8, 3))))
    batch = run_one(trace, 100, COST, "batch")
    # One step with both prefills (8 + 8 ms) and two sequences (9 + 2), then two steps of 11 ms.
    assert batch.jct == pytest.approx([0.049, 0.049], abs=EPS)
    assert (batch.steps, batch.preemptions) == (3, 0)
    assert batch.batch_s / batch.busy_s == pytest.approx(2.0)
    # One at a time: 8 + 3 * 10 ms each, the second waits for the first.
    serial = run_one(trace, 100, COST, "serial")
    assert serial.jct == pytest.approx([0.038, 0.076], abs=EPS)


class _PinsAndRefuses(SimManager):
    """Pins every waiting session and never makes room: pinned blocks stay out of the batch."""

    name = "pins-and-refuses"

    def on_gap(self, s: Sess, now: float) -> None:
        self.sim.cache.pin(s.sid)

    def make_room(self, needed: int, now: float, requester: Sess) -> bool:
        return False


def _pinned_trace() -> Trace:
    # a: one 8-token call, then a 100 s tool (pinned: 2 of the 5 blocks). c at 1.0: 8 + 4 decode
    # slots, 3 blocks. b at 1.001: 4 tokens, one block.
    return Trace(
        (
            _session("a", 0.0, TraceTurn(8, 1, "t", 100.0, 0), TraceTurn(4, 1)),
            _session("c", 1.0, TraceTurn(8, 5)),
            _session("b", 1.001, TraceTurn(4, 1)),
        )
    )


def test_a_call_waits_while_pinned_blocks_leave_no_room() -> None:
    m = BatchSim(_pinned_trace(), _PinsAndRefuses(), gpu_blocks=5, host_blocks=0, cost=COST).run()
    # c: its first step 8 + 9 + 1 ms ends at 1.018, then 4 steps of 10 ms: done at 1.058. b arrived
    # during c's first step; afterwards c's growth takes the last free block, so b waits for c to
    # end, then runs alone: 4 + 9 + 1 ms, done at 1.072. a returns to its pinned 8 tokens and
    # prefills 1 + 4 new ones (15 ms).
    assert sorted(m.jct) == pytest.approx([0.058, 1.072 - 1.001, 0.018 + 100.0 + 0.015], abs=EPS)
    assert (m.preemptions, m.forced) == (0, 0)
    # Without the pin, a's two blocks are free (cached, evictable) and b joins c's batch at 1.018:
    # 4 (b's prefill) + 9 + 2 ms, done at 1.033; c's remaining steps: 15, 10, 10, 10 ms.
    free = run_one(_pinned_trace(), 5, COST, "batch")
    assert sorted(free.jct)[:2] == pytest.approx(sorted([1.033 - 1.001, 1.063 - 1.0]), abs=EPS)


def test_growth_that_does_not_fit_preempts_the_newest_call_which_recomputes_later() -> None:
    # Two calls of 4 prompt tokens and 9 output tokens (12 slots, 3 blocks each) on 4 blocks: each
    # is admitted (3 blocks fit when it arrives), but both cannot grow to 3 blocks.
    trace = Trace((_session("x", 0.0, TraceTurn(4, 9)), _session("y", 0.0, TraceTurn(4, 9))))
    m = run_one(trace, 4, COST, "batch")
    # Steps 0-4 together (8 ms of prefill + 11, then 4 x 11 ms: t = 0.063); at step 5 x needs its
    # third block: none is free, vllm makes no room, so y (the newest) is preempted after 5 tokens.
    # x runs its last 4 steps alone (40 ms, done at 0.103). y resumes with 4 + 5 tokens: its first
    # block survived in the LRU (x's growth evicted the second), so it recomputes 5 tokens
    # (5 + 10 ms) and decodes its last 3 tokens (30 ms): done at 0.148.
    assert m.jct == pytest.approx([0.103, 0.148], abs=EPS)
    assert m.preemptions == 1
    assert m.preempt_recomputed_tokens == 5
    assert m.computed_tokens == 4 + 4 + 5
    assert m.steps == 5 + 4 + 4


class _Ranked(_NoManager):
    """No cache manager, but priorities: ``ranks[session]`` for each of its calls (lower first)."""

    name = "ranked"

    def __init__(self, ranks: dict[str, float]) -> None:
        self.ranks = ranks

    def priority(self, s: Sess, now: float) -> float | None:
        return self.ranks[s.sid]


def _one_at_a_time_trace() -> Trace:
    # Three calls of 8 prompt tokens and 4 decode slots (3 blocks each) on 3 blocks: one at a time.
    # x arrives first and runs; y and then z wait.
    return Trace(
        (
            _session("x", 0.0, TraceTurn(8, 4)),
            _session("y", 0.001, TraceTurn(8, 4)),
            _session("z", 0.002, TraceTurn(8, 4)),
        )
    )


def test_waiting_calls_are_admitted_by_priority_when_the_manager_gives_them() -> None:
    # FCFS (no priorities): y then z. Each call alone: 8 + 10 ms, then 3 x 10 ms = 48 ms.
    fcfs = BatchSim(_one_at_a_time_trace(), _NoManager(), gpu_blocks=3, host_blocks=0, cost=COST).run()
    assert fcfs.jct == pytest.approx([0.048, 0.096 - 0.001, 0.144 - 0.002], abs=EPS)
    # z ranks before y: it runs second although it arrived last.
    ranked = _Ranked({"x": 0.0, "y": 20.0, "z": 10.0})
    m = BatchSim(_one_at_a_time_trace(), ranked, gpu_blocks=3, host_blocks=0, cost=COST).run()
    assert m.jct == pytest.approx([0.048, 0.096 - 0.002, 0.144 - 0.001], abs=EPS)
    # and the serial engine model serves by priority too
    serial = Sim(_one_at_a_time_trace(), _Ranked({"x": 0.0, "y": 20.0, "z": 10.0}), 3, 0, COST).run()
    assert serial.jct == pytest.approx([0.048, 0.096 - 0.002, 0.144 - 0.001], abs=EPS)


def test_growth_that_does_not_fit_preempts_the_lowest_ranked_call_with_priorities() -> None:
    # The preemption scenario above, where vLLM's FCFS preempts the newest (y): with y ranked
    # first, x (ranked last) is preempted instead and y finishes first.
    trace = Trace((_session("x", 0.0, TraceTurn(4, 9)), _session("y", 0.0, TraceTurn(4, 9))))
    m = BatchSim(trace, _Ranked({"x": 5.0, "y": 1.0}), gpu_blocks=4, host_blocks=0, cost=COST).run()
    assert m.preemptions == 1
    assert m.jct[0] == pytest.approx(0.103, abs=EPS)  # the first to finish is y, in x's former time
    assert m.jct == sorted(m.jct)


class _HookOrder(SimManager):
    """Records when the engine model tells the manager a call is ready and when it asks its priority."""

    name = "order"

    def __init__(self) -> None:
        self.hooks: list[tuple[str, str, int]] = []

    def on_ready(self, s: Sess, now: float) -> None:
        self.hooks.append(("ready", s.sid, s.turn))

    def priority(self, s: Sess, now: float) -> float | None:
        self.hooks.append(("priority", s.sid, s.turn))
        return None


@pytest.mark.parametrize("engine", [Sim, BatchSim])
def test_a_calls_priority_is_asked_after_its_ready_events_are_folded(engine: type[Sim]) -> None:
    # The planner computes a call's priority from a log that already holds the tool's completion (its
    # time is part of the program's age), so the engine model asks the manager after on_ready.
    trace = Trace((_session("x", 0.0, TraceTurn(8, 4, "t", 0.5, 4), TraceTurn(4, 4)),))
    order = _HookOrder()
    engine(trace, order, gpu_blocks=8, host_blocks=0, cost=COST).run()
    assert order.hooks == [("ready", "x", 0), ("priority", "x", 0), ("ready", "x", 1), ("priority", "x", 1)]
