"""Checkpoint, restore, fork and merge rules on the pure fold (services/checkpoint.py, services/session.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas import events as ev
from services.checkpoint import (
    cut_of,
    json_digest,
    merge_plan,
    restore_plan,
    state_digest,
    state_from_json,
    state_to_json,
)
from services.planning import CutCheckpoint, MergeBranches, RefuseRestore, WaitFor, next_move
from services.programs import PROGRAMS
from services.session import SessionStatus, step_of
from tests.unit.services.branch_world import World

pytestmark = pytest.mark.unit

LLM: dict[str, Any] = {"llm": {"prompt_tokens": 32, "output_tokens": 4}}
PAY: dict[str, Any] = {"tool": "payment", "arguments": {"account": "a", "amount_cents": 5}}
BOOK: dict[str, Any] = {"tool": "book", "arguments": {"resource": "room-1"}}
ECHO: dict[str, Any] = {"tool": "echo", "arguments": {"text": "hi"}}


def finished_world(steps: list[dict[str, Any]], session: str = "s") -> World:
    world = World()
    world.request(session, steps)
    world.settle()
    assert world.state(session).finished
    return world


def test_a_checkpoint_records_cut_digest_and_effects_and_its_snapshot_replays_to_the_same_state() -> None:
    world = finished_world([LLM, BOOK, {"checkpoint": True}, PAY, LLM])
    state = world.state("s")
    checkpoint = state.checkpoints["ckpt-2"]
    assert checkpoint.step_bound == 3  # llm-0, tool-1 and the checkpoint step itself
    assert [(e.call_id, e.tool, e.effect_class, e.status) for e in checkpoint.taken.effects] == [
        ("tool-1", "book", ev.EffectClass.COMPENSATABLE, "completed")
    ]
    # The digest is the fold of the records below the cut.
    assert checkpoint.taken.state_digest == state_digest(world.state_at("s", checkpoint.taken.cut))
    assert json_digest(world.snapshots[("s", "ckpt-2")][1]) == checkpoint.taken.state_digest  # checked on load
    # Replaying from the snapshot gives the very same state as replaying from the first event.
    assert state_to_json(world.replay_from_snapshot("s", "ckpt-2")) == state_to_json(state)
    assert state_to_json(state_from_json(state_to_json(state))) == state_to_json(state)


def test_the_digest_covers_the_applied_event_ids_not_only_their_number() -> None:
    # Which records a fold skips as already seen is part of the state: swapping one applied id
    # for another (same count) must change the digest, so such a snapshot is not trusted.
    state = finished_world([LLM, ECHO]).state("s")
    data = state_to_json(state)
    swapped = {**data, "applied": sorted([*data["applied"][1:], "not-an-event-of-this-session"])}
    assert len(swapped["applied"]) == len(data["applied"])
    assert json_digest(swapped) != json_digest(data) == state_digest(state)


def test_cut_is_past_every_read_record_and_the_end_offsets_read_before() -> None:
    world = finished_world([LLM, ECHO])
    events = world.events["s"]
    cut = cut_of(events, {"agent.actions": 2, "ops.commands": 50})
    assert cut["ops.commands"] == 50
    assert cut["agent.effects"] == max(e.offset for e in events if e.topic == "agent.effects") + 1
    assert set(cut) == {"agent.actions", "agent.verdicts", "agent.effects", "ops.commands"}


def test_restore_across_an_irreversible_payment_is_refused_naming_it() -> None:
    world = finished_world([LLM, {"checkpoint": True}, PAY, LLM])
    plan = restore_plan(world.state("s"), "ckpt-1")
    assert plan.refused is not None and plan.blocking == ("tool-2",)
    assert "tool-2 (payment) is irreversible and completed" in plan.refused
    world.operator("s", ev.RestoreRequested(author="t", checkpoint_id="ckpt-1", dry_run=False))
    assert isinstance(next_move(world.state("s"), PROGRAMS["script"]), RefuseRestore)
    world.settle()
    state = world.state("s")
    assert state.refusals[0].blocking_call_ids == ["tool-2"] and state.generation == 0
    assert world.executions[("s", "tool-2")] == 1


def test_restore_across_a_booking_compensates_it_once_then_rewinds_and_reruns() -> None:
    world = finished_world([LLM, {"checkpoint": True}, BOOK, LLM])
    plan = restore_plan(world.state("s"), "ckpt-1")
    assert plan.refused is None and [c.tool for c in plan.to_propose] == ["cancel_booking"]
    assert plan.abandoned_steps == ("tool-2", "llm-3")
    world.operator("s", ev.RestoreRequested(author="t", checkpoint_id="ckpt-1", dry_run=False))
    world.settle()
    state = world.state("s")
    assert state.generation == 1 and state.finished
    assert state.restores[0].compensated_call_ids == ["tool-2"]
    assert world.executions[("s", "undo.tool-2")] == 1
    assert world.executions[("s", "r1.tool-2")] == 1  # the rerun booked again, under a new id
    assert sorted(state.abandoned) == ["llm-3", "tool-2", "undo.tool-2"]
    assert [s.call_id for s in state.steps] == ["llm-0", "ckpt-1", "r1.tool-2", "r1.llm-3"]


def test_restore_waits_for_a_call_in_flight_and_refuses_one_in_doubt() -> None:
    world = World()
    world.request("s", [LLM, {"checkpoint": True}, BOOK, LLM])
    for _ in range(6):
        world.planner("s")
        world.decider("s")
    world.operator("s", ev.RestoreRequested(author="t", checkpoint_id="ckpt-1", dry_run=False))
    move = next_move(world.state("s"), PROGRAMS["script"])
    assert isinstance(move, WaitFor) and move.call_id == "tool-2"  # committed, not run yet
    world.executor("s", crash="before_effect")
    world.executor("s")  # recovery: a compensatable call caught mid-flight is in doubt
    plan = restore_plan(world.state("s"), "ckpt-1")
    assert plan.refused is not None and "tool-2 (book) is in doubt" in plan.refused


def test_a_failed_compensation_refuses_the_restore() -> None:
    world = finished_world([LLM, {"checkpoint": True}, BOOK, LLM])
    world.operator("s", ev.RestoreRequested(author="t", checkpoint_id="ckpt-1", dry_run=False))
    world.planner("s")  # proposes undo.tool-2
    world.append("s", ev.ToolCallAborted(call_id="undo.tool-2", votes=[], policy="unanimous", reason="no"), "decider")
    world.settle()
    state = world.state("s")
    assert state.generation == 0 and "compensation undo.tool-2 (cancel_booking) aborted" in state.refusals[0].reason


def test_a_later_checkpoint_is_abandoned_by_a_restore_to_an_earlier_one() -> None:
    world = finished_world([LLM, {"checkpoint": True}, ECHO, {"checkpoint": True}, LLM])
    world.operator("s", ev.RestoreRequested(author="t", checkpoint_id="ckpt-1", dry_run=False))
    world.settle()
    state = world.state("s")
    assert state.checkpoints["ckpt-3"].abandoned and not state.checkpoints["ckpt-1"].abandoned
    assert "rewound past" in (restore_plan(state, "ckpt-3").refused or "")
    assert "r1.ckpt-3" in state.checkpoints  # the rerun took its own checkpoint


def test_a_fork_inherits_history_by_reference_and_never_reruns_the_parents_effects() -> None:
    world = finished_world([LLM, PAY, {"checkpoint": True}, LLM, ECHO])
    world.operator("s", ev.ForkRequested(author="t", checkpoint_id="ckpt-2", fork_session_id="f"))
    world.settle()
    fork = world.state("f")
    assert fork.finished and fork.parent_session_id == "s"
    assert world.executions[("f", "tool-1")] == 0 and world.executions[("s", "tool-1")] == 1
    assert fork.tool_calls["tool-1"].origin == "s" and fork.llm_calls["llm-0"].origin == "s"
    assert "tool-1" not in world.own_state("f").tool_calls  # the executor never even sees it
    assert world.executions[("f", "tool-4")] == 1  # its own step after the fork point
    # A restore inside the fork never rewinds its inherited history.
    assert restore_plan(fork, "ckpt-2").abandoned_steps == ("llm-3", "tool-4")


def test_merge_rules_in_doubt_and_shared_resources_conflict_clean_branches_merge() -> None:
    world = World()
    world.request("p", [LLM, {"checkpoint": True}, LLM])
    world.settle()
    for name, steps in {"a": [BOOK], "b": [BOOK], "c": [ECHO], "d": [PAY]}.items():
        world.request(name, steps)
    world.settle()
    plan = merge_plan({b: world.own_state(b) for b in ("a", "b", "c")})
    assert plan.resources == ("book:room-1",)
    assert plan.conflicts == ("branches a/tool-0, b/tool-0 all have external effects on book:room-1",)
    clean = merge_plan({b: world.own_state(b) for b in ("a", "c", "d")})
    assert not clean.conflicted and set(clean.results) == {"a", "c", "d"}
    world.request("e", [PAY])
    world.planner("e")
    world.planner("e")
    world.decider("e")
    world.executor("e", crash="after_effect")
    world.executor("e")
    doubt = merge_plan({"e": world.own_state("e"), "c": world.own_state("c")})
    assert doubt.conflicts == ("branch e has call tool-0 (payment) in doubt",)
    # An operator merge folds the results into the parent, which sees them.
    world.operator("p", ev.MergeRequested(author="t", branch_session_ids=["a", "c"]))
    world.settle()
    assert json.loads(world.state("p").merges[0].results_json).keys() == {"a", "c"}


def test_a_merge_cycle_is_a_conflict_instead_of_a_wait_forever() -> None:
    # a merges b, b merges c, c merges a: each would wait for the next one's end forever.
    world = World()
    for name in ("a", "b", "c"):
        world.request(name, [LLM, LLM])
        world.planner(name)
    for parent, branch in (("a", "b"), ("b", "c"), ("c", "a")):
        world.operator(parent, ev.MergeRequested(author="t", branch_session_ids=[branch]))
    world.settle()
    states = {name: world.state(name) for name in ("a", "b", "c")}
    assert all(s.finished for s in states.values())
    # The first merge the planner looked at (a's) is refused, naming the cycle; that breaks it.
    assert [c.conflicts for c in states["a"].merge_conflicts] == [
        ["merge cycle: a waits for b, which waits for c, which waits for a; neither can end first"]
    ]
    assert [m.branch_session_ids for m in states["c"].merges] == [["a"]]
    assert [m.branch_session_ids for m in states["b"].merges] == [["c"]]
    assert not states["b"].merge_conflicts and not states["c"].merge_conflicts


def test_a_branch_of_a_fork_step_cannot_merge_its_waiting_parent() -> None:
    world = World()
    world.request("p", [LLM, {"fork": [{"steps": [LLM, LLM]}]}, LLM])
    for _ in range(4):
        world.planner("p")
    branch = "p.fork-1.0"
    assert branch in world.events and not world.state("p").finished  # p waits for its branch
    plan = merge_plan({"p": world.own_state("p")}, branch, {branch: world.own_state(branch)})
    assert plan.conflicts == (f"merge cycle: {branch} waits for p, which waits for {branch}; neither can end first",)


def test_a_program_forks_itself_waits_and_merges() -> None:
    world = World()
    branches = [{"steps": [ECHO, LLM]}, {"steps": [LLM]}]
    world.request("p", [LLM, {"fork": branches}, LLM])
    world.settle()
    parent = world.state("p")
    assert parent.finished
    step = parent.planner_steps["fork-1"]
    assert step.result is not None and set(step.result) == {"p.fork-1.0", "p.fork-1.1"}
    assert parent.checkpoints["fork-1"].step_bound == 1
    for branch in ("p.fork-1.0", "p.fork-1.1"):
        state = world.state(branch)
        assert state.finished and state.context_id == "p" and state.llm_calls["llm-0"].origin == "p"
    assert [step_of(s.call_id) for s in parent.steps] == [0, 1, 2]


def test_automatic_checkpoints_every_n_events() -> None:
    world = World(checkpoint_every=8)
    world.request("s", [LLM, ECHO, LLM, ECHO, LLM])
    world.settle()
    state = world.state("s")
    automatic = [c for c in state.checkpoints if c.startswith("auto-")]
    assert len(automatic) >= 2 and state.finished
    for checkpoint_id in automatic:
        assert state_to_json(world.replay_from_snapshot("s", checkpoint_id)) == state_to_json(state)
    assert not isinstance(next_move(state, PROGRAMS["script"], checkpoint_every=8), CutCheckpoint)


def test_a_second_checkpoint_request_with_a_taken_id_does_not_block_the_session() -> None:
    world = World()
    world.request("s", [LLM, ECHO, LLM])
    world.planner("s")
    world.operator("s", ev.CheckpointRequested(author="t", checkpoint_id="mine"))
    world.operator("s", ev.CheckpointRequested(author="t", checkpoint_id="mine"))
    world.settle()
    state = world.state("s")
    assert state.finished and list(state.checkpoints) == ["mine"] and not state.pending_commands


def test_a_cancel_is_not_held_by_a_merge_waiting_for_its_branches() -> None:
    world = World()
    world.request("p", [LLM, LLM])
    world.request("slow", [LLM, ECHO, LLM])
    world.planner("p")
    world.operator("p", ev.MergeRequested(author="t", branch_session_ids=["slow"]))
    assert isinstance(next_move(world.state("p"), PROGRAMS["script"]), MergeBranches)
    assert not world.planner("p")  # waits: the branch has not finished
    world.operator("p", ev.CancelRequested(author="t", reason="enough"))
    world.planner("p")
    assert world.state("p").status is SessionStatus.CANCELLED
