"""The one interface the planner uses to reach an inference engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from schemas.events import EngineId
from services.programs.base import ModelToolCall, Prompt


@dataclass(frozen=True)
class Completion:
    """What an engine answered, with the numbers the log records."""

    request_id: str
    engine_id: EngineId
    text: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finish_reason: str
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    replayed: bool = False
    """True when the engine answered from its record of this request id instead of running it again."""
    tool_calls: tuple[ModelToolCall, ...] = ()
    """The tool calls of a chat reply (a chat engine's; a completions engine has none)."""


class EngineError(Exception):
    """The engine refused the request (bad prompt, too long, ...): retrying will not help."""


class EngineUnavailable(Exception):
    """The engine could not be reached or is overloaded: retry later."""


class Engine(Protocol):
    engine_id: EngineId

    async def complete(
        self,
        *,
        session_id: str,
        request_id: str,
        prompt: Prompt,
        max_output_tokens: int,
        messages: Sequence[Mapping[str, Any]] = (),
        tools: Sequence[Mapping[str, Any]] = (),
        tool_choice: str | Mapping[str, Any] | None = None,
        priority: int | None = None,
    ) -> Completion:
        """Run one LLM call. ``request_id`` is the same on every retry of the same call.

        ``priority``: the call's program-level priority (``services.scheduling``; lower is served
        first, vLLM's ``priority`` field); None sends none (the engine's default, 0).

        ``messages``, ``tools`` and ``tool_choice`` (OpenAI's, from an SDK program) are what a chat
        engine sends;
        ``prompt`` is their rendering, what a completions engine sends."""
        ...

    async def close(self) -> None: ...
