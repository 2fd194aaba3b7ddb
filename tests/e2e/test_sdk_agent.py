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
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from cli.sessions import SessionBook, read_sessions
from cli.stack import Stack, free_port
from log import open_log
from schemas import events as ev

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PLUGINS = "examples.travel_agent.agent,tests.e2e.sdk_fickle"
GOAL = "Search flights to Lisbon, quote a hotel for two nights, book the cheapest flight."
BRANCHES = 2  # the example forks one branch per hotel
FORK_STEP = 3


class SdkScenario:
    def __init__(self, kafka: str, namespace: str, pg_url: str, work: Path, num_sessions: int = 2) -> None:
        self.log_url = f"kafka://{kafka}"
        self.namespace = namespace
        env = {
            "AGENTLOG_NAMESPACE": namespace,
            "AGENTLOG_LEDGER_URL": pg_url,
            "AGENTLOG_PLUGINS": PLUGINS,
            "AGENTLOG_VOTERS": "default,llm_judge",
        }
        self.stack = Stack(self.log_url, work, extra_env=env)
        run = uuid.uuid4().hex[:4]
        self.sessions = [f"trip{i}-{run}" for i in range(num_sessions)]
        self.poor = f"poor-{run}"  # its budget is too small: the user's voter refuses the booking
        self.ledger = work / "sandbox" / "bookings.jsonl"

    @property
    def parents(self) -> list[str]:
        return [*self.sessions, self.poor]

    @property
    def everyone(self) -> list[str]:
        branches = [f"{p}.fork-{FORK_STEP}.{i}" for p in self.parents for i in range(BRANCHES)]
        return [*self.parents, *branches]

    def start(self, victim: str = "", crash_at: str = "") -> None:
        ensure_topics(self.log_url, namespace=self.namespace)
        self.stack.work_dir.mkdir(parents=True, exist_ok=True)
        self.stack.engine_port = free_port()
        self.stack.start_process("engine")
        self.stack.wait_for_engine(30)
        for name in ("decider", "executor", "planner-0"):
            self.stack.start_process(name, {"AGENTLOG_CRASH_AT": crash_at} if name == victim else None)

    async def request(self, session: str, program: str, args: dict[str, Any]) -> None:
        async with open_log(self.log_url, actor="operator", namespace=self.namespace) as log:
            await log.append(session, ev.SessionRequested(program=program, args_json=json.dumps(args), author="test"))

    def request_all(self) -> None:
        for session in self.sessions:
            asyncio.run(self.request(session, "travel_agent", {"goal": GOAL, "to": "LIS", "budget_cents": 10**6}))
        asyncio.run(self.request(self.poor, "travel_agent", {"goal": GOAL, "to": "LIS", "budget_cents": 1}))

    def bookings(self) -> list[dict[str, Any]]:
        if not self.ledger.exists():
            return []
        return [json.loads(line) for line in self.ledger.read_text().splitlines() if line.strip()]

    def engine_stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.stack.engine_url}/stats", timeout=5) as response:
            stats: dict[str, Any] = json.loads(response.read())
            return stats

    def drive(self, wanted: list[str], deadline_s: float = 150) -> tuple[SessionBook, list[str]]:
        return asyncio.run(self._drive(wanted, deadline_s))

    async def _drive(self, wanted: list[str], deadline_s: float) -> tuple[SessionBook, list[str]]:
        """Like an operator: approve held bookings, resolve in-doubt ones from the ledger, restart the dead."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        resolved: list[str] = []
        approved: set[tuple[str, str]] = set()
        book = SessionBook()
        topics = ["agent.actions", "agent.verdicts", "agent.effects", "ops.commands"]
        async with (
            open_log(self.log_url, actor="operator", namespace=self.namespace) as log,
            log.consumer(f"watch-{uuid.uuid4().hex[:6]}", topics, from_beginning=True) as consumer,
        ):
            while loop.time() < deadline:
                for name, process in list(self.stack.processes.items()):
                    if not process.alive():
                        self.stack.start_process(name, {"AGENTLOG_CRASH_AT": ""})  # the restart runs clean
                book.add_all(await consumer.poll(timeout_s=0.3))
                for session in wanted:
                    record = book.records.get(session)
                    for call_id, tool in record.state.tool_calls.items() if record else ():
                        key = (session, call_id)
                        held = tool.proposed.tool == "book_flight" and tool.status.value == "proposed"
                        if held and key not in approved:
                            approval = ev.ApprovalGiven(
                                call_id=call_id, decision=ev.ApprovalDecision.APPROVE, author="test", reason="ok"
                            )
                            await log.append(session, approval)
                            approved.add(key)
                        if tool.status.value == "in_doubt" and f"{session}/{call_id}" not in resolved:
                            resolved.append(f"{session}/{call_id}")
                            done = any(b["key"] == tool.proposed.idempotency_key for b in self.bookings())
                            flag = "--mark-done" if done else "--retry"
                            argv = ["approve", session, call_id, flag, "--log-url", self.log_url, "--reason", "ledger"]
                            result = await asyncio.to_thread(
                                CliRunner().invoke, app, argv, env={"AGENTLOG_NAMESPACE": self.namespace}
                            )
                            assert result.exit_code == 0, result.output
                if all(s in book.records and book.records[s].state.finished for s in wanted):
                    async with open_log(self.log_url, actor="auditor", namespace=self.namespace) as reader:
                        return await read_sessions(
                            reader, group=f"check-{uuid.uuid4().hex[:6]}", idle_polls=1
                        ), resolved
        states = "\n".join(f"{s}: {r.state.status} {r.state.failure}" for s, r in book.records.items())
        logs = "\n".join(f"--- {n}\n{p.log_tail(40)}" for n, p in self.stack.processes.items())
        raise AssertionError(f"sessions did not finish in {deadline_s} s\n{states}\n{logs}")


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
            if f"{session}/tool-4" in resolved:  # in doubt, and the operator found it in the ledger
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
            assert resolved, "an irreversible call caught mid-flight must be reported in doubt"
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
        held = asyncio.run(_wait_for(scenario, session, lambda s: "tool-2" in s.tool_calls))
        assert held.tool_calls["tool-2"].status.value == "proposed"  # waiting for an approval nobody gives
        planner = scenario.stack.processes["planner-0"]
        planner.kill()
        scenario.stack.start_process("planner-0", {"FICKLE_TO": "OPO"})  # the program now searches elsewhere
        failed = asyncio.run(_wait_for(scenario, session, lambda s: s.finished))
        assert failed.status is not None and failed.status.value == "failed"
        assert failed.failure is not None and failed.failure.startswith(
            'step 1: the log holds tool call tool-1 (search_flights) with arguments {"to": "LIS"}, '
            'the program now asks for {"to": "OPO"}'
        ), failed.failure
        errors = asyncio.run(_error_types(scenario, session))
        assert errors == ["NonDeterminism"]
    finally:
        scenario.stack.stop()


async def _wait_for(scenario: SdkScenario, session: str, done: Any, deadline_s: float = 60) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    book = SessionBook()
    topics = ["agent.actions", "agent.verdicts", "agent.effects"]
    async with (
        open_log(scenario.log_url, actor="auditor", namespace=scenario.namespace) as log,
        log.consumer(f"wait-{uuid.uuid4().hex[:6]}", topics, from_beginning=True) as consumer,
    ):
        while loop.time() < deadline:
            book.add_all(await consumer.poll(timeout_s=0.3))
            record = book.records.get(session)
            if record is not None and done(record.state):
                return record.state
    logs = "\n".join(f"--- {n}\n{p.log_tail(30)}" for n, p in scenario.stack.processes.items())
    raise AssertionError(f"{session} did not get there in {deadline_s} s\n{logs}")


async def _error_types(scenario: SdkScenario, session: str) -> list[str]:
    async with open_log(scenario.log_url, actor="auditor", namespace=scenario.namespace) as log:
        history = await log.history(session)
    return [e.body.error_type for e in history if isinstance(e.body, ev.SessionFailed)]
