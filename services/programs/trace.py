"""The ``trace`` program: replays one session of a recorded agent trace, turn by turn.

Arguments: ``{"session": <one line of the project trace format as an object>}``
(see docs/trace-format.md). Each turn is an LLM call whose prompt is the whole
context so far plus the turn's new prompt tokens, generating the recorded
number of output tokens, then (except on the last turn) the recorded tool,
run as ``trace_tool`` with its recorded duration and result size. The context
grows by prompt + output + tool result tokens each turn, as a real agent's does.
"""

from __future__ import annotations

from typing import Any

from services.programs.base import (
    Action,
    CallLLM,
    CallTool,
    Fail,
    Finish,
    LLMResult,
    ProgramView,
    Prompt,
    TokenRun,
    ToolResult,
    output_run,
)


class TraceProgram:
    name = "trace"

    def next_action(self, view: ProgramView) -> Action:
        session = view.args.get("session")
        if not isinstance(session, dict) or not isinstance(session.get("turns"), list) or not session["turns"]:
            return Fail("trace program needs args.session with a non-empty turns list")
        turns: list[dict[str, Any]] = session["turns"]
        runs: list[TokenRun] = []
        prefix = turns[0].get("shared_prefix")
        if prefix:
            runs.append(TokenRun(f"prefix:{prefix['context_id']}", int(prefix["tokens"])))
        results = iter(view.results)
        for index, turn in enumerate(turns):
            runs.append(TokenRun(f"{view.context_id}:prompt:{index}", int(turn["prompt_tokens"])))
            llm = next(results, None)
            if llm is None:
                return CallLLM(Prompt(tuple(runs)), int(turn["output_tokens"]))
            if not isinstance(llm, LLMResult):
                return Fail(f"turn {index}: expected an LLM result, got {type(llm).__name__}")
            runs.append(output_run(llm.request_id, llm.output_tokens))
            if turn.get("tool") is None:
                return Finish({"turns": index + 1, "context_tokens": sum(r.count for r in runs)})
            tool = next(results, None)
            if tool is None:
                return CallTool(
                    "trace_tool",
                    {
                        "tool": turn["tool"],
                        "duration_s": float(turn.get("tool_duration_s") or 0.0),
                        "result_tokens": int(turn.get("tool_result_tokens") or 0),
                    },
                )
            if not isinstance(tool, ToolResult):
                return Fail(f"turn {index}: expected a tool result, got {type(tool).__name__}")
            runs.append(TokenRun(f"{view.context_id}:tool:{index}", tool.result_tokens))
        return Finish({"turns": len(turns), "context_tokens": sum(r.count for r in runs)})
