"""A pure, in-memory world for branch tests: a log with positions, and the roles as plain functions.

The planner part makes the same moves as ``workers/planner.py`` (``next_move``
and the rules of ``services/checkpoint.py``) with the same deterministic event
ids; the decider commits every proposal; the executor runs committed calls
against a ledger that counts executions, and can crash after ``Started`` (before
or after the effect); recovery then retries retry-safe tools and makes the
others in doubt, and the operator resolves an in-doubt call by looking at the
ledger, as a person would. Folding is ``services.session``; nothing here
knows about Kafka or Postgres.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from log.topics import AGENT_ACTIONS, AGENT_EFFECTS, AGENT_VERDICTS, OPS_COMMANDS, SESSION_TOPICS
from schemas import events as ev
from schemas.envelope import Envelope
from schemas.events import CheckpointId, EngineId
from services.checkpoint import (
    CutEvent,
    after_cut,
    before_cut,
    cut_of,
    effects_of,
    fold_events,
    merge_plan,
    state_digest,
    state_from_json,
    state_to_json,
)
from services.decide import (
    Append,
    checkpoint_taken,
    decide,
    fork_args,
    fork_created,
    llm_completed,
    merge_outcome,
    restore_applied,
)
from services.planning import (
    ApplyRestore,
    CallEngine,
    CutCheckpoint,
    FailSession,
    FinishSession,
    Idle,
    MergeBranches,
    NeedBase,
    ProposeCompensations,
    ProposeTool,
    RefuseRestore,
    StartBranches,
    StartSession,
    WaitFor,
    next_move,
)
from services.programs import PROGRAMS, Program
from services.programs.base import ModelToolCall
from services.session import SessionState, ToolStatus
from services.tools import TOOLS, ToolSpec
from workers.runtime import event_id

T0 = datetime(2026, 1, 1, tzinfo=UTC)
ENGINE_ID = EngineId("sim")
_TOPIC_OF = {t.owner: t.name for t in (AGENT_ACTIONS, AGENT_VERDICTS, AGENT_EFFECTS, OPS_COMMANDS)}


@dataclass
class World:
    events: dict[str, list[CutEvent]] = field(default_factory=dict)
    offsets: Counter[str] = field(default_factory=Counter)
    seqs: Counter[tuple[str, str]] = field(default_factory=Counter)
    ids: set[str] = field(default_factory=set)
    ticks: itertools.count[int] = field(default_factory=itertools.count)
    executions: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(session, call id) -> how many times the tool's effect ran."""
    snapshots: dict[tuple[str, str], tuple[dict[str, int], dict[str, Any]]] = field(default_factory=dict)
    checkpoint_every: int = 0
    programs: dict[str, Program] = field(default_factory=lambda: dict(PROGRAMS))
    tools: dict[str, ToolSpec] = field(default_factory=lambda: dict(TOOLS))
    rejected: set[str] = field(default_factory=set)
    """Tools the decider aborts (every other proposal is committed)."""
    results: dict[str, Any] = field(default_factory=dict)
    """Tool name -> the result its calls complete with (default ``{"ok": true}``)."""
    chat: Callable[[CallEngine], tuple[str, tuple[ModelToolCall, ...]]] | None = None
    """The model of a chat engine: an LLM call's text and tool calls (default: ``"ok"``, none)."""

    # ------------------------------------------------------------------ log

    def append(
        self, session: str, body: ev.Event, actor: str, *, eid: str | None = None, cause: str | None = None
    ) -> bool:
        eid = eid or f"op-{next(self.ticks)}"
        if eid in self.ids:
            return False  # the log's idempotent append: the same event id lands once
        self.ids.add(eid)
        topic = _TOPIC_OF[actor]
        envelope = Envelope(
            event_id=eid,
            session_id=session,
            seq=self.seqs[(topic, session)],
            actor=actor,
            occurred_at=T0 + timedelta(milliseconds=next(self.ticks)),
            causation_id=cause,
            prev_hash=bytes(32),
            body=body,
            hash=bytes(32),
        )
        self.seqs[(topic, session)] += 1
        self.events.setdefault(session, []).append(CutEvent(topic, self.offsets[topic], envelope))
        self.offsets[topic] += 1
        return True

    def planner_append(self, session: str, body: ev.Event, kind: str, key: str = "", cause: str | None = None) -> bool:
        return self.append(session, body, "planner", eid=event_id(session, kind, key), cause=cause)

    def own_state(self, session: str) -> SessionState:
        """What the decider and the executor fold: the session's own events only."""
        return fold_events(session, self.events.get(session, []))

    def state(self, session: str) -> SessionState:
        """What the planner folds: a fork gets its parent's history up to the cut."""
        state = self.own_state(session)
        if state.fork is not None:
            state.inherit(self.state_at(state.fork.parent_session_id, state.fork.cut))
        return state

    def state_at(self, session: str, cut: dict[str, int]) -> SessionState:
        state = fold_events(session, before_cut(self.events.get(session, []), cut))
        if state.fork is not None:
            state.inherit(self.state_at(state.fork.parent_session_id, state.fork.cut))
        return state

    def replay_from_snapshot(self, session: str, checkpoint_id: str) -> SessionState:
        cut, data = self.snapshots[(session, checkpoint_id)]
        state = fold_events(session, after_cut(self.events[session], cut), state_from_json(data))
        if state.fork is not None and not state.inherited:
            state.inherit(self.state_at(state.fork.parent_session_id, state.fork.cut))
        return state

    # ------------------------------------------------------------ operator

    def request(self, session: str, steps: list[dict[str, Any]]) -> None:
        args = json.dumps({"steps": steps})
        self.append(session, ev.SessionRequested(program="script", args_json=args, author="t"), "operator")

    def operator(self, session: str, body: ev.Event) -> None:
        self.append(session, body, "operator")

    # ------------------------------------------------------------- planner

    def planner(self, session: str, *, crash_in_llm: bool = False) -> bool:
        """One planner move (``services.decide``'s events, as the planner appends them); False when it only waits."""
        state = self.state(session)
        forked = self._fork_requests(state)
        move = next_move(
            state, self.programs.get(state.program), checkpoint_every=self.checkpoint_every, tools=self.tools
        )
        match move:
            case Idle() | WaitFor() | NeedBase():
                return forked
            case CallEngine():
                self.planner_append_all(decide(state, move, engine_id=ENGINE_ID, tools=self.tools))
                if crash_in_llm:
                    return True
                text, calls = self.chat(move) if self.chat else ("ok", ())
                done = ev.LLMCallCompleted(
                    call_id=move.call_id, engine_id=ENGINE_ID, prompt_tokens=move.prompt.num_tokens, cached_tokens=0,
                    output_tokens=move.max_output_tokens, output_text=text, finish_reason="length", queue_ms=0,
                    prefill_ms=0, decode_ms=0, tool_calls_json=ModelToolCall.list_to_json(calls),
                )  # fmt: skip
                self.planner_append_all([llm_completed(state, move, done)])
            case StartSession() | ProposeTool() | FinishSession() | FailSession() | ProposeCompensations():
                self.planner_append_all(decide(state, move, engine_id=ENGINE_ID, tools=self.tools))
            case RefuseRestore():
                self.planner_append_all(decide(state, move, engine_id=ENGINE_ID, tools=self.tools))
            case CutCheckpoint():
                self.take_checkpoint(state, move)
            case ApplyRestore():
                cut = state.checkpoints[move.plan.checkpoint_id].taken.cut
                self.planner_append_all([restore_applied(state, move, len(after_cut(self.events[session], cut)))])
            case MergeBranches():
                return self.merge(state, move.branch_session_ids, move.cause, move.cause or "")
            case StartBranches():
                cut = state.checkpoints[move.call_id].taken.cut
                created = [self.create_fork(state, b, move.call_id, cut, args) for b, args in move.branches]
                return self.merge(state, tuple(b for b, _ in move.branches), None, move.call_id) or any(created)
        return True

    def planner_append_all(self, appends: list[Append]) -> bool:
        """Append in order; True when any of them was new."""
        new = False
        for a in appends:
            new |= self.planner_append(a.session_id, a.body, a.kind, a.key, a.cause)
        return new

    def take_checkpoint(self, state: SessionState, move: CutCheckpoint) -> None:
        session = state.session_id
        events = self.events[session]
        cut = cut_of(events, {t: self.offsets[t] for t in SESSION_TOPICS})
        at_cut = self.state_at(session, cut)
        self.snapshots[(session, move.checkpoint_id)] = (cut, state_to_json(at_cut))
        body = ev.CheckpointTaken(
            checkpoint_id=move.checkpoint_id,
            cut=cut,
            state_digest=state_digest(at_cut),
            effects=effects_of(at_cut),
            num_events=at_cut.num_events,
        )
        self.planner_append_all([checkpoint_taken(state, move, body)])

    def _fork_requests(self, state: SessionState) -> bool:
        forked = False
        for _, request in state.fork_requests:
            checkpoint = state.checkpoints.get(request.checkpoint_id)
            if checkpoint is not None:
                checkpoint_id = CheckpointId(request.checkpoint_id)
                cut = checkpoint.taken.cut
                forked |= self.create_fork(state, request.fork_session_id, checkpoint_id, cut, fork_args(state))
        return forked

    def create_fork(
        self, parent: SessionState, fork: str, checkpoint_id: CheckpointId, cut: dict[str, int], args: str
    ) -> bool:
        return self.planner_append_all(fork_created(parent, fork, checkpoint_id, cut, args))

    def merge(self, state: SessionState, branches: tuple[str, ...], cause: str | None, key: str) -> bool:
        others = {s: self.own_state(s) for s in self.sessions()}
        plan = merge_plan({b: self.own_state(b) for b in branches}, state.session_id, others)
        outcome = merge_outcome(state, branches, plan, cause=cause, key=key)
        if outcome is None:
            return False
        self.planner_append_all([outcome])
        return True

    # ------------------------------------------------------ decider, executor

    def decider(self, session: str) -> bool:
        moved = False
        for tool in self.own_state(session).tool_calls.values():
            if tool.status is ToolStatus.PROPOSED:
                body: ev.Event = ev.ToolCallCommitted(call_id=tool.call_id, votes=[], policy="unanimous")
                if tool.proposed.tool in self.rejected:
                    body = ev.ToolCallAborted(call_id=tool.call_id, votes=[], policy="unanimous", reason="refused")
                moved |= self.append(session, body, "decider", eid=event_id(session, "verdict", tool.call_id))
        return moved

    def executor(self, session: str, *, crash: str | None = None) -> bool:
        """Run committed calls; ``crash``: ``before_effect`` or ``after_effect`` (SIGKILL after Started)."""
        moved = False
        for tool in self.own_state(session).tool_calls.values():
            spec = self.tools[tool.proposed.tool]
            if tool.status is ToolStatus.COMMITTED:
                moved |= self._run(session, tool.call_id, 1, crash)
                crash = None  # one crash per call of this function
            elif tool.status is ToolStatus.STARTED:  # recovery after a crash
                if spec.retry_safe:
                    moved |= self._run(session, tool.call_id, tool.attempts + 1, None)
                else:
                    reason = "started and never reported an outcome"
                    body = ev.ToolCallInDoubt(
                        call_id=tool.call_id, tool=spec.name, effect_class=spec.effect_class, reason=reason
                    )
                    moved |= self.append(
                        session, body, "executor", eid=event_id(session, "in-doubt", f"{tool.call_id}/{tool.attempts}")
                    )
            elif tool.status is ToolStatus.IN_DOUBT:
                # The operator looks at the world: did it happen? Then mark it done, else retry it.
                if self.executions[(session, tool.call_id)]:
                    done = ev.ToolCallCompleted(call_id=tool.call_id, result_json="{}", result_tokens=0, duration_ms=0)
                    moved |= self.append(session, done, "executor", eid=event_id(session, "completed", tool.call_id))
                else:
                    moved |= self._run(session, tool.call_id, tool.attempts + 1, None)
        return moved

    def _run(self, session: str, call_id: str, attempt: int, crash: str | None) -> bool:
        tool = self.own_state(session).tool_calls[call_id]
        started = ev.ToolCallStarted(
            call_id=call_id, tool=tool.proposed.tool, idempotency_key=tool.proposed.idempotency_key, attempt=attempt
        )
        if not self.append(session, started, "executor", eid=event_id(session, "started", f"{call_id}/{attempt}")):
            return False
        if crash == "before_effect":
            return True
        self.executions[(session, call_id)] += 1
        if crash == "after_effect":
            return True
        result = json.dumps(self.results.get(tool.proposed.tool, {"ok": True}))
        done = ev.ToolCallCompleted(call_id=call_id, result_json=result, result_tokens=4, duration_ms=1)
        self.append(session, done, "executor", eid=event_id(session, "completed", call_id))
        return True

    # ----------------------------------------------------------------- drive

    def sessions(self) -> list[str]:
        return sorted(self.events)

    def waits_on(self, session: str) -> tuple[str, ...]:
        """What an unfinished session waits on, by the planner's next move: ``call:<id>`` for a
        call of its own still in flight, else the unfinished sessions a merge of it waits for.
        Empty: it waits on nothing that can ever move (a fork without its lineage record, a merge
        waiting for a session that does not exist or is over, ...)."""
        state = self.state(session)
        move = next_move(
            state, self.programs.get(state.program), checkpoint_every=self.checkpoint_every, tools=self.tools
        )
        branches: tuple[str, ...] = ()
        match move:
            case WaitFor():
                tool = state.tool_calls.get(move.call_id)
                return (f"call:{move.call_id}",) if tool is not None and tool.in_flight else ()
            case MergeBranches():
                branches = move.branch_session_ids
            case StartBranches():
                branches = tuple(b for b, _ in move.branches)
            case _:
                return ()
        waiting = merge_plan({b: self.own_state(b) for b in branches}, session).waiting_for
        alive = all(b in self.events and not self.state(b).finished for b in waiting)
        return tuple(waiting) if alive else ()

    def settle(self, max_rounds: int = 400) -> None:
        """Run every role on every session until nothing moves."""
        for _ in range(max_rounds):
            moved = False
            for session in self.sessions():
                moved |= self.decider(session)
                moved |= self.executor(session)
                moved |= self.planner(session)
            if not moved:
                return
        raise AssertionError("the world did not settle")
