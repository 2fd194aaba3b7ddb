"""Per-tool latency distributions learned online, with a prior for unseen tools.

For a tool with observed durations ``d_1..d_n`` (seconds) and a prior of weight ``k``
(pseudo-observations) drawn from an exponential distribution of mean ``m`` (the prior
mean; memoryless, so its mean residual life is ``m`` at any age):

- CDF:  ``F(t) = (#{d_i <= t} + k * (1 - exp(-t / m))) / (n + k)``
- mean residual life at age ``x`` (expected remaining duration given it already ran ``x``):

      MRL(x) = (sum_{d_i > x} (d_i - x) + k * S0(x) * m) / (#{d_i > x} + k * S0(x))

  with ``S0(x) = exp(-x / m)`` the prior's survival at ``x``. With no data it is ``m``;
  once a tool has run longer than every sample, the prior alone answers (``m``): the
  estimate never reaches 0 for a call that is still running.

Samples are kept sorted in chunks with per-chunk sums, so an observation costs no
rebuild and every query is ``O(log n + 256 + n / 256)`` (the linear parts in C).

Pure: no clock; durations and ages are parameters.
"""

from __future__ import annotations

import bisect
import math

__all__ = ["ToolLatencyModel"]


_CHUNK = 256  # a chunk splits in two when it grows past twice this


class _Samples:
    """Sorted durations kept as sorted chunks with per-chunk sums (a sorted list in chunks).

    ``observe`` and every query cost ``O(log n + _CHUNK + n / _CHUNK)``, with the linear
    parts in C (list slices and ``sum``): no full rebuild after an observation, so a
    manager that observes a tool and then decides stays fast with many samples.
    """

    __slots__ = ("chunks", "lens", "maxes", "sums")

    def __init__(self) -> None:
        self.chunks: list[list[float]] = []  # each sorted; chunk i's max <= chunk i+1's min
        self.maxes: list[float] = []
        self.sums: list[float] = []
        self.lens: list[int] = []

    def __len__(self) -> int:
        return sum(self.lens)

    def add(self, value: float) -> None:
        if not self.chunks:
            self.chunks, self.maxes, self.sums, self.lens = [[value]], [value], [value], [1]
            return
        i = min(bisect.bisect_left(self.maxes, value), len(self.chunks) - 1)
        chunk = self.chunks[i]
        bisect.insort(chunk, value)
        self.maxes[i] = chunk[-1]
        self.sums[i] += value
        self.lens[i] += 1
        if len(chunk) > 2 * _CHUNK:
            low, high = chunk[:_CHUNK], chunk[_CHUNK:]
            self.chunks[i : i + 1] = [low, high]
            self.maxes[i : i + 1] = [low[-1], high[-1]]
            self.sums[i : i + 1] = [math.fsum(low), math.fsum(high)]
            self.lens[i : i + 1] = [len(low), len(high)]

    def count_at_most(self, t: float) -> int:
        """How many samples are ``<= t``."""
        i = bisect.bisect_right(self.maxes, t)
        below = sum(self.lens[:i])
        if i < len(self.chunks):
            below += bisect.bisect_right(self.chunks[i], t)
        return below

    def above(self, x: float) -> tuple[int, float]:
        """How many samples are ``> x``, and their sum."""
        i = bisect.bisect_right(self.maxes, x)
        if i == len(self.chunks):
            return 0, 0.0
        chunk = self.chunks[i]
        j = bisect.bisect_right(chunk, x)
        return len(chunk) - j + sum(self.lens[i + 1 :]), sum(chunk[j:]) + sum(self.sums[i + 1 :])

    def values(self) -> list[float]:
        return [v for chunk in self.chunks for v in chunk]


class ToolLatencyModel:
    """Empirical duration distribution per tool plus an exponential prior (see the module docstring)."""

    def __init__(
        self, *, prior_mean_s: float = 5.0, prior_weight: float = 1.0, prior_means_s: dict[str, float] | None = None
    ) -> None:
        if prior_mean_s <= 0 or prior_weight <= 0:
            raise ValueError(f"need prior_mean_s > 0 and prior_weight > 0, got {prior_mean_s}, {prior_weight}")
        self.prior_mean_s = prior_mean_s
        self.prior_weight = prior_weight
        self.prior_means_s = dict(prior_means_s or {})
        self._samples: dict[str, _Samples] = {}

    def observe(self, tool: str, duration_s: float) -> None:
        """Record one finished call of ``tool`` that took ``duration_s`` seconds."""
        if not math.isfinite(duration_s) or duration_s < 0:
            raise ValueError(f"duration must be finite and >= 0, got {duration_s}")
        self._samples.setdefault(tool, _Samples()).add(duration_s)

    def num_samples(self, tool: str) -> int:
        samples = self._samples.get(tool)
        return 0 if samples is None else len(samples)

    def _prior(self, tool: str) -> float:
        return self.prior_means_s.get(tool, self.prior_mean_s)

    def cdf(self, tool: str, t: float) -> float:
        """P(duration <= t)."""
        if t < 0:
            return 0.0
        m, k = self._prior(tool), self.prior_weight
        samples = self._samples.get(tool)
        below, n = (0, 0) if samples is None else (samples.count_at_most(t), len(samples))
        return (below + k * (1.0 - math.exp(-t / m))) / (n + k)

    def mean(self, tool: str) -> float:
        """Expected duration of a new call (``MRL(0)``)."""
        return self.mean_residual_life(tool, 0.0)

    def mean_residual_life(self, tool: str, elapsed_s: float) -> float:
        """Expected remaining seconds of a call of ``tool`` that has run ``elapsed_s`` seconds."""
        x = max(0.0, elapsed_s)
        m, k = self._prior(tool), self.prior_weight
        prior_mass = k * math.exp(-x / m)
        samples = self._samples.get(tool)
        if samples is None:
            return m
        count, total = samples.above(x)
        excess = total - count * x
        return (excess + prior_mass * m) / (count + prior_mass) if count + prior_mass > 0 else m

    def mean_residual_life_bound(self, tool: str, lo_s: float, hi_s: float) -> float:
        """An upper bound of ``mean_residual_life(tool, x)`` for every ``x`` in ``[lo_s, hi_s]``, in
        two queries, however many ages the interval holds: the excess ``sum_{d_i > x} (d_i - x)``
        and the prior's survival only shrink as ``x`` grows, and so does the count above ``x``,
        so the numerator at ``lo_s`` over the denominator at ``hi_s`` bounds every ``x`` between
        (equal to ``MRL(lo_s)`` when ``lo_s == hi_s``; ``inf`` where the prior underflows)."""
        a = max(0.0, lo_s)
        b = max(a, hi_s)
        m, k = self._prior(tool), self.prior_weight
        samples = self._samples.get(tool)
        if samples is None:
            return m
        count_a, total_a = samples.above(a)
        count_b = count_a if b == a else len(samples) - samples.count_at_most(b)
        numerator = max(0.0, total_a - count_a * a) + k * math.exp(-a / m) * m
        denominator = count_b + k * math.exp(-b / m)
        return numerator / denominator if denominator > 0 else math.inf

    def mean_residual_life_ceiling(self, tool: str, lo_s: float) -> float:
        """A coarser upper bound of ``mean_residual_life(tool, x)`` for every ``x >= lo_s``, in O(1):
        ``MRL(x)`` is a weighted mean of the samples' mean excess over ``x`` (at most the largest
        sample minus ``x``) and the prior mean."""
        samples = self._samples.get(tool)
        m = self._prior(tool)
        if samples is None:
            return m
        return max(m, samples.maxes[-1] - max(0.0, lo_s))

    def quantiles(self, tool: str) -> list[float]:
        """The observed durations of ``tool``, sorted (candidate TTLs for a policy)."""
        samples = self._samples.get(tool)
        return samples.values() if samples is not None else []
