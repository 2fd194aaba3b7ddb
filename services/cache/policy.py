"""The cache manager's policy: next-reference distance, survival score, decisions.

Pure: no I/O, no clock; ``now``, the measured delays and the engine's memory and
queue are parameters. Every quantity below is computable from the log alone (no
future knowledge): tool durations are learned online (``ToolLatencyModel``), the
queueing and verdict delays are measured, memory and queue length come from the
engine's KV events and call events.

**Next-reference distance** ``D`` (seconds until the session's next LLM call):

- in an LLM call: 0 (its blocks are in use; it is never a candidate);
- idle (tool done, next call imminent): ``q`` (the measured queueing delay);
- waiting on tool T: ``MRL_T(x) + q`` where ``x`` is how long T has run and
  ``MRL_T`` the mean residual life of T's learned duration distribution (so a heavy
  tail makes a long wait predict a longer one); before the tool started (verdict
  pending) ``max(0, v - waited) + MRL_T(0) + q`` (``v``: measured verdict delay);
- waiting on a human: ``max(human_min_s, MRL_T(x)) + q`` (long);
- finished: infinite.

**Return probability** ``p``: 0 when finished, ``human_return_probability`` when
waiting on a human, else 1.

**Reload cost** ``R`` (ms) of a session holding ``b`` GPU blocks, the cost of not
keeping it on GPU: the swap round trip ``2 * swap_ms(b)`` (the swap-out now plus the
swap-in on return; both occupy the engine) when the host tier has ``b`` free slots
and the round trip is cheaper than recomputing (``can_swap``), else
``recompute_ms(b * block_size)``.

**Survival score**, expected benefit per byte-second of GPU memory (ms per GB-s)::

    score = p * R / ((b * block_bytes / 1e9) * max(D, min_distance_s))

0 when finished or ``D`` is infinite.

**Host score** of a session whose context is (or would be) on the host tier, ``h``
blocks there: the benefit per byte-second of host memory of keeping it there rather
than recomputing it, ``p * (recompute_ms(h * block_size) - swap_ms(h)) / ((h *
block_bytes / 1e9) * max(D, min_distance_s))``.

**Decision** (``decide``). Views in an LLM call are skipped. *GPU candidates* are
the other views holding GPU blocks, plus finished views holding host blocks only;
*host residents* are unfinished views with no GPU blocks and some host blocks.
``deficit = max(0, needed_blocks - gpu_free_blocks)``; ``pressure = 1 -
gpu_free_blocks / gpu_total_blocks`` and ``horizon = max_horizon_s * (1 - pressure)``
(what is worth pinning shrinks as memory fills). GPU candidates are taken in
ascending (score, session id) order (lowest first; ties by id); for each:

1. finished: DISCARD (nothing will reuse its private blocks; shared ones stay);
2. while ``deficit > 0``: SWAP when ``host room`` (below) is worth its cost, else
   RELEASE it to the engine's LRU (unpinned: its blocks are freed tail first and
   only as many as the engine needs, a lazy discard that keeps the prefix). The
   deficit drops by the blocks it frees (``reclaimable``, default ``b``);
3. else, if ``D > horizon``: SWAP when ``can_swap(b, host_free)`` and no call waits
   (``queued_calls == 0``: the transfer then costs no one any time); PRESERVE with
   ``ttl = min_ttl_s`` when swapping pays (``swap_pays``) but calls wait (the
   offload is deferred to an idle moment instead of delaying the queue; re-scored
   at the TTL); else PRESERVE as in rule 4 (no host room: it stays pinned, so that a
   deficit evicts it in score order rather than the LRU in recency order);
4. else PRESERVE with ``ttl = clamp(ttl_factor * D, min_ttl_s, max_ttl_s)``,
   re-scored when it ends.

**Host room under a deficit** for a candidate of ``b`` blocks. Releasing it loses,
in expectation, the recompute of its whole context, ``loss = p *
recompute_ms(b * block_size)`` (``release_loss_ms``): under a sustained deficit the
engine's LRU keeps evicting a released context's blocks, tail first, until it
returns (in the benchmark, charging only the tail the deficit needs now made
``ours`` release too often and recompute more). Swapping costs the round trip
``2 * swap_ms(b)``. With ``budget = loss - 2 * swap_ms(b)``: no SWAP unless
``swap_pays(b)`` and ``budget > 0``; if ``b <= host_free``, SWAP. Otherwise host
residents are displaced (DISCARDed, their decisions emitted before the candidate's
SWAP, in order) in ascending (host score, session id) order, only those whose host
score is below the candidate's, each charging its expected recompute ``p_r *
(recompute_ms(h_r * block_size) - swap_ms(h_r))`` to the budget, until their ``h_r``
host blocks make room; if the budget runs out first, or they cannot make room,
nobody is displaced and the candidate is RELEASEd. Each resident is discarded at
most once per call. This is Belady on the host tier, weighted by size and cost: a
context that returns soon displaces one that returns late only when that saves
recompute.

Rule 2 is ``CachePolicy.evict``, the one eviction rule under pressure: ``decide`` applies
it under a deficit, and ``CacheManager`` to each session its pressure evictions take (its
host residents: the sessions it swapped out).

**Prefetch** (host residents back to GPU before their call, so that the call does not
pay the swap-in). The *lead* of ``h`` host blocks is ``lead_s(h) = swap_ms(h) / 1000 +
prefetch_margin_s`` (the transfer itself plus a margin for the error of ``D``; default
1 s). After the GPU candidates, and only when ``deficit == 0`` and no call waits
(``queued_calls == 0``, the rule that defers offloads: the transfer then delays no
one), host residents not displaced by this call are taken in ascending (``D``, session
id) order; a resident with ``h`` host blocks is PREFETCHed when

- ``D <= lead_s(h)`` (its call is about to come), and
- the GPU keeps room for it: ``room = gpu_free_blocks - needed_blocks - (blocks
  prefetched before it in this call) >= h``, and
- it would then be kept: ``D <= max_horizon_s * (room - h) / gpu_total_blocks`` (the
  horizon at the pressure after the prefetch; otherwise rule 3 would swap it straight
  back out: no ping-pong).

A PREFETCH carries ``ttl = clamp(ttl_factor * D, min_ttl_s, max_ttl_s)`` (rule 4's TTL):
the session is then held on GPU (pinned) like a PRESERVE and re-scored when it ends.
Blocks freed by this call's own SWAP/DISCARD decisions are not counted as room (they
move only once the decisions are carried out).

**Re-look time of a SWAP.** Every SWAP decision of an unfinished session with a finite
``D`` carries ``ttl_s = relook_s(b, D) = max(0, D - lead_s(b) + prefetch_margin_s / 2)``:
when to decide about it again (then as a host resident, for a prefetch), aimed at the
middle of the lead window so that a prediction that holds finds ``D`` within the lead.
``None`` when ``D`` is infinite. A re-look that does not prefetch asks for the next one
at ``relook_s(h, D)`` of that moment only while ``D > lead_s(h)`` (then at least half a
margin later: ``D`` of a call that is late can stop shrinking); within the lead, only
an idle engine or a new event looks again.

**One session** (``decide_session``): what ``decide`` would decide for that view
alone when nothing is needed (``needed_blocks`` is ignored for a GPU candidate; no
resident is ever displaced without a deficit): rules 1, 3 and 4 with the memory given
for a GPU candidate, the prefetch rule for a host resident (whose room leaves
``needed_blocks`` free: a manager passes its headroom); None when the view is neither or
nothing is to be done. ``decide_session(v, ...) == (decide([v], ...) or [None])[0]``
whenever ``needed_blocks <= gpu_free_blocks``. It is O(1), for per-event managers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from schemas.events import CacheAction, CacheDecisionMade, SessionId
from services.cache.latency import ToolLatencyModel
from services.cache.view import Phase, SessionView
from services.engine.cost import CostModel

__all__ = [
    "CacheDecision",
    "CachePolicy",
    "Delays",
    "HostResident",
    "ListedResidents",
    "MemoryState",
    "PolicyConfig",
    "RankedResidents",
]

_MS_PER_S = 1000.0
_BYTES_PER_GB = 1e9
_BOUND_MARGIN = 1e-6


@dataclass(frozen=True, slots=True)
class MemoryState:
    """The engine's memory and queue as measured now.

    ``gpu_free_blocks``: free or evictable GPU blocks; ``needed_blocks``: what the
    engine needs free now (0 when nothing waits). ``reclaimable``: per session, the
    GPU blocks that evicting it would free (its pinned blocks); None means all of a
    session's ``gpu_blocks``. ``queued_calls``: LLM calls waiting for the engine (an
    offload's transfer would delay them); on a continuous-batching engine, where a
    transfer stalls every running call, count the running calls too.
    """

    gpu_total_blocks: int
    gpu_free_blocks: int
    host_free_blocks: int = 0
    needed_blocks: int = 0
    reclaimable: Mapping[SessionId, int] | None = None
    queued_calls: int = 0

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
    prefetch_margin_s: float = 1.0


@dataclass(frozen=True, slots=True)
class CacheDecision:
    """One decision for one session's KV cache."""

    session_id: SessionId
    action: CacheAction
    score: float
    next_reference_s: float  # math.inf when the session will not return
    num_blocks: int
    # PRESERVE, PREFETCH: the hold's TTL; SWAP: when to look again (prefetch); a RELEASE of the manager's
    # on ranked pins (``CacheManager``'s loose hold): when it decides again
    ttl_s: float | None = None
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
class HostResident:
    """A host resident considered for eviction from the host tier."""

    host_score: float
    session_id: SessionId
    view: SessionView
    evicted: bool = False


class RankedResidents(Protocol):
    """Host residents in ascending (host score, session id) order, as far as one asks."""

    def below(self, host_score: float) -> Iterable[HostResident]:
        """The residents whose host score is below ``host_score``, in that order (from the first,
        at every call)."""
        ...


@dataclass(slots=True)
class ListedResidents:
    """``RankedResidents`` listed in full (``CachePolicy.host_residents``). It holds its list
    rather than being one: mypyc compiles no subclass of ``list`` (``services.cache``)."""

    residents: list[HostResident]

    def __iter__(self) -> Iterator[HostResident]:
        return iter(self.residents)

    def below(self, host_score: float) -> Iterable[HostResident]:
        return itertools.takewhile(lambda r: r.host_score < host_score, self.residents)


@dataclass(slots=True)
class CachePolicy:
    """Scores sessions and decides (see the module docstring for the formulas)."""

    cost: CostModel = field(default_factory=CostModel)
    latency: ToolLatencyModel = field(default_factory=ToolLatencyModel)
    config: PolicyConfig = field(default_factory=PolicyConfig)

    # -------------------------------------------------------------- estimates

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

    def next_reference_bound_s(
        self, phase: Phase, tool: str, started: bool, waited_lo_s: float, waited_hi_s: float, delays: Delays
    ) -> float:
        """An upper bound of ``next_reference_s`` over the views in ``phase`` (TOOL or HUMAN) waiting
        on ``tool`` whose wait lies in ``[waited_lo_s, waited_hi_s]``: since the tool started when
        ``started``, since its proposal otherwise (verdict pending). The host residents' index
        prunes with it (``services.cache.residents``); it follows ``next_reference_s`` term by term."""
        if started:
            remaining = self.latency.mean_residual_life_bound(tool, waited_lo_s, waited_hi_s)
        else:
            remaining = max(0.0, delays.verdict_s - waited_lo_s) + self.latency.mean(tool)
        return self.distance_from_remaining_s(phase, remaining, delays)

    def distance_from_remaining_s(self, phase: Phase, remaining_s: float, delays: Delays) -> float:
        """``next_reference_s`` of a view in ``phase`` (TOOL or HUMAN) whose tool has ``remaining_s``
        left (or a bound of both: the function is monotone in ``remaining_s``)."""
        if phase is Phase.HUMAN:
            remaining_s = max(self.config.human_min_s, remaining_s)
        return remaining_s + delays.queue_s

    def return_probability(self, view: SessionView) -> float:
        if view.phase is Phase.FINISHED:
            return 0.0
        if view.phase is Phase.HUMAN:
            return self.config.human_return_probability
        return 1.0

    def swap_round_trip_ms(self, num_blocks: int) -> float:
        """Swapping ``num_blocks`` out now and back in on return."""
        return 2.0 * self.cost.swap_ms(num_blocks)

    def swap_pays(self, num_blocks: int) -> bool:
        """The swap round trip is cheaper than recomputing the blocks."""
        return num_blocks > 0 and self.swap_round_trip_ms(num_blocks) < self.cost.recompute_ms(
            num_blocks * self.cost.block_size
        )

    def can_swap(self, num_blocks: int, host_free_blocks: int) -> bool:
        return 0 < num_blocks <= host_free_blocks and self.swap_pays(num_blocks)

    def reload_ms(self, num_blocks: int, host_free_blocks: int) -> float:
        if self.can_swap(num_blocks, host_free_blocks):
            return self.swap_round_trip_ms(num_blocks)
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

    def host_score(self, view: SessionView, num_blocks: int, now: float, delays: Delays = Delays()) -> float:
        """Benefit per byte-second of host memory of keeping ``num_blocks`` of the view on the host."""
        distance = self.next_reference_s(view, now, delays)
        p = self.return_probability(view)
        if p == 0.0 or math.isinf(distance) or num_blocks <= 0:
            return 0.0
        saved = self.cost.recompute_ms(num_blocks * self.cost.block_size) - self.cost.swap_ms(num_blocks)
        gigabytes = num_blocks * self.cost.block_bytes / _BYTES_PER_GB
        return p * saved / (gigabytes * max(distance, self.config.min_distance_s))

    def host_value(self, view: SessionView, num_blocks: int) -> float:
        """``host_score`` without its distance: ``p * saved / gigabytes``, which does not change
        with time (``host_score = host_value / max(D, min_distance_s)``, up to rounding)."""
        p = self.return_probability(view)
        if p == 0.0 or num_blocks <= 0:
            return 0.0
        saved = self.cost.recompute_ms(num_blocks * self.cost.block_size) - self.cost.swap_ms(num_blocks)
        return p * saved / (num_blocks * self.cost.block_bytes / _BYTES_PER_GB)

    def host_score_lower_bound(self, value: float, distance_bound_s: float) -> float:
        """A lower bound of ``host_score`` for views whose ``host_value`` is at least ``value`` and
        whose distance is at most ``distance_bound_s``, with a margin for rounding (a relative
        1e-6, far above the 1e-15 by which the two ways of computing a score can differ)."""
        if value >= 0.0:
            return value / max(distance_bound_s, self.config.min_distance_s) * (1.0 - _BOUND_MARGIN)
        return value / self.config.min_distance_s * (1.0 + _BOUND_MARGIN)  # a loss: the nearer, the lower

    # -------------------------------------------------------------- decisions

    def decide_session(
        self, view: SessionView, now: float, memory: MemoryState, delays: Delays = Delays()
    ) -> CacheDecision | None:
        """The decision ``decide([view])`` makes when nothing is needed (see the module docstring)."""
        if _is_host_resident(view):
            return self._prefetch(view, now, memory, 0, delays)
        if not _is_gpu_candidate(view):
            return None
        score = self.score(view, now, memory.host_free_blocks, delays)
        made, _ = self._no_deficit(view, score, now, memory, memory.host_free_blocks, delays)
        return made[0]

    def decide(
        self, views: Iterable[SessionView], now: float, memory: MemoryState, delays: Delays = Delays()
    ) -> list[CacheDecision]:
        """Decisions for every GPU candidate, lowest score first (see the module docstring)."""
        host_free = memory.host_free_blocks
        views = list(views)
        scored = sorted((self.score(v, now, host_free, delays), v.session_id, v) for v in views if _is_gpu_candidate(v))
        residents = self.host_residents(views, now, delays)
        deficit = max(0, memory.needed_blocks - memory.gpu_free_blocks)
        decisions: list[CacheDecision] = []
        for score, sid, view in scored:
            freed = view.gpu_blocks if memory.reclaimable is None else memory.reclaimable.get(sid, 0)
            if view.phase is not Phase.FINISHED and deficit > 0:
                made = self.evict(view, score, now, host_free, delays, residents)
                decisions.extend(made)
                host_free += sum(d.num_blocks for d in made[:-1])
                if made[-1].action is CacheAction.SWAP:
                    host_free -= view.gpu_blocks
                deficit -= freed
                continue
            made, host_free = self._no_deficit(view, score, now, memory, host_free, delays)
            decisions.extend(made)
            if view.phase is Phase.FINISHED:
                deficit -= freed
        if memory.needed_blocks <= memory.gpu_free_blocks:  # no deficit to begin with
            decisions.extend(self._prefetches(residents, now, memory, delays))
        return decisions

    def lead_s(self, num_blocks: int) -> float:
        """How long before its next call a host resident is prefetched: the transfer plus a margin."""
        return self.cost.swap_ms(num_blocks) / _MS_PER_S + self.config.prefetch_margin_s

    def relook_s(self, num_blocks: int, distance: float) -> float | None:
        """When to look again at a session swapped out now (``D`` before its call): in the middle
        of its lead window (module docstring)."""
        if math.isinf(distance):
            return None
        return max(0.0, distance - self.lead_s(num_blocks) + self.config.prefetch_margin_s / 2)

    def _prefetches(
        self, residents: Iterable[HostResident], now: float, memory: MemoryState, delays: Delays
    ) -> list[CacheDecision]:
        """The prefetch rule over the residents not displaced, soonest first (module docstring)."""
        if memory.queued_calls > 0:
            return []
        order = sorted(
            ((self.next_reference_s(r.view, now, delays), r.session_id, r.view) for r in residents if not r.evicted),
            key=lambda e: (e[0], e[1]),
        )
        out: list[CacheDecision] = []
        taken = 0
        for _, _, view in order:
            decision = self._prefetch(view, now, memory, taken, delays)
            if decision is not None:
                out.append(decision)
                taken += decision.num_blocks
        return out

    def _prefetch(
        self, view: SessionView, now: float, memory: MemoryState, taken: int, delays: Delays
    ) -> CacheDecision | None:
        """PREFETCH for one host resident when its call is within the lead, the GPU has room
        (``taken`` blocks already prefetched) and it would be kept there; else None."""
        c = self.config
        h = view.host_blocks
        if memory.queued_calls > 0 or h <= 0:
            return None
        distance = self.next_reference_s(view, now, delays)
        lead = self.lead_s(h)
        room = memory.gpu_free_blocks - memory.needed_blocks - taken
        if distance > lead or room < h or memory.gpu_total_blocks <= 0:
            return None
        horizon_after = c.max_horizon_s * (room - h) / memory.gpu_total_blocks
        if distance > horizon_after:
            return None
        ttl = min(c.max_ttl_s, max(c.min_ttl_s, c.ttl_factor * distance))
        reason = f"next reference {distance:.3g}s within the prefetch lead {lead:.3g}s; {room} blocks free"
        score = self.host_score(view, h, now, delays)
        return CacheDecision(view.session_id, CacheAction.PREFETCH, score, distance, h, ttl_s=ttl, reason=reason)

    def _no_deficit(
        self,
        view: SessionView,
        score: float,
        now: float,
        memory: MemoryState,
        host_free: int,
        delays: Delays,
    ) -> tuple[list[CacheDecision], int]:
        """Rules 1, 3 and 4 for one GPU candidate: its decision and the host room left."""
        c = self.config
        sid, blocks = view.session_id, view.gpu_blocks
        distance = self.next_reference_s(view, now, delays)
        if view.phase is Phase.FINISHED:
            return [CacheDecision(sid, CacheAction.DISCARD, score, distance, blocks, reason="finished")], host_free
        horizon = c.max_horizon_s * (1.0 - memory.pressure)
        if distance <= horizon:
            ttl = min(c.max_ttl_s, max(c.min_ttl_s, c.ttl_factor * distance))
            return [
                CacheDecision(sid, CacheAction.PRESERVE, score, distance, blocks, ttl_s=ttl, reason="worth keeping")
            ], host_free
        beyond = f"next reference {distance:.3g}s beyond horizon {horizon:.3g}s"
        if memory.queued_calls > 0 and self.swap_pays(blocks):
            reason = f"{beyond}; offload deferred: {memory.queued_calls} calls wait"
            return [
                CacheDecision(sid, CacheAction.PRESERVE, score, distance, blocks, ttl_s=c.min_ttl_s, reason=reason)
            ], host_free
        if not self.can_swap(blocks, host_free):
            ttl = min(c.max_ttl_s, max(c.min_ttl_s, c.ttl_factor * distance))
            reason = f"{beyond}; no host room: kept until needed"
            return [
                CacheDecision(sid, CacheAction.PRESERVE, score, distance, blocks, ttl_s=ttl, reason=reason)
            ], host_free
        relook = self.relook_s(blocks, distance)
        return [CacheDecision(sid, CacheAction.SWAP, score, distance, blocks, relook, beyond)], host_free - blocks

    def evict(
        self,
        view: SessionView,
        score: float,
        now: float,
        host_free: int,
        delays: Delays,
        residents: RankedResidents | Callable[[], RankedResidents],
    ) -> list[CacheDecision]:
        """Rule 2, the one eviction rule under memory pressure (``decide`` under a deficit and
        ``CacheManager``'s pressure evictions): the view's SWAP when host room is worth its cost
        (``swap_room``), preceded by the DISCARDs of the host residents it displaces, else its
        RELEASE. ``residents``: the host residents in ascending (host score, session id) order
        (``host_residents``), or a function that gives them, called only when the host lacks
        room; they are iterated from the first for each call, and only as far as the rule reads
        (``CacheManager`` passes a search that scores no more than that:
        ``services.cache.residents``); a resident displaced is marked and not displaced again."""
        return self.evictions(view, score, now, delays, self.swap_room(view, now, host_free, delays, residents))

    def swap_room(
        self,
        view: SessionView,
        now: float,
        host_free: int,
        delays: Delays,
        residents: RankedResidents | Callable[[], RankedResidents],
    ) -> list[CacheDecision] | None:
        """Rule 2's question, asked first: None when the view is released (swapping it out does not
        beat losing its context), else the DISCARDs of the host residents its SWAP displaces (maybe
        none; those residents are marked). ``evictions`` makes the decisions from the answer; a
        caller that would keep a released view (``CacheManager`` on ranked pins) asks only this."""
        blocks = view.gpu_blocks
        budget = self.release_loss_ms(view) - self.swap_round_trip_ms(blocks)
        if not self.swap_pays(blocks) or budget <= 0:
            return None
        if blocks <= host_free:
            return []
        mine = self.host_score(view, blocks, now, delays)
        chosen: list[HostResident] = []
        room = host_free
        for resident in (residents() if callable(residents) else residents).below(mine):
            if resident.evicted:
                continue
            h = resident.view.host_blocks
            budget -= self.return_probability(resident.view) * (
                self.cost.recompute_ms(h * self.cost.block_size) - self.cost.swap_ms(h)
            )
            if budget <= 0:
                return None
            chosen.append(resident)
            room += h
            if room >= blocks:
                break  # before asking for the next resident: finding it is a search
        if room < blocks:
            return None
        out: list[CacheDecision] = []
        for resident in chosen:
            resident.evicted = True
            r = resident.view
            distance = self.next_reference_s(r, now, delays)
            reason = f"host room for {view.session_id} (host score {resident.host_score:.3g} < {mine:.3g})"
            out.append(
                CacheDecision(
                    r.session_id, CacheAction.DISCARD, resident.host_score, distance, r.host_blocks, reason=reason
                )
            )
        return out

    def evictions(
        self, view: SessionView, score: float, now: float, delays: Delays, room: list[CacheDecision] | None
    ) -> list[CacheDecision]:
        """Rule 2's decisions for the view from ``swap_room``'s answer ``room``."""
        distance = self.next_reference_s(view, now, delays)
        if room is None:
            release = CacheDecision(
                view.session_id, CacheAction.RELEASE, score, distance, view.gpu_blocks, None,
                "memory pressure: no host room or recompute is cheaper",
            )  # fmt: skip
            return [release]
        swap = CacheDecision(
            view.session_id, CacheAction.SWAP, score, distance, view.gpu_blocks,
            self.relook_s(view.gpu_blocks, distance), "memory pressure: swap-in is cheaper than recompute",
        )  # fmt: skip
        return [*room, swap]

    def host_residents(self, views: Iterable[SessionView], now: float, delays: Delays) -> ListedResidents:
        """The host residents among ``views`` in ascending (host score, session id) order."""
        return ListedResidents(sorted(
            (HostResident(self.host_score(v, v.host_blocks, now, delays), v.session_id, v) for v in views
             if _is_host_resident(v)),
            key=lambda r: (r.host_score, r.session_id),
        ))  # fmt: skip

    def release_loss_ms(self, view: SessionView) -> float:
        """Expected cost of releasing the view's GPU blocks to the LRU under pressure: its whole
        context recomputed on return (see the module docstring)."""
        return self.return_probability(view) * self.cost.recompute_ms(view.gpu_blocks * self.cost.block_size)


def _is_gpu_candidate(view: SessionView) -> bool:
    if view.phase is Phase.LLM:
        return False
    return view.gpu_blocks > 0 or (view.phase is Phase.FINISHED and view.host_blocks > 0)


def _is_host_resident(view: SessionView) -> bool:
    return view.phase not in (Phase.LLM, Phase.FINISHED) and view.gpu_blocks <= 0 and view.host_blocks > 0
