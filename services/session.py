"""Session state: a pure fold over one session's events, from every topic.

``SessionState.apply(envelope)`` evolves the state by one event; applying an
event_id twice is a no-op, so a worker may apply its own appends at once and
again when it reads them back. Nothing here does I/O or reads a clock.

Steps are numbered in program order: step k is the program's k-th action,
an LLM call (call id ``llm-<k>``) or a tool call (``tool-<k>``). The ids are
derived, never random, so a replayed program asks for the same ids again and
residual completion can match its actions with what the log already holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from schemas import events as ev
from schemas.envelope import Envelope


class SessionStatus(StrEnum):
    REQUESTED = "requested"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ToolStatus(StrEnum):
    PROPOSED = "proposed"
    COMMITTED = "committed"
    ABORTED = "aborted"
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"
    IN_DOUBT = "in_doubt"


def llm_call_id(step: int) -> str:
    return f"llm-{step}"


def tool_call_id(step: int) -> str:
    return f"tool-{step}"


def step_of(call_id: str) -> int:
    """The step number of a derived call id (``tool-7`` -> 7)."""
    return int(call_id.rsplit("-", 1)[1])


@dataclass
class LLMCall:
    """One LLM call of the session, as the log tells it."""

    call_id: str
    started: ev.LLMCallStarted
    completed: ev.LLMCallCompleted | None = None


@dataclass
class ToolCall:
    """One tool call of the session: proposal, verdict, attempts and outcome."""

    call_id: str
    proposed: ev.ToolCallProposed
    proposed_at: datetime | None = None
    status: ToolStatus = ToolStatus.PROPOSED
    verdict: ev.ToolCallCommitted | ev.ToolCallAborted | None = None
    num_verdicts: int = 0
    attempts: int = 0
    completed: ev.ToolCallCompleted | None = None
    failure: ev.ToolCallFailed | None = None
    in_doubt: ev.ToolCallInDoubt | None = None
    approvals: list[ev.ApprovalGiven] = field(default_factory=list)

    @property
    def arguments(self) -> dict[str, Any]:
        args: dict[str, Any] = json.loads(self.proposed.arguments_json)
        return args

    @property
    def done(self) -> bool:
        """The call has a final outcome the program can read."""
        return self.status in (ToolStatus.COMPLETED, ToolStatus.FAILED, ToolStatus.ABORTED)


@dataclass
class SessionState:
    """Everything the log says about one session, folded."""

    session_id: str
    status: SessionStatus | None = None
    program: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    parent_session_id: str | None = None
    llm_calls: dict[str, LLMCall] = field(default_factory=dict)
    tool_calls: dict[str, ToolCall] = field(default_factory=dict)
    output_json: str | None = None
    failure: str | None = None
    cancel_requested: bool = False
    num_events: int = 0
    actors: set[str] = field(default_factory=set)
    """Every principal that wrote an event of the session."""
    applied: set[str] = field(default_factory=set)
    anomalies: list[str] = field(default_factory=list)
    """Events that make sense on the wire but not here (a second verdict), in words."""
    early: dict[str, list[ev.Event]] = field(default_factory=dict)
    """Events about a tool call whose proposal has not been read yet, by call id.

    Topics are ordered only within themselves: a verdict (agent.verdicts) or an
    approval (ops.commands) can be read before the proposal (agent.actions) it
    answers. They wait here and are applied right after the proposal.
    """

    @property
    def steps(self) -> list[LLMCall | ToolCall]:
        """Every step the session took, in program order."""
        both: list[LLMCall | ToolCall] = [*self.llm_calls.values(), *self.tool_calls.values()]
        return sorted(both, key=lambda s: step_of(s.call_id))

    @property
    def num_steps(self) -> int:
        return len(self.llm_calls) + len(self.tool_calls)

    @property
    def finished(self) -> bool:
        return self.status in (SessionStatus.FINISHED, SessionStatus.FAILED, SessionStatus.CANCELLED)

    def apply(self, envelope: Envelope) -> bool:
        """Evolve by one event; False (and no change) if this event was applied already."""
        if envelope.event_id in self.applied:
            return False
        self.applied.add(envelope.event_id)
        self.num_events += 1
        self.actors.add(envelope.actor)
        _evolve(self, envelope.body)
        if isinstance(envelope.body, ev.ToolCallProposed):
            self.tool_calls[envelope.body.call_id].proposed_at = envelope.occurred_at
            for body in self.early.pop(envelope.body.call_id, []):
                _evolve(self, body)
        return True


def fold(session_id: str, envelopes: list[Envelope]) -> SessionState:
    """The state after ``envelopes`` (one session's events, in log order)."""
    state = SessionState(session_id)
    for envelope in envelopes:
        state.apply(envelope)
    return state


def _evolve(state: SessionState, body: ev.Event) -> None:
    match body:
        case ev.SessionRequested():
            if state.status is None:
                state.status = SessionStatus.REQUESTED
                state.program = body.program
                state.args = json.loads(body.args_json)
        case ev.SessionStarted():
            state.status = SessionStatus.RUNNING
            state.program = body.program
            state.args = json.loads(body.args_json)
            state.parent_session_id = body.parent_session_id
        case ev.SessionFinished():
            state.status = SessionStatus.FINISHED
            state.output_json = body.output_json
        case ev.SessionFailed():
            state.status = SessionStatus.CANCELLED if body.error_type == "Cancelled" else SessionStatus.FAILED
            state.failure = body.reason
        case ev.CancelRequested():
            state.cancel_requested = True
        case ev.LLMCallStarted():
            state.llm_calls.setdefault(body.call_id, LLMCall(body.call_id, body))
        case ev.LLMCallCompleted():
            call = state.llm_calls.get(body.call_id)
            if call is None:
                state.anomalies.append(f"LLMCallCompleted for unknown call {body.call_id}")
            else:
                call.completed = body
        case ev.ToolCallProposed():
            state.tool_calls.setdefault(body.call_id, ToolCall(body.call_id, body))
        case ev.ToolCallCommitted() | ev.ToolCallAborted():
            _verdict(state, body)
        case ev.ToolCallStarted():
            if tool := _tool(state, body.call_id, body):
                tool.status = ToolStatus.STARTED
                tool.attempts = max(tool.attempts, body.attempt)
        case ev.ToolCallCompleted():
            if tool := _tool(state, body.call_id, body):
                tool.status = ToolStatus.COMPLETED
                tool.completed = body
        case ev.ToolCallFailed():
            if tool := _tool(state, body.call_id, body):
                tool.status = ToolStatus.FAILED
                tool.failure = body
        case ev.ToolCallInDoubt():
            if tool := _tool(state, body.call_id, body):
                tool.status = ToolStatus.IN_DOUBT
                tool.in_doubt = body
        case ev.ApprovalGiven():
            if tool := _tool(state, body.call_id, body):
                tool.approvals.append(body)
        case _:
            pass  # KV, cache, checkpoint and DLQ events do not change the program's state


def _tool(state: SessionState, call_id: str, body: ev.Event) -> ToolCall | None:
    tool = state.tool_calls.get(call_id)
    if tool is None:
        state.early.setdefault(call_id, []).append(body)  # applied when the proposal arrives
    return tool


def _verdict(state: SessionState, body: ev.ToolCallCommitted | ev.ToolCallAborted) -> None:
    tool = _tool(state, body.call_id, body)
    if tool is None:
        return
    tool.num_verdicts += 1
    if tool.verdict is not None:
        # The first verdict stands; a second one is reported, never obeyed.
        state.anomalies.append(f"duplicate verdict for {body.call_id}: {type(body).__name__} ignored")
        return
    tool.verdict = body
    if tool.status is ToolStatus.PROPOSED:
        tool.status = ToolStatus.COMMITTED if isinstance(body, ev.ToolCallCommitted) else ToolStatus.ABORTED
