"""Bad input never stops a worker: each case gets a clear error in the log.

Real processes (sim engine, planner, decider, executor) on the real Postgres log:
a program step that is not an action, a tool that raises, arguments that fail the
tool's schema, an unknown tool, an event for a session nobody requested, and a
duplicate verdict.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from cli.common import ensure_topics
from cli.sessions import SessionBook
from cli.stack import Stack
from log import open_log
from schemas import events as ev

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def llm(n: int = 20) -> dict[str, Any]:
    return {"llm": {"prompt_tokens": n, "output_tokens": 4}}


CASES: dict[str, list[dict[str, Any]]] = {
    "not-an-action": [llm(), {"bogus": True}],
    "tool-raises": [llm(), {"tool": "file_write", "arguments": {"path": "../outside.txt", "content": "x"}}, llm()],
    "bad-arguments": [llm(), {"tool": "echo", "arguments": {"text": 3}}, llm()],
    "unknown-tool": [llm(), {"tool": "launch_rockets", "arguments": {}}, llm()],
    "duplicate-verdict": [llm(), {"tool": "sleep", "arguments": {"seconds": 1.0}}, llm()],
}


def test_bad_input_is_recorded_and_no_worker_stops(
    pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url)
    run = uuid.uuid4().hex[:4]
    sessions = {case: f"{case}-{run}" for case in CASES}
    stack = Stack(pg_url, tmp_path, time_scale=1.0, extra_env={"AGENTLOG_LEDGER_URL": pg_url})
    with stack:
        book, letters = asyncio.run(_scenario(pg_url, sessions))
        assert all(p.alive() for p in stack.processes.values()), {n: p.log_tail() for n, p in stack.processes.items()}

    def state(case: str) -> Any:
        return book.records[sessions[case]].state

    failed = state("not-an-action")
    assert failed.status.value == "failed" and "neither llm nor tool" in (failed.failure or "")

    raised = state("tool-raises").tool_calls["tool-1"]
    assert raised.status.value == "failed" and raised.failure is not None
    assert raised.failure.error_type == "PermissionError" and "outside the sandbox" in raised.failure.error
    assert state("tool-raises").status.value == "finished"  # the program saw the failure and went on

    aborted = state("bad-arguments").tool_calls["tool-1"]
    assert aborted.status.value == "aborted" and "text: 3 is not of type 'string'" in aborted.verdict.reason

    unknown = state("unknown-tool").tool_calls["tool-1"]
    assert unknown.status.value == "aborted" and "unknown tool 'launch_rockets'" in unknown.verdict.reason
    assert unknown.attempts == 0, "an aborted call never runs"

    duplicate = state("duplicate-verdict")
    assert duplicate.status.value == "finished"
    assert duplicate.tool_calls["tool-1"].status.value == "completed"  # the first verdict stood

    by_error = {(d.error_type, d.source_session_id) for d in letters}
    assert ("UnknownSession", f"ghost-{run}") in by_error
    assert ("DuplicateVerdict", sessions["duplicate-verdict"]) in by_error


async def _scenario(pg_url: str, sessions: dict[str, str]) -> tuple[SessionBook, list[ev.RecordDeadLettered]]:
    run = next(iter(sessions.values())).rsplit("-", 1)[1]
    async with open_log(pg_url, actor="operator") as operator, open_log(pg_url, actor="decider") as decider:
        for case, session in sessions.items():
            args = json.dumps({"steps": CASES[case]})
            await operator.append(session, ev.SessionRequested(program="script", args_json=args, author="test"))
        # An operator command for a session nobody requested.
        await operator.append(
            f"ghost-{run}",
            ev.ApprovalGiven(call_id="tool-1", decision=ev.ApprovalDecision.APPROVE, author="t", reason="typo"),
        )
        book = SessionBook()
        letters: list[ev.RecordDeadLettered] = []
        duplicated = False
        topics = ["agent.actions", "agent.verdicts", "agent.effects", "ops.commands", "agent.dlq"]
        deadline = time.monotonic() + 90
        async with operator.consumer(f"watch-{run}", topics, from_beginning=True) as consumer:
            while time.monotonic() < deadline:
                for event in await consumer.poll(timeout_s=0.3):
                    if isinstance(event.body, ev.RecordDeadLettered):
                        letters.append(event.body)
                    else:
                        book.add(event)
                dup = book.records.get(sessions["duplicate-verdict"])
                if (
                    not duplicated
                    and dup
                    and "tool-1" in dup.state.tool_calls
                    and dup.state.tool_calls["tool-1"].verdict
                ):
                    # A second, contradicting verdict from the decider's principal (a buggy or replayed decider).
                    await decider.append(
                        sessions["duplicate-verdict"],
                        ev.ToolCallAborted(call_id="tool-1", votes=[], policy="unanimous", reason="second opinion"),
                    )
                    duplicated = True
                done = all(s in book.records and book.records[s].state.finished for s in sessions.values())
                if done and {d.error_type for d in letters} >= {"UnknownSession", "DuplicateVerdict"}:
                    break
    return book, letters
