"""The ``script`` program: a fixed list of steps, for tests, demos and operators' dry runs.

Arguments: ``{"steps": [...]}`` where each step is
``{"llm": {"prompt_tokens": n, "output_tokens": m}}`` (with ``"size": "small"`` or
``"large"``: the model size the step declares, for a stack with engines of both sizes) or
``{"tool": "<name>", "arguments": {...}}``, ``{"checkpoint": true}`` (a checkpoint
here) or ``{"fork": [{"steps": [...]}, ...]}`` (one branch per entry, each running
the steps so far and then its own; the step's result is the merge of their
outputs). The LLM prompts grow like a real
context (each prompt extends the previous one), so prefix caching applies.
Failed tool calls do not stop the script; the output lists each tool's outcome.
"""

from __future__ import annotations

from typing import Any

from services.programs.base import (
    Action,
    CallLLM,
    CallTool,
    Fail,
    Finish,
    Fork,
    LLMResult,
    ProgramView,
    Prompt,
    TakeCheckpoint,
    TokenRun,
    ToolResult,
    output_run,
)


class ScriptProgram:
    name = "script"

    def next_action(self, view: ProgramView) -> Action:
        steps = view.args.get("steps")
        if not isinstance(steps, list):
            return Fail("script needs args.steps (a list)")
        if view.step >= len(steps):
            outcomes: list[Any] = [
                {"tool": r.tool, "ok": r.ok, "error": r.error, **({"result": r.result} if r.tool == "merge" else {})}
                for r in view.results
                if isinstance(r, ToolResult)
            ]
            return Finish({"steps": len(steps), "tools": outcomes})
        step = steps[view.step]
        if "llm" in step:
            spec = step["llm"]
            prompt = (*_context(view), TokenRun(f"{view.context_id}:prompt:{view.step}", int(spec["prompt_tokens"])))
            return CallLLM(Prompt(prompt), int(spec.get("output_tokens", 16)), size=spec.get("size"))
        if "tool" in step:
            return CallTool(str(step["tool"]), dict(step.get("arguments", {})), step.get("resource"))
        if "checkpoint" in step:
            return TakeCheckpoint()
        if "fork" in step:
            # Each branch replays the steps so far (its inherited history) and then runs its own.
            return Fork(
                tuple(
                    {"steps": [*steps[: view.step], *branch.get("steps", [])], "branch": index}
                    for index, branch in enumerate(step["fork"])
                )
            )
        return Fail(f"step {view.step} is neither llm nor tool (nor checkpoint, fork): {step!r}")


def _context(view: ProgramView) -> tuple[TokenRun, ...]:
    """Every prompt, output and tool result so far, in order: the prefix of the next prompt."""
    steps = view.args["steps"]
    runs: list[TokenRun] = []
    for index, result in enumerate(view.results):
        if isinstance(result, LLMResult):
            runs.append(TokenRun(f"{view.context_id}:prompt:{index}", int(steps[index]["llm"]["prompt_tokens"])))
            runs.append(output_run(result.request_id, result.output_tokens))
        else:
            runs.append(TokenRun(f"{view.context_id}:tool:{index}", result.result_tokens))
    return tuple(runs)
