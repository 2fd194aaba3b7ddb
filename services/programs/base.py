"""What an agent program is: a deterministic function from its results so far to its next action.

A program never sees the log, the clock or the engine. The planner gives it a
``ProgramView`` (its arguments and the results of its completed steps, in
order) and carries out the ``Action`` it returns. Given the same view it must
return the same action: that is what lets recovery replay it against the
recorded results and run only what is left.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

VOCAB_SIZE = 32_000


@dataclass(frozen=True, slots=True)
class TokenRun:
    """``count`` synthetic tokens drawn from ``seed``: a stand-in for text when only sizes matter.

    Token i of a run is a fixed function of (seed, i), so the same run always
    yields the same tokens, and two prompts that share runs share a prefix
    (and KV cache blocks).
    """

    seed: str
    count: int

    def token_ids(self) -> list[int]:
        base = zlib.crc32(self.seed.encode())
        return [(base + i * 2_654_435_761) % VOCAB_SIZE for i in range(self.count)]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as text (real models) or as token runs (simulated engines)."""

    runs: tuple[TokenRun, ...] = ()
    text: str | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens in the runs (a text prompt is counted by the engine's tokenizer)."""
        return sum(r.count for r in self.runs)

    def token_ids(self) -> list[int]:
        ids: list[int] = []
        for run in self.runs:
            ids.extend(run.token_ids())
        return ids

    def to_json(self) -> dict[str, Any]:
        return {"runs": [[r.seed, r.count] for r in self.runs], "text": self.text}

    def digest(self) -> str:
        """SHA-256 of the canonical JSON: what ``LLMCallStarted.prompt_digest`` records."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    @staticmethod
    def from_json(data: dict[str, Any]) -> Prompt:
        return Prompt(tuple(TokenRun(seed, count) for seed, count in data.get("runs", [])), data.get("text"))


def output_run(request_id: str, num_tokens: int) -> TokenRun:
    """The tokens a simulated engine generates for ``request_id`` (see workers.engines.sim)."""
    return TokenRun(f"{request_id}:out", num_tokens)


# ----------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class CallLLM:
    prompt: Prompt
    max_output_tokens: int
    messages: tuple[dict[str, Any], ...] = ()
    """The chat messages the prompt was rendered from (SDK programs); empty for token-run prompts."""
    tools: tuple[dict[str, Any], ...] = ()
    """The tools (OpenAI function specs) offered to the model with the messages."""
    tool_choice: str | dict[str, Any] | None = None
    """OpenAI's ``tool_choice`` (``none``, ``auto``, ``required``, a named function); None: the engine's default."""
    size: str | None = None
    """The model size the program declares for this step (``small`` or ``large``); None: no opinion. Only a
    stack with engines of several sizes reads it (``services.routing.choose_size``); it is not in the prompt
    digest, so declaring it does not change what replay checks."""


@dataclass(frozen=True, slots=True)
class CallTool:
    tool: str
    arguments: dict[str, Any]
    resource: str | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    output: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Fail:
    """The program gives up; the session fails with this reason."""

    reason: str


@dataclass(frozen=True, slots=True)
class TakeCheckpoint:
    """The program asks for a checkpoint here; its result is ``{"checkpoint_id": ...}``."""


@dataclass(frozen=True, slots=True)
class Fork:
    """The program forks itself: one branch per entry (the branch's arguments), runs them, merges them.

    Each branch is a new session whose history is this one's up to here (by
    reference); it runs the same program with its own arguments. The step's
    result is a ``ToolResult`` of tool ``merge`` whose result maps each branch's
    session id to its final output (``{"failed": reason}`` for a failed branch);
    not ok, with the conflicts as the error, when the branches conflict.
    """

    branches: tuple[dict[str, Any], ...]


Action = CallLLM | CallTool | Finish | Fail | TakeCheckpoint | Fork


# ----------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class ModelToolCall:
    """A tool call a chat model asked for, as it asked: ``arguments`` is the raw string it
    emitted (JSON when well formed; a program must not assume so)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's form (an entry of an assistant message's ``tool_calls``)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_json(self) -> dict[str, str]:
        """The form ``LLMCallCompleted.tool_calls_json`` records."""
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    @staticmethod
    def list_from_json(text: str | None) -> tuple[ModelToolCall, ...]:
        """The calls ``LLMCallCompleted.tool_calls_json`` holds (none for null)."""
        if not text:
            return ()
        return tuple(ModelToolCall(str(c["id"]), str(c["name"]), str(c["arguments"])) for c in json.loads(text))

    @staticmethod
    def list_to_json(calls: tuple[ModelToolCall, ...]) -> str | None:
        return json.dumps([c.to_json() for c in calls]) if calls else None


@dataclass(frozen=True, slots=True)
class LLMResult:
    call_id: str
    request_id: str
    output_text: str
    prompt_tokens: int
    output_tokens: int
    prompt_digest: str = ""
    """The digest of the prompt the log recorded for this call (empty: not known)."""
    tool_calls: tuple[ModelToolCall, ...] = ()
    """The tool calls of a chat reply (``LLMCallCompleted.tool_calls_json``)."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    call_id: str
    tool: str
    ok: bool
    result: Any
    result_tokens: int
    error: str | None = None
    arguments: dict[str, Any] | None = None
    """The arguments the log recorded for this call (None: not known, or a checkpoint or merge step)."""


Result = LLMResult | ToolResult


@dataclass(frozen=True)
class ProgramView:
    """What a program may know: who it is, its arguments, and its results so far."""

    session_id: str
    args: dict[str, Any]
    results: tuple[Result, ...] = field(default_factory=tuple)
    context_id: str = ""
    """Seed for the tokens of the program's own prompts: the session id, or for a fork its root
    ancestor's, so that a fork's prompts repeat its parent's tokens (and hit its KV prefix)."""
    merged: tuple[dict[str, Any], ...] = ()
    """Results an operator merged into this session (``logctl merge``), oldest first: branch id -> output."""

    def __post_init__(self) -> None:
        if not self.context_id:
            object.__setattr__(self, "context_id", self.session_id)

    @property
    def step(self) -> int:
        """The index of the action being asked for."""
        return len(self.results)


class Program(Protocol):
    """An agent program. ``next_action`` must be a pure, deterministic function of the view."""

    name: str

    def next_action(self, view: ProgramView) -> Action: ...


class InvalidAction(Exception):
    """A program returned something that is not an action, or an action that cannot be carried out."""


class NonDeterminism(Exception):
    """A program asked, on replay, for something else than the log holds for that step.

    The message names the step. The planner fails the session with error type ``NonDeterminism``.
    """
