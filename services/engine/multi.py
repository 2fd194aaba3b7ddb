"""Several engines on one event clock, a router in front: the multi-engine model of ``bench/routing.py``.

``MultiSim`` drives N ``BatchSim`` engines (the shipped continuous-batching model, unchanged:
each with its own GPU and host blocks, cost model and cache manager instance) through one
clock. Each engine keeps its own event heap; the driver keeps the sessions' readiness (arrivals
and tool ends) and always handles the earliest event of all heaps next (its own first on a tie,
so a call routed at ``t`` joins its engine's queue before that engine schedules at ``t``).

When a session's call is ready the driver extends its context (``extend_context``: the
sessions are shared by every engine, since a session's context is the same wherever it runs),
reads how much of the prompt each engine holds (``PagedKVCache.num_prefix_blocks``, GPU or host:
what the real router learns from each engine's ``kv.events``), and asks the router
(``services.routing``) for the engine; the call then joins that engine's queue (its ``enqueue``
event) and runs there like any call of a single engine. ``queued_tokens`` is what the router's
caller counts, as the planner does (``workers/planner.py``, ``EnginePool.begin``): the prompt tokens
the router expected each call in flight there to compute (``Route.expected_recompute_tokens``),
until the call is answered. (``queue="prompt"`` counts whole prompts instead, for comparison.)

Where the recomputed prompt tokens come from (``MultiMetrics.recompute_*``), split at each routing
from what every engine holds then, so that a router's recompute can be read, not guessed:

- ``first``: a session's first call, the part no engine holds (a shared system prompt can be held);
- ``new``: a later call's tokens no engine ever computed (the tool's result, the turn's prompt, the
  last block of the previous call): no router can avoid these; with ``first`` they are the floor;
- ``lost``: computed by an earlier call but held by no engine when the call is routed (evicted
  under pressure, released, discarded or dropped from the host by a cache manager);
- ``elsewhere``: held by another engine more than by the chosen one (the router's choice: a move,
  or round robin's blindness);
- ``after_routing`` (the rest): evicted from the chosen engine while the call waited, and
  recomputed after a preemption.

Moving a session: when its call goes to another engine than its previous one, the previous
engine's manager is told (``SimManager.on_leave``) and discards what that engine holds of it,
as the shipped per-engine managers do (``services.cache.engines.EngineCacheManagers``: the
engine a session left folds the move as the session's end there and DISCARDs its stale copy;
``bench/ours.py`` folds the same ``SessionFinished``). So a router that moves a session back
finds nothing of it there: until this followed the shipped managers, the old engine only
released its pin and kept the blocks in its LRU, which credited round robin with prefixes the
stack throws away. A finished session's last engine's manager discards it as on one engine.

Model size (optional, ``size_policy``): each call's size is chosen by ``choose_size`` from what
the run has learned so far (``SizeStats``, fed as calls end); a call served by a small engine on
a step it is not good at fails with a seeded probability (``SmallModelSkill``): its output is
dropped (the context rewound to the prompt) and the same call is retried at once on a large
engine. The small engine's manager is not told about a failed call's end (it sees the call's KV
events only), as a real small engine's failure is a completed call the planner rejects.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from schemas.events import SessionId
from services.engine.batching import MAX_NUM_SEQS, BatchSim
from services.engine.cost import CostModel
from services.engine.serial import Metrics, Sess, SimManager, extend_context
from services.routing import CallRequest, EngineInfo, Router, SizeStats, choose_size
from services.traces.model import Trace

__all__ = ["QUEUE_COUNTS", "EngineSpec", "MultiMetrics", "MultiSim", "SmallModelSkill", "step_of"]

QUEUE_COUNTS = ("recompute", "prompt")  # what ``queued_tokens`` counts per call in flight (the module docstring)

_MS = 1000.0


@dataclass(frozen=True)
class EngineSpec:
    """One engine of the stack: its id, model size, blocks, cost model and (fresh) cache manager."""

    engine_id: str
    manager: SimManager
    gpu_blocks: int
    host_blocks: int
    cost: CostModel
    size: str = "large"
    max_num_seqs: int = MAX_NUM_SEQS


@dataclass(frozen=True)
class SmallModelSkill:
    """Which steps a small model fails, deterministically from a seed: a step (``step_of``) is *hard*
    for it with probability ``hard_share``; a small call on a hard step fails with ``fail_hard``, on
    an easy one with ``fail_easy``. Draws are a hash of (seed, session, turn), not a shared RNG, so
    a call's fate does not depend on the order calls are served in."""

    seed: int = 0
    hard_share: float = 0.5
    fail_hard: float = 0.7
    fail_easy: float = 0.02

    def _u(self, *parts: object) -> float:
        digest = hashlib.sha256(":".join(str(p) for p in (self.seed, *parts)).encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    def is_hard(self, step: str) -> bool:
        return self._u("step", step) < self.hard_share

    def fails(self, sid: str, turn: int, step: str) -> bool:
        p = self.fail_hard if self.is_hard(step) else self.fail_easy
        return self._u("call", sid, turn) < p


@dataclass
class SizePolicy:
    """The model-size choice in the model: the program's name (one per workload), what the run learns."""

    program: str
    skill: SmallModelSkill
    stats: SizeStats = field(default_factory=SizeStats)


def step_of(s: Sess) -> str:
    """The step a call is: the tool its answer calls (``final`` for the last turn), as a program's step."""
    return s.trace.turns[s.turn].tool or "final"


@dataclass
class MultiMetrics:
    """The engines' metrics and the driver's counts."""

    per_engine: dict[str, Metrics]
    calls_by_engine: dict[str, int]
    calls: int = 0  # calls routed, retries included
    retries: int = 0  # small-model calls that failed and were served again by a large engine
    small_calls: int = 0  # calls served by a small engine (failed ones included)
    moves: int = 0  # calls routed to another engine than the session's previous call
    reasons: dict[str, int] = field(default_factory=dict)
    failed_computed_tokens: int = 0  # prompt tokens prefilled by calls that failed
    recompute_first: int = 0  # see the module docstring: where the recomputed tokens come from
    recompute_new: int = 0
    recompute_lost: int = 0
    recompute_elsewhere: int = 0

    @property
    def jct(self) -> list[float]:
        return [x for m in self.per_engine.values() for x in m.jct]

    @property
    def computed_tokens(self) -> int:
        return sum(m.computed_tokens for m in self.per_engine.values())

    @property
    def prompt_tokens(self) -> int:
        return sum(m.prompt_tokens for m in self.per_engine.values())

    @property
    def recompute_after_routing(self) -> int:
        """Recomputed but held by the chosen engine when routed: evicted there while queued, or preempted."""
        routed = self.recompute_first + self.recompute_new + self.recompute_lost + self.recompute_elsewhere
        return self.computed_tokens - routed

    @property
    def recompute_floor(self) -> int:
        """What no router can avoid: first calls' tokens nobody held, and tokens never computed before."""
        return self.recompute_first + self.recompute_new


class _Engine(BatchSim):
    """A ``BatchSim`` whose sessions' readiness goes to the driver, and whose calls' ends the driver sees."""

    def __init__(self, driver: MultiSim, spec: EngineSpec, trace: Trace) -> None:
        super().__init__(trace, spec.manager, spec.gpu_blocks, spec.host_blocks, spec.cost, spec.max_num_seqs)
        self.driver = driver
        self.spec = spec

    def push(self, t: float, kind: str, sid: SessionId) -> None:
        if kind == "ready":
            self.driver.push(t, "ready", sid)
            return
        super().push(t, kind, sid)

    def next_event_s(self) -> float:
        """The driver's events count too: a call routed here at that time must not wait for a chunk's end."""
        return min(super().next_event_s(), self.driver.next_event_s())

    def _done(self, s: Sess, t: float) -> None:
        if self.driver.call_ended(self, s, t):
            super()._done(s, t)


class MultiSim:
    """N engines, one clock, a router per call (see the module docstring)."""

    def __init__(self, trace: Trace, engines: Sequence[EngineSpec], router: Router,
                 size_policy: SizePolicy | None = None, queue: str = "recompute") -> None:  # fmt: skip
        if not engines:
            raise ValueError("MultiSim needs at least one engine")
        if queue not in QUEUE_COUNTS:
            raise ValueError(f"queue {queue!r} is not one of {', '.join(QUEUE_COUNTS)}")
        self.queue_count = queue
        if len({e.engine_id for e in engines}) != len(engines):
            raise ValueError("engine ids must be unique")
        if len({e.cost.block_size for e in engines}) != 1:
            raise ValueError("every engine must use the same block size (the sessions' block hashes are shared)")
        self.router = router
        self.size_policy = size_policy
        self.engines = [_Engine(self, spec, trace) for spec in engines]
        self.by_id = {e.spec.engine_id: e for e in self.engines}
        self.sessions = self.engines[0].sessions
        for engine in self.engines[1:]:
            engine.sessions = self.sessions  # one session object wherever its calls run
        self.bs = engines[0].cost.block_size
        self.queued: dict[str, int] = {e.spec.engine_id: 0 for e in self.engines}
        self.where: dict[SessionId, str] = {}  # session -> engine of its current or last call
        self.size_of: dict[SessionId, str] = {}  # session -> size of its current call
        self.retrying: set[SessionId] = set()
        self.in_flight: dict[SessionId, int] = {}  # session -> its call's tokens in ``queued``
        self.computed_upto: dict[SessionId, int] = {}  # session -> tokens of its context some engine computed
        self._events: list[tuple[float, int, str, SessionId]] = []
        self._seq = 0
        self.m = MultiMetrics(
            per_engine={e.spec.engine_id: e.m for e in self.engines},
            calls_by_engine={e.spec.engine_id: 0 for e in self.engines},
        )

    def push(self, t: float, kind: str, sid: SessionId) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, sid))
        self._seq += 1

    def next_event_s(self) -> float:
        return self._events[0][0] if self._events else math.inf

    def run(self) -> MultiMetrics:
        for s in self.sessions.values():
            s.ready_at = s.trace.arrival_s
            self.push(s.trace.arrival_s, "ready", s.sid)
        while True:
            mine = self._events[0][0] if self._events else math.inf
            engine = min(self.engines, key=lambda e: e._events[0][0] if e._events else math.inf)
            theirs = engine._events[0][0] if engine._events else math.inf
            if mine == math.inf and theirs == math.inf:
                break
            if mine <= theirs:
                t, _, kind, sid = heapq.heappop(self._events)
                self._route(self.sessions[sid], t, extend=kind == "ready")
            else:
                engine.process_next()
        for e in self.engines:
            e.finish()
        return self.m

    # ------------------------------------------------------------------ routing

    def engine_infos(self) -> list[EngineInfo]:
        return [
            EngineInfo(
                engine_id=e.spec.engine_id,
                model=f"sim-{e.spec.size}",
                size=e.spec.size,
                queued_tokens=self.queued[e.spec.engine_id],
                prefill_tokens_per_s=_MS / max(e.cost.prefill_ms_per_token, 1e-9),
            )
            for e in self.engines
        ]

    def _route(self, s: Sess, t: float, *, extend: bool) -> None:
        if extend:
            extend_context(s, self.bs)
        retry = s.sid in self.retrying
        size = "large"
        if self.size_policy is not None:
            p = self.size_policy
            sizes = {e.spec.size for e in self.engines}
            size = choose_size(p.program, step_of(s), declared=None, pinned=None, stats=p.stats, retry=retry,
                               available=sizes).size  # fmt: skip
        n_prompt = len(s.tokens)
        hashes = s.hashes[: n_prompt // self.bs]
        cached = {e.spec.engine_id: e.cache.num_prefix_blocks(hashes) * self.bs for e in self.engines}
        route = self.router.route(CallRequest(s.sid, n_prompt, cached, size=size), self.engine_infos())
        engine = self.by_id[route.engine_id]
        previous = self.where.get(s.sid)
        if previous is not None and previous != route.engine_id:
            self.m.moves += 1
            self.by_id[previous].manager.on_leave(s, t, route.engine_id)
        self.where[s.sid] = route.engine_id
        self.size_of[s.sid] = engine.spec.size
        self._split_recompute(s, cached, route.engine_id)
        counted = route.expected_recompute_tokens if self.queue_count == "recompute" else n_prompt
        self.queued[route.engine_id] += counted
        self.in_flight[s.sid] = counted
        self.m.calls += 1
        self.m.calls_by_engine[route.engine_id] += 1
        self.m.reasons[route.reason] = self.m.reasons.get(route.reason, 0) + 1
        if engine.spec.size == "small":
            self.m.small_calls += 1
        engine.push(t, "enqueue", s.sid)

    def _split_recompute(self, s: Sess, cached: dict[str, int], chosen: str) -> None:
        """Split the chosen engine's expected recompute by where it comes from (the module docstring)."""
        n_prompt, held = len(s.tokens), max(cached.values())
        if s.sid not in self.computed_upto:
            self.m.recompute_first += n_prompt - held
        else:
            before = min(self.computed_upto[s.sid], n_prompt)
            self.m.recompute_new += n_prompt - max(before, held)
            self.m.recompute_lost += max(before - held, 0)
        self.m.recompute_elsewhere += held - cached[chosen]

    def call_ended(self, engine: _Engine, s: Sess, t: float) -> bool:
        """A call of ``s`` ended on ``engine``: False when it failed (it is retried, the engine's ``_done``
        must not run), True otherwise."""
        turn = s.trace.turns[s.turn]
        self.queued[engine.spec.engine_id] -= self.in_flight.pop(s.sid)
        # Full blocks of its context now computed (the last token, sampled, has no KV yet).
        self.computed_upto[s.sid] = (len(s.tokens) - 1) // self.bs * self.bs
        retried = s.sid in self.retrying
        self.retrying.discard(s.sid)
        if self.size_policy is not None:
            p = self.size_policy
            failed = engine.spec.size == "small" and p.skill.fails(s.sid, s.turn, step_of(s))
            if not retried:
                p.stats.record(p.program, step_of(s), engine.spec.size, retried=failed)
            if failed:
                self.m.retries += 1
                self.m.failed_computed_tokens += s.call_computed_tokens
                del s.tokens[len(s.tokens) - turn.output_tokens :]  # its answer is dropped
                del s.hashes[len(s.tokens) // self.bs :]
                self.computed_upto[s.sid] = min(self.computed_upto[s.sid], len(s.hashes) * self.bs)
                engine.manager.on_expire([], t)  # its KV events, nothing more (see the module docstring)
                self.retrying.add(s.sid)
                self.push(t, "retry", s.sid)
                return False
        if turn.tool is None:  # its last call: copies elsewhere are no one's now
            for other in self.engines:
                if other is not engine:
                    other.cache.release(s.sid)
        return True
