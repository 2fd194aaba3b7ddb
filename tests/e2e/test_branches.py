"""Kill workers in the middle of a restore or a merge: recovery completes it exactly once.

The stack runs as OS processes on a real Postgres log (with the ledger and the
snapshot store in the same server); one process is armed with a crash point
(``AGENTLOG_CRASH_AT``, a SIGKILL at a chosen place) and restarted clean when
it dies, like an orchestrator would.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from cli.stack import Stack
from log import LoggedEvent, open_log
from schemas import events as ev
from services.session import SessionState, fold

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LLM: dict[str, Any] = {"llm": {"prompt_tokens": 48, "output_tokens": 4}}


class Crashy:
    def __init__(
        self, pg_url: str, namespace: str, work: Path, victim: str, crash_at: str, log_url: str | None = None
    ) -> None:
        self.pg_url, self.namespace = pg_url, namespace
        self.log_url = log_url or pg_url
        self.stack = Stack(self.log_url, work, time_scale=0.05, extra_env={"AGENTLOG_LEDGER_URL": pg_url})
        self.victim, self.crash_at = victim, crash_at
        self.num_restarts = 0

    def start(self) -> None:
        stack = self.stack
        stack.work_dir.mkdir(parents=True, exist_ok=True)
        from cli.stack import free_port

        stack.engine_port = free_port()
        stack.start_process("engine")
        stack.wait_for_engine(30)
        for name in ("decider", "executor", "planner-0"):
            stack.start_process(name, {"AGENTLOG_CRASH_AT": self.crash_at} if name == self.victim else None)

    def revive(self) -> None:
        for name, process in list(self.stack.processes.items()):
            if not process.alive():
                self.num_restarts += 1
                self.stack.start_process(name, {"AGENTLOG_CRASH_AT": ""})

    def logctl(self, *argv: str) -> Any:
        return CliRunner().invoke(app, [*argv, "--log-url", self.log_url], env={"AGENTLOG_NAMESPACE": self.namespace})

    def history(self, session: str) -> list[LoggedEvent]:
        async def go() -> list[LoggedEvent]:
            async with open_log(self.log_url, actor="auditor", namespace=self.namespace) as log:
                return await log.history(session)

        return asyncio.run(go())

    def state(self, session: str) -> SessionState:
        return fold(session, [e.envelope for e in self.history(session)])

    def request(self, session: str, steps: list[dict[str, Any]]) -> None:
        async def go() -> None:
            async with open_log(self.log_url, actor="operator", namespace=self.namespace) as log:
                body = ev.SessionRequested(program="script", args_json=json.dumps({"steps": steps}), author="t")
                await log.append(session, body)

        asyncio.run(go())

    def wait(self, session: str, until: Any, timeout_s: float = 90) -> SessionState:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.revive()
            state = self.state(session)
            if until(state):
                return state
            time.sleep(0.3)
        logs = "\n".join(f"--- {n}\n{p.log_tail(40)}" for n, p in self.stack.processes.items())
        raise AssertionError(f"{session} never got there: {self.state(session)}\n{logs}")

    def crashed(self) -> bool:
        text = self.stack.processes[self.victim].log_path.read_text(errors="replace")
        return f"crash point {self.crash_at.split(':')[0]} reached" in text

    def bookings(self, session: str) -> list[str]:
        async def go() -> list[str]:
            conn = await asyncpg.connect(self.pg_url)
            try:
                rows = await conn.fetch(
                    "SELECT status FROM agentlog_ledger.bookings WHERE session_id = $1 ORDER BY id", session
                )
            finally:
                await conn.close()
            return [r[0] for r in rows]

        return asyncio.run(go())


def count(history: list[LoggedEvent], kind: type[Any]) -> int:
    return sum(isinstance(e.body, kind) for e in history)


RESTORE_CRASHES = [
    ("planner-0", "planner.after_compensations:1"),
    ("planner-0", "planner.before_restore:1"),
    ("executor", "executor.after_started.cancel_booking:1"),
    ("executor", "executor.after_tool.cancel_booking:1"),
    ("decider", "decider.before_verdict:3"),
]


@pytest.mark.parametrize(("victim", "crash_at"), RESTORE_CRASHES, ids=[c for _, c in RESTORE_CRASHES])
def test_a_crash_mid_restore_completes_it_exactly_once(
    victim: str, crash_at: str, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url, namespace=namespace)
    run = Crashy(pg_url, namespace, tmp_path, victim, crash_at)
    _restore_after_a_crash(run)


def test_on_kafka_a_planner_killed_mid_restore_completes_it_exactly_once(
    kafka_bootstrap: str, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    log_url = f"kafka://{kafka_bootstrap}"
    ensure_topics(log_url, namespace=namespace)
    run = Crashy(pg_url, namespace, tmp_path, "planner-0", "planner.after_compensations:1", log_url)
    _restore_after_a_crash(run)


def _restore_after_a_crash(run: Crashy) -> None:
    run.start()
    try:
        session = f"rs-{uuid.uuid4().hex[:6]}"
        run.request(session, [LLM, {"checkpoint": True}, {"tool": "book", "arguments": {"resource": "r-1"}}, LLM])
        run.wait(session, lambda s: s.finished)
        asked = run.logctl("restore", session, "--to", "ckpt-1", "--no-wait")
        assert asked.exit_code == 0, asked.output
        state = run.wait(session, lambda s: s.finished and s.generation == 1)
        assert run.crashed(), "the crash point was never reached"
        history = run.history(session)
        assert count(history, ev.RestoreApplied) == 1
        assert state.restores[0].compensated_call_ids == ["tool-2"]
        undo = state.abandoned["undo.tool-2"]
        assert undo.status.value == "completed"  # type: ignore[union-attr]
        # The original booking was cancelled once; the rerun booked again, once.
        assert run.bookings(session) == ["cancelled", "booked"]
        assert not state.anomalies
    finally:
        run.stack.stop()


MERGE_CRASHES = [
    ("planner-0", "planner.before_merge:1"),
    ("planner-0", "planner.after_branches:1"),
    ("planner-0", "planner.after_checkpoint:1"),
]


@pytest.mark.parametrize(("victim", "crash_at"), MERGE_CRASHES, ids=[c for _, c in MERGE_CRASHES])
def test_a_crash_mid_merge_completes_it_exactly_once(
    victim: str, crash_at: str, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url, namespace=namespace)
    run = Crashy(pg_url, namespace, tmp_path, victim, crash_at)
    run.start()
    try:
        parent = f"mg-{uuid.uuid4().hex[:6]}"
        branches = [{"steps": [{"tool": "book", "arguments": {"resource": f"room-{i}"}}, LLM]} for i in range(2)]
        run.request(parent, [LLM, {"fork": branches}, LLM])
        state = run.wait(parent, lambda s: s.finished)
        assert run.crashed(), "the crash point was never reached"
        history = run.history(parent)
        assert count(history, ev.MergeApplied) == 1 and count(history, ev.MergeConflict) == 0
        assert count(history, ev.CheckpointTaken) == 1
        step = state.planner_steps["fork-1"]
        assert step.result is not None and len(step.result) == 2
        for i in range(2):
            branch = f"{parent}.fork-1.{i}"
            branch_history = run.history(branch)
            assert count(branch_history, ev.SessionStarted) == 1 and count(branch_history, ev.ForkCreated) == 1
            assert run.bookings(branch) == ["booked"], "each branch booked once"
    finally:
        run.stack.stop()


def test_a_branch_with_a_call_in_doubt_makes_a_merge_conflict(
    pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url, namespace=namespace)
    run = Crashy(pg_url, namespace, tmp_path, "executor", "executor.after_started.book:1")
    run.start()
    try:
        parent = f"dq-{uuid.uuid4().hex[:6]}"
        branches = [
            {"steps": [{"tool": "book", "arguments": {"resource": "room-x"}}]},
            {"steps": [{"tool": "echo", "arguments": {"text": "b"}}]},
        ]
        run.request(parent, [LLM, {"fork": branches}, LLM])
        state = run.wait(parent, lambda s: s.finished)
        (conflict,) = [e.body for e in run.history(parent) if isinstance(e.body, ev.MergeConflict)]
        doubtful = f"{parent}.fork-1.0"
        assert conflict.conflicts == [f"branch {doubtful} has call tool-1 (book) in doubt"]
        assert state.planner_steps["fork-1"].error == conflict.conflicts[0]
        assert run.state(doubtful).tool_calls["tool-1"].status.value == "in_doubt"
        assert count(run.history(parent), ev.MergeApplied) == 0, "nothing is merged silently"
    finally:
        run.stack.stop()
