"""The planner's chat engine client (``--engine-kind openai``) on a real vLLM server.

The tiny random-weight model has no chat template; ``workers.engines.vllm.server`` gives vLLM
``chat_template.jinja``. A named ``tool_choice`` makes vLLM constrain the reply to the function's
schema (no tool parser needed), so a real model returns a real tool call: its arguments parse and
satisfy the schema. The next turn sends the call and its result back (``tool`` message) with
``tool_choice: none``: a text answer, whose prompt starts with the first turn's, so whole blocks
come from vLLM's prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import jsonschema
import pytest

from services.programs.base import Prompt
from services.programs.sdk import render_messages
from tests.integration.vllm.conftest import Vllm, vllm_client
from workers.engines.chat import ChatEngine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCHEMA = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "detailed": {"type": "boolean"}},
    "required": ["unit", "detailed"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": SCHEMA}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_tool_choice_gets_a_real_tool_call_from_vllm(vllm: Vllm) -> None:
    async def body() -> None:
        session = f"chat-{uuid.uuid4().hex[:8]}"
        rng = random.Random(session)
        words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(60))  # a prefix no other test shares
        messages: list[dict[str, object]] = [
            {"role": "system", "content": "You call tools."},
            {"role": "user", "content": f"What is the weather? {words}"},
        ]
        engine = ChatEngine(vllm.url, engine_id="vllm-chat", model=vllm.model, temperature=0.0)
        try:
            first = await engine.complete(
                session_id=session,
                request_id=f"{session}/llm-0",
                prompt=Prompt(text=render_messages(messages, [TOOL], NAMED)),
                max_output_tokens=48,
                messages=messages,
                tools=[TOOL],
                tool_choice=NAMED,
            )
            [call] = first.tool_calls
            assert call.name == "get_weather" and call.id
            jsonschema.validate(json.loads(call.arguments), SCHEMA)
            assert first.prompt_tokens > 0 and first.output_tokens > 0

            messages += [
                {"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"high": 21}'},
            ]
            second = await engine.complete(
                session_id=session,
                request_id=f"{session}/llm-1",
                prompt=Prompt(text=render_messages(messages, [TOOL], "none")),
                max_output_tokens=4,
                messages=messages,
                tools=[TOOL],
                tool_choice="none",
            )
            assert second.tool_calls == () and second.output_tokens > 0
            assert second.prompt_tokens > first.prompt_tokens
            assert second.cached_tokens > 0  # the first turn's full blocks
        finally:
            await engine.close()
        async with vllm_client(vllm) as client:
            client.sessions.add(session)  # discard the session's blocks when done, as every vLLM test does

    asyncio.run(body())
