"""An SDK agent (examples/travel_agent) through real processes on a real Kafka broker, killed anywhere.

The stack (sim engine, planner, decider, executor) loads the example's module as
a plugin (``AGENTLOG_PLUGINS``) and runs the decider with the LLM judge besides
the default voters and the example's ``budget_guard``. Each scenario arms one
SIGKILL in the planner or the executor, restarts whatever died, approves the
irreversible bookings like an operator, and checks that:

- every session, and each of its fork's branches, finishes; a session over its
  budget gets its booking refused by the user's voter and says so;
- the engine computed exactly the distinct LLM calls (none recomputed);
- the bookings ledger holds each session's irreversible booking exactly once;
- every verdict on a booking carries the votes of the user's voter and of the judge.

And a program that changes its mind on replay fails its session with ``NonDeterminism``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

from log import open_log
from schemas import events as ev
from tests.e2e.sdk_scenario import SdkScenario, wait_for_session

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


CRASH_POINTS = [
    ("planner-0", "planner.after_llm_started:2"),
    ("planner-0", "planner.after_engine:3"),
    ("planner-0", "planner.after_checkpoint:2"),
    ("planner-0", "planner.after_branches:1"),
    ("executor", "executor.after_started.search_flights:1"),
    ("executor", "executor.after_tool.book_flight:1"),
    ("executor", "executor.after_completed:4"),
]


@pytest.mark.parametrize(("victim", "crash_at"), CRASH_POINTS, ids=[c for _, c in CRASH_POINTS])
def test_an_sdk_agent_killed_anywhere_completes_exactly_once(
    victim: str, crash_at: str, kafka_bootstrap: str, namespace: str, pg_url: str, tmp_path: Path
) -> None:
    scenario = SdkScenario(kafka_bootstrap, namespace, pg_url, tmp_path)
    scenario.start(victim, crash_at)
    try:
        scenario.request_all()
        book, resolved = scenario.drive(scenario.everyone)
        crashed_log = scenario.stack.processes[victim].log_path.read_text(errors="replace")
        assert f"crash point {crash_at.split(':')[0]} reached" in crashed_log, "the crash point was never reached"
        states = {s: book.records[s].state for s in scenario.everyone}
        for session, state in states.items():
            assert state.status is not None and state.status.value == "finished", (session, state.failure)
            assert not state.anomalies, state.anomalies
        for session in scenario.sessions:
            output = json.loads(states[session].output_json or "")
            if resolved.get(f"{session}/tool-4") == "--mark-done":  # in doubt, and found in the ledger
                assert output["booking"]["reason"] == "ledger", output
            else:
                assert output["booking"]["confirmation"].startswith("BK-"), output
            assert set(output["hotel"]) == {"hotel", "total_cents"}
            (booking,) = [t for t in states[session].tool_calls.values() if t.proposed.tool == "book_flight"]
            assert isinstance(booking.verdict, ev.ToolCallCommitted)
            voters = {v.voter: v.decision.value for v in booking.verdict.votes}
            assert voters["budget_guard"] == "APPROVE" and voters["human_approval"] == "APPROVE"
            assert voters["llm_judge"] in ("APPROVE", "ABSTAIN")
        refused = json.loads(states[scenario.poor].output_json or "")
        assert refused["booking"] is None
        assert "budget_guard: " in refused["refused"] and "over the budget of 1" in refused["refused"], refused
        # No LLM call recomputed: the engine served each distinct call once (branches reuse their parent's).
        distinct = sum(len(state.llm_calls) for state in states.values())
        assert distinct == 2 * len(scenario.sessions) + 1  # the refused session ends without its summary
        assert scenario.engine_stats()["num_served"] == distinct
        # The irreversible booking ran exactly once per session that was allowed to book.
        keys = [b["key"] for b in scenario.bookings()]
        assert sorted(keys) == sorted({f"{s}/tool-4" for s in scenario.sessions}), keys
        if crash_at.startswith("executor.after_tool.book_flight"):
            assert "--mark-done" in resolved.values(), "an irreversible call caught after it ran must be in doubt"
    finally:
        scenario.stack.stop()


def test_a_program_that_changes_its_mind_on_replay_fails_with_nondeterminism(
    kafka_bootstrap: str, namespace: str, pg_url: str, tmp_path: Path
) -> None:
    scenario = SdkScenario(kafka_bootstrap, namespace, pg_url, tmp_path, num_sessions=0)
    scenario.start()
    session = f"fickle-{uuid.uuid4().hex[:4]}"
    try:
        # Within budget, so budget_guard approves and the booking waits for a human: the session is still
        # open when the planner comes back with another mind (over budget, the voter would abort the
        # call and the session would fail with ToolError before the kill).
        asyncio.run(
            scenario.request(session, "fickle_agent", {"goal": "search flights, book flight", "budget_cents": 100_000})
        )
        held = asyncio.run(wait_for_session(scenario, session, lambda s: "tool-2" in s.tool_calls))
        assert held.tool_calls["tool-2"].status.value == "proposed"  # waiting for an approval nobody gives
        planner = scenario.stack.processes["planner-0"]
        planner.kill()
        scenario.stack.start_process("planner-0", {"FICKLE_TO": "OPO"})  # the program now searches elsewhere
        failed = asyncio.run(wait_for_session(scenario, session, lambda s: s.finished))
        assert failed.status is not None and failed.status.value == "failed"
        assert failed.failure is not None and failed.failure.startswith(
            'step 1: the log holds tool call tool-1 (search_flights) with arguments {"to": "LIS"}, '
            'the program now asks for {"to": "OPO"}'
        ), failed.failure
        errors = asyncio.run(_error_types(scenario, session))
        assert errors == ["NonDeterminism"]
    finally:
        scenario.stack.stop()


async def _error_types(scenario: SdkScenario, session: str) -> list[str]:
    async with open_log(scenario.log_url, actor="auditor", namespace=scenario.namespace) as log:
        history = await log.history(session)
    return [e.body.error_type for e in history if isinstance(e.body, ev.SessionFailed)]
