"""The cache manager's policy: next-reference distance, survival score, decisions.

Pure: no I/O, no clock; ``now`` and the measured delays are parameters.

**Next-reference distance** ``D`` (seconds until the session's next LLM call):

- in an LLM call: 0 (its blocks are in use; it is never a candidate);
- idle (tool done, next call imminent): ``q`` (the measured queueing delay);
- waiting on tool T: ``MRL_T(x) + q`` where ``x`` is how long T has run; before the
  tool started (verdict pending) ``v + MRL_T(0) + q`` (``v``: measured verdict delay);
- waiting on a human: ``max(human_min_s, MRL_T(x)) + q`` (long);
- finished: infinite.

**Return probability** ``p``: 0 when finished, ``human_return_probability`` when
waiting on a human, else 1.

**Reload cost** ``R`` (ms) of a session holding ``b`` GPU blocks: ``swap_ms(b)`` when
the host tier has ``b`` free slots and swapping is cheaper than recomputing
(``CostModel.recompute_vs_swap``), else ``recompute_ms(b * block_size)``.

**Survival score**, expected benefit per byte-second of GPU memory (ms per GB-s)::

    score = p * R / ((b * block_bytes / 1e9) * max(D, min_distance_s))

0 when finished or ``D`` is infinite.

**Decision** (``decide``): candidates are sessions not in an LLM call holding GPU
blocks, taken in ascending (score, session id) order (lowest first; ties by id).
``deficit = max(0, needed_blocks - gpu_free_blocks)``; for each candidate in order:

1. finished: DISCARD (nothing will reuse its private blocks; shared ones stay);
2. while ``deficit > 0``: SWAP if the host tier has room for its blocks and swap-in is
   cheaper than recompute, else RELEASE it to the engine's LRU (unpinned, its blocks
   are freed tail first and only as many as the engine needs: a lazy discard that keeps
   the prefix it does not need); the deficit drops by the blocks it frees;
3. else, if ``D > horizon`` with ``horizon = max_horizon_s * (1 - pressure)``: SWAP
   when the host has room and swap-in is cheaper (proactive offload), else RELEASE
   (its blocks go back to the LRU, cached but evictable);
4. else PRESERVE with ``ttl = clamp(ttl_factor * D, min_ttl_s, max_ttl_s)``, re-scored
   at the next decision.

``pressure = 1 - gpu_free_blocks / gpu_total_blocks`` is measured before deciding, so
the horizon (what is worth pinning) shrinks as memory fills.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from schemas.events import CacheAction, CacheDecisionMade, SessionId
from services.cache.latency import ToolLatencyModel
from services.cache.view import Phase, SessionView
from services.engine.cost import CostModel

__all__ = ["CacheDecision", "CachePolicy", "Delays", "MemoryState", "PolicyConfig"]

_MS_PER_S = 1000.0
_BYTES_PER_GB = 1e9


@dataclass(frozen=True, slots=True)
class MemoryState:
    """The engine's memory as measured now.

    ``gpu_free_blocks``: free or evictable GPU blocks; ``needed_blocks``: what the
    engine needs free now (0 when nothing waits). ``reclaimable``: per session, the
    GPU blocks that evicting it would free (its pinned blocks); None means all of a
    session's ``gpu_blocks``.
    """

    gpu_total_blocks: int
    gpu_free_blocks: int
    host_free_blocks: int = 0
    needed_blocks: int = 0
    reclaimable: Mapping[SessionId, int] | None = None

    @property
    def pressure(self) -> float:
        if self.gpu_total_blocks <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.gpu_free_blocks / self.gpu_total_blocks))


@dataclass(frozen=True, slots=True)
class Delays:
    """Measured delays between a tool's end and the next LLM call's start (seconds)."""

    queue_s: float = 0.0
    verdict_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    human_min_s: float = 60.0
    human_return_probability: float = 0.9
    min_distance_s: float = 0.01
    max_horizon_s: float = 300.0
    ttl_factor: float = 2.0
    min_ttl_s: float = 1.0
    max_ttl_s: float = 600.0


@dataclass(frozen=True, slots=True)
class CacheDecision:
    """One decision for one session's KV cache."""

    session_id: SessionId
    action: CacheAction
    score: float
    next_reference_s: float  # math.inf when the session will not return
    num_blocks: int
    ttl_s: float | None = None  # PRESERVE only
    reason: str = ""

    def to_event(self, engine_id: str) -> CacheDecisionMade:
        """The log event for this decision."""
        return CacheDecisionMade(
            engine_id=engine_id,
            action=self.action,
            ttl_ms=None if self.ttl_s is None else round(self.ttl_s * _MS_PER_S),
            score=self.score,
            next_reference_ms=None if math.isinf(self.next_reference_s) else self.next_reference_s * _MS_PER_S,
            num_blocks=self.num_blocks,
            reason=self.reason,
        )


@dataclass(slots=True)
class CachePolicy:
    """Scores sessions and decides (see the module docstring for the formulas)."""

    cost: CostModel = field(default_factory=CostModel)
    latency: ToolLatencyModel = field(default_factory=ToolLatencyModel)
    config: PolicyConfig = field(default_factory=PolicyConfig)

    def next_reference_s(self, view: SessionView, now: float, delays: Delays = Delays()) -> float:
        c = self.config
        if view.phase is Phase.FINISHED:
            return math.inf
        if view.phase is Phase.LLM:
            return 0.0
        if view.phase is Phase.IDLE or view.tool is None:
            return delays.queue_s
        if view.tool_started_at is None:
            remaining = max(0.0, delays.verdict_s - (now - view.since)) + self.latency.mean(view.tool)
        else:
            remaining = self.latency.mean_residual_life(view.tool, now - view.tool_started_at)
        if view.phase is Phase.HUMAN:
            remaining = max(c.human_min_s, remaining)
        return remaining + delays.queue_s

    def return_probability(self, view: SessionView) -> float:
        if view.phase is Phase.FINISHED:
            return 0.0
        if view.phase is Phase.HUMAN:
            return self.config.human_return_probability
        return 1.0

    def can_swap(self, num_blocks: int, host_free_blocks: int) -> bool:
        return 0 < num_blocks <= host_free_blocks and self.cost.recompute_vs_swap(num_blocks) == "swap"

    def reload_ms(self, num_blocks: int, host_free_blocks: int) -> float:
        if self.can_swap(num_blocks, host_free_blocks):
            return self.cost.swap_ms(num_blocks)
        return self.cost.recompute_ms(num_blocks * self.cost.block_size)

    def score(self, view: SessionView, now: float, host_free_blocks: int, delays: Delays = Delays()) -> float:
        distance = self.next_reference_s(view, now, delays)
        p = self.return_probability(view)
        if p == 0.0 or math.isinf(distance) or view.gpu_blocks <= 0:
            return 0.0
        gigabytes = view.gpu_blocks * self.cost.block_bytes / _BYTES_PER_GB
        return (
            p
            * self.reload_ms(view.gpu_blocks, host_free_blocks)
            / (gigabytes * max(distance, self.config.min_distance_s))
        )

    def decide(
        self, views: Iterable[SessionView], now: float, memory: MemoryState, delays: Delays = Delays()
    ) -> list[CacheDecision]:
        """Decisions for every candidate, lowest score first (see the module docstring)."""
        c = self.config
        host_free = memory.host_free_blocks
        scored = sorted(
            (self.score(v, now, host_free, delays), v.session_id, v)
            for v in views
            if v.phase is not Phase.LLM and v.gpu_blocks > 0
        )
        deficit = max(0, memory.needed_blocks - memory.gpu_free_blocks)
        horizon = c.max_horizon_s * (1.0 - memory.pressure)
        decisions: list[CacheDecision] = []
        for score, sid, view in scored:
            distance = self.next_reference_s(view, now, delays)
            blocks = view.gpu_blocks
            freed = blocks if memory.reclaimable is None else memory.reclaimable.get(sid, 0)
            if view.phase is Phase.FINISHED:
                decisions.append(CacheDecision(sid, CacheAction.DISCARD, score, distance, blocks, reason="finished"))
                deficit -= freed
            elif deficit > 0:
                if self.can_swap(blocks, host_free):
                    host_free -= blocks
                    action, reason = CacheAction.SWAP, "memory pressure: swap-in is cheaper than recompute"
                else:
                    action, reason = CacheAction.RELEASE, "memory pressure: no host room or recompute is cheaper"
                decisions.append(CacheDecision(sid, action, score, distance, blocks, reason=reason))
                deficit -= freed
            elif distance > horizon:
                reason = f"next reference {distance:.3g}s beyond horizon {horizon:.3g}s"
                action = CacheAction.RELEASE
                if self.can_swap(blocks, host_free):
                    host_free -= blocks
                    action = CacheAction.SWAP
                decisions.append(CacheDecision(sid, action, score, distance, blocks, reason=reason))
            else:
                ttl = min(c.max_ttl_s, max(c.min_ttl_s, c.ttl_factor * distance))
                decisions.append(
                    CacheDecision(sid, CacheAction.PRESERVE, score, distance, blocks, ttl_s=ttl, reason="worth keeping")
                )
        return decisions
