"""Crash points: deterministic SIGKILLs for recovery tests.

``AGENTLOG_CRASH_AT="executor.after_tool_started:2"`` makes the process kill
itself with SIGKILL the second time it reaches that point (no cleanup, no
flush: as abrupt as ``kill -9``). Points are named ``<role>.<where>``; each
worker documents the points it has. Unset, a crash point costs a dict lookup.
"""

from __future__ import annotations

import os
import signal
import sys

_spec = os.environ.get("AGENTLOG_CRASH_AT", "")
_targets: dict[str, int] = {}
for item in filter(None, _spec.split(",")):
    point, _, nth = item.partition(":")
    _targets[point.strip()] = int(nth or 1)
_hits: dict[str, int] = {}


def crash_point(point: str) -> None:
    """SIGKILL this process if ``point`` is armed and reached for the n-th time."""
    if point not in _targets:
        return
    _hits[point] = _hits.get(point, 0) + 1
    if _hits[point] == _targets[point]:
        print(f"crash point {point} reached (hit {_hits[point]}): SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
