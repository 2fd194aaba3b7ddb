"""Tests of services.traces; ``real_trace`` finds the published trace files (``traces/``, shipped)."""

from __future__ import annotations

from pathlib import Path

from cli.data import trace_file


def real_trace(name: str) -> Path:
    """The path of a published trace file. They ship with the repository, so a missing one fails
    the test (FileNotFoundError naming where it looked) instead of skipping it."""
    return trace_file(name)
