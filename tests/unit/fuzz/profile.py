"""One Hypothesis profile for the fuzz tests: few examples, derandomized, no deadline.

Derandomized, a run is the same run every time (CI time stays small and a failure
reproduces); ``AGENTLOG_FUZZ_EXAMPLES`` raises the count for a longer hunt by hand.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

FUZZ = settings(
    max_examples=int(os.environ.get("AGENTLOG_FUZZ_EXAMPLES", "100")),
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

FUZZ_SLOW = settings(FUZZ, max_examples=max(10, FUZZ.max_examples // 3))
"""For examples that each run a whole scenario (a log, a consumer, an event loop)."""
