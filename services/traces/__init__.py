"""Agent traces: the project's own format, importers of published traces, and a generator.

The format (see :mod:`services.traces.model` and ``docs/trace-format.md``) is JSONL, one line per
session; each turn records the tokens *appended* before an LLM call, the tokens it generated, and
the tool the agent then waited on (name, seconds, result tokens). The simulator and the ``trace``
agent program replay it.

Everything here is pure: importers take already-parsed JSON objects (InferCept, Continuum) or
lines of text (Mooncake), never paths, and randomness (Poisson arrivals, synthetic traces) comes
from a ``random.Random`` the caller seeds. Reading and writing files is the CLI's job
(``logctl trace import|synth|stats``).
"""

from services.traces.continuum import from_continuum
from services.traces.infercept import from_infercept
from services.traces.model import (
    SharedPrefix,
    Trace,
    TraceFormatError,
    TraceSession,
    TraceTurn,
    head,
    time_scale,
)
from services.traces.mooncake import from_mooncake
from services.traces.stats import TraceStats, percentile, trace_stats
from services.traces.synthetic import synthetic
from services.traces.tokens import approx_token_count

__all__ = [
    "SharedPrefix",
    "Trace",
    "TraceFormatError",
    "TraceSession",
    "TraceStats",
    "TraceTurn",
    "approx_token_count",
    "from_continuum",
    "from_infercept",
    "from_mooncake",
    "head",
    "percentile",
    "synthetic",
    "time_scale",
    "trace_stats",
]
