"""The react program: JSON tool calls, results fed back, invalid replies handled."""

from __future__ import annotations

import pytest

from services.programs import CallLLM, CallTool, Fail, Finish, LLMResult, ProgramView, ReactProgram, ToolResult

pytestmark = pytest.mark.unit

ARGS = {"task": "say hi", "tools": ["echo"], "max_invalid": 2}


def llm(i: int, text: str) -> LLMResult:
    return LLMResult(f"llm-{i}", f"s/llm-{i}", text, 10, 5)


def test_tool_call_then_answer() -> None:
    react = ReactProgram()
    first = react.next_action(ProgramView("s", ARGS))
    assert isinstance(first, CallLLM) and first.prompt.text and "Task: say hi" in first.prompt.text
    reply = llm(0, '{"tool": "echo", "arguments": {"text": "hi"}}')
    assert react.next_action(ProgramView("s", ARGS, (reply,))) == CallTool("echo", {"text": "hi"})
    result = ToolResult("tool-1", "echo", True, {"text": "hi"}, 3)
    again = react.next_action(ProgramView("s", ARGS, (reply, result)))
    assert isinstance(again, CallLLM) and 'Tool echo: {"text": "hi"}' in (again.prompt.text or "")
    done = react.next_action(ProgramView("s", ARGS, (reply, result, llm(2, '{"answer": "hi"}'))))
    assert done == Finish({"answer": "hi", "llm_calls": 2})


def test_invalid_replies_are_shown_then_fail() -> None:
    react = ReactProgram()
    once = react.next_action(ProgramView("s", ARGS, (llm(0, "hello!"),)))
    assert isinstance(once, CallLLM) and "Error: not JSON" in (once.prompt.text or "")
    twice = react.next_action(ProgramView("s", ARGS, (llm(0, "hello!"), llm(1, '{"tool": "rm"}'))))
    assert isinstance(twice, Fail) and "unknown tool 'rm'" in twice.reason
