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

Pure: no clock; durations and ages are parameters.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

__all__ = ["ToolLatencyModel"]


@dataclass(slots=True)
class _Samples:
    sorted_s: list[float] = field(default_factory=list)
    # suffix sums: suffix[i] = sum(sorted_s[i:]); rebuilt lazily
    suffix: list[float] | None = None

    def add(self, value: float) -> None:
        bisect.insort(self.sorted_s, value)
        self.suffix = None

    def suffix_sums(self) -> list[float]:
        if self.suffix is None:
            sums = [0.0] * (len(self.sorted_s) + 1)
            for i in range(len(self.sorted_s) - 1, -1, -1):
                sums[i] = sums[i + 1] + self.sorted_s[i]
            self.suffix = sums
        return self.suffix


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
        return 0 if samples is None else len(samples.sorted_s)

    def _prior(self, tool: str) -> float:
        return self.prior_means_s.get(tool, self.prior_mean_s)

    def cdf(self, tool: str, t: float) -> float:
        """P(duration <= t)."""
        if t < 0:
            return 0.0
        m, k = self._prior(tool), self.prior_weight
        samples = self._samples.get(tool)
        data = samples.sorted_s if samples is not None else []
        below = bisect.bisect_right(data, t)
        return (below + k * (1.0 - math.exp(-t / m))) / (len(data) + k)

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
        start = bisect.bisect_right(samples.sorted_s, x)
        count = len(samples.sorted_s) - start
        excess = samples.suffix_sums()[start] - count * x
        return (excess + prior_mass * m) / (count + prior_mass) if count + prior_mass > 0 else m

    def quantiles(self, tool: str) -> list[float]:
        """The observed durations of ``tool``, sorted (candidate TTLs for a policy)."""
        samples = self._samples.get(tool)
        return list(samples.sorted_s) if samples is not None else []
