"""Synthetic agent traces with the shapes that matter to a KV-cache policy, from a seeded RNG.

What the real traces show, and this generator reproduces:

- **Heavy-tailed tool durations**: most tool calls are short, a few are very long (InferCept's gaps
  span 1e-5 s to 60 s). ``tool_duration="lognormal"`` draws log-normal durations (all moments finite,
  a long right tail); ``"pareto"`` draws Pareto durations (power-law tail: mean residual life
  *grows* with the time already waited, the hard case for predicting when a session returns).
  Pareto draws are capped at ``max_tool_duration_s`` so one draw cannot stall a replay for days.
- **Tools with different latencies**: a small catalogue (:data:`TOOLS`), each with its own
  distribution, result size and share of calls; ``human`` is rare and slow.
- **Mixed session lengths**: a mix of short and long sessions, each geometric (the number of turns
  of an agent that stops with a fixed probability after each turn); ``long_fraction`` of sessions
  come from the long component, whose mean is 4x the short one, so the mix keeps ``mean_turns``.
- **Shared system prompts**: ``shared_prefix_fraction`` of sessions start with one of two system
  prompts (``synthetic:system-0``/``-1``) that their KV blocks can share.
- **Poisson arrivals** at ``arrival_rate_per_s``.

Everything random comes from the ``rng`` argument, so one seed gives one trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from services.traces.arrivals import poisson_arrivals
from services.traces.model import SharedPrefix, Trace, TraceSession, TraceTurn

SOURCE = "synthetic"
ToolDuration = Literal["lognormal", "pareto"]
SYSTEM_PROMPTS = (("synthetic:system-0", 1024), ("synthetic:system-1", 2048))
_LONG_TO_SHORT = 4.0  # how much longer the long sessions are on average


@dataclass(frozen=True, slots=True)
class ToolProfile:
    """One tool: its share of calls, its latency (median; log-normal sigma; Pareto alpha), result size."""

    name: str
    weight: float
    median_s: float
    sigma: float
    alpha: float
    median_result_tokens: int


TOOLS: tuple[ToolProfile, ...] = (
    ToolProfile("search", weight=0.40, median_s=0.8, sigma=0.8, alpha=1.8, median_result_tokens=600),
    ToolProfile("code_exec", weight=0.35, median_s=3.0, sigma=1.2, alpha=1.5, median_result_tokens=300),
    ToolProfile("browser", weight=0.20, median_s=6.0, sigma=1.0, alpha=1.7, median_result_tokens=1500),
    ToolProfile("human", weight=0.05, median_s=30.0, sigma=1.5, alpha=1.2, median_result_tokens=50),
)


def _lognormal_int(rng: random.Random, median: float, sigma: float, minimum: int) -> int:
    return max(minimum, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))


def _geometric(rng: random.Random, mean: float) -> int:
    """Turns >= 1 with the given mean: stop after each turn with probability 1 / mean."""
    if mean <= 1.0:
        return 1
    stop = 1.0 / mean
    # Inverse CDF; 1 - random() lies in (0, 1], so the log is finite.
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - stop))


def tool_duration_s(tool: ToolProfile, kind: ToolDuration, rng: random.Random, cap_s: float) -> float:
    """One duration of ``tool``: log-normal around its median, or Pareto with the same median."""
    if kind == "lognormal":
        return min(cap_s, tool.median_s * math.exp(tool.sigma * rng.gauss(0.0, 1.0)))
    # A Pareto(alpha) with scale x_m has median x_m * 2**(1/alpha): pick x_m to keep the median.
    scale = tool.median_s / math.pow(2.0, 1.0 / tool.alpha)
    return min(cap_s, scale * rng.paretovariate(tool.alpha))


def synthetic(
    num_sessions: int,
    *,
    rng: random.Random,
    tool_duration: ToolDuration = "lognormal",
    mean_turns: float = 8.0,
    long_fraction: float = 0.2,
    arrival_rate_per_s: float = 1.0,
    shared_prefix_fraction: float = 0.5,
    median_task_tokens: int = 400,
    median_output_tokens: int = 150,
    turn_overhead_tokens: int = 8,
    max_tool_duration_s: float = 3600.0,
    tools: tuple[ToolProfile, ...] = TOOLS,
) -> Trace:
    """``num_sessions`` synthetic sessions; see the module docstring for the shapes."""
    if num_sessions < 0:
        raise ValueError(f"num_sessions must be >= 0, got {num_sessions}")
    if tool_duration not in ("lognormal", "pareto"):
        raise ValueError(f"tool_duration must be 'lognormal' or 'pareto', got {tool_duration!r}")
    if not mean_turns >= 1.0:
        raise ValueError(f"mean_turns must be >= 1, got {mean_turns}")
    for name, fraction in (("long_fraction", long_fraction), ("shared_prefix_fraction", shared_prefix_fraction)):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {fraction}")
    if not tools:
        raise ValueError("tools must not be empty")
    # Short mean m, long mean 4m: (1 - f) m + f 4m = mean_turns.
    short_mean = mean_turns / (1.0 + (_LONG_TO_SHORT - 1.0) * long_fraction)
    weights = [t.weight for t in tools]
    arrivals = poisson_arrivals(num_sessions, arrival_rate_per_s, rng)
    sessions: list[TraceSession] = []
    for i, arrival in enumerate(arrivals):
        long = rng.random() < long_fraction
        num_turns = max(1, _geometric(rng, short_mean * (_LONG_TO_SHORT if long else 1.0)))
        prefix: SharedPrefix | None = None
        first_prompt = _lognormal_int(rng, median_task_tokens, 0.6, 1)
        if rng.random() < shared_prefix_fraction:
            context_id, tokens = SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))]
            prefix = SharedPrefix(context_id, tokens)
            first_prompt += tokens
        turns: list[TraceTurn] = []
        for j in range(num_turns):
            prompt = first_prompt if j == 0 else turn_overhead_tokens
            output = _lognormal_int(rng, median_output_tokens, 0.7, 1)
            if j == num_turns - 1:
                turns.append(TraceTurn(prompt, output, shared_prefix=prefix if j == 0 else None))
                break
            tool = rng.choices(tools, weights=weights)[0]
            duration = tool_duration_s(tool, tool_duration, rng, max_tool_duration_s)
            result = _lognormal_int(rng, tool.median_result_tokens, 0.8, 0)
            turns.append(TraceTurn(prompt, output, tool.name, duration, result, prefix if j == 0 else None))
        sessions.append(TraceSession(f"syn-{i:05d}", SOURCE, arrival, tuple(turns)))
    notes = (
        f"synthetic: {num_sessions} sessions, {tool_duration} tool durations, mean_turns={mean_turns:g}, "
        f"long_fraction={long_fraction:g}",
    )
    return Trace(tuple(sessions), notes=notes)
