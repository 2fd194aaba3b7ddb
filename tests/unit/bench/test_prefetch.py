"""``ours`` prefetches in the cache-policy bench: a session swapped out under pressure is looked
at again at the time its SWAP asked for and brought back to GPU before its call, on both engine
models, with the transfer charged like every swap."""

from __future__ import annotations

import pytest

from bench.cache_policies import BatchSim, Sim, make_manager
from schemas.events import SessionId
from services.engine.cost import CostModel
from services.traces.model import Trace, TraceSession, TraceTurn


def _trace(b_prompt: int) -> Trace:
    # a: one block, then a 30 s tool; b arrives at 0.5 s with a call of 12 blocks (168 + 16 slots):
    # on 12 GPU blocks it needs a's pinned block, so a is swapped out (the host has room).
    return Trace(
        (
            TraceSession("a", "test", 0.0, (TraceTurn(16, 1, "t", 30.0, 0), TraceTurn(16, 1))),
            TraceSession("b", "test", 0.5, (TraceTurn(b_prompt, 17),)),
        )
    )


def _run(engine: type[Sim], trace: Trace) -> tuple[Sim, list[float]]:
    sim = engine(trace, make_manager("ours"), gpu_blocks=12, host_blocks=12, cost=CostModel())
    for _ in range(20):  # the tool is known to take 30 s: its mean residual life shrinks as it runs
        sim.latency.observe("t", 30.0)
    relooks: list[float] = []
    push = sim.push

    def recording(t: float, kind: str, sid: SessionId) -> None:
        if kind == "relook":
            relooks.append(t)
        push(t, kind, sid)

    sim.push = recording  # type: ignore[method-assign]
    return sim, relooks


@pytest.mark.parametrize("engine", [BatchSim, Sim])
def test_a_swapped_session_is_prefetched_before_its_call(engine: type[Sim]) -> None:
    sim, relooks = _run(engine, _trace(168))
    m = sim.run()
    # a was swapped out for b (1 block), and brought back by a prefetch, not by its call.
    assert m.swapped_out_blocks == 1
    assert (m.prefetches, m.prefetched_blocks, m.swapped_in_blocks) == (1, 1, 1)
    assert m.computed_tokens == 16 + 168 + 17  # a's second call hits its prefetched block
    policy = sim.manager.policy  # type: ignore[attr-defined]
    assert policy is not None
    # Two looks: the SWAP's (half a margin inside the lead of the ~28.8 s predicted then), which
    # finds more than the 1 s lead left (the prior keeps the estimate above 30 s - elapsed), then
    # the next one, at least half a margin later and before a's tool ends (30 s after its gap),
    # which prefetches.
    assert len(relooks) == 2
    assert 28.0 < relooks[0] < 29.0
    assert relooks[0] + 0.5 <= relooks[1] < 30.0
    assert max(m.jct) > 30.0


@pytest.mark.parametrize("engine", [BatchSim, Sim])
def test_no_swap_no_relook_and_no_prefetch(engine: type[Sim]) -> None:
    # With b one block smaller there is room for both: a stays pinned, nothing moves.
    sim, relooks = _run(engine, _trace(152))
    m = sim.run()
    assert (m.swapped_out_blocks, m.swapped_in_blocks, m.prefetches) == (0, 0, 0)
    assert relooks == []
