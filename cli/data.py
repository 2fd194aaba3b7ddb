"""Where agentlog's shipped data lives: the published traces (``traces/``, see its README).

One lookup for the demo, the benchmarks and the tests, so that a checkout with nothing
beside it and an installed wheel both find them:

1. ``AGENTLOG_TRACES_DIR`` when set (your own copy, or another set of traces);
2. ``traces/`` of the source checkout this module was imported from;
3. ``share/agentlog/traces`` of the Python environment (where the wheel installs them).

When none exists the checkout's folder is returned, so the caller's "not found" error
names the place a user would look first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TRACES_DIR_ENV = "AGENTLOG_TRACES_DIR"
CHECKOUT_TRACES = Path(__file__).resolve().parent.parent / "traces"
INSTALLED_TRACES = Path(sys.prefix) / "share" / "agentlog" / "traces"

INFERCEPT = "infercept_merged_exp_uniform.json"
CONTINUUM = "continuum_swe_test5_with_timings.json"
MOONCAKE = "mooncake_conversation_trace.jsonl"


def traces_dir() -> Path:
    """The folder of the published traces (see the module docstring for the order)."""
    if configured := os.environ.get(TRACES_DIR_ENV):
        return Path(configured)
    for candidate in (CHECKOUT_TRACES, INSTALLED_TRACES):
        if candidate.is_dir():
            return candidate
    return CHECKOUT_TRACES


def trace_file(name: str, folder: Path | None = None) -> Path:
    """``folder / name`` (``folder`` defaults to ``traces_dir()``), or FileNotFoundError naming
    the path and the variable that moves it."""
    path = (folder or traces_dir()) / name
    if not path.is_file():
        raise FileNotFoundError(f"trace {path} not found: pass its folder, or set {TRACES_DIR_ENV} to it")
    return path
