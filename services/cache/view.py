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
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

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


@dataclass(frozen=True, slots=True)
class SessionView:
    """What the policy knows of one session."""

    session_id: SessionId
    phase: Phase = Phase.IDLE
    since: float = 0.0  # when the phase began (seconds)
    tool: str | None = None  # the pending tool in TOOL / HUMAN
    tool_started_at: float | None = None  # when the pending tool started running (after its verdict)
    context_tokens: int = 0
    gpu_blocks: int = 0
    host_blocks: int = 0
    turns: int = 0  # LLM calls started
    attained_service_s: float = 0.0  # prefill + decode time of its completed calls


@dataclass(slots=True)
class _State:
    view: SessionView
    tools: dict[str, str] = field(default_factory=dict)  # call_id -> tool
    proposed_at: dict[str, float] = field(default_factory=dict)
    hashes: dict[KVTier, set[str]] = field(default_factory=dict)


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
        if isinstance(body, LLMCallStarted):
            v = replace(
                v, phase=Phase.LLM, since=at, tool=None, tool_started_at=None,
                context_tokens=body.prompt_tokens, turns=max(v.turns, body.turn + 1),
            )  # fmt: skip
        elif isinstance(body, LLMCallCompleted):
            self.queue_delay_s = self._ewma(self.queue_delay_s, body.queue_ms / _MS_PER_S)
            v = replace(
                v, phase=Phase.IDLE, since=at, context_tokens=body.prompt_tokens + body.output_tokens,
                attained_service_s=v.attained_service_s + (body.prefill_ms + body.decode_ms) / _MS_PER_S,
            )  # fmt: skip
        elif isinstance(body, ToolCallProposed):
            state.tools[body.call_id] = body.tool
            state.proposed_at[body.call_id] = at
            phase = Phase.HUMAN if body.tool in self.human_tools else Phase.TOOL
            v = replace(v, phase=phase, since=at, tool=body.tool, tool_started_at=None)
        elif isinstance(body, ToolCallStarted):
            proposed = state.proposed_at.get(body.call_id)
            if proposed is not None and body.attempt == 1:
                self.verdict_delay_s = self._ewma(self.verdict_delay_s, max(0.0, at - proposed))
            v = replace(v, tool=body.tool, tool_started_at=at)
        elif isinstance(body, ToolCallCompleted | ToolCallFailed):
            tool = state.tools.get(body.call_id)
            if tool is not None:
                self.latency.observe(tool, body.duration_ms / _MS_PER_S)
            if isinstance(body, ToolCallCompleted):
                v = replace(v, context_tokens=v.context_tokens + body.result_tokens)
            v = replace(v, phase=Phase.IDLE, since=at, tool=None, tool_started_at=None)
        elif isinstance(body, SessionFinished | SessionFailed):
            v = replace(v, phase=Phase.FINISHED, since=at, tool=None, tool_started_at=None)
        elif isinstance(body, KVBlocksStored | KVBlocksRemoved):
            held = state.hashes.setdefault(body.tier, set())
            if isinstance(body, KVBlocksStored):
                held.update(body.block_hashes)
            else:
                held.difference_update(body.block_hashes)
            v = replace(
                v, gpu_blocks=len(state.hashes.get(KVTier.GPU, ())), host_blocks=len(state.hashes.get(KVTier.CPU, ()))
            )
        state.view = v

    def _ewma(self, old: float, new: float) -> float:
        return (1.0 - self.ewma_alpha) * old + self.ewma_alpha * new
