"""The gateway in front of a real vLLM server, driven by the official ``openai`` client.

The same processes as ``tests/e2e/test_gateway.py`` (planner, decider, executor, ``workers.gateway``
on Kafka) with vLLM's OpenAI server instead of the sim engine. A named ``tool_choice`` makes the tiny
random model return a real tool call of ``echo`` (a built-in tool: the decider's voters know its schema
and commit it); the client gets it, reports a result, and the next turn streams text. The log holds
both LLM calls as the session's, the call committed and its reported result; a re-sent request is
answered from the log.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from cli.common import ensure_topics
from cli.sessions import read_sessions
from cli.stack import Stack, free_port
from log import open_log
from schemas import events as ev
from services.session import SessionState
from tests.integration.vllm.conftest import Vllm
from workers.gateway import SESSION_HEADER

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY = "vllm-gateway-key"
ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Return the text it is given.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 40}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def stack(vllm: Vllm, kafka_bootstrap: str, namespace: str, tmp_path: Path) -> Iterator[Stack]:
    log_url = f"kafka://{kafka_bootstrap}"
    ensure_topics(log_url, namespace=namespace)
    stack = Stack(
        log_url,
        tmp_path,
        extra_env={"AGENTLOG_NAMESPACE": namespace, "AGENTLOG_GATEWAY_API_KEYS": KEY},
        gateway=True,
        gateway_args=["--engine-url", vllm.url.rstrip("/"), "--engine-id", "vllm-0", "--models", vllm.model],
    )
    stack.work_dir.mkdir(parents=True, exist_ok=True)
    stack.engine_port = urlsplit(vllm.url).port or 80
    try:
        for name in ("decider", "executor", "planner-0"):
            stack.start_process(name)
        stack.gateway_port = free_port()
        stack.start_process("gateway")
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(stack.gateway_url.removesuffix("/v1") + "/health", timeout=1):
                    break
            except OSError:
                assert stack.processes["gateway"].alive(), stack.processes["gateway"].log_tail()
                assert time.monotonic() < deadline, stack.processes["gateway"].log_tail()
                time.sleep(0.2)
        yield stack
    finally:
        stack.stop()


def _state(stack: Stack, namespace: str, session: str, done: Any) -> SessionState:
    async def read() -> SessionState | None:
        async with open_log(stack.log_url, actor="auditor", namespace=namespace) as log:
            record = (await read_sessions(log, group=f"logctl-read-{uuid.uuid4().hex[:6]}")).records.get(session)
            return record.state if record else None

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = asyncio.run(read())
        if state is not None and done(state):
            return state
        time.sleep(0.5)
    raise AssertionError(f"{session}: {state}")


def test_an_openai_client_through_the_gateway_on_vllm(stack: Stack, vllm: Vllm, namespace: str) -> None:
    session = f"vllm-gw-{uuid.uuid4().hex[:8]}"
    rng = random.Random(session)
    words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(40))  # a prefix no other test shares
    client = openai.OpenAI(
        base_url=stack.gateway_url, api_key=KEY, default_headers={SESSION_HEADER: session}, max_retries=0, timeout=120
    )
    assert [m.id for m in client.models.list()] == [vllm.model]
    messages: list[Any] = [{"role": "user", "content": f"Echo a word. {words}"}]
    named = {"type": "function", "function": {"name": "echo"}}
    first = client.chat.completions.create(
        model=vllm.model, messages=messages, tools=[ECHO], tool_choice=named, max_tokens=48, temperature=0
    )
    [call] = first.choices[0].message.tool_calls or []
    assert call.function.name == "echo" and isinstance(json.loads(call.function.arguments), dict)
    again = client.chat.completions.with_raw_response.create(
        model=vllm.model, messages=messages, tools=[ECHO], tool_choice=named, max_tokens=48, temperature=0
    )
    assert again.headers["X-Agentlog-Replayed"] == "true" and again.parse().model_dump() == first.model_dump()

    messages += [
        first.choices[0].message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": "echoed"},
    ]
    chunks = list(
        client.chat.completions.create(
            model=vllm.model,
            messages=messages,
            tools=[ECHO],
            tool_choice="none",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next(c.usage for c in chunks if c.usage is not None)

    state = _state(stack, namespace, session, lambda s: "llm-2" in s.llm_calls and s.llm_calls["llm-2"].completed
                   and "tool-1" in s.tool_calls and s.tool_calls["tool-1"].completed)  # fmt: skip
    tool = state.tool_calls["tool-1"]
    assert tool.proposed.tool == "echo" and isinstance(tool.verdict, ev.ToolCallCommitted)
    assert tool.completed is not None and json.loads(tool.completed.result_json) == "echoed"
    second = state.llm_calls["llm-2"].completed
    assert second is not None and second.output_text == text and second.engine_id == "vllm-0"
    assert second.prompt_tokens == usage.prompt_tokens and second.output_tokens == usage.completion_tokens
