"""The ``react`` program on a real vLLM server, through the planner, decider and executor.

The planner runs here with ``VllmEngine``; vLLM's grammar-guided decoding keeps the tiny random
model's replies valid react JSON. The decider and executor are real processes, the log is the
real Postgres. Two sessions:

- ``tools``: replies constrained to tool calls (the model may not answer), ``max_steps=3``: three
  LLM calls with ``echo`` between them, then the program's own limit ends the session. Each
  call's prompt starts with the previous one's, so from turn 2 on whole blocks come from the
  cache, and the planner records vLLM's cached tokens and timings;
- ``answer``: replies constrained to answers: one LLM call, then ``SessionFinished``.

(Turn 1 of any react session may hit blocks too: every react prompt starts with the same
system text, and vLLM shares those blocks across sessions.)
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
from tests.integration.vllm.conftest import Vllm
from workers.engines.vllm.control import ControlClient
from workers.engines.vllm_http import VllmEngine, react_schema
from workers.planner import PlannerWorker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOPICS = ["agent.actions", "agent.verdicts", "agent.effects", "ops.commands"]
TASK = "Echo the word hello, then answer."


def test_react_runs_on_vllm_and_the_log_records_its_cache_hits(
    vllm: Vllm, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url)
    run = uuid.uuid4().hex[:6]
    stack = Stack(pg_url, tmp_path)
    stack.work_dir.mkdir(parents=True, exist_ok=True)
    try:
        stack.start_process("decider")
        stack.start_process("executor")
        tools = asyncio.run(_session(vllm, pg_url, f"tools-{run}", answer=False, max_steps=3))
        answer = asyncio.run(_session(vllm, pg_url, f"answer-{run}", answer=True, max_steps=3))
        assert all(p.alive() for p in stack.processes.values()), {n: p.log_tail() for n, p in stack.processes.items()}
    finally:
        stack.stop()

    state = tools.records[f"tools-{run}"].state
    assert state.status is not None and state.status.value == "failed", state.status
    assert state.failure == "no answer after 3 LLM calls"
    assert [t.status.value for t in state.tool_calls.values()] == ["completed", "completed", "completed"]
    calls = [c.completed for c in state.llm_calls.values()]
    assert len(calls) == 3
    block_size = 32
    for turn, done in enumerate(calls):
        assert done is not None
        assert done.engine_id == "vllm-0" and done.prompt_tokens > 0 and done.output_tokens > 0
        assert done.prefill_ms > 0 and done.decode_ms > 0 and done.queue_ms >= 0  # vLLM's per-request metrics
        reply = json.loads(done.output_text)
        assert reply["tool"] == "echo" and isinstance(reply["arguments"]["text"], str)
        if turn > 0:
            previous = calls[turn - 1]
            assert previous is not None
            # The transcript grows by appending: at least every full block of the previous prompt is a hit.
            assert done.cached_tokens >= (previous.prompt_tokens // block_size) * block_size
            assert done.cached_tokens % block_size == 0 and done.cached_tokens < done.prompt_tokens

    finished = answer.records[f"answer-{run}"].state
    assert finished.status is not None and finished.status.value == "finished", finished.failure
    assert len(finished.llm_calls) == 1


def _ended(book: SessionBook, session: str) -> bool:
    return session in book.records and book.records[session].state.finished


async def _session(vllm: Vllm, pg_url: str, session: str, *, answer: bool, max_steps: int) -> SessionBook:
    """Run one react session to its end with an in-process planner on vLLM."""
    schema = react_schema(["echo"], answer=False) if not answer else react_schema([], answer=True)
    engine = VllmEngine(vllm.url, engine_id="vllm-0", model=vllm.model, json_schema=schema)
    args: dict[str, Any] = {"task": TASK, "tools": ["echo"], "max_steps": max_steps, "max_output_tokens": 48}
    async with open_log(pg_url, actor="planner") as planner_log, open_log(pg_url, actor="operator") as operator:
        planner = PlannerWorker(planner_log, engine=engine, instance_id="planner-0")
        running = asyncio.create_task(planner.run())
        book = SessionBook()
        try:
            request = ev.SessionRequested(program="react", args_json=json.dumps(args), author="test")
            await operator.append(session, request)
            deadline = time.monotonic() + 120
            async with operator.consumer(f"watch-{session}", TOPICS, from_beginning=True) as consumer:
                while time.monotonic() < deadline and not _ended(book, session):
                    for event in await consumer.poll(timeout_s=0.3):
                        book.add(event)
        finally:
            planner.shutdown()
            await running
            await planner.close()
            control = ControlClient(vllm.control)
            await control.call("discard", session=session)
            await control.aclose()
    return book
