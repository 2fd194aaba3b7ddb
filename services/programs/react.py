"""The ``react`` program: a small tool-using loop for a real model.

Each step asks the LLM for one JSON object, either a tool call
``{"tool": "<name>", "arguments": {...}}`` or the answer ``{"answer": ...}``.
Tool results are fed back into the transcript. An output that is not valid
JSON of either shape is shown to the model with the error; after
``max_invalid`` invalid outputs in a row, or ``max_steps`` LLM calls, the
program fails with the reason.

Arguments: ``{"task": str, "tools": [names], "max_steps": int = 8, "max_invalid": int = 2,
"max_output_tokens": int = 256}``.
"""

from __future__ import annotations

import json
from typing import Any

from services.programs.base import Action, CallLLM, CallTool, Fail, Finish, LLMResult, ProgramView, Prompt, ToolResult

SYSTEM = (
    "You are an agent. Reply with exactly one JSON object and nothing else: "
    '{"tool": "<name>", "arguments": {...}} to call a tool, or {"answer": <value>} when done.'
)


def parse_reply(text: str, tools: list[str]) -> tuple[str, Any] | str:
    """``("tool", (name, args))`` / ``("answer", value)``, or an error message."""
    try:
        reply = json.loads(text.strip())
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at char {e.pos})"
    if not isinstance(reply, dict):
        return "not a JSON object"
    if "answer" in reply:
        return ("answer", reply["answer"])
    tool = reply.get("tool")
    if not isinstance(tool, str) or tool not in tools:
        return f"unknown tool {tool!r}; tools are {', '.join(tools)}"
    arguments = reply.get("arguments", {})
    if not isinstance(arguments, dict):
        return "arguments must be a JSON object"
    return ("tool", (tool, arguments))


class ReactProgram:
    name = "react"

    def next_action(self, view: ProgramView) -> Action:
        task = view.args.get("task")
        tools = view.args.get("tools", [])
        if not isinstance(task, str) or not isinstance(tools, list):
            return Fail("react needs args.task (string) and args.tools (list of tool names)")
        max_steps = int(view.args.get("max_steps", 8))
        max_invalid = int(view.args.get("max_invalid", 2))
        lines = [SYSTEM, f"Tools: {', '.join(tools)}", f"Task: {task}"]
        num_llm = invalid = 0
        pending: tuple[str, dict[str, Any]] | None = None
        for result in view.results:
            if isinstance(result, LLMResult):
                num_llm += 1
                lines.append(f"Assistant: {result.output_text}")
                parsed = parse_reply(result.output_text, tools)
                if isinstance(parsed, str):
                    invalid += 1
                    lines.append(f"Error: {parsed}. Reply with one JSON object.")
                    if invalid >= max_invalid:
                        return Fail(f"the model gave {invalid} invalid replies in a row; last: {parsed}")
                    continue
                invalid = 0
                kind, value = parsed
                if kind == "answer":
                    return Finish({"answer": value, "llm_calls": num_llm})
                pending = value
            elif isinstance(result, ToolResult):
                pending = None
                outcome = json.dumps(result.result) if result.ok else f"error: {result.error}"
                lines.append(f"Tool {result.tool}: {outcome}")
        if pending is not None:
            return CallTool(pending[0], pending[1])
        if num_llm >= max_steps:
            return Fail(f"no answer after {num_llm} LLM calls")
        return CallLLM(Prompt(text="\n".join([*lines, "Assistant:"])), int(view.args.get("max_output_tokens", 256)))
