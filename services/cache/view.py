"""A per-session view of what the cache manager needs, folded from log event bodies.

``CacheViewBuilder.apply(session_id, body, at)`` folds one event (``at``: the event's
time in seconds on the caller's clock; the builder never reads a clock). Phases:

- ``IDLE``: started, no LLM call yet, or between a tool's end and the next LLM call
  (the next call is imminent);
- ``LLM``: an LLM call is running (its blocks are in use and cannot be evicted);
- ``TOOL``: waiting on tool ``tool`` since ``since`` (proposal; the verdict wait counts);
- ``HUMAN``: waiting on a tool named in ``human_tools`` (a person answers);
- ``FINISHED``: SessionFinished or SessionFailed.

KV blocks per tier come from KVBlocksStored / KVBlocksRemoved (hashes per tier, so a
repeated store or removal is idempotent). Tool durations from ToolCallCompleted and
ToolCallFailed feed the builder's ``ToolLatencyModel``; queue and verdict delays are
exponentially weighted moving averages (weight ``ewma_alpha`` on the newest value)
of ``LLMCallCompleted.queue_ms`` and of the proposal-to-start time of tool calls.
Other event types are ignored.

``forget(session_id)`` drops a session's state (the cache manager forgets finished
sessions that hold nothing; see ``services.cache.manager``); ``forgettable`` says when
nothing the builder keeps about it can matter again: finished, no blocks on either tier
by kv.events, and no tool call of it running (its completion still feeds the latency
model, which needs the tool's name).

Views are built field by field rather than with ``dataclasses.replace``, which costs
about twice as much (a view per event, 10,000s of events a second).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from schemas.events import (
    KVBlocksRemoved,
    KVBlocksStored,
    KVTier,
    LLMCallCompleted,
    LLMCallStarted,
    Model,
    SessionFailed,
    SessionFinished,
    SessionId,
    ToolCallCompleted,
    ToolCallFailed,
    ToolCallInDoubt,
    ToolCallProposed,
    ToolCallStarted,
)
from services.cache.latency import ToolLatencyModel

__all__ = ["CacheViewBuilder", "Phase", "SessionView"]

_MS_PER_S = 1000.0


class Phase(StrEnum):
    IDLE = "idle"
    LLM = "llm"
    TOOL = "tool"
    HUMAN = "human"
    FINISHED = "finished"


@dataclass(slots=True, unsafe_hash=True)
class SessionView:
    """What the policy knows of one session; immutable (``Final``: mypy refuses an assignment).

    Its ``__init__`` is written out rather than generated: mypyc compiles a written one
    (``services.cache``), where a frozen dataclass's generated one runs interpreted, setting
    each field through ``object.__setattr__``: 2.4 us a view, two views an event, a sixth
    of the compiled fold (docs/benchmarks.md)."""

    session_id: Final[SessionId]
    phase: Final[Phase]
    since: Final[float]  # when the phase began (seconds)
    tool: Final[str | None]  # the pending tool in TOOL / HUMAN
    tool_started_at: Final[float | None]  # when the pending tool started running (after its verdict)
    context_tokens: Final[int]
    gpu_blocks: Final[int]
    host_blocks: Final[int]
    turns: Final[int]  # LLM calls started
    attained_service_s: Final[float]  # prefill + decode time of its completed calls

    def __init__(
        self,
        session_id: SessionId,
        phase: Phase = Phase.IDLE,
        since: float = 0.0,
        tool: str | None = None,
        tool_started_at: float | None = None,
        context_tokens: int = 0,
        gpu_blocks: int = 0,
        host_blocks: int = 0,
        turns: int = 0,
        attained_service_s: float = 0.0,
    ) -> None:
        self.session_id = session_id
        self.phase = phase
        self.since = since
        self.tool = tool
        self.tool_started_at = tool_started_at
        self.context_tokens = context_tokens
        self.gpu_blocks = gpu_blocks
        self.host_blocks = host_blocks
        self.turns = turns
        self.attained_service_s = attained_service_s


@dataclass(slots=True)
class _State:
    view: SessionView
    tools: dict[str, str] = field(default_factory=dict)  # call_id -> tool
    proposed_at: dict[str, float] = field(default_factory=dict)
    hashes: dict[KVTier, set[str]] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)  # tool calls started, not yet completed or failed


class CacheViewBuilder:
    """Folds event bodies into ``SessionView``s (see the module docstring)."""

    def __init__(
        self,
        *,
        latency: ToolLatencyModel | None = None,
        human_tools: frozenset[str] = frozenset({"human"}),
        ewma_alpha: float = 0.2,
    ) -> None:
        self.latency = latency if latency is not None else ToolLatencyModel()
        self.human_tools = human_tools
        self.ewma_alpha = ewma_alpha
        self.queue_delay_s = 0.0
        self.verdict_delay_s = 0.0
        self._states: dict[SessionId, _State] = {}

    def views(self) -> dict[SessionId, SessionView]:
        return {sid: state.view for sid, state in self._states.items()}

    def view(self, session_id: SessionId) -> SessionView:
        state = self._states.get(session_id)
        return state.view if state is not None else SessionView(session_id)

    def apply(self, session_id: SessionId, body: Model, at: float) -> None:
        """Fold one event body of ``session_id`` that happened at ``at`` seconds."""
        state = self._states.get(session_id)
        if state is None:
            state = self._states[session_id] = _State(SessionView(session_id, since=at))
        v = state.view
        # Fields: session_id, phase, since, tool, tool_started_at, context_tokens, gpu_blocks,
        # host_blocks, turns, attained_service_s.
        if isinstance(body, LLMCallStarted):
            state.view = SessionView(
                session_id, Phase.LLM, at, None, None, body.prompt_tokens, v.gpu_blocks, v.host_blocks,
                max(v.turns, body.turn + 1), v.attained_service_s,
            )  # fmt: skip
        elif isinstance(body, LLMCallCompleted):
            self.queue_delay_s = self._ewma(self.queue_delay_s, body.queue_ms / _MS_PER_S)
            state.view = SessionView(
                session_id, Phase.IDLE, at, v.tool, v.tool_started_at, body.prompt_tokens + body.output_tokens,
                v.gpu_blocks, v.host_blocks, v.turns,
                v.attained_service_s + (body.prefill_ms + body.decode_ms) / _MS_PER_S,
            )  # fmt: skip
        elif isinstance(body, ToolCallProposed):
            state.tools[body.call_id] = body.tool
            state.proposed_at[body.call_id] = at
            phase = Phase.HUMAN if body.tool in self.human_tools else Phase.TOOL
            state.view = SessionView(
                session_id, phase, at, body.tool, None, v.context_tokens, v.gpu_blocks, v.host_blocks, v.turns,
                v.attained_service_s,
            )  # fmt: skip
        elif isinstance(body, ToolCallStarted):
            proposed = state.proposed_at.get(body.call_id)
            if proposed is not None and body.attempt == 1:
                self.verdict_delay_s = self._ewma(self.verdict_delay_s, max(0.0, at - proposed))
            state.running.add(body.call_id)
            state.view = SessionView(
                session_id, v.phase, v.since, body.tool, at, v.context_tokens, v.gpu_blocks, v.host_blocks, v.turns,
                v.attained_service_s,
            )  # fmt: skip
        elif isinstance(body, ToolCallCompleted | ToolCallFailed):
            state.running.discard(body.call_id)
            tool = state.tools.get(body.call_id)
            if tool is not None:
                self.latency.observe(tool, body.duration_ms / _MS_PER_S)
            context = v.context_tokens + body.result_tokens if isinstance(body, ToolCallCompleted) else v.context_tokens
            if v.phase is Phase.FINISHED:  # a tool that ends after its session did (e.g. cancelled while running)
                phase, since = Phase.FINISHED, v.since
            else:
                phase, since = Phase.IDLE, at
            state.view = SessionView(
                session_id, phase, since, None, None, context, v.gpu_blocks, v.host_blocks, v.turns,
                v.attained_service_s,
            )  # fmt: skip
        elif isinstance(body, ToolCallInDoubt):
            state.running.discard(body.call_id)  # it will not complete: an operator resolves it
        elif isinstance(body, SessionFinished | SessionFailed):
            state.view = SessionView(
                session_id, Phase.FINISHED, at, None, None, v.context_tokens, v.gpu_blocks, v.host_blocks, v.turns,
                v.attained_service_s,
            )  # fmt: skip
        elif isinstance(body, KVBlocksStored | KVBlocksRemoved):
            held = state.hashes.get(body.tier)
            if held is None:
                held = state.hashes[body.tier] = set()
            if isinstance(body, KVBlocksStored):
                held.update(body.block_hashes)
            else:
                held.difference_update(body.block_hashes)
            gpu = state.hashes.get(KVTier.GPU)
            host = state.hashes.get(KVTier.CPU)
            state.view = SessionView(
                session_id, v.phase, v.since, v.tool, v.tool_started_at, v.context_tokens,
                0 if gpu is None else len(gpu), 0 if host is None else len(host), v.turns, v.attained_service_s,
            )  # fmt: skip

    def forgettable(self, session_id: SessionId) -> bool:
        """Finished, no blocks on either tier, no tool call running (see the module docstring)."""
        state = self._states.get(session_id)
        if state is None:
            return True
        v = state.view
        return v.phase is Phase.FINISHED and v.gpu_blocks == 0 and v.host_blocks == 0 and not state.running

    def finished(self, session_id: SessionId, at: float) -> None:
        """A fresh state for ``session_id``, finished at ``at`` (a forgotten session whose blocks
        are reported late comes back as what it was: finished)."""
        self._states[session_id] = _State(SessionView(session_id, Phase.FINISHED, at))

    def forget(self, session_id: SessionId) -> None:
        """Drop everything kept about ``session_id`` (its view reads as a new session's after this)."""
        self._states.pop(session_id, None)

    def __len__(self) -> int:
        """Sessions with state."""
        return len(self._states)

    def _ewma(self, old: float, new: float) -> float:
        return (1.0 - self.ewma_alpha) * old + self.ewma_alpha * new
