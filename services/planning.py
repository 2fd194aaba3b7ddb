"""Residual completion for the planner: given a session's folded state and its
program, what is the one thing to do next?

The program is replayed against the recorded results (completed LLM calls and
finished tool calls, in step order). The first step with no recorded result
is the residual work:

- an LLM call that was started but has no output is requested again, under
  the same request id (the engine answers a repeated request id from its
  record instead of running it twice); an LLM call with an output is never
  requested again;
- a tool call that was proposed is only waited for: verdicts and effects are
  other roles' work;
- if the program now asks for something else than what the log holds for
  that step, the program is not deterministic and the session fails with
  ``NonDeterminism`` rather than guessing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from schemas.events import EffectClass
from services.programs.base import (
    CallLLM,
    CallTool,
    Fail,
    Finish,
    LLMResult,
    Program,
    ProgramView,
    Prompt,
    Result,
    ToolResult,
)
from services.session import LLMCall, SessionState, SessionStatus, ToolCall, ToolStatus, llm_call_id, tool_call_id
from services.tools import TOOLS, idempotency_key


@dataclass(frozen=True)
class StartSession:
    program: str
    args_json: str


@dataclass(frozen=True)
class CallEngine:
    call_id: str
    request_id: str
    turn: int
    prompt: Prompt
    prompt_digest: str
    max_output_tokens: int
    resume: bool
    """True when LLMCallStarted is already in the log (only the output is missing)."""


@dataclass(frozen=True)
class ProposeTool:
    call_id: str
    tool: str
    arguments_json: str
    effect_class: EffectClass
    idempotency_key: str
    compensation_tool: str | None
    resource: str | None


@dataclass(frozen=True)
class WaitFor:
    call_id: str
    status: str


@dataclass(frozen=True)
class FinishSession:
    output_json: str
    num_llm_calls: int
    num_tool_calls: int


@dataclass(frozen=True)
class FailSession:
    reason: str
    error_type: str


@dataclass(frozen=True)
class Idle:
    """Nothing to do: the session is finished, or not requested."""

    reason: str


Move = StartSession | CallEngine | ProposeTool | WaitFor | FinishSession | FailSession | Idle


def request_id(session_id: str, call_id: str) -> str:
    """The engine request id of an LLM call: the same on every retry of that call."""
    return f"{session_id}/{call_id}"


def prompt_digest(prompt: Prompt) -> str:
    return hashlib.sha256(json.dumps(prompt.to_json(), sort_keys=True).encode()).hexdigest()


def recorded_results(state: SessionState) -> tuple[list[Result], LLMCall | ToolCall | None]:
    """The results of the session's finished steps, in order, and the first unfinished step."""
    results: list[Result] = []
    for index, step in enumerate(state.steps):
        expected = llm_call_id(index) if isinstance(step, LLMCall) else tool_call_id(index)
        if step.call_id != expected:
            return results, step  # a hole in the steps: treat the first odd one as pending
        if isinstance(step, LLMCall):
            if step.completed is None:
                return results, step
            results.append(
                LLMResult(
                    step.call_id,
                    request_id(state.session_id, step.call_id),
                    step.completed.output_text,
                    step.completed.prompt_tokens,
                    step.completed.output_tokens,
                )
            )
        else:
            if not step.done:
                return results, step
            results.append(_tool_result(step))
    return results, None


def _tool_result(step: ToolCall) -> ToolResult:
    tool = step.proposed.tool
    if step.status is ToolStatus.COMPLETED and step.completed is not None:
        return ToolResult(
            step.call_id, tool, True, json.loads(step.completed.result_json), step.completed.result_tokens
        )
    if step.status is ToolStatus.ABORTED:
        reason = getattr(step.verdict, "reason", "aborted")
        return ToolResult(step.call_id, tool, False, None, 0, f"aborted by the decider: {reason}")
    error = step.failure.error if step.failure else "failed"
    return ToolResult(step.call_id, tool, False, None, 0, error)


def next_move(state: SessionState, program: Program | None) -> Move:
    """The planner's next move for one session (see the module docstring)."""
    if state.status is None:
        return Idle("no such session")
    if state.finished:
        return Idle(f"session {state.status.value}")
    if state.status is SessionStatus.REQUESTED:
        if program is None:
            return FailSession(f"unknown program {state.program!r}", "UnknownProgram")
        return StartSession(state.program, json.dumps(state.args, sort_keys=True))
    if program is None:
        return FailSession(f"unknown program {state.program!r}", "UnknownProgram")
    if state.cancel_requested:
        return FailSession("cancelled by an operator", "Cancelled")
    results, pending = recorded_results(state)
    view = ProgramView(state.session_id, state.args, tuple(results))
    try:
        action: Any = program.next_action(view)
    except Exception as e:  # a program bug must fail its session, not the planner
        return FailSession(f"program {program.name} raised {type(e).__name__}: {e}", "ProgramError")
    step = len(results)
    if pending is not None:
        return _resume(state, pending, action, step)
    match action:
        case CallLLM():
            call_id = llm_call_id(step)
            return CallEngine(
                call_id,
                request_id(state.session_id, call_id),
                sum(1 for r in results if isinstance(r, LLMResult)),
                action.prompt,
                prompt_digest(action.prompt),
                action.max_output_tokens,
                resume=False,
            )
        case CallTool():
            call_id = tool_call_id(step)
            spec = TOOLS.get(action.tool)
            return ProposeTool(
                call_id,
                action.tool,
                json.dumps(action.arguments, sort_keys=True),
                # An unknown tool is proposed as irreversible (the safest class); the decider refuses it.
                spec.effect_class if spec else EffectClass.IRREVERSIBLE,
                idempotency_key(state.session_id, call_id),
                spec.compensation if spec else None,
                action.resource,
            )
        case Finish():
            return FinishSession(json.dumps(action.output, sort_keys=True), len(state.llm_calls), len(state.tool_calls))
        case Fail():
            return FailSession(action.reason, "ProgramFailed")
        case _:
            return FailSession(f"program {program.name} returned {action!r}, which is not an action", "InvalidAction")


def _resume(state: SessionState, pending: LLMCall | ToolCall, action: Any, step: int) -> Move:
    if isinstance(pending, LLMCall):
        if not isinstance(action, CallLLM) or prompt_digest(action.prompt) != pending.started.prompt_digest:
            return FailSession(
                f"step {step}: the log holds LLM call {pending.call_id} but the program now asks for {action!r}",
                "NonDeterminism",
            )
        return CallEngine(
            pending.call_id,
            request_id(state.session_id, pending.call_id),
            pending.started.turn,
            action.prompt,
            pending.started.prompt_digest,
            action.max_output_tokens,
            resume=True,
        )
    same = (
        isinstance(action, CallTool)
        and action.tool == pending.proposed.tool
        and json.dumps(action.arguments, sort_keys=True) == pending.proposed.arguments_json
    )
    if not same:
        return FailSession(
            f"step {step}: the log holds tool call {pending.call_id} ({pending.proposed.tool}) "
            f"but the program now asks for {action!r}",
            "NonDeterminism",
        )
    return WaitFor(pending.call_id, pending.status.value)
