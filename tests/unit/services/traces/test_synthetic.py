"""Synthetic traces: one seed gives one trace, and the shapes the docstring promises are there."""

from __future__ import annotations

import random
from typing import Any

import pytest

from services.traces import Trace, synthetic, trace_stats
from services.traces.synthetic import SYSTEM_PROMPTS, TOOLS, tool_duration_s

pytestmark = pytest.mark.unit


def test_one_seed_gives_one_trace() -> None:
    first = synthetic(50, rng=random.Random(1))
    assert first.to_json_lines() == synthetic(50, rng=random.Random(1)).to_json_lines()
    assert first.to_json_lines() != synthetic(50, rng=random.Random(2)).to_json_lines()


def test_the_trace_is_valid_and_survives_a_round_trip() -> None:
    trace = synthetic(200, rng=random.Random(3), tool_duration="pareto")
    assert Trace.from_json_lines(trace.to_json_lines()) == trace
    assert all(s.source == "synthetic" for s in trace)
    assert [s.session_id for s in trace][:2] == ["syn-00000", "syn-00001"]


def test_session_lengths_mix_short_and_long_around_the_mean() -> None:
    trace = synthetic(4000, rng=random.Random(4), mean_turns=8.0)
    lengths = [len(s.turns) for s in trace]
    assert sum(lengths) / len(lengths) == pytest.approx(8.0, rel=0.1)
    assert min(lengths) == 1
    assert max(lengths) > 60  # the long component's tail


@pytest.mark.parametrize("kind", ["lognormal", "pareto"])
def test_tool_durations_are_heavy_tailed(kind: Any) -> None:
    stats = trace_stats(synthetic(2000, rng=random.Random(5), tool_duration=kind))
    assert stats.gap_max_s > 20 * stats.gap_median_s
    assert {t.tool for t in stats.tools} == {t.name for t in TOOLS}
    by_tool = {t.tool: t.median_s for t in stats.tools}
    assert by_tool["search"] < by_tool["code_exec"] < by_tool["browser"] < by_tool["human"]


def test_each_distribution_keeps_the_tools_median() -> None:
    search = TOOLS[0]
    for kind in ("lognormal", "pareto"):
        rng = random.Random(6)
        draws = sorted(tool_duration_s(search, kind, rng, 3600.0) for _ in range(20001))
        assert draws[10000] == pytest.approx(search.median_s, rel=0.05)


def test_pareto_durations_are_capped() -> None:
    rng = random.Random(7)
    human = TOOLS[-1]
    assert max(tool_duration_s(human, "pareto", rng, 100.0) for _ in range(5000)) == 100.0


def test_a_fraction_of_sessions_starts_with_a_shared_system_prompt() -> None:
    trace = synthetic(1000, rng=random.Random(8), shared_prefix_fraction=0.5)
    prefixes = [s.turns[0].shared_prefix for s in trace]
    assert 400 < sum(p is not None for p in prefixes) < 600
    assert {(p.context_id, p.tokens) for p in prefixes if p is not None} == set(SYSTEM_PROMPTS)
    assert all(t.shared_prefix is None for s in trace for t in s.turns[1:])
    assert synthetic(100, rng=random.Random(8), shared_prefix_fraction=0.0).sessions[0].turns[0].shared_prefix is None


def test_arrivals_are_poisson_at_the_given_rate() -> None:
    trace = synthetic(2000, rng=random.Random(9), arrival_rate_per_s=4.0)
    assert trace_stats(trace).span_s / 2000 == pytest.approx(0.25, rel=0.1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_sessions": -1}, "num_sessions must be >= 0"),
        ({"tool_duration": "weibull"}, "tool_duration must be 'lognormal' or 'pareto'"),
        ({"mean_turns": 0.5}, "mean_turns must be >= 1"),
        ({"long_fraction": 1.5}, "long_fraction must be in"),
        ({"shared_prefix_fraction": -0.1}, "shared_prefix_fraction must be in"),
        ({"tools": ()}, "tools must not be empty"),
        ({"arrival_rate_per_s": 0.0}, "arrival rate must be a finite number > 0"),
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"num_sessions": 3, "rng": random.Random(0), **kwargs}
    with pytest.raises(ValueError, match=message):
        synthetic(**arguments)
