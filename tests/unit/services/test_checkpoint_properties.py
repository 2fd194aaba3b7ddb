"""Property-based tests: random runs, checkpoints, forks, restores, merges and crashes on the pure world.

Whatever the sequence:
- no irreversible effect runs twice: each payment call runs at most once, and
  per session and step index at most one payment ever runs (restores across a
  payment are refused; forks never run what they inherited);
- every session's fold is the same replayed from its first event or from any
  of its snapshots plus the records after the snapshot's cut;
- every checkpoint's digest is the digest of the fold of the records below its cut.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import events as ev
from services.checkpoint import state_digest, state_to_json
from services.session import step_of
from tests.unit.services.branch_world import World

pytestmark = pytest.mark.unit

LLM: dict[str, Any] = {"llm": {"prompt_tokens": 16, "output_tokens": 2}}
STEPS: dict[str, dict[str, Any]] = {
    "llm": LLM,
    "echo": {"tool": "echo", "arguments": {"text": "x"}},
    "book": {"tool": "book", "arguments": {"resource": "room"}},
    "pay": {"tool": "payment", "arguments": {"account": "a", "amount_cents": 1}},
    "write": {"tool": "file_write", "arguments": {"path": "f", "content": "c"}},
    "checkpoint": {"checkpoint": True},
}

scripts = st.lists(st.sampled_from(sorted(STEPS)), min_size=2, max_size=7)
roles = st.sampled_from(["planner", "decider", "executor", "crash_before", "crash_after", "crash_llm"])
operations = st.one_of(
    st.tuples(st.just("run"), st.integers(0, 9), roles),
    st.tuples(st.just("checkpoint"), st.integers(0, 9)),
    st.tuples(st.just("restore"), st.integers(0, 9), st.integers(0, 5)),
    st.tuples(st.just("fork"), st.integers(0, 9), st.integers(0, 5)),
    st.tuples(st.just("merge"), st.integers(0, 9), st.integers(1, 9), st.integers(1, 9)),
    st.tuples(st.just("settle")),
)


def _apply(world: World, order: list[str], op: tuple[Any, ...], n: int) -> None:
    session = order[op[1] % len(order)] if len(op) > 1 else ""
    match op[0]:
        case "run":
            role = op[2]
            if role == "planner":
                world.planner(session)
            elif role == "crash_llm":
                world.planner(session, crash_in_llm=True)
            elif role == "decider":
                world.decider(session)
            elif role == "executor":
                world.executor(session)
            else:
                # Bring a call to the executor, then kill it after ToolCallStarted (before or after the effect).
                for _ in range(3):
                    world.planner(session)
                    world.decider(session)
                world.executor(session, crash="before_effect" if role == "crash_before" else "after_effect")
        case "checkpoint":
            world.operator(session, ev.CheckpointRequested(author="p", checkpoint_id=f"c{n}"))
        case "restore" | "fork":
            checkpoints = list(world.state(session).checkpoints)
            if not checkpoints:
                return
            checkpoint_id = checkpoints[op[2] % len(checkpoints)]
            if op[0] == "restore":
                world.operator(session, ev.RestoreRequested(author="p", checkpoint_id=checkpoint_id, dry_run=False))
            else:
                fork = f"{session}~{n}"
                world.operator(session, ev.ForkRequested(author="p", checkpoint_id=checkpoint_id, fork_session_id=fork))
                world.planner(session)  # the planner creates it; it joins the sessions the test picks from
                if fork in world.events:
                    order.append(fork)
        case "merge":
            # Only sessions created later than the parent: a merge waits for its branches, so a
            # branch that waits for its parent in turn would wait forever (see docs/branches.md).
            index = order.index(session)
            later = order[index + 1 :]
            if later:
                branches = sorted({later[op[2] % len(later)], later[op[3] % len(later)]})
                world.operator(session, ev.MergeRequested(author="p", branch_session_ids=branches))
        case "settle":
            world.settle()


def _check(world: World) -> None:
    by_step: Counter[tuple[str, int]] = Counter()
    for (session, call_id), runs in world.executions.items():
        call = world.own_state(session).tool_calls.get(call_id) or world.own_state(session).abandoned.get(call_id)
        tool = getattr(getattr(call, "proposed", None), "tool", None)
        if tool == "payment":
            assert runs == 1, f"payment {session}/{call_id} ran {runs} times"
            by_step[(session, step_of(call_id))] += 1
    assert all(n == 1 for n in by_step.values()), f"a payment step ran again after a restore: {by_step}"
    for session in world.sessions():
        state = world.state(session)
        assert not state.anomalies, state.anomalies
        full = state_to_json(state)
        for (owner, checkpoint_id), (cut, _) in world.snapshots.items():
            if owner != session:
                continue
            assert state_to_json(world.replay_from_snapshot(session, checkpoint_id)) == full
            taken = state.checkpoints.get(checkpoint_id) or world.own_state(session).checkpoints[checkpoint_id]
            assert taken.taken.state_digest == state_digest(world.state_at(session, cut))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=scripts,
    second=scripts,
    ops=st.lists(operations, min_size=1, max_size=40),
    every=st.sampled_from([0, 0, 7]),
)
def test_random_histories_never_repeat_an_irreversible_effect_and_replay_the_same(
    first: list[str], second: list[str], ops: list[tuple[Any, ...]], every: int
) -> None:
    world = World(checkpoint_every=every)
    order = ["a", "b"]
    world.request("a", [STEPS[s] for s in first])
    world.request("b", [STEPS[s] for s in second])
    for n, op in enumerate(ops):
        _apply(world, order, op, n)
        _check(world)
    world.settle()
    _check(world)
    # Settled: a session is finished, or waits on something named (a call of its own in flight, or
    # unfinished sessions a merge waits for) -- never stuck on nothing, forks included.
    waits = {s: world.waits_on(s) for s in world.sessions() if not world.state(s).finished}
    for session, on in waits.items():
        assert on, f"{session} is stuck: {world.state(session).status}"
    # ...and what sessions wait on ends in calls: no cycle of sessions waiting on each other.
    done: set[str] = set()
    for session in waits:
        path = [session]
        while path[-1] not in done:
            after = [o for o in waits[path[-1]] if o in waits and o not in done]
            if not after:
                done.add(path.pop())
                if not path:
                    break
                continue
            assert after[0] not in path, f"sessions wait on each other: {path + after[:1]}"
            path.append(after[0])
