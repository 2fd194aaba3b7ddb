"""Golden logs (tests/golden/*.jsonl), recorded from real runs, replayed with today's code.

Each is loaded into the in-memory backend and folded into what the roles derive from it
(tests/golden/replay.py): every session's state and digest, every checkpoint's state at
its cut, every merge's plan, the cache manager's decisions. The result must equal what it
was when the log was recorded (``NAME.expected.json``): a change to folding, to the cache
manager or to the checkpoint and merge rules that changes any of them fails here. When the
change is meant, run ``python -m tests.golden.record --expected-only`` and review the diff.

Where the recorded workers wrote a value derived from the log (a checkpoint's digest, a
merge's results or conflicts, the cache manager's decisions), the replay must also give
what they wrote: the log and today's code agree.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.golden.replay import HERE, golden_names, load, replay

pytestmark = pytest.mark.unit

NAMES = golden_names()


def test_the_three_scenarios_are_recorded() -> None:
    assert set(NAMES) >= {"crash_recovered", "fork_merge", "cache_managed"}


@pytest.fixture(scope="module")
def replayed() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Per golden log: (what it replays into now, what it replayed into when recorded)."""
    out = {}
    for name in NAMES:
        header, store = load(HERE / f"{name}.jsonl")
        expected = json.loads((HERE / f"{name}.expected.json").read_text())
        out[name] = (asyncio.run(replay(header, store)), expected)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_a_golden_log_replays_into_its_recorded_states_and_decisions(name: str, replayed: dict[str, Any]) -> None:
    now, expected = replayed[name]
    for part in ("sessions", "checkpoints", "merges", "cache_decisions"):
        assert now[part] == expected[part], f"{name}: {part} changed (see the module docstring)"


@pytest.mark.parametrize("name", NAMES)
def test_what_the_recorded_workers_logged_is_what_the_replay_derives(name: str, replayed: dict[str, Any]) -> None:
    now, _ = replayed[name]
    for key, checkpoint in now["checkpoints"].items():
        assert checkpoint["digest"] == checkpoint["logged"], f"{name}: checkpoint {key}"
    for key, merge in now["merges"].items():
        plan, logged = merge["plan"], merge["logged"]
        assert plan["conflicts" if "conflicts" in logged else "results"] == next(iter(logged.values())), key
    decisions = now["cache_decisions"]
    if decisions:
        assert all(d["as_logged"] for d in decisions["decisions"]), f"{name}: a decision differs from the log's"
        assert len(decisions["decisions"]) == decisions["num_logged"]
