"""The collector thresholds of a process that consumes the log: ``tune_gc``.

A consumer of the log holds a long-lived state (chain tails of every session it has
read, a worker's own views) and allocates a dozen short-lived, acyclic objects per
record: the record, its envelope and body, the ``LoggedEvent``. With CPython's default
thresholds (700, 10, 10) a poll's events, alive until the caller is done with them,
survive two young collections, are promoted to the oldest generation and push it into
full collections, each a walk over everything the process holds. With a young
threshold of 50,000 allocations a poll's objects are freed by reference counting
before any collection sees them; only cyclic garbage (rare on this path) lives longer,
at most one young generation's worth.

Measured (docs/benchmarks.md): the cache manager worker's 28 full collections took 3.7 s
of a 16 s run of 150,000 events, and none ran with these thresholds; consuming
``agent.actions`` through ``EventConsumer`` on librdkafka went from 27,000-30,000 to
34,000-42,000 events/s (``bench.log_throughput``, alternated runs).

The setting is process-wide, so a library does not make it for its host: every worker
process sets it at start (``workers.main.run_worker``), the benchmarks set it as the
workers do, and a third-party consumer calls ``tune_gc()`` itself if it wants the same.
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (50_000, 20, 10)
"""Collector thresholds of a consuming process; CPython's default is (700, 10, 10)."""


def tune_gc() -> None:
    """Collect young objects every 50,000 allocations instead of every 700 (module docstring)."""
    gc.set_threshold(*GC_THRESHOLDS)
