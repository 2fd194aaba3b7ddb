"""Session arrival times for traces that record none (InferCept, Continuum, synthetic)."""

from __future__ import annotations

import math
import random


def poisson_arrivals(count: int, rate_per_s: float, rng: random.Random) -> list[float]:
    """``count`` arrival times of a Poisson process: exponential gaps of mean ``1 / rate_per_s``.

    The first session arrives after one gap, not at 0, as in InferCept's own benchmark driver,
    so every session has a genuine (random) inter-arrival gap before it.
    """
    if isinstance(rate_per_s, bool) or not math.isfinite(rate_per_s) or rate_per_s <= 0:
        raise ValueError(f"arrival rate must be a finite number > 0 per second, got {rate_per_s!r}")
    times: list[float] = []
    now = 0.0
    for _ in range(count):
        now += rng.expovariate(rate_per_s)
        times.append(now)
    return times
