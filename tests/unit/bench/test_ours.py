"""``ours`` in the cache-policy bench: the shipped ``CacheManager`` fed the log's events by the
engine models, its decisions carried out by the sim server's mapping (``CacheControl.apply``)."""

from __future__ import annotations

import pytest

from bench.ours import Ours, OursPlas, VllmPlas, VllmPlasHold
from schemas.events import CacheDecisionMade, SessionId
from services.cache.manager import CacheManager
from services.engine.batching import BatchSim
from services.engine.cost import CostModel
from services.engine.serial import Sess, Sim
from services.traces.model import Trace, TraceSession, TraceTurn


def _recorded(sim: Sim) -> list[tuple[str, str]]:
    """(session, action) of every decision the engine model carries out, in order."""
    carried: list[tuple[str, str]] = []
    carry_out = sim.carry_out

    def recording(decision: CacheDecisionMade, sid: SessionId, now: float) -> int:
        carried.append((sid, decision.action.value))
        return carry_out(decision, sid, now)

    sim.carry_out = recording  # type: ignore[method-assign]
    return carried


@pytest.mark.parametrize("engine", [Sim, BatchSim])
def test_a_call_that_does_not_fit_with_a_pin_makes_the_manager_swap_it_out(engine: type[Sim]) -> None:
    # a: one 16-token call, then a 30 s tool; its gap decision pins its 2 blocks (the manager counts
    # prompt + output: 17 tokens). b arrives at 0.5 s: its LLMCallStarted charges ceil(185 / 16) =
    # 12 blocks, 14 of 12 are used, so the manager evicts a: the host has room and swapping pays.
    # b's end discards b; a's call swaps its block back in; a's end discards a.
    trace = Trace(
        (
            TraceSession("a", "test", 0.0, (TraceTurn(16, 1, "t", 30.0, 0), TraceTurn(16, 1))),
            TraceSession("b", "test", 0.5, (TraceTurn(168, 17),)),
        )
    )
    ours = Ours()
    sim = engine(trace, ours, gpu_blocks=12, host_blocks=12, cost=CostModel())
    carried = _recorded(sim)
    m = sim.run()
    assert carried == [("a", "PRESERVE"), ("a", "SWAP"), ("b", "DISCARD"), ("a", "DISCARD")]
    assert (m.swapped_out_blocks, m.swapped_in_blocks, m.prefetches, m.refused, m.forced) == (1, 1, 0, 0, 0)
    assert m.computed_tokens == 16 + 168 + 17  # a's return hits its swapped-in block
    assert isinstance(ours.manager, CacheManager)
    assert ours.num_decisions == 4 and ours.num_events > 2 * 5  # the planner's, the executor's and the KV events
    # Both finished sessions hold nothing any more: the manager forgot them.
    assert ours.manager.num_sessions == 0
    assert ours.manager.forgotten(SessionId("a")) and ours.manager.forgotten(SessionId("b"))


def test_the_manager_knows_no_engine_queue_so_ours_offloads_while_calls_run() -> None:
    # a's one-block context enters a long human gap while b's call holds the other 10 of 11 GPU
    # blocks: a's next reference (at least 60 s) is beyond the horizon and swapping it out pays.
    # The log has no queue length (the manager decides with queued_calls = 0), so a is swapped out
    # at once although the transfer stalls b's steps (the policy alone, told that calls wait,
    # defers it: tests/unit/services/cache/test_cache_policy.py).
    trace = Trace(
        (
            TraceSession("a", "test", 0.0, (TraceTurn(16, 1, "human", 100.0, 0), TraceTurn(16, 1))),
            TraceSession("b", "test", 0.0, (TraceTurn(144, 17),)),
        )
    )
    sim = BatchSim(trace, Ours(), gpu_blocks=11, host_blocks=11, cost=CostModel())
    carried = _recorded(sim)
    m = sim.run()
    assert carried == [("a", "SWAP"), ("b", "DISCARD"), ("a", "DISCARD")]
    assert (m.swapped_out_blocks, m.swapped_in_blocks, m.preemptions) == (1, 1, 0)


@pytest.mark.parametrize("engine", [Sim, BatchSim])
def test_a_call_that_does_not_fit_takes_the_lowest_scored_pin(engine: type[Sim]) -> None:
    # No host tier: pins are evicted by RELEASE or by the engine's pressure valve; every session
    # still finishes and nothing is ever forced (all pins released at once).
    turns = (TraceTurn(200, 20, "search", 1.0, 40), TraceTurn(10, 30, "t", 2.0, 20), TraceTurn(10, 5))
    trace = Trace(tuple(TraceSession(f"s{i}", "test", 0.05 * i, turns) for i in range(12)))
    m = engine(trace, Ours(), gpu_blocks=60, host_blocks=0, cost=CostModel()).run()
    assert len(m.jct) == 12
    assert (m.swapped_out_blocks, m.refused, m.forced) == (0, 0, 0)


@pytest.mark.parametrize("host_blocks", [0, 1500])
def test_ours_plas_ranks_its_pins_and_leaves_releases_to_the_engines_valve(host_blocks: int) -> None:
    # ours+plas runs on an engine with ranked pins (the priorities its planner sends rank each
    # session's pins) and the manager knows it: under pressure it may swap, it never releases.
    # Calls wait for programs ranked ahead rather than take their contexts, and still every
    # session finishes without a forced release of all pins. Contexts of 5,000 tokens (0.54 s to
    # recompute) are worth waiting for through the manager's first guess of a gap (5 s, within
    # ranked_wait_factor recomputes); after their 1 s tools, the short last turns' are not.
    turns = (TraceTurn(5000, 20, "search", 1.0, 40), TraceTurn(10, 30, "t", 2.0, 20), TraceTurn(10, 5))
    trace = Trace(tuple(TraceSession(f"s{i}", "test", 0.05 * i, turns) for i in range(12)))
    ours = OursPlas()
    sim = BatchSim(trace, ours, gpu_blocks=1500, host_blocks=host_blocks, cost=CostModel())
    reasons: list[tuple[str, str]] = []
    carry_out = sim.carry_out

    def recording(decision: CacheDecisionMade, sid: SessionId, now: float) -> int:
        reasons.append((decision.action.value, decision.reason))
        return carry_out(decision, sid, now)

    sim.carry_out = recording  # type: ignore[method-assign]
    m = sim.run()
    assert sim.control.ranked and ours.manager.config.ranked_pins
    assert len(m.jct) == 12 and (m.forced, m.refused) == (0, 0)
    actions = {action for action, _ in reasons}
    assert "PRESERVE" in actions
    # Every release is a gap's or a TTL's, of a session too far away to be waited for; none is pressure's.
    assert all(reason.startswith("ranked pins:") for action, reason in reasons if action == "RELEASE")
    assert ("SWAP" in actions) == (host_blocks > 0)
    assert sim.control.ranks == {}  # a finished session's rank goes with it
    unranked = BatchSim(trace, Ours(), gpu_blocks=1500, host_blocks=host_blocks, cost=CostModel())
    carried = _recorded(unranked)
    unranked.run()
    assert not unranked.control.ranked and "RELEASE" in {action for _, action in carried}


def test_vllm_plas_follows_each_programs_progress_and_decides_nothing() -> None:
    # Stock vLLM's cache with program-level scheduling: the priorities come from the same log as
    # ours+plas's, no decision is carried out, and every block goes to the LRU as vllm's do: here,
    # as for vllm (test_cache_policies.py), every prompt is computed again after its tool call.
    turns = (TraceTurn(200, 20, "search", 1.0, 40), TraceTurn(10, 30, "t", 2.0, 20), TraceTurn(10, 5))
    trace = Trace(tuple(TraceSession(f"s{i}", "test", 0.05 * i, turns) for i in range(12)))
    plas = VllmPlas()
    sim = BatchSim(trace, plas, gpu_blocks=60, host_blocks=0, cost=CostModel())
    carried = _recorded(sim)
    m = sim.run()
    assert carried == [] and plas.num_decisions == 0
    assert len(m.jct) == 12 and (m.swapped_out_blocks, m.forced, m.refused) == (0, 0, 0)
    assert set(plas.book.progress) == {f"s{i}" for i in range(12)}  # each program's progress, from the log
    assert plas.book.preserved == {}  # no warm credit: nothing preserves a session's KV
    assert m.computed_tokens == 12 * (200 + 270 + 330)


def test_vllm_plas_hold_computes_fewer_prompts_and_never_forces_a_release() -> None:
    # vllm+plas on an engine with ranked pins: every call holds its context until the session's next
    # call, and a call waits rather than take the blocks of a program ahead of it. Every session still
    # finishes (a call never waits for a pin for ever: the programs ahead of it finish, and a finished
    # session's hold is released), and fewer prompts are computed again than under vllm+plas.
    turns = (TraceTurn(200, 20, "search", 1.0, 40), TraceTurn(10, 30, "t", 2.0, 20), TraceTurn(10, 5))
    trace = Trace(tuple(TraceSession(f"s{i}", "test", 0.05 * i, turns) for i in range(12)))
    held = BatchSim(trace, VllmPlasHold(), gpu_blocks=60, host_blocks=0, cost=CostModel()).run()
    plas = BatchSim(trace, VllmPlas(), gpu_blocks=60, host_blocks=0, cost=CostModel()).run()
    assert len(held.jct) == 12 and (held.swapped_out_blocks, held.forced, held.refused) == (0, 0, 0)
    assert held.computed_tokens < plas.computed_tokens == 12 * (200 + 270 + 330)


def test_vllm_plas_hold_ranks_each_program_by_its_start_at_every_call() -> None:
    # Ranked pins need ranks that stay put: with the attained-service term a program's rank moves
    # back at each call and two programs holding contexts take each other's in turn. Every step's
    # time is on the log, so the ready time less the recorded age is the program's arrival.
    turns = (TraceTurn(200, 20, "search", 1.0, 40), TraceTurn(10, 30, "t", 2.0, 20), TraceTurn(10, 5))
    trace = Trace(tuple(TraceSession(f"s{i}", "test", 0.05 * i, turns) for i in range(12)))
    held = VllmPlasHold()
    ranks: dict[str, list[float]] = {}
    priority = held.priority

    def recording(s: Sess, now: float) -> float | None:
        value = priority(s, now)
        assert value is not None
        ranks.setdefault(s.sid, []).append(value)
        return value

    held.priority = recording  # type: ignore[method-assign]
    m = BatchSim(trace, held, gpu_blocks=60, host_blocks=0, cost=CostModel()).run()
    assert len(m.jct) == 12
    for i in range(12):
        values = ranks[f"s{i}"]
        assert len(values) >= 3  # each call ranked (a call waiting for room is ranked again)
        assert max(values) - min(values) <= 1 and abs(values[0] - 50 * i) <= 1  # ms: its arrival
