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

``mean_residual_life_bound`` bounds ``MRL`` over an interval of ages (``_Bounds``): the host
residents' index prunes a pressure eviction's search with it.

Pure: no clock; durations and ages are parameters.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

__all__ = ["ToolLatencyModel"]


_CHUNK = 256  # a chunk splits in two when it grows past twice this
_BLOCK = 32  # gaps per block of ``_Bounds.blocks``
_LIFT = 1.125  # a bound lifted by new samples past this many times the build's: build anew


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
        # 0.0 to start from: a compiled build (services.cache) takes an empty sum's int 0 for no float
        return len(chunk) - j + sum(self.lens[i + 1 :]), sum(chunk[j:], 0.0) + sum(self.sums[i + 1 :], 0.0)

    def values(self) -> list[float]:
        return [v for chunk in self.chunks for v in chunk]


class _Bounds:
    """Upper bounds of one tool's ``MRL`` over intervals of ages, from its samples at a build.

    Write ``MRL(x) = N(x) / D(x)`` (module docstring): the numerator ``N`` and the denominator
    ``D`` both only shrink as ``x`` grows. Two bounds over ``[lo, hi]``, the smaller is taken:

    - *two points*: ``N(lo) / D(hi)``; exact for a point, loose for a wide interval (it
      divides the excess of every sample past ``lo`` by the count of the few past ``hi``).
    - *gaps*: gap ``j`` is ``[edges[j], edges[j + 1])`` (``edges``: 0, then the samples in
      order; the last gap runs on forever). For ``x`` in a gap every sample
      ``>= edges[j + 1]`` is above ``x``, so ``D(x)`` is at least their count plus the
      prior's survival at ``edges[j + 1]``, and ``N(x)`` at most ``N(edges[j])``: their ratio
      is ``ceilings[j]`` (past the last sample ``MRL`` is the prior mean). The largest ceiling
      of the gaps an interval meets stays close to the true maximum however wide it is.

    The host residents' index prunes with these (``services.cache.residents``). The gaps'
    bound made a pressure eviction's search at 10,000 sessions read a third of the nodes the
    two points alone did (docs/benchmarks.md, cache manager scale).

    The largest ceiling over a range of gaps is read from the maxima of blocks of ``_BLOCK``
    gaps for the whole blocks inside it: a group of host residents spans hundreds of gaps.

    **Samples observed since the build** (``new``, sorted) do not force a rebuild (``O(n)``).
    Write ``MRL'(x) = (N(x) + S(x)) / (D(x) + c(x))`` with ``S(x)``, ``c(x)`` the excess over
    ``x`` and the count of the new samples above ``x``, and ``B`` the build's bound over
    ``[lo, hi]``. Past the longest new sample ``MRL'`` is ``MRL <= B``; below it, on
    ``[lo, top]`` (``top = min(hi, d_max)``): ``N(x) <= D(x) * B``, ``S(x) <= S(lo)`` and
    ``c(x) >= c(top)``, so ``MRL'(x) <= (w * B + S(lo)) / (w + c(top))`` with ``w = D(x)``
    somewhere in ``[D(top), D(lo)]``. That is monotone in ``w``, so the larger of its two ends
    bounds ``MRL'`` there: a weighted mean of ``B`` and the new samples' excess, barely above
    ``B`` for a handful of new samples among hundreds. So is ``max(B, d_max - lo)`` (a
    weighted mean is at most its largest part); the smaller of the two is taken. Where it lies
    more than ``_LIFT`` times above ``B`` (the tail, where ``D(hi)`` is nearly 0 and the new
    samples dominate), ``bound`` says build anew (``None``): the exact build is tighter. The
    bounds are also built anew once an eighth of the samples are new (``stale``).
    """

    __slots__ = ("blocks", "ceilings", "edges", "k", "m", "new", "new_sums", "suffix")

    def __init__(self, values: list[float], m: float, k: float) -> None:
        n = len(values)
        self.m, self.k = m, k
        self.suffix = suffix = list(itertools.accumulate(reversed(values), initial=0.0))[::-1]  # sum(values[i:])
        self.edges = edges = [0.0, *values]
        # above[j]: the first sample > edges[j]; at_least[j]: the first sample >= values[j]
        # (both j when no two samples are equal and none is 0: the usual case, in C).
        above: Sequence[int]
        at_least: Sequence[int]
        if values[0] > 0.0 and len(set(values)) == n:
            above = at_least = range(n)
        else:
            above = [bisect.bisect_right(values, left) for left in edges[:n]]
            at_least = [bisect.bisect_left(values, right) for right in values]
        survival = [k * math.exp(-x / m) for x in edges]  # the prior's weight at each edge
        self.ceilings = [
            (max(0.0, suffix[i] - (n - i) * left) + s_left * m) / (n - g + s_right)
            for left, i, g, s_left, s_right in zip(edges, above, at_least, survival, survival[1:], strict=False)
        ]
        self.ceilings.append(m)
        ceilings = self.ceilings
        self.blocks = [max(ceilings[i : i + _BLOCK]) for i in range(0, len(ceilings), _BLOCK)]
        self.new: list[float] = []  # samples observed since the build, sorted
        self.new_sums: list[float] = [0.0]  # new_sums[i] = sum(new[i:])

    def observed(self, duration_s: float) -> None:
        bisect.insort(self.new, duration_s)
        self.new_sums = list(itertools.accumulate(reversed(self.new), initial=0.0))[::-1]

    def stale(self) -> bool:
        return len(self.new) * 8 >= len(self.edges)

    def _max_ceiling(self, first: int, last: int) -> float:
        """The largest of ``ceilings[first .. last]``."""
        ceilings = self.ceilings
        a, b = first // _BLOCK + 1, last // _BLOCK  # the whole blocks inside: a .. b - 1
        if b - a < 2:
            return max(ceilings[first : last + 1])
        return max(max(ceilings[first : a * _BLOCK]), max(self.blocks[a:b]), max(ceilings[b * _BLOCK : last + 1]))

    def bound(self, lo_s: float, hi_s: float) -> float | None:
        """The smaller bound over ``[lo_s, hi_s]`` (``0 <= lo_s <= hi_s``), lifted by the samples
        observed since the build; None where that cannot be bounded (build anew)."""
        edges, m, k = self.edges, self.m, self.k
        past_lo = bisect.bisect_right(edges, lo_s) - 1  # = the first sample > lo_s; gap of lo_s
        past_hi = bisect.bisect_right(edges, hi_s) - 1
        n = len(edges) - 1
        prior_lo = k * math.exp(-lo_s / m)
        numerator = max(0.0, self.suffix[past_lo] - (n - past_lo) * lo_s) + prior_lo * m
        denominator = n - past_hi + k * math.exp(-hi_s / m)  # D(hi)
        bound = self._max_ceiling(past_lo, past_hi)
        if denominator > 0.0:
            bound = min(bound, numerator / denominator)
        new = self.new
        if not new or new[-1] <= lo_s:
            return bound  # nothing new above lo_s: MRL' <= MRL on the interval
        # Past the longest new sample nothing changed: lift only over [lo_s, top].
        top = min(hi_s, new[-1])
        i = bisect.bisect_right(new, lo_s)
        excess = self.new_sums[i] - (len(new) - i) * lo_s  # S(lo)
        above = len(new) - bisect.bisect_right(new, top)  # c(top)
        d_lo = n - past_lo + prior_lo
        d_top = n - (bisect.bisect_right(edges, top) - 1) + k * math.exp(-top / m)
        lifted = max(bound, new[-1] - lo_s)  # a mean is at most its largest part
        if d_top + above > 0.0:
            lifted = min(lifted, max(
                bound, (d_top * bound + excess) / (d_top + above), (d_lo * bound + excess) / (d_lo + above)
            ))  # fmt: skip
        return lifted if lifted <= bound * _LIFT else None


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
        self._bounds: dict[str, _Bounds] = {}  # per tool: built when first needed
        self._means: dict[str, float] = {}  # per tool, till its next sample: asked of every pending call

    def observe(self, tool: str, duration_s: float) -> None:
        """Record one finished call of ``tool`` that took ``duration_s`` seconds."""
        if not math.isfinite(duration_s) or duration_s < 0:
            raise ValueError(f"duration must be finite and >= 0, got {duration_s}")
        self._samples.setdefault(tool, _Samples()).add(duration_s)
        self._means.pop(tool, None)
        bounds = self._bounds.get(tool)
        if bounds is not None:
            bounds.observed(duration_s)

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
        mean = self._means.get(tool)
        if mean is None:
            mean = self._means[tool] = self.mean_residual_life(tool, 0.0)
        return mean

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
        """An upper bound of ``mean_residual_life(tool, x)`` for every ``x`` in ``[lo_s, hi_s]``,
        equal to ``MRL(lo_s)`` when ``lo_s == hi_s`` and no sample came since the last build
        (``_Bounds``), and close to the true maximum however wide the interval."""
        samples = self._samples.get(tool)
        if samples is None:
            return self._prior(tool)
        a = max(0.0, lo_s)
        b = max(a, hi_s)
        bounds = self._bounds.get(tool)
        bound = None if bounds is None or bounds.stale() else bounds.bound(a, b)
        if bound is None:  # none yet, stale, or samples observed since that cannot be bounded
            bounds = self._bounds[tool] = _Bounds(samples.values(), self._prior(tool), self.prior_weight)
            bound = bounds.bound(a, b)
            assert bound is not None  # nothing observed since the build
        return bound

    def quantiles(self, tool: str) -> list[float]:
        """The observed durations of ``tool``, sorted (candidate TTLs for a policy)."""
        samples = self._samples.get(tool)
        return samples.values() if samples is not None else []
