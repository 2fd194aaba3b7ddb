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

Branches (docs/branches.md, rules in ``services/checkpoint.py``): operator
commands (checkpoint, restore, merge) come before the program's next step and
wait for a step boundary (no tool call in flight); a fork waits for its
parent's history (``NeedBase``); a program's ``TakeCheckpoint`` and ``Fork``
are steps the planner carries out itself; with ``checkpoint_every`` the planner
takes a checkpoint at the first step boundary after that many events.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from schemas import events as ev
from schemas.events import CallId, CheckpointId, EffectClass
from services.checkpoint import Compensation, RestorePlan, in_flight, restore_plan
from services.programs.base import (
    CallLLM,
    CallTool,
    Fail,
    Finish,
    Fork,
    LLMResult,
    ModelToolCall,
    NonDeterminism,
    Program,
    ProgramView,
    Prompt,
    Result,
    TakeCheckpoint,
    ToolResult,
)
from services.session import (
    LLMCall,
    PlannerStep,
    SessionState,
    SessionStatus,
    Step,
    ToolCall,
    ToolStatus,
    branch_session_id,
    checkpoint_step_id,
    fork_step_id,
    llm_call_id,
    step_of,
    tool_call_id,
)
from services.tools import TOOLS, ToolSpec, idempotency_key


@dataclass(frozen=True)
class StartSession:
    program: str
    args_json: str


@dataclass(frozen=True)
class CallEngine:
    call_id: CallId
    request_id: str
    turn: int
    prompt: Prompt
    prompt_digest: str
    max_output_tokens: int
    resume: bool
    """True when LLMCallStarted is already in the log (only the output is missing)."""
    messages: tuple[dict[str, Any], ...] = ()
    """The chat messages the prompt renders (SDK programs): what a chat engine is sent."""
    tools: tuple[dict[str, Any], ...] = ()
    """The tools offered with the messages (OpenAI function specs)."""
    tool_choice: str | dict[str, Any] | None = None
    size: str | None = None
    """The model size the program declared for the call (``CallLLM.size``), or None."""


@dataclass(frozen=True)
class ProposeTool:
    call_id: CallId
    tool: str
    arguments_json: str
    effect_class: EffectClass
    idempotency_key: str
    compensation_tool: str | None
    resource: str | None


@dataclass(frozen=True)
class WaitFor:
    call_id: CallId
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


@dataclass(frozen=True)
class NeedBase:
    """A fork whose parent history (up to its checkpoint) has not been added to its state yet."""

    parent_session_id: str
    checkpoint_id: CheckpointId


@dataclass(frozen=True)
class CutCheckpoint:
    """Take a checkpoint now (the session is at a step boundary): cut the session's log, fold
    it, snapshot it, append ``CheckpointTaken``. What the planner does for an operator's
    request, ``checkpoint_every``, or a program's ``TakeCheckpoint`` / ``Fork`` step."""

    checkpoint_id: CheckpointId
    cause: str | None
    """The operator's request it answers, or None (automatic, or a program's step)."""


@dataclass(frozen=True)
class ProposeCompensations:
    """A pending restore first undoes compensatable calls through the normal tool path."""

    cause: str
    compensations: tuple[Compensation, ...]


@dataclass(frozen=True)
class ApplyRestore:
    cause: str
    plan: RestorePlan


@dataclass(frozen=True)
class RefuseRestore:
    cause: str
    plan: RestorePlan


@dataclass(frozen=True)
class MergeBranches:
    """Fold branches into this session (an operator's merge, or the end of a program's fork step)."""

    cause: str | None
    branch_session_ids: tuple[str, ...]
    fork_call_id: str | None = None


@dataclass(frozen=True)
class StartBranches:
    """A program's fork step: create each branch (idempotent), then merge them when they are done."""

    call_id: CheckpointId
    """The fork step's id, which is also the id of the checkpoint its branches fork at."""
    branches: tuple[tuple[str, str], ...]
    """(branch session id, its arguments as JSON)."""


Move = (
    StartSession
    | CallEngine
    | ProposeTool
    | WaitFor
    | FinishSession
    | FailSession
    | Idle
    | NeedBase
    | CutCheckpoint
    | ProposeCompensations
    | ApplyRestore
    | RefuseRestore
    | MergeBranches
    | StartBranches
)


def request_id(session_id: str, call_id: CallId) -> str:
    """The engine request id of an LLM call: the same on every retry of that call."""
    return f"{session_id}/{call_id}"


def prompt_digest(prompt: Prompt) -> str:
    return prompt.digest()


def recorded_results(state: SessionState) -> tuple[list[Result], Step | None]:
    """The results of the session's finished steps, in order, and the first unfinished step."""
    results: list[Result] = []
    for index, step in enumerate(state.steps):
        if step_of(step.call_id) != index:
            return results, step  # a hole in the steps: treat the first odd one as pending
        if isinstance(step, LLMCall):
            if step.completed is None:
                return results, step
            results.append(
                LLMResult(
                    step.call_id,
                    request_id(step.origin or state.session_id, CallId(step.call_id)),
                    step.completed.output_text,
                    step.completed.prompt_tokens,
                    step.completed.output_tokens,
                    step.started.prompt_digest,
                    ModelToolCall.list_from_json(step.completed.tool_calls_json),
                )
            )
        elif isinstance(step, PlannerStep):
            if not step.done:
                return results, step
            tool = "checkpoint" if step.kind == "checkpoint" else "merge"
            results.append(
                ToolResult(step.call_id, tool, step.error is None, step.result, PLANNER_RESULT_TOKENS, step.error)
            )
        else:
            if not step.done:
                return results, step
            results.append(_tool_result(step))
    return results, None


PLANNER_RESULT_TOKENS = 16
"""Tokens a checkpoint or merge result adds to the context."""


def _tool_result(step: ToolCall) -> ToolResult:
    tool = step.proposed.tool
    arguments = step.arguments
    if step.status is ToolStatus.COMPLETED and step.completed is not None:
        result = json.loads(step.completed.result_json)
        return ToolResult(step.call_id, tool, True, result, step.completed.result_tokens, None, arguments)
    if step.status is ToolStatus.ABORTED:
        reason = getattr(step.verdict, "reason", "aborted")
        return ToolResult(step.call_id, tool, False, None, 0, f"aborted by the decider: {reason}", arguments)
    error = step.failure.error if step.failure else "failed"
    return ToolResult(step.call_id, tool, False, None, 0, error, arguments)


def next_move(
    state: SessionState,
    program: Program | None,
    *,
    checkpoint_every: int = 0,
    tools: Mapping[str, ToolSpec] = TOOLS,
) -> Move:
    """The planner's next move for one session (see the module docstring); ``tools``: the specs of every
    tool the stack knows (built-ins and plugins), for the effect class of a proposal."""
    if state.status is None:
        return Idle("no such session")
    if state.status is SessionStatus.REQUESTED:
        if program is None:
            return FailSession(f"unknown program {state.program!r}", "UnknownProgram")
        return StartSession(state.program, json.dumps(state.args, sort_keys=True))
    if state.parent_session_id is not None and not state.inherited:
        if state.fork is None:
            return Idle("waiting for the fork's lineage record")
        return NeedBase(state.fork.parent_session_id, CheckpointId(state.fork.checkpoint_id))
    if state.cancel_requested and not state.finished:
        # Before any pending command: a merge waiting for branches must not hold a cancel.
        return FailSession("cancelled by an operator", "Cancelled")
    if command := _command_move(state):
        return command
    if state.finished:
        return Idle(f"session {state.status.value}")
    if program is None:
        return FailSession(f"unknown program {state.program!r}", "UnknownProgram")
    results, pending = recorded_results(state)
    if pending is None and checkpoint_every > 0 and not in_flight(state):
        last = next((c for c in reversed(state.checkpoints.values()) if not c.abandoned), None)
        if state.num_events - (last.taken.num_events if last else 0) >= checkpoint_every:
            checkpoint_id = CheckpointId(f"auto-g{state.generation}-s{state.step_bound}")
            if checkpoint_id not in state.checkpoints:
                return CutCheckpoint(checkpoint_id, None)
    merged = tuple(json.loads(m.results_json) for m in state.merges if not _own_fork_merge(state, m))
    view = ProgramView(state.session_id, state.args, tuple(results), state.context_id, merged)
    try:
        action: Any = program.next_action(view)
    except NonDeterminism as e:
        return FailSession(str(e), "NonDeterminism")
    except Exception as e:  # a program bug must fail its session, not the planner
        return FailSession(f"program {program.name} raised {type(e).__name__}: {e}", "ProgramError")
    step = len(results)
    generation = state.generation
    if pending is not None:
        return _resume(state, pending, action, step)
    match action:
        case CallLLM():
            call_id = llm_call_id(step, generation)
            return CallEngine(
                call_id,
                request_id(state.session_id, call_id),
                sum(1 for r in results if isinstance(r, LLMResult)),
                action.prompt,
                prompt_digest(action.prompt),
                action.max_output_tokens,
                resume=False,
                messages=action.messages,
                tools=action.tools,
                tool_choice=action.tool_choice,
                size=action.size,
            )
        case CallTool():
            call_id = tool_call_id(step, generation)
            spec = tools.get(action.tool)
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
        case TakeCheckpoint():
            return CutCheckpoint(checkpoint_step_id(step, generation), None)
        case Fork():
            if not action.branches:
                return FailSession(f"step {step}: a fork needs at least one branch", "InvalidAction")
            # The step begins with the checkpoint its branches fork at.
            return CutCheckpoint(fork_step_id(step, generation), None)
        case Finish():
            return FinishSession(json.dumps(action.output, sort_keys=True), len(state.llm_calls), len(state.tool_calls))
        case Fail():
            return FailSession(action.reason, "ProgramFailed")
        case _:
            return FailSession(f"program {program.name} returned {action!r}, which is not an action", "InvalidAction")


def _own_fork_merge(state: SessionState, merge: ev.MergeApplied) -> bool:
    return all(b.startswith(f"{state.session_id}.") and ".fork-" in b for b in merge.branch_session_ids)


def _command_move(state: SessionState) -> Move | None:
    """The first pending operator command, if the session is at a point where it can be carried out."""
    pending = state.pending_commands
    if not pending:
        return None
    command = pending[0]
    body = command.body
    busy = [t for t in in_flight(state) if not t.call_id.startswith("undo.")]
    if isinstance(body, ev.RestoreRequested):
        plan = restore_plan(state, body.checkpoint_id)
        if plan.refused is not None:
            return RefuseRestore(command.event_id, plan)
        if busy:
            return WaitFor(CallId(busy[0].call_id), f"{busy[0].status.value} (a restore waits for a step boundary)")
        if plan.to_propose:
            return ProposeCompensations(command.event_id, plan.to_propose)
        if plan.waiting_for:
            return WaitFor(CallId(plan.waiting_for[0]), "compensation before a restore")
        return ApplyRestore(command.event_id, plan)
    if busy:
        return WaitFor(
            CallId(busy[0].call_id), f"{busy[0].status.value} (a {type(body).__name__} waits for a step boundary)"
        )
    if isinstance(body, ev.CheckpointRequested):
        return CutCheckpoint(CheckpointId(body.checkpoint_id), command.event_id)
    return MergeBranches(command.event_id, tuple(body.branch_session_ids))


def _resume(state: SessionState, pending: Step, action: Any, step: int) -> Move:
    if isinstance(pending, PlannerStep):
        if pending.kind != "fork" or not isinstance(action, Fork):
            return FailSession(
                f"step {step}: the log holds {pending.kind} step {pending.call_id} but the program now asks for "
                f"{action!r}",
                "NonDeterminism",
            )
        branches = tuple(
            (branch_session_id(state.session_id, pending.call_id, i), json.dumps(args, sort_keys=True))
            for i, args in enumerate(action.branches)
        )
        return StartBranches(CheckpointId(pending.call_id), branches)
    if isinstance(pending, LLMCall):
        if not isinstance(action, CallLLM) or prompt_digest(action.prompt) != pending.started.prompt_digest:
            return FailSession(
                f"step {step}: the log holds LLM call {pending.call_id} but the program now asks for {action!r}",
                "NonDeterminism",
            )
        return CallEngine(
            CallId(pending.call_id),
            request_id(state.session_id, CallId(pending.call_id)),
            pending.started.turn,
            action.prompt,
            pending.started.prompt_digest,
            action.max_output_tokens,
            resume=True,
            messages=action.messages,
            tools=action.tools,
            tool_choice=action.tool_choice,
            size=action.size,
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
    return WaitFor(CallId(pending.call_id), pending.status.value)
