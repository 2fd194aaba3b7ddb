"""The tool latency model's bounds of the mean residual life over an interval of ages.

``mean_residual_life_bound`` prunes the host residents' search (``services.cache.residents``):
it must never be below ``mean_residual_life`` anywhere in the interval, samples observed
after its tables were built included, and it must stay close to the true maximum over a
wide interval (a loose bound makes every pressure eviction read more of the index).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cache.latency import ToolLatencyModel

pytestmark = pytest.mark.unit


def _assert_bounds(latency: ToolLatencyModel, tool: str, lo: float, hi: float, steps: int = 40) -> float:
    bound = latency.mean_residual_life_bound(tool, lo, hi)
    for k in range(steps + 1):
        x = lo + (hi - lo) * k / steps
        assert latency.mean_residual_life(tool, x) <= bound * (1 + 1e-12), (lo, hi, x)
    return bound


def test_bounds_hold_over_the_interval() -> None:
    latency = ToolLatencyModel()
    for d in [0.1, 0.5, 2.0, 3.0, 9.0, 30.0]:
        latency.observe("t", d)
    for lo, hi in itertools.product([0.0, 0.4, 2.5, 8.0, 31.0], [0.0, 1.0, 5.0, 40.0]):
        if hi >= lo:
            _assert_bounds(latency, "t", lo, hi)
    assert latency.mean_residual_life_bound("t", 4.0, 4.0) == pytest.approx(latency.mean_residual_life("t", 4.0))
    assert latency.mean_residual_life_bound("none", 1.0, 9.0) == latency.mean_residual_life("none", 5.0)
    # Over every age at once: finite (the prior underflows past 1e6 s, which made the bound of the
    # two ends alone infinite) and no more than the largest sample plus the prior mean.
    assert _assert_bounds(latency, "t", 0.0, 1e6, steps=2000) <= 30.0 + latency.prior_mean_s


def test_a_wide_interval_is_bounded_close_to_the_true_maximum() -> None:
    rng = random.Random(3)
    latency = ToolLatencyModel()
    for _ in range(600):
        latency.observe("t", rng.lognormvariate(math.log(5.0), 1.0))
    top = max(latency.quantiles("t"))
    truth = max(latency.mean_residual_life("t", top * k / 4000) for k in range(4001))
    for lo, hi in [(0.0, top), (0.0, 10.0), (2.0, 40.0), (0.0, 2 * top)]:
        bound = _assert_bounds(latency, "t", lo, hi)
        assert bound <= 1.25 * truth, (lo, hi, bound, truth)


@settings(max_examples=200, deadline=None)
@given(
    first=st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.0, 7.5]) | st.floats(0.0, 60.0), min_size=1, max_size=30),
    later=st.lists(st.floats(0.0, 120.0), max_size=12),
    intervals=st.lists(st.tuples(st.floats(0.0, 150.0), st.floats(0.0, 150.0)), min_size=1, max_size=6),
)
def test_bounds_hold_for_samples_observed_after_the_build(
    first: list[float], later: list[float], intervals: list[tuple[float, float]]
) -> None:
    """Ties, zeros and samples observed after the tables were built (kept, or built anew)."""
    latency = ToolLatencyModel(prior_mean_s=4.0)
    for d in first:
        latency.observe("t", d)
    latency.mean_residual_life_bound("t", 0.0, 1.0)  # builds the tables
    for d in later:
        latency.observe("t", d)
        for a, b in intervals:
            _assert_bounds(latency, "t", min(a, b), max(a, b), steps=12)


def test_a_new_sample_lifts_the_bound_a_little_without_a_rebuild() -> None:
    """A long call observed after the build raises every bound below it by its share, not to its
    own length, and costs no rebuild (a rebuild per long call was 8% of the manager's fold)."""
    rng = random.Random(5)
    latency = ToolLatencyModel()
    for _ in range(400):
        latency.observe("t", rng.lognormvariate(math.log(5.0), 1.0))
    latency.mean_residual_life_bound("t", 0.0, 1.0)
    built = latency._bounds["t"]
    latency.observe("t", 300.0)
    latency.observe("t", 0.5)
    for lo, hi in [(0.0, 1.0), (2.0, 3.0), (0.0, 30.0), (50.0, 400.0)]:
        bound = _assert_bounds(latency, "t", lo, hi, steps=200)
        truth = max(latency.mean_residual_life("t", lo + (hi - lo) * k / 200) for k in range(201))
        assert bound <= 1.25 * truth, (lo, hi, bound, truth)
        if hi <= 3.0:  # narrow, where most samples lie: lifted a little, no rebuild
            assert latency._bounds["t"] is built
    # Wide ones, where few samples of the build are left at the top and the new ones weigh
    # more there, were built anew: the exact build is tighter than the lift.
    assert latency._bounds["t"] is not built


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 300), first=st.integers(0, 299), width=st.integers(0, 299))
def test_the_largest_ceiling_of_a_range_is_read_from_blocks_as_from_the_list(n: int, first: int, width: int) -> None:
    rng = random.Random(n * 1000 + first)
    latency = ToolLatencyModel()
    for _ in range(n):
        latency.observe("t", rng.expovariate(0.2))
    latency.mean_residual_life_bound("t", 0.0, 0.0)
    bounds = latency._bounds["t"]
    first = min(first, len(bounds.ceilings) - 1)
    last = min(first + width, len(bounds.ceilings) - 1)
    assert bounds._max_ceiling(first, last) == max(bounds.ceilings[first : last + 1])
