"""The stack an SDK agent runs on in the e2e tests: real processes on a real Kafka broker, and an
operator that drives sessions to their end (approves held bookings, resolves in-doubt calls from
the sandbox's ledger, restarts whatever died).

``SdkScenario`` defaults to the travel agent (examples/travel_agent) with the LLM judge;
``plugins`` and ``env`` run another agent (tests/e2e/test_chat_agent.py: a chat engine).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from cli.common import ensure_topics
from cli.main import app
from cli.sessions import SessionBook, read_sessions
from cli.stack import Stack, free_port
from log import open_log
from schemas import events as ev

PLUGINS = "examples.travel_agent.agent,tests.e2e.sdk_fickle"
GOAL = "Search flights to Lisbon, quote a hotel for two nights, book the cheapest flight."
BRANCHES = 2  # the example forks one branch per hotel
FORK_STEP = 3


class SdkScenario:
    def __init__(
        self,
        kafka: str,
        namespace: str,
        pg_url: str,
        work: Path,
        num_sessions: int = 2,
        *,
        plugins: str = PLUGINS,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log_url = f"kafka://{kafka}"
        self.namespace = namespace
        stack_env = {
            "AGENTLOG_NAMESPACE": namespace,
            "AGENTLOG_LEDGER_URL": pg_url,
            "AGENTLOG_PLUGINS": plugins,
            "AGENTLOG_VOTERS": "default,llm_judge",
            **(env or {}),
        }
        self.stack = Stack(self.log_url, work, extra_env=stack_env)
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

    def drive(self, wanted: list[str], deadline_s: float = 150) -> tuple[SessionBook, dict[str, str]]:
        return asyncio.run(self._drive(wanted, deadline_s))

    async def _drive(self, wanted: list[str], deadline_s: float) -> tuple[SessionBook, dict[str, str]]:
        """Like an operator: approve held bookings, resolve in-doubt ones from the ledger, restart the dead.

        Returns the sessions' states and how each in-doubt call was resolved (``session/call`` ->
        ``--mark-done`` when the ledger held it, ``--retry`` when it did not: the SIGKILL caught
        that call before it ran, which happens to whichever other booking was in flight then)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        resolved: dict[str, str] = {}
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
                            done = any(b["key"] == tool.proposed.idempotency_key for b in self.bookings())
                            flag = resolved[f"{session}/{call_id}"] = "--mark-done" if done else "--retry"
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


async def wait_for_session(scenario: SdkScenario, session: str, done: Any, deadline_s: float = 60) -> Any:
    """The session's folded state once ``done(state)`` holds (AssertionError with the processes' logs after
    ``deadline_s``)."""
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
