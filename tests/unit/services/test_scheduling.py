"""Program-level scheduling (``services.scheduling``): the priority scale, the ordering it gives,
the critical path of programs with parallel branches, the cache term and the bounded wait."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import pytest

from schemas import events as ev
from services.scheduling import (
    DEFAULT_SCHEDULING,
    PROGRAM_ORDER,
    ProgramProgress,
    ProgressBook,
    SchedulingConfig,
    call_priority,
    call_progress,
    preserved_until,
    prioritize,
    program_progress,
    request_priority,
)
from services.session import LLMCall, SessionState, ToolCall

pytestmark = pytest.mark.unit


def completed(call_id: str, *, prefill_ms: float = 0.0, decode_ms: float = 0.0,
              queue_ms: float = 0.0) -> ev.LLMCallCompleted:  # fmt: skip
    return ev.LLMCallCompleted(call_id=call_id, engine_id="sim-0", prompt_tokens=10, cached_tokens=0, output_tokens=5,
                               output_text="", finish_reason="length", queue_ms=queue_ms, prefill_ms=prefill_ms,
                               decode_ms=decode_ms)  # fmt: skip


def started(call_id: str) -> ev.LLMCallStarted:
    return ev.LLMCallStarted(call_id=call_id, turn=0, engine_id="sim-0", prompt_tokens=10, max_output_tokens=5,
                             prompt_digest="")  # fmt: skip


def with_calls(session_id: str, *calls: tuple[str, float, str | None]) -> SessionState:
    """A session whose completed calls are ``(call_id, service_ms, origin)``."""
    state = SessionState(session_id)
    for call_id, service_ms, origin in calls:
        state.llm_calls[call_id] = LLMCall(call_id, started(call_id), completed(call_id, decode_ms=service_ms), origin)
    return state


# ------------------------------------------------------------------ the scale and the ordering


def test_priority_is_the_ready_time_in_ms_placed_by_progress() -> None:
    config = SchedulingConfig(max_age_credit_ms=1e6, service_weight=2.0, max_level_ms=1e6, warm_credit_ms=100.0)
    progress = ProgramProgress(attained_ms=300.0, elapsed_ms=5_000.0)
    assert call_priority(10.0, ProgramProgress(), config=config) == 10_000
    # anchored 5 s back at its program's start, 2 x 300 ms later for the service it had
    assert call_priority(10.0, progress, config=config) == 10_000 - 5_000 + 600
    assert call_priority(10.0, progress, warm=True, config=config) == 10_000 - 5_000 + 600 - 100


def test_a_program_keeps_its_place_between_calls() -> None:
    # Program a started at 0 and comes back at 50 s after 49 s of recorded tool and engine time; b
    # starts at 45 s. Per-call FCFS would serve b first; as programs, a is first.
    a = call_priority(50.0, ProgramProgress(attained_ms=0.0, elapsed_ms=49_000.0))
    b = call_priority(45.0, ProgramProgress())
    assert a < b


def test_least_attained_service_goes_first_at_the_same_age() -> None:
    light = call_priority(100.0, ProgramProgress(attained_ms=1_000.0, elapsed_ms=20_000.0))
    heavy = call_priority(100.0, ProgramProgress(attained_ms=9_000.0, elapsed_ms=20_000.0))
    assert light < heavy
    assert heavy - light == round(DEFAULT_SCHEDULING.service_weight * 8_000)


def test_program_order_ranks_a_program_by_its_start_whatever_it_attained() -> None:
    # PROGRAM_ORDER (an engine with ranked pins): a program that started at 10 s ranks 10,000 at
    # every call, ahead of one that started at 12 s however much engine time it has had.
    first = [call_priority(10.0 + e / 1000, ProgramProgress(a, e), config=PROGRAM_ORDER)
             for a, e in ((0, 0), (4_000, 9_000), (40_000, 90_000))]  # fmt: skip
    assert first == [10_000, 10_000, 10_000]
    assert call_priority(12.0, ProgramProgress(), config=PROGRAM_ORDER) > first[-1]
    assert PROGRAM_ORDER.service_weight == 0 and PROGRAM_ORDER.warm_credit_ms == DEFAULT_SCHEDULING.warm_credit_ms


def test_terms_are_capped() -> None:
    config = SchedulingConfig(max_age_credit_ms=1_000.0, service_weight=1.0, max_level_ms=2_000.0)
    huge = ProgramProgress(attained_ms=1e9, elapsed_ms=1e9)
    assert call_priority(0.0, huge, config=config) == -1_000 + 2_000


def test_call_progress_counts_service_and_age_and_tools_count_age_only() -> None:
    call = completed("llm-0", prefill_ms=30.0, decode_ms=70.0, queue_ms=400.0)
    assert call_progress(call) == ProgramProgress(attained_ms=100.0, elapsed_ms=500.0)
    assert ProgramProgress().after_call(call).after_tool(2_000.0) == ProgramProgress(100.0, 2_500.0)


# ------------------------------------------------------------------ critical path (ATLAS)


def test_a_session_counts_its_completed_calls_and_tools() -> None:
    state = with_calls("s", ("llm-0", 100.0, None), ("llm-1", 50.0, None))
    state.llm_calls["llm-2"] = LLMCall("llm-2", started("llm-2"))  # in flight: not attained yet
    proposed = ev.ToolCallProposed(call_id="tool-0", tool="t", arguments_json="{}", effect_class=ev.EffectClass.PURE,
                                   idempotency_key="k")  # fmt: skip
    tool = ToolCall("tool-0", proposed)
    tool.completed = ev.ToolCallCompleted(call_id="tool-0", result_json="{}", result_tokens=1, duration_ms=1_000.0)
    state.tool_calls["tool-0"] = tool
    assert program_progress(state) == ProgramProgress(attained_ms=150.0, elapsed_ms=1_150.0)


def test_a_branch_carries_its_parents_path_up_to_the_fork() -> None:
    # The fold copies the parent's calls into the fork, marked with their origin.
    branch = with_calls("p.fork-1.0", ("llm-0", 100.0, "p"), ("llm-2", 30.0, None))
    assert program_progress(branch).attained_ms == 130.0


def test_after_a_merge_the_parent_carries_the_slowest_branch_not_the_sum() -> None:
    parent = with_calls("p", ("llm-0", 100.0, None))
    parent.merges.append(ev.MergeApplied(branch_session_ids=["b0", "b1", "b2"], results_json="{}"))
    b0 = with_calls("b0", ("llm-0", 100.0, "p"), ("llm-2", 40.0, None))
    b1 = with_calls("b1", ("llm-0", 100.0, "p"), ("llm-2", 70.0, None), ("llm-4", 20.0, None))
    # b2 is another planner's: not known here, counts nothing
    progress = program_progress(parent, {"b0": b0, "b1": b1})
    assert progress.attained_ms == 100.0 + 90.0  # the parent's own and b1's own (not b0 + b1, nor inherited twice)
    # Parallel branches rank like one thread of the same length, not like their sum.
    assert call_priority(0.0, progress) < call_priority(0.0, ProgramProgress(attained_ms=100.0 + 40.0 + 90.0))


def test_nested_merges_follow_the_path_and_a_merge_cycle_does_not_loop() -> None:
    inner = with_calls("b0.x", ("llm-0", 10.0, None))
    b0 = with_calls("b0", ("llm-0", 5.0, None))
    b0.merges.append(ev.MergeApplied(branch_session_ids=["b0.x"], results_json="{}"))
    parent = with_calls("p", ("llm-0", 1.0, None))
    parent.merges.append(ev.MergeApplied(branch_session_ids=["b0"], results_json="{}"))
    assert program_progress(parent, {"b0": b0, "b0.x": inner}).attained_ms == 1.0 + 5.0 + 10.0
    b0.merges.append(ev.MergeApplied(branch_session_ids=["p"], results_json="{}"))  # a cycle
    assert program_progress(parent, {"b0": b0, "b0.x": inner, "p": parent}).attained_ms == 16.0


# ------------------------------------------------------------------ the cache term


def decision(action: ev.CacheAction, ttl_ms: int | None) -> ev.CacheDecisionMade:
    return ev.CacheDecisionMade(engine_id="sim-0", action=action, ttl_ms=ttl_ms, score=1.0, num_blocks=4, reason="")


def test_a_preserved_session_does_not_wait_behind_a_cold_one() -> None:
    # Same program history, the warm one became ready a little later: it still goes first.
    cold = call_priority(10.0, ProgramProgress(attained_ms=500.0, elapsed_ms=8_000.0))
    warm = call_priority(12.0, ProgramProgress(attained_ms=500.0, elapsed_ms=8_000.0), warm=True)
    assert warm < cold
    assert cold - call_priority(10.0, ProgramProgress(500.0, 8_000.0), warm=True) == DEFAULT_SCHEDULING.warm_credit_ms


def test_preserved_until_reads_the_managers_last_decision() -> None:
    assert preserved_until(decision(ev.CacheAction.PRESERVE, 2_500), 10.0) == pytest.approx(12.5)
    assert preserved_until(decision(ev.CacheAction.PREFETCH, 1_000), 10.0) == pytest.approx(11.0)
    assert preserved_until(decision(ev.CacheAction.PRESERVE, None), 10.0) == float("inf")
    for action in (ev.CacheAction.SWAP, ev.CacheAction.RELEASE, ev.CacheAction.DISCARD):
        assert preserved_until(decision(action, 5_000), 10.0) is None


# ------------------------------------------------------------------ anti-starvation


@dataclass
class _Call:
    name: str
    ready_s: float
    service_s: float
    priority: int
    started_s: float = -1.0


def serve_lowest_first(calls: list[_Call]) -> None:
    """One non-preemptive server that, whenever it is free, starts the waiting call with the lowest
    priority (ties in ready order): vLLM's priority policy with one slot."""
    pending = sorted(calls, key=lambda c: c.ready_s)
    waiting: list[tuple[int, float, int, _Call]] = []
    now, i = 0.0, 0
    while i < len(pending) or waiting:
        if not waiting:
            now = max(now, pending[i].ready_s)
        while i < len(pending) and pending[i].ready_s <= now:
            heapq.heappush(waiting, (pending[i].priority, pending[i].ready_s, i, pending[i]))
            i += 1
        _, _, _, call = heapq.heappop(waiting)
        call.started_s = now
        now += call.service_s


def overload(config: SchedulingConfig, heavy: ProgramProgress) -> tuple[_Call, list[_Call]]:
    """A stream of new programs' calls keeps one server busy for 2,000 s (one 1 s call per second)
    while one call of a program with ``heavy`` progress waits from t = 10.5 s."""
    fresh = [_Call(f"new-{k}", float(k), 1.0, call_priority(float(k), ProgramProgress(), config=config))
             for k in range(2_000)]  # fmt: skip
    old = _Call("old", 10.5, 1.0, call_priority(10.5, heavy, config=config))
    return old, fresh


def test_a_heavy_programs_call_waits_at_most_the_bound_under_overload() -> None:
    config = SchedulingConfig(max_age_credit_ms=0.0, service_weight=1.0, max_level_ms=60_000.0, warm_credit_ms=0.0)
    old, fresh = overload(config, ProgramProgress(attained_ms=1e9))
    serve_lowest_first([old, *fresh])
    wait = old.started_s - old.ready_s
    # Bound: the window, plus the work queued when it ends (calls ready in it, one at a time, and
    # the call running at its end).
    assert wait <= config.max_wait_ms / 1000 + 1.0 + 1.0
    assert wait >= 59.0  # and it did yield to the new programs for that long: least attained first
    # Without the cap (pure least attained service) the same call starves until the stream ends.
    uncapped = SchedulingConfig(max_age_credit_ms=0.0, service_weight=1.0, max_level_ms=1e12, warm_credit_ms=0.0)
    old, fresh = overload(uncapped, ProgramProgress(attained_ms=1e9))
    serve_lowest_first([old, *fresh])
    assert old.started_s >= 2_000.0


def test_a_new_programs_call_waits_at_most_the_bound_behind_old_programs() -> None:
    # The other side: old programs' calls, anchored far back by their age, keep coming; a new
    # program's call is still served within the bound.
    config = SchedulingConfig(max_age_credit_ms=30_000.0, service_weight=0.0, max_level_ms=0.0, warm_credit_ms=5_000.0)
    old = [_Call(f"old-{k}", float(k), 1.0, call_priority(float(k), ProgramProgress(elapsed_ms=1e9), warm=True,
                                                          config=config)) for k in range(2_000)]  # fmt: skip
    new = _Call("new", 10.5, 1.0, call_priority(10.5, ProgramProgress(), config=config))
    serve_lowest_first([new, *old])
    assert 34.0 <= new.started_s - new.ready_s <= config.max_wait_ms / 1000 + 2.0


@pytest.mark.parametrize("seed", range(8))
def test_no_call_is_passed_by_one_ready_more_than_the_window_after_it(seed: int) -> None:
    """The invariant behind the bound, on random histories: whatever the programs' progress and
    cache state, a call never starts after a call that became ready more than ``max_wait_ms``
    after it."""
    rng = random.Random(seed)
    config = SchedulingConfig(
        max_age_credit_ms=rng.uniform(0, 20_000),
        service_weight=rng.uniform(0, 3),
        max_level_ms=rng.uniform(0, 20_000),
        warm_credit_ms=rng.uniform(0, 5_000),
    )
    calls = []
    for k in range(300):
        ready = rng.uniform(0, 150)
        progress = ProgramProgress(attained_ms=rng.expovariate(1 / 5_000), elapsed_ms=rng.expovariate(1 / 30_000))
        priority = call_priority(ready, progress, warm=rng.random() < 0.3, config=config)
        calls.append(_Call(f"c{k}", ready, rng.uniform(0.1, 1.5), priority))
    serve_lowest_first(calls)
    window_s = config.max_wait_ms / 1000
    for a in calls:
        for b in calls:
            if b.ready_s > a.ready_s + window_s:
                assert b.started_s >= a.started_s, (a, b)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("value", [1.5, "3", True, [1], {"p": 1}, float("nan")])
def test_a_request_priority_that_is_not_an_integer_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="priority must be an integer"):
        request_priority(value)


def test_a_missing_request_priority_is_vllms_default() -> None:
    assert request_priority(None) == 0
    assert request_priority(-7) == -7


@pytest.mark.parametrize(
    "field", ["max_age_credit_ms", "service_weight", "max_level_ms", "warm_credit_ms"]
)  # fmt: skip
@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_bad_configs_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulingConfig(**{field: value})


@pytest.mark.parametrize("attained, elapsed", [(-1.0, 0.0), (0.0, -1.0), (float("inf"), 0.0), (0.0, float("nan"))])
def test_bad_progress_is_refused(attained: float, elapsed: float) -> None:
    with pytest.raises(ValueError, match="progress"):
        ProgramProgress(attained, elapsed)


def test_prioritize_gives_the_priority_with_what_it_was_computed_from() -> None:
    progress = ProgramProgress(attained_ms=700_000.0, elapsed_ms=900_000.0)
    ranked = prioritize(5_000.0, progress, warm=True)
    assert ranked.priority == call_priority(5_000.0, progress, warm=True)
    assert (ranked.attained_ms, ranked.age_ms, ranked.warm) == (700_000.0, 900_000.0, True)  # before the caps
    assert prioritize(5_000.0, ProgramProgress()).priority == 5_000_000 and not prioritize(5.0, progress).warm


def test_a_progress_book_ranks_a_call_as_the_session_fold_would() -> None:
    """The book, fed the events in log order, gives the priority ``call_priority`` gives for the
    same progress and warm state; a decision that is not a PRESERVE ends the warm credit."""
    book = ProgressBook()
    book.logged("s", completed("llm-0", prefill_ms=300.0, decode_ms=200.0, queue_ms=100.0), 1.0)
    book.logged("s", ev.ToolCallCompleted(call_id="t", result_json="{}", result_tokens=1, duration_ms=2_000.0), 3.0)
    book.logged("s", decision(ev.CacheAction.PRESERVE, 5_000), 3.0)
    progress = ProgramProgress(attained_ms=500.0, elapsed_ms=2_600.0)
    assert book.priority("s", 4.0) == call_priority(4.0, progress, warm=True)
    assert book.priority("s", 9.0) == call_priority(9.0, progress), "past the TTL: cold"
    book.logged("s", decision(ev.CacheAction.RELEASE, None), 4.0)
    assert book.priority("s", 4.0) == call_priority(4.0, progress)
    assert book.priority("new", 4.0) == call_priority(4.0, ProgramProgress())
