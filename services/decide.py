"""Decide: the events the planner appends to carry out a move (pure).

``services.planning.next_move`` says what a session needs next; this module says
which events carry it out. Each comes as an ``Append``: the session it goes to,
its body, and the kind and key its deterministic event id is made of
(``workers.runtime.event_id``), so that a move made again after a crash lands
once. ``decide`` covers the moves whose events follow from the move and the
state alone; a move that needs an answer from outside first has a function that
takes that answer: the engine's output (``llm_completed``, ``engine_failed``),
the checkpoint cut from the log (``checkpoint_taken``), how many events a
restore abandons (``restore_applied``), the branches' merge plan
(``merge_outcome``), a fork's cut (``fork_created``).

The planner worker does that I/O and appends what these return; the unit
tests' branch world (``tests/unit/services/branch_world.py``) does the same in
memory. The state these events evolve is ``SessionState.apply``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from schemas import events as ev
from schemas.events import CheckpointId, EffectClass, EngineId
from services.checkpoint import MergePlan
from services.planning import (
    ApplyRestore,
    CallEngine,
    CutCheckpoint,
    FailSession,
    FinishSession,
    ProposeCompensations,
    ProposeTool,
    RefuseRestore,
    StartSession,
)
from services.scheduling import CallPriority
from services.session import SessionState
from services.tools import TOOLS, ToolSpec, idempotency_key


@dataclass(frozen=True)
class Append:
    """One event to append to ``session_id``, with the kind and key of its deterministic id."""

    session_id: str
    body: ev.Event
    kind: str
    key: str = ""
    cause: str | None = None


PureMove = StartSession | CallEngine | ProposeTool | ProposeCompensations | RefuseRestore | FinishSession | FailSession
"""The moves whose events follow from the move and the state alone."""


def decide(
    state: SessionState,
    move: PureMove,
    *,
    engine_id: EngineId,
    tools: Mapping[str, ToolSpec] | None = None,
    priority: CallPriority | None = None,
) -> list[Append]:
    """The events that carry out ``move`` for ``state``'s session (for ``CallEngine``: the
    ``LLMCallStarted`` before the engine is asked, none when it is in the log already).
    ``tools``: the registered tools (default: the built-ins), for a compensation's effect class.
    ``priority``: for ``CallEngine``, the priority the engine request will carry (recorded on the
    ``LLMCallStarted``; None: it carries none)."""
    sid = state.session_id
    match move:
        case StartSession():
            return [Append(sid, ev.SessionStarted(program=move.program, args_json=move.args_json), "start")]
        case CallEngine():
            if move.resume:
                return []
            started = ev.LLMCallStarted(
                call_id=move.call_id,
                turn=move.turn,
                engine_id=engine_id,
                prompt_tokens=move.prompt.num_tokens,
                max_output_tokens=move.max_output_tokens,
                prompt_digest=move.prompt_digest,
                priority=None if priority is None else priority.priority,
                priority_attained_ms=None if priority is None else priority.attained_ms,
                priority_age_ms=None if priority is None else priority.age_ms,
                priority_warm=None if priority is None else priority.warm,
            )
            return [Append(sid, started, "llm-started", move.call_id)]
        case ProposeTool():
            proposed = ev.ToolCallProposed(
                call_id=move.call_id,
                tool=move.tool,
                arguments_json=move.arguments_json,
                effect_class=move.effect_class,
                idempotency_key=move.idempotency_key,
                compensation_tool=move.compensation_tool,
                resource=move.resource,
            )
            return [Append(sid, proposed, "proposed", move.call_id)]
        case ProposeCompensations():
            out = []
            for comp in move.compensations:
                spec = (TOOLS if tools is None else tools).get(comp.tool)
                body = ev.ToolCallProposed(
                    call_id=comp.call_id,
                    tool=comp.tool,
                    arguments_json=comp.arguments_json,
                    effect_class=spec.effect_class if spec else EffectClass.IRREVERSIBLE,
                    idempotency_key=idempotency_key(sid, comp.call_id),
                )
                out.append(Append(sid, body, "proposed", comp.call_id, move.cause))
            return out
        case RefuseRestore():
            refusal = ev.RestoreRefused(
                checkpoint_id=move.plan.checkpoint_id,
                blocking_call_ids=list(move.plan.blocking),
                reason=move.plan.refused or "refused",
            )
            return [Append(sid, refusal, "restore", move.cause, move.cause)]
        case FinishSession():
            finished = ev.SessionFinished(
                output_json=move.output_json, num_llm_calls=move.num_llm_calls, num_tool_calls=move.num_tool_calls
            )
            return [Append(sid, finished, "end", end_key(state))]
        case FailSession():
            return [session_failed(state, move.reason, move.error_type)]


def end_key(state: SessionState) -> str:
    """A session ends once per generation: a restored session's new end is a new event."""
    return f"r{state.generation}" if state.generation else ""


def session_failed(state: SessionState, reason: str, error_type: str) -> Append:
    return Append(state.session_id, ev.SessionFailed(reason=reason, error_type=error_type), "end", end_key(state))


def engine_failed(state: SessionState, error: str) -> Append:
    """The engine gave up on a call (unreachable past the planner's patience, or an error): the session fails."""
    return session_failed(state, error, "EngineError")


def llm_completed(state: SessionState, move: CallEngine, completed: ev.LLMCallCompleted) -> Append:
    """The engine's answer to ``move``, as the engine reported it."""
    return Append(state.session_id, completed, "llm-completed", move.call_id)


def checkpoint_taken(state: SessionState, move: CutCheckpoint, taken: ev.CheckpointTaken) -> Append:
    """The checkpoint ``move`` asked for, once the log is cut and folded (and snapshotted)."""
    return Append(state.session_id, taken, "checkpoint", move.checkpoint_id, move.cause)


def restore_applied(state: SessionState, move: ApplyRestore, num_abandoned: int) -> Append:
    """The restore ``move`` applies; ``num_abandoned``: the session's events after the checkpoint's cut."""
    body = ev.RestoreApplied(
        checkpoint_id=move.plan.checkpoint_id,
        num_abandoned=num_abandoned,
        compensated_call_ids=list(move.plan.compensated),
    )
    return Append(state.session_id, body, "restore", move.cause, move.cause)


def fork_created(
    parent: SessionState, fork_id: str, checkpoint_id: CheckpointId, cut: dict[str, int], args_json: str
) -> list[Append]:
    """A new session forked from ``parent`` at a checkpoint's cut.

    ``SessionStarted`` first: the fork exists; it waits for ``ForkCreated`` (its lineage) before any step.
    """
    started = ev.SessionStarted(program=parent.program, args_json=args_json, parent_session_id=parent.session_id)
    created = ev.ForkCreated(parent_session_id=parent.session_id, checkpoint_id=checkpoint_id, cut=cut)
    return [Append(fork_id, started, "start"), Append(fork_id, created, "fork")]


def fork_args(state: SessionState) -> str:
    """An operator's fork runs the parent's program with the parent's arguments."""
    return json.dumps(state.args, sort_keys=True)


def merge_outcome(
    state: SessionState, branch_ids: tuple[str, ...], plan: MergePlan, *, cause: str | None, key: str
) -> Append | None:
    """``MergeApplied`` or ``MergeConflict`` for the branches, or None while the merge waits for some."""
    if not plan.conflicted and plan.waiting_for:
        return None
    body: ev.MergeApplied | ev.MergeConflict
    if plan.conflicted:
        body = ev.MergeConflict(
            branch_session_ids=list(branch_ids), conflicts=list(plan.conflicts), resources=list(plan.resources)
        )
    else:
        body = ev.MergeApplied(
            branch_session_ids=list(branch_ids), results_json=json.dumps(plan.results, sort_keys=True)
        )
    return Append(state.session_id, body, "merge", key, cause)
