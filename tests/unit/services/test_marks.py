"""Partition marks (services/marks.py) and the pure helpers of worker recovery (services/replay.py)."""

from __future__ import annotations

from typing import Any

from log.topics import SESSION_TOPICS
from schemas import events as ev
from services.checkpoint import state_from_json, state_to_json
from services.marks import SessionLow, make_mark, needs_work, session_start
from services.replay import without_parent_history
from services.session import SessionState, ToolStatus
from tests.unit.services.branch_world import World

LLM: dict[str, Any] = {"llm": {"prompt_tokens": 32, "output_tokens": 4}}
ECHO: dict[str, Any] = {"tool": "echo", "arguments": {"text": "hi"}}
DECIDER = frozenset({ToolStatus.PROPOSED})
EXECUTOR = frozenset({ToolStatus.COMMITTED, ToolStatus.STARTED, ToolStatus.IN_DOUBT})
TOPICS = SESSION_TOPICS


def test_a_finished_session_needs_no_work_unless_a_role_still_acts_on_it() -> None:
    world = World()
    world.request("done", [LLM, ECHO])
    world.settle()
    assert world.state("done").finished and not needs_work(world.state("done"))
    assert not needs_work(SessionState("never-requested"))

    world.request("running", [LLM, ECHO, LLM])
    world.planner("running")
    assert needs_work(world.state("running"))

    # Finished (cancelled) with a proposal nobody decided: the decider still acts, the executor not.
    world.request("held", [ECHO])
    world.planner("held")
    world.planner("held")
    world.operator("held", ev.CancelRequested(author="t", reason="stop"))
    world.planner("held")  # the planner ends a cancelled session
    state = world.own_state("held")
    assert state.finished and state.tool_calls["tool-0"].status is ToolStatus.PROPOSED
    assert needs_work(state) and needs_work(state, DECIDER) and not needs_work(state, EXECUTOR)
    # Once committed, it is the executor's.
    world.decider("held")
    state = world.own_state("held")
    assert needs_work(state, EXECUTOR) and not needs_work(state, DECIDER)


def test_a_finished_session_with_a_pending_restore_is_needed() -> None:
    world = World()
    world.request("s", [LLM, {"checkpoint": True}, LLM])
    world.settle()
    assert not needs_work(world.state("s"))
    world.operator("s", ev.RestoreRequested(author="t", checkpoint_id="ckpt-1", dry_run=False))
    assert world.state("s").pending_commands and needs_work(world.state("s"), DECIDER)


def test_a_session_starts_at_its_newest_snapshotted_checkpoint_else_at_its_first_records() -> None:
    first = {"agent.actions": 10, "ops.commands": 3}
    cuts = [("c1", {t: 20 for t in TOPICS}), ("c2", {t: 40 for t in TOPICS})]
    assert session_start(SessionLow("s", first, cuts), TOPICS) == ({t: 40 for t in TOPICS}, "c2")
    assert session_start(SessionLow("s", first, []), TOPICS) == (first, None)
    # A role that reads fewer topics: only those.
    assert session_start(SessionLow("s", first, cuts), ("agent.actions",)) == ({"agent.actions": 40}, "c2")


def test_the_mark_is_the_lowest_offset_any_needed_session_needs_per_topic() -> None:
    read_to = {"agent.actions": 100, "agent.verdicts": 50, "ops.commands": 9}
    needed = [
        SessionLow("a", {"agent.actions": 70, "ops.commands": 8}, []),  # from scratch, no verdict yet
        SessionLow("b", {"agent.actions": 5}, [("auto-1", {**read_to, "agent.actions": 60, "agent.verdicts": 30})]),
    ]
    mark = make_mark(3, read_to, needed)
    assert mark.partition == 3
    assert mark.start == {"agent.actions": 60, "agent.verdicts": 30, "ops.commands": 8}
    assert mark.read_to == read_to
    assert mark.sessions == {"a": None, "b": "auto-1"}
    # Nothing needed: start where the worker has read to; nothing listed.
    empty = make_mark(0, read_to, [])
    assert empty.start == read_to and empty.sessions == {}


def test_a_forks_snapshot_without_its_parent_history_is_the_forks_own_fold() -> None:
    world = World()
    world.request("p", [LLM, {"checkpoint": True}, ECHO, LLM])
    world.settle()
    world.operator("p", ev.ForkRequested(author="t", checkpoint_id="ckpt-1", fork_session_id="f"))
    world.settle()
    full = world.state("f")
    assert full.inherited and any(s.origin == "p" for s in full.steps)
    own = state_to_json(world.own_state("f"))
    assert state_to_json(without_parent_history(state_from_json(state_to_json(full)))) == own
    assert state_to_json(without_parent_history(world.own_state("f"))) == own  # nothing to take out
