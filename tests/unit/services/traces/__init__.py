"""Tests of services.traces; ``real_trace`` finds the published trace files in shared/traces."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def traces_dir() -> Path:
    """``AGENTLOG_TRACES_DIR`` when set, else ``shared/traces`` beside the repository checkout."""
    if env := os.environ.get("AGENTLOG_TRACES_DIR"):
        return Path(env)
    return Path(__file__).resolve().parents[5] / "shared" / "traces"  # <checkout>/../shared/traces


def real_trace(name: str) -> Path:
    """The path of a published trace file; skips the test (saying where it looked) when it is absent."""
    path = traces_dir() / name
    if not path.is_file():
        pytest.skip(f"published trace {name} not found at {path} (set AGENTLOG_TRACES_DIR to its folder)")
    return path
