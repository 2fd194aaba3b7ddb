"""Checkpoint, fork, restore and merge rules: pure functions over folded sessions (docs/branches.md).

**Cut.** A checkpoint's cut is, for each session topic, the offset of the next
record after the cut in the session's partition (topics are co-partitioned, so
one partition per topic). Taken as ``max(end offset read before the session's
history, last offset of the session read + 1)``: every record of the session
below the cut was read, every record appended later lands at or after it. The
planner takes a checkpoint only at a *step boundary* (no LLM call and no tool
call in flight), so ``fold(records below the cut)`` is the state at the
checkpoint, and ``fold(all records)`` equals ``fold_from(snapshot at the cut,
records at or after the cut)``.

**Digest.** ``state_digest`` = SHA-256 of the canonical JSON (sorted keys, no
spaces) of ``state_to_json(state)``, the sorted set of applied event ids
included: that set decides which later records a fold skips as already seen, so
a snapshot whose ids were swapped (same count, other ids) would fold a tail
differently, and its digest must not match.

**Restore eligibility** (``restore_plan``), over the steps at or after the
checkpoint's step bound, in the current generation:

- an ``irreversible`` call that completed, started or is in doubt blocks it
  (it happened, or may have, and cannot be undone);
- any call still in doubt blocks it (its outcome is unknown);
- a merge after the checkpoint blocks it (the branches' effects are not this
  session's to undo);
- a ``compensatable`` call that completed needs its compensation, proposed as
  ``undo.<call id>`` through the normal propose / verdict / execute path; the
  restore is applied only once every compensation completed, and refused if
  one fails or is aborted;
- pure and idempotent calls, failed and aborted calls need nothing.

**Merge conflicts** (``merge_plan``), over each branch's *own* calls (what it
inherited is its parent's history, already the parent's):

- a branch with a call in doubt conflicts (nobody knows what it did);
- two branches with external effects (idempotent, compensatable or
  irreversible calls that completed, started or are in doubt) on the same
  resource conflict; a call's resource is ``ToolCallProposed.resource``, else
  ``<tool>:<resource|account|path argument>``;
- a branch that waits, directly or through other sessions, to merge the parent
  (``merge_cycle``: pending merge requests, unfinished fork steps) conflicts:
  each would wait for the other's end forever;
- otherwise the merge waits until every branch finished (or failed), then
  applies: ``results`` holds each branch's final output (or its failure).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from log.topics import SESSION_TOPICS
from schemas import events as ev
from schemas.envelope import Envelope
from schemas.events import EffectClass, ResourceKind
from services.resources import Resource, ResourceStatus
from services.session import (
    Checkpoint,
    Command,
    LLMCall,
    PlannerStep,
    SessionState,
    SessionStatus,
    Step,
    ToolCall,
    ToolStatus,
    compensation_call_id,
    step_of,
)

EXTERNAL = (EffectClass.IDEMPOTENT, EffectClass.COMPENSATABLE, EffectClass.IRREVERSIBLE)
_HAPPENED = (ToolStatus.STARTED, ToolStatus.COMPLETED, ToolStatus.IN_DOUBT)


# ------------------------------------------------------------------ the cut


@dataclass(frozen=True)
class CutEvent:
    """One event of a session with where it was read (topic and offset in the session's partition)."""

    topic: str
    offset: int
    envelope: Envelope


def cut_of(events: Iterable[CutEvent], ends_before: Mapping[str, int]) -> dict[str, int]:
    """The cut after ``events`` (see the module docstring); ``ends_before``: end offsets read before them."""
    cut = {topic: ends_before.get(topic, 0) for topic in SESSION_TOPICS}
    for event in events:
        cut[event.topic] = max(cut.get(event.topic, 0), event.offset + 1)
    return cut


def before_cut(events: Iterable[CutEvent], cut: Mapping[str, int]) -> list[CutEvent]:
    return [e for e in events if e.offset < cut.get(e.topic, 0)]


def after_cut(events: Iterable[CutEvent], cut: Mapping[str, int]) -> list[CutEvent]:
    return [e for e in events if e.offset >= cut.get(e.topic, 0)]


def fold_events(session_id: str, events: Iterable[CutEvent], start: SessionState | None = None) -> SessionState:
    """Fold events (in history order) onto ``start`` (a snapshot) or onto nothing."""
    state = start if start is not None else SessionState(session_id)
    for event in events:
        state.apply(event.envelope)
    return state


def effects_of(state: SessionState) -> list[ev.EffectRef]:
    """The session's own tool calls with an external effect, for a checkpoint's record."""
    return [
        ev.EffectRef(
            call_id=t.call_id, tool=t.proposed.tool, effect_class=t.proposed.effect_class, status=t.status.value
        )
        for t in sorted(state.tool_calls.values(), key=lambda t: t.call_id)
        if t.origin is None and t.proposed.effect_class in EXTERNAL and t.status is not ToolStatus.ABORTED
    ]


def in_flight(state: SessionState) -> list[ToolCall]:
    """The session's own tool calls (compensations included) that have no final outcome yet."""
    return [t for t in state.tool_calls.values() if t.origin is None and t.in_flight]


def state_digest(state: SessionState) -> str:
    return json_digest(state_to_json(state))


def json_digest(data: Mapping[str, Any]) -> str:
    """``state_digest`` of the state ``data`` is the JSON of (``state_to_json``), without rebuilding it."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ----------------------------------------------------------- serialization

_BODY_TYPES: dict[str, type[ev.Model]] = {t.__name__: t for t in ev.EVENT_TYPES}


def _added_later(model: type[ev.Model]) -> tuple[str, ...]:
    """The optional fields a later schema release added to ``model`` (``since_release``)."""
    return tuple(
        name
        for name, f in model.model_fields.items()
        if isinstance(f.json_schema_extra, dict) and "since_release" in f.json_schema_extra
    )


_ADDED_LATER: dict[type[ev.Model], tuple[str, ...]] = {t: names for t in ev.EVENT_TYPES if (names := _added_later(t))}


def _body(model: ev.Model | None) -> dict[str, Any] | None:
    if model is None:
        return None
    data = model.model_dump(mode="json")
    # A field added by a later schema release, still null, is left out: a state folded from a
    # log written before that release keeps its digest, so its checkpoints still verify.
    for name in _ADDED_LATER.get(type(model), ()):
        if data.get(name) is None:
            del data[name]
    return {"type": type(model).__name__, "data": data}


def _model(data: dict[str, Any] | None) -> Any:
    if data is None:
        return None
    return _BODY_TYPES[data["type"]].model_validate(data["data"])


def _step_json(step: Step) -> dict[str, Any]:
    match step:
        case LLMCall():
            return {"kind": "llm", "call_id": step.call_id, "started": _body(step.started),
                    "completed": _body(step.completed), "origin": step.origin}  # fmt: skip
        case ToolCall():
            return {
                "kind": "tool",
                "call_id": step.call_id,
                "proposed": _body(step.proposed),
                "proposed_at": step.proposed_at.isoformat() if step.proposed_at else None,
                "status": step.status.value,
                "verdict": _body(step.verdict),
                "num_verdicts": step.num_verdicts,
                "attempts": step.attempts,
                "completed": _body(step.completed),
                "failure": _body(step.failure),
                "in_doubt": _body(step.in_doubt),
                "approvals": [_body(a) for a in step.approvals],
                "origin": step.origin,
            }
        case PlannerStep():
            return {"kind": "planner", "call_id": step.call_id, "step_kind": step.kind, "result": step.result,
                    "error": step.error, "origin": step.origin}  # fmt: skip


def _step_from(data: dict[str, Any]) -> Step:
    if data["kind"] == "llm":
        return LLMCall(data["call_id"], _model(data["started"]), _model(data["completed"]), data["origin"])
    if data["kind"] == "planner":
        return PlannerStep(data["call_id"], data["step_kind"], data["result"], data["error"], data["origin"])
    return ToolCall(
        data["call_id"],
        _model(data["proposed"]),
        datetime.fromisoformat(data["proposed_at"]) if data["proposed_at"] else None,
        ToolStatus(data["status"]),
        _model(data["verdict"]),
        data["num_verdicts"],
        data["attempts"],
        _model(data["completed"]),
        _model(data["failure"]),
        _model(data["in_doubt"]),
        [_model(a) for a in data["approvals"]],
        data["origin"],
    )


def state_to_json(state: SessionState) -> dict[str, Any]:
    """Everything in a folded session, as JSON (a snapshot); ``state_from_json`` is its inverse.

    Calls are listed by call id (a fork's inherited calls may be added before or after its
    own: the order of a dict is not part of the state); checkpoints keep their log order,
    which a restore depends on.
    """
    return {
        "session_id": state.session_id,
        "status": state.status.value if state.status else None,
        "program": state.program,
        "args": state.args,
        "parent_session_id": state.parent_session_id,
        "llm_calls": [_step_json(state.llm_calls[c]) for c in sorted(state.llm_calls)],
        "tool_calls": [_step_json(state.tool_calls[c]) for c in sorted(state.tool_calls)],
        "planner_steps": [_step_json(state.planner_steps[c]) for c in sorted(state.planner_steps)],
        "output_json": state.output_json,
        "failure": state.failure,
        "cancel_requested": state.cancel_requested,
        "num_events": state.num_events,
        "actors": sorted(state.actors),
        "applied": sorted(state.applied),
        "anomalies": list(state.anomalies),
        "early": {k: [_body(b) for b in v] for k, v in state.early.items()},
        "generation": state.generation,
        "context_id": state.context_id,
        "fork": _body(state.fork),
        "inherited": state.inherited,
        "checkpoints": [
            {"taken": _body(c.taken), "step_bound": c.step_bound, "generation": c.generation, "abandoned": c.abandoned}
            for c in state.checkpoints.values()
        ],
        "abandoned": [_step_json(state.abandoned[c]) for c in sorted(state.abandoned)],
        "restores": [_body(r) for r in state.restores],
        "refusals": [_body(r) for r in state.refusals],
        "merges": [_body(m) for m in state.merges],
        "merge_conflicts": [_body(m) for m in state.merge_conflicts],
        "merges_after": [[k, v] for k, v in state.merges_after.items()],
        "commands": [{"event_id": c.event_id, "body": _body(c.body)} for c in state.commands],
        "answered": sorted(state.answered),
        "fork_requests": [[eid, _body(body)] for eid, body in state.fork_requests],
        # Only when there are some: the digests of states without resources stay what they were.
        **({"resources": [_resource_json(r) for r in state.resources.values()]} if state.resources else {}),
    }


_RESOURCE_TIMES = ("acquiring_at", "acquired_at", "released_at", "retry_at")


def _resource_json(r: Resource) -> dict[str, Any]:
    out: dict[str, Any] = dict(r.__dict__)
    out["kind"], out["status"] = r.kind.value, r.status.value
    for name in _RESOURCE_TIMES:
        out[name] = out[name].isoformat() if out[name] is not None else None
    return out


def _resource_from(data: dict[str, Any]) -> Resource:
    values = dict(data)
    values["kind"], values["status"] = ResourceKind(data["kind"]), ResourceStatus(data["status"])
    for name in _RESOURCE_TIMES:
        values[name] = datetime.fromisoformat(data[name]) if data[name] is not None else None
    return Resource(**values)


def state_from_json(data: dict[str, Any]) -> SessionState:
    state = SessionState(data["session_id"])
    state.status = SessionStatus(data["status"]) if data["status"] else None
    state.program, state.args, state.parent_session_id = data["program"], data["args"], data["parent_session_id"]
    for key, target in (("llm_calls", state.llm_calls), ("tool_calls", state.tool_calls)):
        for item in data[key]:
            step = _step_from(item)
            target[step.call_id] = step  # type: ignore[assignment]
    for item in data["planner_steps"]:
        planner = _step_from(item)
        assert isinstance(planner, PlannerStep)
        state.planner_steps[planner.call_id] = planner
    state.output_json, state.failure = data["output_json"], data["failure"]
    state.cancel_requested, state.num_events = data["cancel_requested"], data["num_events"]
    state.actors, state.applied = set(data["actors"]), set(data["applied"])
    state.anomalies = list(data["anomalies"])
    state.early = {k: [_model(b) for b in v] for k, v in data["early"].items()}
    state.generation, state.context_id = data["generation"], data["context_id"]
    state.fork, state.inherited = _model(data["fork"]), data["inherited"]
    for c in data["checkpoints"]:
        taken = _model(c["taken"])
        state.checkpoints[taken.checkpoint_id] = Checkpoint(taken, c["step_bound"], c["generation"], c["abandoned"])
    for item in data["abandoned"]:
        step = _step_from(item)
        state.abandoned[step.call_id] = step
    state.restores = [_model(r) for r in data["restores"]]
    state.refusals = [_model(r) for r in data["refusals"]]
    state.merges = [_model(m) for m in data["merges"]]
    state.merge_conflicts = [_model(m) for m in data["merge_conflicts"]]
    state.merges_after = {k: v for k, v in data["merges_after"]}
    state.commands = [Command(c["event_id"], _model(c["body"])) for c in data["commands"]]
    state.answered = set(data["answered"])
    state.fork_requests = [(eid, _model(body)) for eid, body in data["fork_requests"]]
    state.resources = {r["resource_id"]: _resource_from(r) for r in data.get("resources", [])}
    return state


# ------------------------------------------------------------------ restore


@dataclass(frozen=True)
class Compensation:
    """A compensating call to propose before a restore: ``tool`` with the undone call's arguments."""

    call_id: str
    undoes: str
    tool: str
    arguments_json: str


@dataclass(frozen=True)
class RestorePlan:
    """What restoring a checkpoint takes. Exactly one of: refuse, compensate/wait, or apply."""

    checkpoint_id: str
    refused: str | None = None
    """Why it is refused (naming the blocking calls), or None."""
    blocking: tuple[str, ...] = ()
    to_propose: tuple[Compensation, ...] = ()
    """Compensations not proposed yet."""
    waiting_for: tuple[str, ...] = ()
    """Compensations proposed and not finished yet."""
    compensated: tuple[str, ...] = ()
    """Calls whose compensation completed."""
    abandoned_steps: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        """Nothing blocks and every compensation completed: append RestoreApplied."""
        return self.refused is None and not self.to_propose and not self.waiting_for


def restore_plan(state: SessionState, checkpoint_id: str) -> RestorePlan:
    """Can ``state`` be rewound to ``checkpoint_id``, and what must run first (see the module docstring)?"""
    checkpoint = state.checkpoints.get(checkpoint_id)
    if checkpoint is None:
        known = ", ".join(state.checkpoints) or "none"
        return RestorePlan(checkpoint_id, f"no checkpoint {checkpoint_id!r} in {state.session_id} (known: {known})")
    if checkpoint.abandoned:
        return RestorePlan(checkpoint_id, f"checkpoint {checkpoint_id} was rewound past by an earlier restore")
    later = sorted(
        (s for s in state.steps if s.origin is None and step_of(s.call_id) >= checkpoint.step_bound), key=_order
    )
    abandoned = tuple(s.call_id for s in later)
    blocking: list[str] = []
    reasons: list[str] = []
    compensations: list[Compensation] = []
    for step in later:
        if isinstance(step, ToolCall) and step.origin is None:
            cls = step.proposed.effect_class
            if step.status is ToolStatus.IN_DOUBT:
                blocking.append(step.call_id)
                reasons.append(f"{step.call_id} ({step.proposed.tool}) is in doubt")
            elif cls is EffectClass.IRREVERSIBLE and step.status in _HAPPENED:
                blocking.append(step.call_id)
                reasons.append(f"{step.call_id} ({step.proposed.tool}) is irreversible and {step.status.value}")
            elif cls is EffectClass.COMPENSATABLE and step.status in _HAPPENED:
                if step.proposed.compensation_tool is None:
                    blocking.append(step.call_id)
                    reasons.append(f"{step.call_id} ({step.proposed.tool}) declares no compensation")
                else:
                    undo = compensation_call_id(step.call_id)
                    compensations.append(
                        Compensation(undo, step.call_id, step.proposed.compensation_tool, step.proposed.arguments_json)
                    )
    position = list(state.checkpoints).index(checkpoint_id)
    for index, num_checkpoints in state.merges_after.items():
        if num_checkpoints > position:
            merged = ", ".join(state.merges[index].branch_session_ids)
            blocking.append(f"merge:{merged}")
            reasons.append(f"branches {merged} were merged after the checkpoint")
    if blocking:
        return RestorePlan(
            checkpoint_id,
            f"restore to {checkpoint_id} refused: " + "; ".join(reasons),
            tuple(blocking),
            abandoned_steps=abandoned,
        )
    to_propose, waiting, done, failed = [], [], [], []
    for comp in compensations:
        call = state.tool_calls.get(comp.call_id)
        if call is None:
            to_propose.append(comp)
        elif call.status is ToolStatus.COMPLETED:
            done.append(comp.undoes)
        elif call.done:
            failed.append(f"compensation {comp.call_id} ({comp.tool}) {call.status.value}")
        else:
            waiting.append(comp.call_id)
    if failed:
        return RestorePlan(
            checkpoint_id,
            f"restore to {checkpoint_id} refused: " + "; ".join(failed),
            tuple(c.call_id for c in compensations),
            abandoned_steps=abandoned,
        )
    return RestorePlan(
        checkpoint_id,
        to_propose=tuple(to_propose),
        waiting_for=tuple(waiting),
        compensated=tuple(done),
        abandoned_steps=abandoned,
    )


def _order(step: Step) -> int:
    return step_of(step.call_id)


# -------------------------------------------------------------------- merge


def resource_of(call: ToolCall) -> str | None:
    """The external resource a call touches (for merge conflicts), or None."""
    if call.proposed.resource:
        return call.proposed.resource
    args = call.arguments
    for key in ("resource", "account", "path"):
        if isinstance(args.get(key), str):
            return f"{call.proposed.tool}:{args[key]}"
    return None


@dataclass(frozen=True)
class MergePlan:
    conflicts: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()
    waiting_for: tuple[str, ...] = ()
    """Branches that have not finished yet."""
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def conflicted(self) -> bool:
        return bool(self.conflicts)


def merge_waits(state: SessionState) -> tuple[frozenset[str], tuple[str, ...]]:
    """Whose end the session waits for to merge: the branches its pending merge requests name,
    and (as id prefixes) the branches of its own fork steps that have not merged yet."""
    named = frozenset(
        b for c in state.pending_commands if isinstance(c.body, ev.MergeRequested) for b in c.body.branch_session_ids
    )
    prefixes = tuple(
        f"{state.session_id}.{s.call_id}."
        for s in state.planner_steps.values()
        if s.kind == "fork" and not s.done and s.origin is None
    )
    return named, prefixes


def merge_cycle(parent: str, branches: Iterable[str], states: Mapping[str, SessionState]) -> tuple[str, ...]:
    """A chain ``(branch, ..., parent)`` of unfinished sessions, each waiting to merge the next,
    as far as ``states`` shows; empty if there is none. Merging such a branch would wait forever."""
    paths: list[tuple[str, ...]] = [(b,) for b in sorted(branches) if b != parent]
    seen: set[str] = set()
    while paths:
        path = paths.pop(0)  # breadth first: the shortest cycle is named
        state = states.get(path[-1])
        if path[-1] in seen or state is None or state.finished:
            continue  # a finished session waits for nobody
        seen.add(path[-1])
        named, prefixes = merge_waits(state)
        if parent in named or parent.startswith(prefixes):
            return (*path, parent)
        children = {s for s in states if s.startswith(prefixes)} if prefixes else set()
        paths.extend((*path, nxt) for nxt in sorted(named | children))
    return ()


def merge_plan(
    branches: Mapping[str, SessionState],
    parent: str | None = None,
    others: Mapping[str, SessionState] | None = None,
) -> MergePlan:
    """Conflicts between branches, or the branches still running, or each branch's result.

    A session merged into itself is a conflict too (it would wait for its own end forever), and
    so is a branch that waits to merge the parent (``others``: the states of further sessions
    the branches wait for, to find longer cycles).
    """
    conflicts: list[str] = []
    touched: dict[str, list[tuple[str, str]]] = {}
    for branch_id, branch in branches.items():
        if branch_id == parent:
            conflicts.append(f"{branch_id} cannot be merged into itself")
            continue
        if branch.status is None:
            conflicts.append(f"branch {branch_id} does not exist")
            continue
        for call in sorted(branch.tool_calls.values(), key=lambda c: c.call_id):
            if call.origin is not None:
                continue  # inherited: the parent's own history
            if call.status is ToolStatus.IN_DOUBT:
                conflicts.append(f"branch {branch_id} has call {call.call_id} ({call.proposed.tool}) in doubt")
            if call.proposed.effect_class in EXTERNAL and call.status in _HAPPENED:
                resource = resource_of(call)
                if resource is not None:
                    touched.setdefault(resource, []).append((branch_id, call.call_id))
    shared = sorted(r for r, users in touched.items() if len({b for b, _ in users}) > 1)
    for resource in shared:
        users = ", ".join(f"{b}/{c}" for b, c in touched[resource])
        conflicts.append(f"branches {users} all have external effects on {resource}")
    if conflicts:
        return MergePlan(tuple(conflicts), tuple(shared))
    waiting = tuple(b for b, s in branches.items() if not s.finished)
    if waiting and parent is not None:
        for waiting_id in waiting:
            if cycle := merge_cycle(parent, [waiting_id], {**(others or {}), **branches}):
                chain = ", which waits for ".join(cycle)
                conflicts.append(f"merge cycle: {parent} waits for {chain}; neither can end first")
        if conflicts:
            return MergePlan(tuple(conflicts))
    if waiting:
        return MergePlan(waiting_for=waiting)
    results: dict[str, Any] = {}
    for branch_id, branch in branches.items():
        if branch.status is SessionStatus.FINISHED and branch.output_json is not None:
            results[branch_id] = json.loads(branch.output_json)
        else:
            results[branch_id] = {"failed": branch.failure or (branch.status.value if branch.status else "unknown")}
    return MergePlan(results=results)


def pending_of_kind(state: SessionState, kind: type[Any]) -> list[Command]:
    return [c for c in state.pending_commands if isinstance(c.body, kind)]
