"""Session state: a pure fold over one session's events, from every topic.

``SessionState.apply(envelope)`` evolves the state by one event; applying an
event_id twice is a no-op, so a worker may apply its own appends at once and
again when it reads them back. Nothing here does I/O or reads a clock.

Steps are numbered in program order: step k is the program's k-th action,
an LLM call (call id ``llm-<k>``), a tool call (``tool-<k>``), or a step the
planner carries out itself: a checkpoint (``ckpt-<k>``) or a fork into branches
(``fork-<k>``). The ids are derived, never random, so a replayed program asks
for the same ids again and residual completion can match its actions with what
the log already holds.

Branches (docs/branches.md):

- **checkpoints**: ``CheckpointTaken`` records, besides its cut, the *step
  bound* of the fold at that moment (one more than the highest index of the
  session's own steps).
  The bound is a function of agent.actions alone (every step begins there), so
  every reader computes the same bound whatever order it reads other topics in;
- **restore**: ``RestoreApplied`` moves every step at or after the
  checkpoint's bound to ``abandoned`` (the events stay in the log) and starts a
  new *generation*: the steps the program takes next get ids prefixed with
  ``r<generation>.`` (``r1.llm-4``), so they never collide with the abandoned
  ones and their deterministic event ids are new;
- **compensations** (``undo.<call id>``) are tool calls the planner proposes
  while a restore is pending; they go through the decider and the executor
  like any call but are not program steps;
- **forks**: a fork's own log holds only its own events; ``inherit`` adds the
  parent's steps up to the fork's checkpoint (read by reference from the
  parent's log), marked with their ``origin`` session, so the program replays
  against them and the executor, which never sees them, never runs them again;
- **operator commands** (checkpoint, restore, merge requests) stay pending until
  an event of the session names them as its ``causation_id``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from schemas import events as ev
from schemas.envelope import Envelope
from schemas.events import CallId, CheckpointId
from services import resources as res


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


def _generation_prefix(generation: int) -> str:
    return f"r{generation}." if generation else ""


def llm_call_id(step: int, generation: int = 0) -> CallId:
    return CallId(f"{_generation_prefix(generation)}llm-{step}")


def tool_call_id(step: int, generation: int = 0) -> CallId:
    return CallId(f"{_generation_prefix(generation)}tool-{step}")


def checkpoint_step_id(step: int, generation: int = 0) -> CheckpointId:
    return CheckpointId(f"{_generation_prefix(generation)}ckpt-{step}")


def fork_step_id(step: int, generation: int = 0) -> CheckpointId:
    return CheckpointId(f"{_generation_prefix(generation)}fork-{step}")


COMPENSATION_PREFIX = "undo."

GATEWAY_PROGRAM = "gateway"
"""The program name of a session an external agent drives through the gateway (workers/gateway):
the planner hosts no program for it, it adopts the gateway's records (``gateway_calls``) instead."""


def compensation_call_id(call_id: str) -> str:
    """The id of the call that undoes ``call_id`` during a restore."""
    return f"{COMPENSATION_PREFIX}{call_id}"


_PLANNER_STEP = re.compile(r"^(?:r\d+\.)?(ckpt|fork)-(\d+)$")


def step_of(call_id: str) -> int:
    """The step number of a derived call id (``tool-7`` -> 7, ``r1.llm-4`` -> 4)."""
    return int(call_id.rsplit("-", 1)[1])


def branch_session_id(parent: str, fork_call_id: str, index: int) -> str:
    """The session id of branch ``index`` of a program's fork step: derived, so a replay finds it again."""
    return f"{parent}.{fork_call_id}.{index}"


@dataclass
class LLMCall:
    """One LLM call of the session, as the log tells it."""

    call_id: str
    started: ev.LLMCallStarted
    completed: ev.LLMCallCompleted | None = None
    origin: str | None = None
    """For a fork's inherited call: the session that made it (None: this session)."""
    completed_at: datetime | None = None
    """When its completion was logged (the engine holds its context from then on)."""


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
    origin: str | None = None
    """For a fork's inherited call: the session that made it (None: this session)."""

    @property
    def arguments(self) -> dict[str, Any]:
        args: dict[str, Any] = json.loads(self.proposed.arguments_json)
        return args

    @property
    def done(self) -> bool:
        """The call has a final outcome the program can read."""
        return self.status in (ToolStatus.COMPLETED, ToolStatus.FAILED, ToolStatus.ABORTED)

    @property
    def in_flight(self) -> bool:
        """Proposed, committed, started or in doubt: the world may still change because of it."""
        return not self.done


@dataclass
class PlannerStep:
    """A program step the planner carries out itself: a checkpoint, or a fork into branches and their merge."""

    call_id: str
    kind: str  # "checkpoint" or "fork"
    result: dict[str, Any] | None = None
    error: str | None = None
    origin: str | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass
class Checkpoint:
    """A checkpoint as the fold knows it."""

    taken: ev.CheckpointTaken
    step_bound: int
    """Steps with an index below this were in the session at the cut."""
    generation: int
    abandoned: bool = False
    """A later restore went back before it: it can no longer be restored or forked from."""


@dataclass(frozen=True)
class Command:
    """An operator command that waits for the planner (checkpoint, restore, merge)."""

    event_id: str
    body: ev.CheckpointRequested | ev.RestoreRequested | ev.MergeRequested


Step = LLMCall | ToolCall | PlannerStep


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
    planner_steps: dict[str, PlannerStep] = field(default_factory=dict)
    generation: int = 0
    """Restores applied so far: new steps get ids prefixed ``r<generation>.``."""
    context_id: str = ""
    """Whose token seeds the program's prompts use: the session itself, or a fork's root ancestor."""
    fork: ev.ForkCreated | None = None
    inherited: bool = False
    """A fork's parent history has been added (``inherit``)."""
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)
    abandoned: dict[str, Step] = field(default_factory=dict)
    """Steps (and compensations) a restore rewound past, by call id: in the log, ignored by the program."""
    restores: list[ev.RestoreApplied] = field(default_factory=list)
    refusals: list[ev.RestoreRefused] = field(default_factory=list)
    merges: list[ev.MergeApplied] = field(default_factory=list)
    merge_conflicts: list[ev.MergeConflict] = field(default_factory=list)
    merges_after: dict[int, int] = field(default_factory=dict)
    """For each merge (index in ``merges``): how many checkpoints the session had when it merged."""
    commands: list[Command] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)
    """Event ids of operator commands some event has answered (its causation id)."""
    fork_requests: list[tuple[str, ev.ForkRequested]] = field(default_factory=list)
    gateway_calls: dict[str, ev.GatewayLLMCallServed] = field(default_factory=dict)
    """A gateway session's LLM calls as the gateway recorded them (agent.gateway), by call id."""
    gateway_results: dict[str, ev.GatewayToolResultReported] = field(default_factory=dict)
    """The tool results its client reported (agent.gateway), by tool call id."""
    resources: dict[str, res.Resource] = field(default_factory=dict)
    """What its tools acquired through the executor, by resource id, in acquisition order
    (services/resources.py): released when the session ends, never forgotten until then."""
    gateway_ended: ev.GatewaySessionEnded | None = None
    """Why the gateway ended the session (idle or finished by its client); the planner finishes it."""
    routes: dict[str, ev.EngineRouted] = field(default_factory=dict)
    """The latest route of each LLM call (its engine and model size; a failover replaces it), by call id."""
    route_history: list[ev.EngineRouted] = field(default_factory=list)
    """Every route in log order, failovers included (what ``logctl audit --routes`` shows)."""
    gateway_routes: dict[tuple[str, int], ev.GatewayEngineRouted] = field(default_factory=dict)
    """A gateway session's routes as the gateway recorded them (agent.gateway), by (call id, attempt);
    the planner adopts each as an ``EngineRouted``."""
    model_pin: str | None = None
    """The model size an operator pinned the session to (``ModelPinRequested``), or None."""
    pins: list[ev.ModelPinRequested] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.context_id = self.context_id or self.session_id

    @property
    def steps(self) -> list[Step]:
        """Every step the session took (not abandoned), in program order; compensations are not steps."""
        tools = [t for t in self.tool_calls.values() if not t.call_id.startswith(COMPENSATION_PREFIX)]
        every: list[Step] = [*self.llm_calls.values(), *tools, *self.planner_steps.values()]
        return sorted(every, key=lambda s: step_of(s.call_id))

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def step_bound(self) -> int:
        """One more than the highest index of the session's own steps (0 with none).

        Inherited steps do not count: a fork's readers that never add its parent's
        history (the executor, the decider) must agree on every checkpoint's bound.
        """
        return max((step_of(s.call_id) + 1 for s in self.steps if s.origin is None), default=0)

    @property
    def pending_commands(self) -> list[Command]:
        """Commands no event has answered yet, oldest first. A checkpoint request whose id is
        taken already is done (a retried request, or a second one with the same id)."""
        return [
            c
            for c in self.commands
            if c.event_id not in self.answered
            and not (isinstance(c.body, ev.CheckpointRequested) and c.body.checkpoint_id in self.checkpoints)
        ]

    def compensations(self) -> Iterator[ToolCall]:
        return (t for t in self.tool_calls.values() if t.call_id.startswith(COMPENSATION_PREFIX))

    def inherit(self, base: SessionState) -> None:
        """Add a parent's history up to the fork point (``base``: the parent folded up to its checkpoint).

        Steps keep their ids and carry their origin; they are results for the program,
        not work for anyone: no verdict or effect of them will ever reach this session.
        """
        origin = base.session_id
        for llm in base.llm_calls.values():
            self.llm_calls.setdefault(
                llm.call_id, LLMCall(llm.call_id, llm.started, llm.completed, llm.origin or origin, llm.completed_at)
            )
        for tool in base.tool_calls.values():
            if tool.call_id.startswith(COMPENSATION_PREFIX) or tool.call_id in self.tool_calls:
                continue
            copy = ToolCall(**{**tool.__dict__, "approvals": list(tool.approvals)})
            copy.origin = tool.origin or origin
            self.tool_calls[tool.call_id] = copy
        for step in base.planner_steps.values():
            self.planner_steps.setdefault(
                step.call_id, PlannerStep(step.call_id, step.kind, step.result, step.error, step.origin or origin)
            )
        self.context_id = base.context_id
        self.inherited = True

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
        if envelope.causation_id is not None and isinstance(envelope.body, _ANSWERS):
            self.answered.add(envelope.causation_id)
        match envelope.body:
            case ev.CheckpointRequested() | ev.RestoreRequested() | ev.MergeRequested() as command:
                if not (isinstance(command, ev.RestoreRequested) and command.dry_run):
                    self.commands.append(Command(envelope.event_id, command))
            case ev.ForkRequested() as request:
                self.fork_requests.append((envelope.event_id, request))
        if isinstance(envelope.body, _RESOURCE_EVENTS):
            res.evolve(self.resources, envelope.body, envelope.occurred_at)
            return True
        _evolve(self, envelope.body)
        if isinstance(envelope.body, ev.LLMCallCompleted) and (call := self.llm_calls.get(envelope.body.call_id)):
            call.completed_at = call.completed_at or envelope.occurred_at
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


_RESOURCE_EVENTS = (ev.ResourceAcquiring, ev.ResourceAcquired, ev.ResourceReleased, ev.ResourceReleaseFailed)

_ANSWERS = (ev.CheckpointTaken, ev.RestoreApplied, ev.RestoreRefused, ev.MergeApplied, ev.MergeConflict)


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
        case ev.ForkCreated():
            state.fork = body
            state.parent_session_id = body.parent_session_id
        case ev.CheckpointTaken():
            _checkpoint(state, body)
        case ev.RestoreApplied():
            _restore(state, body)
        case ev.RestoreRefused():
            state.refusals.append(body)
        case ev.MergeApplied():
            state.merges_after[len(state.merges)] = len(state.checkpoints)
            state.merges.append(body)
            _finish_fork_step(state, body.branch_session_ids, result=json.loads(body.results_json))
        case ev.MergeConflict():
            state.merge_conflicts.append(body)
            _finish_fork_step(state, body.branch_session_ids, error="; ".join(body.conflicts))
        case ev.SessionFinished():
            state.status = SessionStatus.FINISHED
            state.output_json = body.output_json
        case ev.SessionFailed():
            state.status = SessionStatus.CANCELLED if body.error_type == "Cancelled" else SessionStatus.FAILED
            state.failure = body.reason
        case ev.CancelRequested():
            state.cancel_requested = True
        case ev.GatewayLLMCallServed():
            # The gateway's first record of a session is its request: the planner starts it.
            if state.status is None:
                state.status = SessionStatus.REQUESTED
                state.program = GATEWAY_PROGRAM
            state.gateway_calls.setdefault(body.call_id, body)
        case ev.GatewayToolResultReported():
            state.gateway_results.setdefault(body.call_id, body)
        case ev.GatewaySessionEnded():
            state.gateway_ended = state.gateway_ended or body
        case ev.GatewayEngineRouted():
            # Appended with (before) its call's record: a session's first route is its request too.
            if state.status is None:
                state.status = SessionStatus.REQUESTED
                state.program = GATEWAY_PROGRAM
            state.gateway_routes.setdefault((body.call_id, body.attempt), body)
        case ev.LLMCallStarted():
            state.llm_calls.setdefault(body.call_id, LLMCall(body.call_id, body))
        case ev.LLMCallCompleted():
            call = state.llm_calls.get(body.call_id)
            if call is None and isinstance(abandoned := state.abandoned.get(body.call_id), LLMCall):
                call = abandoned
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
        case ev.EngineRouted():
            state.route_history.append(body)
            current = state.routes.get(body.call_id)
            if current is None or body.attempt >= current.attempt:
                state.routes[body.call_id] = body
        case ev.ModelPinRequested():
            state.model_pin = body.size
            state.pins.append(body)
        case _:
            pass  # KV, cache, checkpoint and DLQ events do not change the program's state


def _checkpoint(state: SessionState, body: ev.CheckpointTaken) -> None:
    # A fork step's checkpoint comes before the step (restoring it forks again); a checkpoint
    # step is inside its own checkpoint (restoring it goes on after it).
    bound = state.step_bound
    if match := _PLANNER_STEP.match(body.checkpoint_id):
        kind = "checkpoint" if match.group(1) == "ckpt" else "fork"
        # A checkpoint step is done once taken; a fork step waits for its branches' merge.
        result = {"checkpoint_id": body.checkpoint_id} if kind == "checkpoint" else None
        state.planner_steps.setdefault(body.checkpoint_id, PlannerStep(body.checkpoint_id, kind, result))
        if kind == "checkpoint":
            bound = state.step_bound
    state.checkpoints.setdefault(body.checkpoint_id, Checkpoint(body, bound, state.generation))


def _restore(state: SessionState, body: ev.RestoreApplied) -> None:
    checkpoint = state.checkpoints.get(body.checkpoint_id)
    if checkpoint is None:
        state.anomalies.append(f"RestoreApplied to unknown checkpoint {body.checkpoint_id}")
        return
    bound = checkpoint.step_bound
    for call_id in [c for c, s in state.llm_calls.items() if _abandoned_by(s, bound)]:
        state.abandoned[call_id] = state.llm_calls.pop(call_id)
    for call_id in [c for c, s in state.tool_calls.items() if _abandoned_by(s, bound)]:
        state.abandoned[call_id] = state.tool_calls.pop(call_id)
    for call_id in [c for c, s in state.planner_steps.items() if _abandoned_by(s, bound)]:
        state.abandoned[call_id] = state.planner_steps.pop(call_id)
    later = list(state.checkpoints)[list(state.checkpoints).index(body.checkpoint_id) + 1 :]
    for checkpoint_id in later:
        state.checkpoints[checkpoint_id].abandoned = True
    state.generation += 1
    state.restores.append(body)
    state.status = SessionStatus.RUNNING
    state.output_json = state.failure = None
    state.cancel_requested = False


def _abandoned_by(step: Step, bound: int) -> bool:
    if step.origin is not None:
        return False  # a fork's inherited history is its parent's: never rewound here
    if step.call_id.startswith(COMPENSATION_PREFIX):
        return True  # its restore is done: it is history now
    return step_of(step.call_id) >= bound


def _finish_fork_step(
    state: SessionState, branches: list[str], *, result: dict[str, Any] | None = None, error: str | None = None
) -> None:
    """A merge of a program's own branches is the result of its fork step."""
    for step in state.planner_steps.values():
        prefix = f"{state.session_id}.{step.call_id}."
        if step.kind == "fork" and not step.done and branches and all(b.startswith(prefix) for b in branches):
            step.result, step.error = result, error
            return


def _tool(state: SessionState, call_id: str, body: ev.Event) -> ToolCall | None:
    tool = state.tool_calls.get(call_id)
    if tool is None and isinstance(abandoned := state.abandoned.get(call_id), ToolCall):
        return abandoned  # a late event of a call a restore rewound past: kept with it
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
