"""Routing LLM calls across several engines: which engine serves a call, and which model size.

Two pure decisions, each returned with its reason so that the caller can record it in the log:

- **Which engine** (``Router.route``): given the call (its prompt, how much of its prefix each
  engine holds) and the engines (health, size, queue), return a ``Route``. Three routers:
  ``round_robin`` and ``least_loaded`` (the baselines, blind to the cache) and ``locality``
  (agentlog's: minimise queue wait plus recompute time, so a session goes back to the engine
  holding its KV unless that engine's queue makes recomputing elsewhere faster).
- **Which model size** (``choose_size``): per step of a program, small or large, from an
  operator's pin, the program's declaration, and what the log has learned (``SizeStats``: how
  often the small model completed that step without a retry). Like a voter's vote, the choice
  carries its reason in words.

Rules every router keeps (``candidates``):

- an unhealthy engine is never chosen;
- only engines of the call's size are candidates; when that size has no healthy engine the call
  falls back to the other size (reason ``failover``) rather than fail;
- no healthy engine at all is a ``ValueError`` that says so.

Time is measured in seconds of prefill: an engine's queue wait is its queued prompt tokens over
its prefill rate, a recompute is the prompt tokens it does not hold over the same rate. The
module has no clock, no I/O and no randomness: the same inputs give the same route, and ties are
broken by ``engine_id``. ``RoundRobin`` keeps one counter (its position), nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "ROUTERS",
    "SIZES",
    "CallRequest",
    "EngineInfo",
    "LeastLoaded",
    "Locality",
    "RoundRobin",
    "Route",
    "Router",
    "SizeChoice",
    "SizeStats",
    "candidates",
    "choose_size",
    "make_router",
]

SIZES = ("small", "large")


@dataclass(frozen=True)
class EngineInfo:
    """One engine as the router sees it when a call is routed."""

    engine_id: str
    model: str
    """The model name the engine serves."""
    size: str = "large"
    """``small`` or ``large``."""
    healthy: bool = True
    queued_tokens: int = 0
    """Prompt tokens its calls in flight must compute (the router's caller counts them: each call's
    ``Route.expected_recompute_tokens`` from its routing until it is answered, as the planner does).
    A call's cached prefix costs no prefill, so counting whole prompts would make an engine that
    serves its sessions from cache look busier the better it does, and push them off it."""
    prefill_tokens_per_s: float = 1.0

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"engine {self.engine_id!r}: size {self.size!r} is not one of {', '.join(SIZES)}")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"engine {self.engine_id!r}: prefill_tokens_per_s must be > 0")

    @property
    def queue_wait_s(self) -> float:
        """How long a call sent now waits behind the prompts already queued on this engine."""
        return max(self.queued_tokens, 0) / self.prefill_tokens_per_s


@dataclass(frozen=True)
class CallRequest:
    """One LLM call to route."""

    session_id: str
    prompt_tokens: int
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    """engine_id -> tokens of this prompt's prefix that engine holds."""
    parent_session_id: str | None = None
    """Set for a fork's call: the caller fills ``cached_tokens`` from the parent's location."""
    size: str = "large"
    """The model size chosen for this call (``choose_size``)."""

    def cached_on(self, engine_id: str) -> int:
        """Tokens of the prompt held by ``engine_id``, clamped to the prompt (a stale count cannot exceed it)."""
        return min(max(self.cached_tokens.get(engine_id, 0), 0), max(self.prompt_tokens, 0))


@dataclass(frozen=True)
class Route:
    """Where a call goes and why."""

    engine_id: str
    reason: str
    """``only`` | ``round_robin`` | ``least_loaded`` | ``locality`` | ``load`` (locality overridden by the
    holder's queue) | ``failover`` (the call's size or the prefix's holder had no healthy engine)."""
    expected_recompute_tokens: int
    """Prompt tokens the chosen engine does not hold and must prefill."""
    detail: str = ""
    """The reason in words, for the log and ``logctl audit``."""


class Router(Protocol):
    name: str

    def route(self, call: CallRequest, engines: Sequence[EngineInfo]) -> Route: ...


def candidates(call: CallRequest, engines: Sequence[EngineInfo]) -> tuple[list[EngineInfo], str]:
    """The healthy engines of the call's size sorted by ``engine_id``, and a note when the size fell back.

    The note is empty when the call's own size has a healthy engine; otherwise the candidates are
    the healthy engines of the other size and the note says so. ``ValueError`` when there are no
    engines, two share an id, or none is healthy.
    """
    if not engines:
        raise ValueError(f"no engine to route session {call.session_id!r} to: the stack has no engines")
    ids = [e.engine_id for e in engines]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"engine ids must be unique, got {', '.join(dup)} more than once")
    healthy = sorted((e for e in engines if e.healthy), key=lambda e: e.engine_id)
    if not healthy:
        raise ValueError(
            f"no healthy engine to route session {call.session_id!r} to "
            f"({len(engines)} engine(s), all unhealthy: {', '.join(sorted(ids))})"
        )
    same = [e for e in healthy if e.size == call.size]
    if same:
        return same, ""
    return healthy, f"no healthy {call.size} engine, fell back to {healthy[0].size}"


def _recompute(call: CallRequest, engine: EngineInfo) -> int:
    return max(call.prompt_tokens, 0) - call.cached_on(engine.engine_id)


def _route(call: CallRequest, engine: EngineInfo, reason: str, fallback: str, detail: str) -> Route:
    if fallback:
        reason, detail = "failover", f"{fallback}; {detail}" if detail else fallback
    return Route(engine.engine_id, reason, _recompute(call, engine), detail)


class RoundRobin:
    """Each call to the next candidate in ``engine_id`` order, blind to cache and load (a baseline).

    The position advances once per routed call, whatever the call; the next candidate is the
    first whose id sorts after the last one chosen, so an engine that drops out or comes back
    does not make the rotation skip or repeat the others.
    """

    name: str = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def route(self, call: CallRequest, engines: Sequence[EngineInfo]) -> Route:
        pool, fallback = candidates(call, engines)
        after = [e for e in pool if self._last is not None and e.engine_id > self._last]
        engine = after[0] if after else pool[0]
        self._last = engine.engine_id
        if len(pool) == 1:
            return _route(call, engine, "only", fallback, "one healthy engine")
        return _route(call, engine, "round_robin", fallback, "")


class LeastLoaded:
    """Each call to the candidate with the shortest queue wait, blind to the cache (a baseline); ties by id."""

    name: str = "least_loaded"

    def route(self, call: CallRequest, engines: Sequence[EngineInfo]) -> Route:
        pool, fallback = candidates(call, engines)
        engine = min(pool, key=lambda e: (e.queue_wait_s, e.engine_id))
        if len(pool) == 1:
            return _route(call, engine, "only", fallback, "one healthy engine")
        return _route(call, engine, "least_loaded", fallback, f"queue wait {engine.queue_wait_s:.3f}s")


@dataclass
class Locality:
    """Send a call where it finishes its prefill soonest: queue wait + recompute time, over the candidates.

    ``cost(e) = queue_wait(e) + (prompt - cached_on(e)) / prefill_rate(e)``. The *holder* is the
    candidate holding the most of the prompt. It is chosen unless its cost exceeds the best other
    candidate's: i.e. unless its queue wait exceeds the recompute time elsewhere plus that engine's
    queue wait (the prompt's uncached suffix costs the same on both with equal rates, so it cancels).

    Anti-thrash: leaving the holder costs more than the moved call's own recompute: the session's
    KV then lives on the new engine, the recompute lands in that engine's queue ahead of other
    calls, and the next call of a loaded system may want to move back. So the holder is left only
    when the other engine is better by ``switch_margin`` (a fraction of the other's cost) and by
    at least ``min_gain_s``; a call holding nothing anywhere just goes to the cheapest candidate.
    Ties by ``engine_id``.

    Reasons: ``locality`` (the holder), ``load`` (a holder existed, its queue sent the call
    elsewhere), ``least_loaded`` (nobody holds any of the prompt), ``only`` (one candidate),
    ``failover`` (the call's size had no healthy engine, or the engine holding the most of the
    prompt is unhealthy).
    """

    switch_margin: float = 0.25
    min_gain_s: float = 0.0
    name: str = field(default="locality", init=False, repr=False)

    def cost_s(self, call: CallRequest, engine: EngineInfo) -> float:
        return engine.queue_wait_s + _recompute(call, engine) / engine.prefill_tokens_per_s

    def route(self, call: CallRequest, engines: Sequence[EngineInfo]) -> Route:
        pool, fallback = candidates(call, engines)
        lost = _lost_holder(call, engines, pool)
        if lost and not fallback:
            fallback = f"{lost} holding its prefix is unhealthy"
        if len(pool) == 1:
            return _route(call, pool[0], "only", fallback, "one healthy engine")
        best = min(pool, key=lambda e: (self.cost_s(call, e), e.engine_id))
        holder = max(pool, key=lambda e: (call.cached_on(e.engine_id), _rev(e.engine_id)))
        held = call.cached_on(holder.engine_id)
        if held == 0:
            return _route(
                call, best, "least_loaded", fallback, f"no engine holds its prefix; cost {self.cost_s(call, best):.3f}s"
            )
        holder_cost, best_cost = self.cost_s(call, holder), self.cost_s(call, best)
        worth_moving = holder_cost > best_cost * (1.0 + self.switch_margin) + self.min_gain_s
        if holder is best or not worth_moving:
            return _route(
                call, holder, "locality", fallback, f"holds {held}/{call.prompt_tokens} tokens; cost {holder_cost:.3f}s"
            )
        return _route(
            call,
            best,
            "load",
            fallback,
            f"{holder.engine_id} holds {held} tokens but costs {holder_cost:.3f}s (queue {holder.queue_wait_s:.3f}s) "
            f"vs {best_cost:.3f}s here",
        )


def _rev(engine_id: str) -> tuple[int, ...]:
    # max() with ties broken by the *smallest* engine_id: negate the code points.
    return tuple(-ord(c) for c in engine_id)


def _lost_holder(call: CallRequest, engines: Sequence[EngineInfo], pool: Sequence[EngineInfo]) -> str:
    """The unhealthy engine holding the most of the prompt, when it holds more than any candidate ('' if none)."""
    down = [e for e in engines if not e.healthy and call.cached_on(e.engine_id) > 0]
    if not down:
        return ""
    top = max(down, key=lambda e: (call.cached_on(e.engine_id), _rev(e.engine_id)))
    if call.cached_on(top.engine_id) > max((call.cached_on(e.engine_id) for e in pool), default=0):
        return top.engine_id
    return ""


ROUTERS: dict[str, Callable[[], Router]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "locality": Locality,
}


def make_router(name: str) -> Router:
    """A fresh router by name; ``ValueError`` naming the known routers for an unknown one."""
    try:
        return ROUTERS[name]()
    except KeyError:
        raise ValueError(f"unknown router {name!r}; known routers: {', '.join(sorted(ROUTERS))}") from None


# -- model size -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeChoice:
    """The model size for one step, with the reason in words (recorded like a vote)."""

    size: str
    reason: str


@dataclass
class SizeStats:
    """Learned from the log: per (program, step), how often each size completed without a retry.

    ``record`` is fed one finished step at a time (the size that served its first attempt, and
    whether it had to be retried); ``choose_size`` reads it. Knobs:

    - ``min_samples``: small-model attempts needed before its record decides;
    - ``min_success``: the share of those it must have completed for the step to stay small;
    - ``explore_trials``: with fewer small attempts than this on a step, and nothing declared,
      the small model is tried (the log cannot learn what it never sees); 0 turns trying off,
      and an unknown step then runs on the large model ("default").
    """

    min_samples: int = 3
    min_success: float = 0.9
    explore_trials: int = 3
    _attempts: dict[tuple[str, str, str], int] = field(default_factory=dict, repr=False)
    _completed: dict[tuple[str, str, str], int] = field(default_factory=dict, repr=False)

    def record(self, program: str, step: str, size: str, retried: bool) -> None:
        if size not in SIZES:
            raise ValueError(f"size {size!r} is not one of {', '.join(SIZES)}")
        key = (program, step, size)
        self._attempts[key] = self._attempts.get(key, 0) + 1
        if not retried:
            self._completed[key] = self._completed.get(key, 0) + 1

    def tally(self, program: str, step: str, size: str = "small") -> tuple[int, int]:
        """(completed without a retry, attempts) of ``size`` on this step."""
        key = (program, step, size)
        return self._completed.get(key, 0), self._attempts.get(key, 0)


def _check_size(what: str, size: str | None) -> None:
    if size is not None and size not in SIZES:
        raise ValueError(f"{what} size {size!r} is not one of {', '.join(SIZES)}")


def choose_size(
    program: str,
    step: str,
    *,
    declared: str | None,
    pinned: str | None,
    stats: SizeStats,
    retry: bool = False,
    available: Collection[str] = SIZES,
) -> SizeChoice:
    """Small or large for one step of a program, first rule that applies wins:

    1. an operator's pin (the operator outranks everything);
    2. a retry after the small model failed goes to the large one (never retry on what failed);
    3. the program's declaration (the author knows the step);
    4. the log's record: small when it completed this step at least ``min_success`` of at least
       ``min_samples`` times; trying small while it has fewer than ``explore_trials`` attempts;
    5. large by default.

    A size with no engine (``available``) is replaced by the other one, and the reason says so.
    """
    _check_size("pinned", pinned)
    _check_size("declared", declared)
    sizes = [s for s in SIZES if s in available]
    if not sizes:
        raise ValueError(f"no model size available for {program}/{step} (available: {sorted(available)})")
    choice = _choose(program, step, declared=declared, pinned=pinned, stats=stats, retry=retry)
    if choice.size in sizes:
        return choice
    other = sizes[0]
    return SizeChoice(other, f"{choice.reason}, but no {choice.size} engine is available: {other}")


def _choose(
    program: str, step: str, *, declared: str | None, pinned: str | None, stats: SizeStats, retry: bool
) -> SizeChoice:
    if pinned is not None:
        return SizeChoice(pinned, "pinned by operator")
    if retry:
        return SizeChoice("large", "retry after small failed")
    if declared is not None:
        return SizeChoice(declared, "declared by program")
    done, tried = stats.tally(program, step)
    if tried >= stats.min_samples and tried >= stats.explore_trials:
        if done >= stats.min_success * tried:
            return SizeChoice("small", f"small model completed this step {done}/{tried} times")
        return SizeChoice("large", f"small model completed this step only {done}/{tried} times")
    if tried < stats.explore_trials:
        return SizeChoice("small", f"trying the small model on this step ({tried + 1} of {stats.explore_trials})")
    return SizeChoice("large", "default")
