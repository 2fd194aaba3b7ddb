"""A fork's first LLM call reuses its parent's KV prefix on a real vLLM server.

A ``script`` session (an LLM call, a checkpoint, an LLM call) runs with an in-process planner
on ``VllmEngine``; an operator forks it at the checkpoint. The fork inherits its parent's
context (the same ``context_id``, so the same token ids up to the fork point), so vLLM serves
its first call's prefix from the blocks the parent left in its prefix cache: no recompute of
the parent's history. A session with the same steps and no lineage shares nothing and hits
nothing, which shows where the fork's hit came from.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

import pytest

from cli.common import ensure_topics
from log import SharedLog, open_log
from schemas import events as ev
from services.session import SessionState, fold
from tests.integration.vllm.conftest import Vllm
from workers.engines.vllm.control import ControlClient
from workers.engines.vllm_http import VllmEngine
from workers.planner import PlannerWorker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BLOCK = 32  # the test server's block size
STEPS: list[dict[str, Any]] = [
    {"llm": {"prompt_tokens": 8 * BLOCK, "output_tokens": 4}},
    {"checkpoint": True},
    {"llm": {"prompt_tokens": BLOCK, "output_tokens": 4}},
]


async def _state(log: SharedLog, session: str) -> SessionState:
    return fold(session, [e.envelope for e in await log.history(session)])


async def _until_finished(log: SharedLog, session: str, timeout_s: float = 120) -> SessionState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = await _state(log, session)
        if state.finished:
            return state
        await asyncio.sleep(0.2)
    raise AssertionError(f"{session} did not finish: {await _state(log, session)}")


def _first_call(state: SessionState) -> ev.LLMCallCompleted:
    own = [c for c in state.llm_calls.values() if c.origin is None and c.completed is not None]
    assert own, state
    completed = own[0].completed
    assert completed is not None
    return completed


async def _run(vllm: Vllm, pg_url: str, parent: str, fork: str, stranger: str) -> dict[str, SessionState]:
    engine = VllmEngine(vllm.url, engine_id="vllm-0", model=vllm.model)
    args = json.dumps({"steps": STEPS})
    async with open_log(pg_url, actor="planner") as planner_log, open_log(pg_url, actor="operator") as operator:
        planner = PlannerWorker(planner_log, engine=engine, instance_id="planner-fork")
        running = asyncio.create_task(planner.run())
        try:
            await operator.append(parent, ev.SessionRequested(program="script", args_json=args, author="test"))
            states = {parent: await _until_finished(operator, parent)}
            request = ev.ForkRequested(author="test", checkpoint_id="ckpt-1", fork_session_id=fork)
            await operator.append(parent, request)
            states[fork] = await _until_finished(operator, fork)
            await operator.append(stranger, ev.SessionRequested(program="script", args_json=args, author="test"))
            states[stranger] = await _until_finished(operator, stranger)
            return states
        finally:
            planner.shutdown()
            await running
            await planner.close()
            control = ControlClient(vllm.control)
            for session in (parent, fork, stranger):
                await control.call("discard", session=session)
            await control.aclose()


def test_a_forks_first_call_is_served_from_its_parents_cached_prefix(
    vllm: Vllm, pg_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url)
    run = uuid.uuid4().hex[:6]
    parent, fork, stranger = f"fp-{run}", f"fp-{run}.fork", f"fs-{run}"
    states = asyncio.run(_run(vllm, pg_url, parent, fork, stranger))

    parent_first = _first_call(states[parent])
    assert parent_first.call_id == "llm-0" and parent_first.cached_tokens == 0, "fresh token ids: nothing cached"
    child = states[fork]
    assert child.fork is not None and child.fork.checkpoint_id == "ckpt-1"
    child_first = _first_call(child)
    assert child_first.call_id == "llm-2" and child_first.engine_id == "vllm-0"
    # Every full block of the parent's history (its first prompt at least) comes from vLLM's cache.
    assert child_first.cached_tokens >= 8 * BLOCK, child_first
    assert child_first.cached_tokens % BLOCK == 0 and child_first.cached_tokens < child_first.prompt_tokens
    # The same steps without the lineage: other token ids, no hit on the first call.
    assert _first_call(states[stranger]).cached_tokens == 0
