"""Residual completion with real processes on a real Kafka broker: kill any worker anywhere.

Each scenario starts the stack (sim engine, planner, decider, executor) as OS
processes, arms one crash point (a SIGKILL at a chosen place: before or after
an append, before or after a tool runs), runs sessions that call the LLM, run
tools and make irreversible payments, restarts whatever died, and checks:

- every session finishes;
- the engine computed exactly the distinct LLM calls the programs needed
  (a retried request id is answered from the engine's record, never recomputed);
- the payments ledger holds no duplicate, and every payment that a session
  completed is in it exactly once;
- an irreversible call caught mid-flight is reported in doubt and resolved by
  the operator command.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from cli.sessions import SessionBook, read_sessions
from cli.stack import Stack
from log import open_log
from schemas import events as ev

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_SESSIONS = 4


def script(i: int) -> dict[str, Any]:
    """LLM, tool, LLM, payment, LLM: every kind of step, an irreversible one in the middle."""
    return {
        "steps": [
            {"llm": {"prompt_tokens": 120, "output_tokens": 8}},
            {"tool": "sleep", "arguments": {"seconds": 0.05}},
            {"llm": {"prompt_tokens": 40, "output_tokens": 8}},
            {"tool": "payment", "arguments": {"account": f"acct-{i}", "amount_cents": 100 + i}},
            {"llm": {"prompt_tokens": 30, "output_tokens": 4}},
        ]
    }


class Scenario:
    def __init__(self, kafka: str, namespace: str, pg_url: str, work: Path) -> None:
        self.log_url = f"kafka://{kafka}"
        self.env = {"AGENTLOG_NAMESPACE": namespace, "AGENTLOG_LEDGER_URL": pg_url, "AGENTLOG_LOG_LEVEL": "INFO"}
        self.namespace = namespace
        self.pg_url = pg_url
        self.stack = Stack(self.log_url, work, time_scale=1.0, extra_env=self.env)
        self.sessions = [f"s{i}-{uuid.uuid4().hex[:4]}" for i in range(NUM_SESSIONS)]

    async def request_all(self) -> None:
        async with open_log(self.log_url, actor="operator", namespace=self.namespace) as log:
            for i, session in enumerate(self.sessions):
                await log.append(
                    session, ev.SessionRequested(program="script", args_json=json.dumps(script(i)), author="test")
                )

    async def read(self) -> SessionBook:
        async with open_log(self.log_url, actor="auditor", namespace=self.namespace) as log:
            book = await read_sessions(log, group=f"check-{uuid.uuid4().hex[:6]}", idle_polls=1)
        return book

    async def operator(self, session: str, call: str, decision: ev.ApprovalDecision) -> None:
        async with open_log(self.log_url, actor="operator", namespace=self.namespace) as log:
            await log.append(
                session, ev.ApprovalGiven(call_id=call, decision=decision, author="test-operator", reason="e2e")
            )

    async def payments(self) -> list[tuple[str, int]]:
        conn = await asyncpg.connect(self.pg_url)
        try:
            rows = await conn.fetch(
                "SELECT idempotency_key, count(*) FROM agentlog_ledger.payments WHERE session_id = ANY($1::text[]) "
                "GROUP BY idempotency_key",
                self.sessions,
            )
        finally:
            await conn.close()
        return [(r[0], r[1]) for r in rows]

    def engine_stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.stack.engine_url}/stats", timeout=5) as response:
            stats: dict[str, Any] = json.loads(response.read())
            return stats

    def drive(self, deadline_s: float = 150) -> tuple[SessionBook, list[str]]:
        return asyncio.run(self._drive(deadline_s))

    async def _drive(self, deadline_s: float) -> tuple[SessionBook, list[str]]:
        """Watch the log like an operator: approve held payments, resolve in-doubt calls, restart the dead."""
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
                        if name == "engine":
                            self.stack.wait_for_engine(30)
                book.add_all(await consumer.poll(timeout_s=0.3))
                for session in self.sessions:
                    record = book.records.get(session)
                    for call_id, tool in record.state.tool_calls.items() if record else ():
                        key = (session, call_id)
                        if tool.proposed.tool == "payment" and tool.status.value == "proposed" and key not in approved:
                            await log.append(
                                session,
                                ev.ApprovalGiven(
                                    call_id=call_id, decision=ev.ApprovalDecision.APPROVE, author="test", reason="ok"
                                ),
                            )
                            approved.add(key)
                        if tool.status.value == "in_doubt" and f"{session}/{call_id}" not in resolved:
                            resolved.append(f"{session}/{call_id}")
                            # The operator checks the outside world (the ledger): did the payment happen?
                            done = tool.proposed.idempotency_key in dict(await self.payments())
                            flag = "--mark-done" if done else "--retry"
                            argv = ["approve", session, call_id, flag, "--log-url", self.log_url, "--reason", "ledger"]
                            result = await asyncio.to_thread(
                                CliRunner().invoke, app, argv, env={"AGENTLOG_NAMESPACE": self.namespace}
                            )
                            assert result.exit_code == 0, result.output
                if all(s in book.records and book.records[s].state.finished for s in self.sessions):
                    # Re-read everything once more, from a fresh group, to check with a cold fold.
                    return await self.read(), resolved
        states = "\n".join(
            f"{s}: {r.state.status} llm={[(c, bool(x.completed)) for c, x in r.state.llm_calls.items()]} "
            f"tools={[(c, t.status.value, t.attempts) for c, t in r.state.tool_calls.items()]} "
            f"early={list(r.state.early)}"
            for s, r in book.records.items()
        )
        logs = "\n".join(f"--- {n}\n{p.log_tail(60)}" for n, p in self.stack.processes.items())
        raise AssertionError(f"sessions did not finish in {deadline_s} s\n{states}\n{logs}")


CRASH_POINTS = [
    ("engine", "engine.before_record:3"),
    ("engine", "engine.after_record:5"),
    ("planner-0", "planner.after_llm_started:2"),
    ("planner-0", "planner.after_engine:3"),
    ("planner-0", "planner.after_llm_completed:4"),
    ("planner-0", "planner.after_proposed:2"),
    ("decider", "decider.before_verdict:3"),
    ("decider", "decider.after_verdict:2"),
    ("executor", "executor.before_started:2"),
    ("executor", "executor.after_started.sleep:2"),
    ("executor", "executor.after_tool.sleep:1"),
    ("executor", "executor.after_started.payment:1"),
    ("executor", "executor.after_tool.payment:2"),
    ("executor", "executor.after_completed:3"),
]


@pytest.mark.parametrize(("victim", "crash_at"), CRASH_POINTS, ids=[c for _, c in CRASH_POINTS])
def test_kill_anywhere_and_complete_exactly_once(
    victim: str, crash_at: str, kafka_bootstrap: str, namespace: str, pg_url: str, tmp_path: Path
) -> None:
    scenario = Scenario(kafka_bootstrap, namespace, pg_url, tmp_path)
    _ensure_topics_in(scenario)
    stack = scenario.stack
    stack.engine_port = 0
    stack.work_dir.mkdir(parents=True, exist_ok=True)
    from cli.stack import free_port

    stack.engine_port = free_port()
    stack.start_process("engine")
    stack.wait_for_engine(30)
    if victim == "engine":
        stack.processes["engine"].stop()
        stack.start_process("engine", {"AGENTLOG_CRASH_AT": crash_at})
        stack.wait_for_engine(30)
    for name in ("decider", "executor", "planner-0"):
        stack.start_process(name, {"AGENTLOG_CRASH_AT": crash_at} if name == victim else None)
    try:
        asyncio.run(scenario.request_all())
        book, resolved = scenario.drive()
        crashed_log = stack.processes[victim].log_path.read_text(errors="replace")
        assert f"crash point {crash_at.split(':')[0]} reached" in crashed_log, "the crash point was never reached"
        for session in scenario.sessions:
            state = book.records[session].state
            assert state.status is not None and state.status.value == "finished", (session, state.status, state.failure)
            assert not state.anomalies, state.anomalies
        distinct_llm_calls = sum(len(book.records[s].state.llm_calls) for s in scenario.sessions)
        assert distinct_llm_calls == NUM_SESSIONS * 3
        assert scenario.engine_stats()["num_served"] == distinct_llm_calls
        payments = asyncio.run(scenario.payments())
        assert all(count == 1 for _, count in payments), f"duplicate payments: {payments}"
        assert len(payments) == NUM_SESSIONS
        if crash_at.startswith(("executor.after_started.payment", "executor.after_tool.payment")):
            assert resolved, "an irreversible call caught mid-flight must be reported in doubt"
    finally:
        stack.stop()


def _ensure_topics_in(scenario: Scenario) -> None:
    ensure_topics(scenario.log_url, namespace=scenario.namespace)


def test_two_planners_split_partitions_and_a_dead_ones_sessions_move(
    kafka_bootstrap: str, namespace: str, pg_url: str, tmp_path: Path
) -> None:
    scenario = Scenario(kafka_bootstrap, namespace, pg_url, tmp_path)
    scenario.sessions = [f"split{i}-{uuid.uuid4().hex[:4]}" for i in range(8)]
    _ensure_topics_in(scenario)
    stack = scenario.stack
    from cli.stack import free_port

    stack.engine_port = free_port()
    stack.work_dir.mkdir(parents=True, exist_ok=True)
    stack.start_process("engine")
    stack.wait_for_engine(30)
    for name in ("decider", "executor", "planner-0", "planner-1"):
        stack.start_process(name)
    try:
        # Both planners own partitions before any session starts.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            logs = [stack.processes[p].log_path.read_text(errors="replace") for p in ("planner-0", "planner-1")]
            if all("caught up" in text for text in logs):
                break
            time.sleep(0.3)
        else:
            raise AssertionError("the two planners did not both get partitions")
        asyncio.run(scenario.request_all())
        time.sleep(2.0)
        stack.processes["planner-1"].kill()  # its partitions must move to planner-0
        del stack.processes["planner-1"]  # and it is not restarted
        book, _ = scenario.drive()
        assert all(book.records[s].state.status.value == "finished" for s in scenario.sessions)
        taken = stack.processes["planner-0"].log_path.read_text(errors="replace")
        assert {f"partition {p} caught up" in taken for p in range(4)} == {True}
        assert scenario.engine_stats()["num_served"] == sum(
            len(book.records[s].state.llm_calls) for s in scenario.sessions
        )
    finally:
        stack.stop()


# ---------------------------------------------------------------------------- the librdkafka client
# The same scenarios with every process (and this test's own log clients) on librdkafka
# (log/rdkafka_backend.py): a crash after each role's append, an irreversible call caught
# mid-flight, and a group rebalance after a member dies.

RDKAFKA_CRASH_POINTS = [
    ("planner-0", "planner.after_llm_completed:4"),
    ("decider", "decider.after_verdict:2"),
    ("executor", "executor.after_started.payment:1"),
]


@pytest.mark.parametrize(("victim", "crash_at"), RDKAFKA_CRASH_POINTS, ids=[c for _, c in RDKAFKA_CRASH_POINTS])
def test_kill_anywhere_and_complete_exactly_once_on_librdkafka(
    victim: str,
    crash_at: str,
    kafka_bootstrap: str,
    namespace: str,
    pg_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AGENTLOG_KAFKA_CLIENT", "rdkafka")  # inherited by every process of the stack
    test_kill_anywhere_and_complete_exactly_once(victim, crash_at, kafka_bootstrap, namespace, pg_url, tmp_path)
    for name in ("decider", "executor", "planner-0"):
        assert "with librdkafka" in (tmp_path / "logs" / f"{name}.log").read_text(errors="replace"), name


def test_two_planners_split_partitions_and_a_dead_ones_sessions_move_on_librdkafka(
    kafka_bootstrap: str, namespace: str, pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_KAFKA_CLIENT", "rdkafka")
    test_two_planners_split_partitions_and_a_dead_ones_sessions_move(kafka_bootstrap, namespace, pg_url, tmp_path)
    assert "with librdkafka" in (tmp_path / "logs" / "planner-0.log").read_text(errors="replace")
