"""Pure domain logic: no I/O, no clocks, no implicit randomness.

The fold of a session's events (``session``), agent programs (``programs``), the
planner's next move (``planning``) and the events that carry it out (``decide``),
checkpoint / fork / restore / merge rules (``checkpoint``), replay and partition-mark
rules (``replay``, ``marks``), tools and voters, the cache manager and its policy
(``cache``), the simulated engine (``engine``) and agent traces (``traces``).
"""
