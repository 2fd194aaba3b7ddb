"""Program-level scheduling: an LLM call's priority from its program's history as the log records it.

An agent is a program of many LLM calls, so a per-call scheduler lets programs hold each other
up: under FCFS every call of a program queues again behind calls of programs that started after
it (a program pays the queue once per turn), and a program that has already run for minutes
competes with one that has just started. The log knows each program's history, so a call's
priority is its program's, from two numbers of the folded log (``program_progress``):

- **elapsed**: the program's recorded age, the engine time (queueing included) and the tool time
  of its recorded steps. Subtracting it from the call's ready time anchors the call at its
  program's start: a program keeps its place in the queue from one call to the next, so programs
  are served first come first served *as programs*, and one that has started finishes before
  newer ones crowd it (fewer programs alive at once also means fewer sessions holding KV cache).
- **attained**: the engine time (prefill and decode) its completed calls attained, Autellix's
  PLAS (*Program-Level Attained Service*): least attained first approximates shortest remaining
  first when program lengths are heavy-tailed. For programs with parallel branches (a fork step
  whose branches run as sessions and are merged back, docs/branches.md) both numbers follow the
  critical path (Autellix's ATLAS): a branch carries its parent's history up to the fork, and
  after a merge the parent carries the branch that attained the most, not the sum, so branches
  that run side by side are not punished for it.

**The scale** (vLLM's: an integer, lower is served first; ties in arrival order). A call's
priority is a *virtual start time* in milliseconds of log time::

    priority = ready_at_ms - min(elapsed_ms, max_age_credit_ms)
                           + min(max_level_ms, service_weight * attained_ms)
                           - (warm_credit_ms if the session's KV is preserved)

Two properties follow, and are why the priority is a time and not a level:

- **Anti-starvation (bounded wait) with a number fixed at submission.** Every term besides the
  ready time is bounded: a call ready at ``t`` has a priority at most ``t + max_level_ms``, and a
  call ready at ``t'`` at least ``t' - max_age_credit_ms - warm_credit_ms``. So a call is never
  passed by a call that became ready more than ``max_wait_ms`` (the three bounds added) after it:
  on a server that serves the lowest priority first whenever it is free, a call waits at most
  that window plus the work already queued or running when the window ends. This is aging
  written as a number fixed at submission, which is what vLLM's ``priority`` field is: it cannot
  change while a request waits.
- **Comparable across processes.** The planner and the gateway stamp calls with the log's clock;
  any two priorities in one engine compare correctly whoever sent them.

**The cache term.** A session whose KV cache the cache manager preserves (a ``PRESERVE`` or
``PREFETCH`` decision whose TTL runs) holds GPU memory while it waits: serving it soon reuses that
memory at the price of a short prefill, while waiting behind a cold call risks the pin's TTL
ending and the whole prompt being recomputed. Such a call goes ``warm_credit_ms`` ahead.

**Programs in the order they started** (``PROGRAM_ORDER``: ``service_weight`` 0). An engine that
holds memory in the programs' order (vLLM's ranked pins: a waiting call takes no context that a
program ranked before it holds) needs ranks that stay put. With the attained-service term a
program's rank moves back at each of its calls, so two programs that hold contexts pass each other
in turn, and each one's next call takes the other's context: both recompute at every turn (in the
simulator of ``bench.vllm_agents``' long regime, 2-3x the prompt tokens of ranks that stay put).
Without it a program's priority is its start on the log's clock (every step's time is recorded:
the ready time less the recorded age), the same at every call.

Pure: times are parameters (seconds, the log's clock), no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from schemas.events import (
    CacheAction,
    CacheDecisionMade,
    GatewayLLMCallServed,
    LLMCallCompleted,
    Model,
    ToolCallCompleted,
)
from services.session import SessionState

__all__ = [
    "DEFAULT_SCHEDULING",
    "PROGRAM_ORDER",
    "CallPriority",
    "ProgramProgress",
    "ProgressBook",
    "SchedulingConfig",
    "call_priority",
    "call_progress",
    "preserved_until",
    "prioritize",
    "program_progress",
    "request_priority",
]

_MS = 1000.0
_INF = float("inf")


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """The policy's knobs, each the bound of one term of the priority (module docstring).

    ``max_age_credit_ms``: how much of a program's recorded age anchors its calls (an older program
    is served as if it had started this long ago): long enough to cover an agent's whole run, so
    that programs are served in the order they started. ``service_weight``: milliseconds of waiting
    that one millisecond of attained service costs (1: one for one). ``max_level_ms``: the cap on
    the service term (a program that has had more than ``max_level_ms / service_weight`` of engine
    time ranks like one that has had exactly that). ``warm_credit_ms``: how far ahead a call whose
    session's KV is preserved goes.
    """

    max_age_credit_ms: float = 600_000.0
    service_weight: float = 1.0
    max_level_ms: float = 60_000.0
    warm_credit_ms: float = 5_000.0

    def __post_init__(self) -> None:
        for name in ("max_age_credit_ms", "service_weight", "max_level_ms", "warm_credit_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < _INF:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def max_wait_ms(self) -> float:
        """The bounded-wait window: a call is never passed by one that became ready more than this
        much later."""
        return self.max_age_credit_ms + self.max_level_ms + self.warm_credit_ms


DEFAULT_SCHEDULING = SchedulingConfig()
PROGRAM_ORDER = SchedulingConfig(service_weight=0.0)
"""Programs first come first served (with the warm credit): for an engine with ranked pins (module
docstring)."""


@dataclass(frozen=True, slots=True)
class ProgramProgress:
    """What the log says a program has had so far, on its critical path (milliseconds)."""

    attained_ms: float = 0.0  # engine time its completed calls attained (prefill and decode)
    elapsed_ms: float = 0.0  # its recorded age: engine time with queueing, and tool time

    def __post_init__(self) -> None:
        if not (0 <= self.attained_ms < _INF and 0 <= self.elapsed_ms < _INF):
            raise ValueError(f"progress must be finite and >= 0 ms, got {self.attained_ms!r}, {self.elapsed_ms!r}")

    def __add__(self, other: ProgramProgress) -> ProgramProgress:
        return ProgramProgress(self.attained_ms + other.attained_ms, self.elapsed_ms + other.elapsed_ms)

    def after_call(self, completed: LLMCallCompleted | GatewayLLMCallServed) -> ProgramProgress:
        """This progress and one more recorded LLM call."""
        return self + call_progress(completed)

    def after_tool(self, duration_ms: float) -> ProgramProgress:
        """This progress and one more recorded tool call that took ``duration_ms``."""
        return ProgramProgress(self.attained_ms, self.elapsed_ms + max(0.0, duration_ms))


def call_priority(ready_at_s: float, progress: ProgramProgress, *, warm: bool = False,
                  config: SchedulingConfig = DEFAULT_SCHEDULING) -> int:  # fmt: skip
    """The call's priority (lower is served first; the module docstring has the scale).

    ``ready_at_s``: when the call became ready, on the log's clock (seconds); ``progress``: its
    program's (``program_progress``); ``warm``: its session's KV cache is preserved now
    (``preserved_until``)."""
    anchor = min(progress.elapsed_ms, config.max_age_credit_ms)
    level = min(config.max_level_ms, config.service_weight * progress.attained_ms)
    if warm:
        level -= config.warm_credit_ms
    return round(ready_at_s * _MS - anchor + level)


@dataclass(frozen=True, slots=True)
class CallPriority:
    """A call's priority and what it was computed from, as ``LLMCallStarted`` records them (so that
    a reader of the log can say why a call waited: a program's age, its attained service, the warm
    credit)."""

    priority: int
    attained_ms: float
    age_ms: float  # the program's recorded age, before the cap (``max_age_credit_ms``)
    warm: bool


def prioritize(ready_at_s: float, progress: ProgramProgress, *, warm: bool = False,
               config: SchedulingConfig = DEFAULT_SCHEDULING) -> CallPriority:  # fmt: skip
    """``call_priority`` with its inputs, to record beside it."""
    priority = call_priority(ready_at_s, progress, warm=warm, config=config)
    return CallPriority(priority, progress.attained_ms, progress.elapsed_ms, warm)


def call_progress(completed: LLMCallCompleted | GatewayLLMCallServed) -> ProgramProgress:
    """What one recorded call adds: its prefill and decode as service; those and its queueing as age."""
    service = max(0.0, completed.prefill_ms) + max(0.0, completed.decode_ms)
    return ProgramProgress(service, service + max(0.0, completed.queue_ms))


def program_progress(state: SessionState, branches: Mapping[str, SessionState] | None = None) -> ProgramProgress:
    """The progress of the program ``state`` belongs to, on its critical path (ATLAS).

    A session's own completed LLM and tool calls count, and so do those a fork inherited from its
    parent (the log's fold copies them into the fork's state: the path up to the fork point). For
    each merge the session applied, the merged branch that attained the most counts (the join
    waited for it), not their sum; a branch not in ``branches`` (another planner's partition)
    counts nothing."""
    return _path(state, branches or {}, inherited=True, seen=frozenset())


def _path(state: SessionState, branches: Mapping[str, SessionState], *, inherited: bool,
          seen: frozenset[str]) -> ProgramProgress:  # fmt: skip
    seen = seen | {state.session_id}
    total = ProgramProgress()
    for call in state.llm_calls.values():
        if call.completed is not None and (inherited or call.origin is None):
            total = total.after_call(call.completed)
    for tool in state.tool_calls.values():
        if tool.completed is not None and (inherited or tool.origin is None):
            total = total.after_tool(tool.completed.duration_ms)
    for merge in state.merges:
        paths = [
            _path(branches[b], branches, inherited=False, seen=seen)
            for b in merge.branch_session_ids
            if b in branches and b not in seen  # merge_plan refuses a merge cycle; never loop on one
        ]
        if paths:
            total = total + max(paths, key=lambda p: (p.attained_ms, p.elapsed_ms))
    return total


def preserved_until(decision: CacheDecisionMade, decided_at_s: float) -> float | None:
    """Until when (log seconds) a cache decision keeps the session's KV on GPU: a ``PRESERVE`` or
    ``PREFETCH`` until its TTL ends (without a TTL, until the next decision: infinity); any other
    decision ends it (None)."""
    if decision.action not in (CacheAction.PRESERVE, CacheAction.PREFETCH):
        return None
    if decision.ttl_ms is None:
        return float("inf")
    return decided_at_s + decision.ttl_ms / _MS


class ProgressBook:
    """Each session's progress and warm state, kept up to date from the events it is shown, in
    log order: a reader that follows a stream of events (the benchmarks' engine drivers) rather
    than folding sessions as the planner does. Single-threaded programs: a session is its
    program's critical path."""

    def __init__(self, config: SchedulingConfig = DEFAULT_SCHEDULING) -> None:
        self.config = config
        self.progress: dict[str, ProgramProgress] = {}
        self.preserved: dict[str, float] = {}  # session -> until when (log s) its KV is preserved

    def logged(self, session_id: str, body: Model, now_s: float) -> None:
        """One event of ``session_id``, logged at ``now_s``: a completed call or tool adds to its
        progress, a cache decision sets or ends its warm state."""
        if isinstance(body, LLMCallCompleted):
            self.progress[session_id] = self.progress.get(session_id, ProgramProgress()).after_call(body)
        elif isinstance(body, ToolCallCompleted):
            self.progress[session_id] = self.progress.get(session_id, ProgramProgress()).after_tool(body.duration_ms)
        elif isinstance(body, CacheDecisionMade):
            until = preserved_until(body, now_s)
            if until is None:
                self.preserved.pop(session_id, None)
            else:
                self.preserved[session_id] = until

    def priority(self, session_id: str, ready_at_s: float) -> int:
        """The priority of the session's call that is ready at ``ready_at_s`` (``call_priority``)."""
        warm = self.preserved.get(session_id, -1.0) > ready_at_s
        progress = self.progress.get(session_id, ProgramProgress())
        return call_priority(ready_at_s, progress, warm=warm, config=self.config)


def request_priority(value: object) -> int:
    """An engine request's ``priority`` field (absent: 0, vLLM's default); raises ``ValueError``
    unless it is an integer (vLLM's type: a float or a string is refused, not rounded)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"priority must be an integer (lower is served first), got {value!r:.40}")
    return value
