"""A plugin for tests/e2e/test_chat_agent.py: an agent whose model picks its tool calls (function calling).

``weather_agent`` offers the model one user tool, ``forecast``; while the model answers with tool
calls the agent makes them (``ctx.run_tool_calls``: proposed, voted on, executed) and sends the
results back; it returns the model's text answer and the ``tool`` messages it sent. On the
simulated engine the first call asks for ``forecast`` and the second, with its result in hand,
answers; a ``#malformed-...`` marker in the goal makes the model's call malformed, and the agent
tells it the error instead (the default). ``forecast`` appends a line to the sandbox's ledger per
execution, so a test can count them.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

from services.sdk import Context, program, tool


@tool(
    name="forecast",
    effect="idempotent",
    schema={
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 2, "maxLength": 16},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    description="The weather forecast for a city.",
)
def forecast(args: dict[str, Any], ctx: Any) -> dict[str, Any]:
    ledger = ctx.sandbox / "forecasts.jsonl"
    ledger.parent.mkdir(parents=True, exist_ok=True)
    with ledger.open("a") as out:
        out.write(json.dumps({"key": ctx.idempotency_key, **args}, sort_keys=True) + "\n")
        out.flush()
        os.fsync(out.fileno())
    return {"city": args["city"], "high": 10 + zlib.crc32(args["city"].encode()) % 20, "days": args["days"]}


@program(name="weather_agent")
async def weather_agent(ctx: Context) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer weather questions; call forecast for data."},
        {"role": "user", "content": ctx.args["goal"]},
    ]
    sent: list[dict[str, Any]] = []
    for _ in range(int(ctx.args.get("max_turns", 4))):
        reply = await ctx.llm(messages=messages, tools=[forecast.function_spec], max_tokens=12)
        messages.append(reply.message)
        if not reply.tool_calls:
            return {"answer": reply.text, "tool_messages": sent}
        answers = await ctx.run_tool_calls(reply)
        sent.extend(answers)
        messages.extend(answers)
    return {"answer": None, "tool_messages": sent}
