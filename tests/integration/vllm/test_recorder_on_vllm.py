"""No LLM call computed twice on real vLLM: a planner SIGKILLed right after vLLM answered, then
restarted, through the engine recorder (workers/engines/recorder.py) and without it.

The planner, decider and executor are real processes on the real Postgres log; the planner's
engine is vLLM (``--engine-kind vllm``, replies constrained to ``react`` JSON). The crash point
``planner.after_engine`` kills the planner after the engine's answer and before
``LLMCallCompleted`` is in the log, so the restarted planner asks for the same request id again.
vLLM's own ``vllm:e2e_request_latency_seconds_count`` counts what it computed:

- through the recorder, exactly the LLM calls the log holds (the retry is answered from the record);
- straight to vLLM, one more: the control case, which shows the test can fail.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from cli.common import ensure_topics
from cli.sessions import SessionBook
from cli.stack import Stack, free_port
from log import open_log
from schemas import events as ev
from tests.integration.vllm.conftest import Vllm

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOPICS = ["agent.actions", "agent.verdicts", "agent.effects", "ops.commands"]
_COUNT = re.compile(r"^vllm:e2e_request_latency_seconds_count\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE)


def _computed(vllm: Vllm) -> int:
    """Requests vLLM has finished computing, from its Prometheus metrics."""
    with urllib.request.urlopen(f"{vllm.url}/metrics", timeout=10) as response:
        return sum(int(float(n)) for n in _COUNT.findall(response.read().decode()))


def _wait_http(url: str, process: subprocess.Popen[bytes], wait_s: float = 60) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the recorder exited {process.returncode}"
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {wait_s} s")


async def _run_session(pg_url: str, session: str, stack: Stack, wait_s: float) -> SessionBook:
    """Request a react session, restart the planner when its crash point kills it, and read the
    log until the session ends."""
    args = {"task": "Echo the word hello, then answer.", "tools": ["echo"], "max_steps": 3, "max_output_tokens": 32}
    book = SessionBook()
    async with open_log(pg_url, actor="operator") as operator:
        await operator.append(session, ev.SessionRequested(program="react", args_json=json.dumps(args), author="test"))
        restarted = False
        deadline = time.monotonic() + wait_s
        async with operator.consumer(f"watch-{session}", TOPICS, from_beginning=True) as consumer:
            while time.monotonic() < deadline:
                for event in await consumer.poll(timeout_s=0.3):
                    book.add(event)
                if session in book.records and book.records[session].state.finished:
                    break
                if not restarted and not stack.processes["planner-0"].alive():
                    stack.start_process("planner-0")  # no crash point this time
                    restarted = True
        assert restarted, "the crash point never fired"
    return book


@pytest.mark.parametrize("through_recorder", [True, False], ids=["recorder", "straight-to-vllm"])
def test_a_planner_killed_after_the_engine_answered_does_not_make_vllm_compute_again(
    vllm: Vllm, pg_url: str, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through_recorder: bool
) -> None:
    monkeypatch.setenv("AGENTLOG_NAMESPACE", namespace)
    ensure_topics(pg_url)
    session = f"rec-{uuid.uuid4().hex[:6]}"
    recorder = None
    engine_port = int(vllm.url.rsplit(":", 1)[1])
    if through_recorder:
        engine_port = free_port()
        recorder = subprocess.Popen(
            [sys.executable, "-m", "workers.engines.recorder", "--upstream", vllm.url, "--port", str(engine_port),
             "--record-url", pg_url, "--namespace", namespace]
        )  # fmt: skip
        _wait_http(f"http://127.0.0.1:{engine_port}/recorder/stats", recorder)
    stack = Stack(
        pg_url,
        tmp_path,
        engine_port=engine_port,
        extra_env={
            "AGENTLOG_ENGINE_KIND": "vllm",
            "AGENTLOG_VLLM_MODEL": vllm.model,
            "AGENTLOG_VLLM_REACT_TOOLS": "echo",
        },
    )
    stack.work_dir.mkdir(parents=True, exist_ok=True)
    before = _computed(vllm)
    try:
        stack.start_process("decider")
        stack.start_process("executor")
        stack.start_process("planner-0", env={"AGENTLOG_CRASH_AT": "planner.after_engine:1"})
        book = asyncio.run(_run_session(pg_url, session, stack, wait_s=180))
    finally:
        stack.stop()
        if recorder is not None:
            recorder.terminate()
            recorder.wait(10)
    computed = _computed(vllm) - before

    state = book.records[session].state
    assert state.finished, {n: p.log_tail() for n, p in stack.processes.items()}
    calls = [c for c in state.llm_calls.values() if c.completed is not None]
    assert calls, "the session made no LLM call"
    if through_recorder:
        assert computed == len(calls), f"vLLM computed {computed} requests for {len(calls)} LLM calls"
    else:
        assert computed == len(calls) + 1, f"vLLM computed {computed} requests for {len(calls)} LLM calls"
