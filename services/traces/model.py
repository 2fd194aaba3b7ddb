"""The project's own agent trace format: one JSON object per line, one line per session.

A trace file is JSONL. Each line is one **session** (one agent run)::

    {"session_id": "s1", "source": "infercept", "arrival_s": 0.0,
     "turns": [
       {"prompt_tokens": 400, "output_tokens": 120, "tool": "search", "tool_duration_s": 2.5,
        "tool_result_tokens": 300, "shared_prefix": {"context_id": "sys-a", "tokens": 256}},
       {"prompt_tokens": 0, "output_tokens": 80, "tool": null, "tool_duration_s": null,
        "tool_result_tokens": null, "shared_prefix": null}
     ]}

A **turn** is one LLM call and, except on the last turn, the tool call that follows it:

- ``prompt_tokens``: the tokens *appended* to the context just before this LLM call (the system
  prompt and task on the first turn; template or user text on later turns). Not the context size.
- ``output_tokens``: tokens the LLM generated (at least 1: an engine always emits one).
- ``tool``, ``tool_duration_s``, ``tool_result_tokens``: the tool the agent then waited on, how long
  it took (seconds) and how many tokens its result appended to the context. All three are null on
  the last turn and all three are set on every other turn: a session is LLM, tool, LLM, ..., LLM.
- ``shared_prefix``: ``{"context_id", "tokens"}`` or null. At this turn the first ``tokens`` tokens
  of the session's context are identical to those of every other session (at its turn) declaring
  the same ``context_id`` (a common system prompt, or a Mooncake hash-id prefix), so their KV blocks
  can be shared. Every declaration of one context_id in a trace has the same ``tokens``.

**Why new tokens, not context size.** The simulator and the ``trace`` agent program need, at each
turn, what to *prefill*: exactly the tokens appended since the last call. The context size then
follows by a running sum (prompt + output + tool result per turn), so one primitive gives both,
while a recorded context size would force every consumer to re-derive the deltas and to decide
again what to do when they come out negative. Importers of context-size traces (InferCept) derive
the deltas once, clamp a negative delta (a recorded context *smaller* than the running sum: the
source truncated its history) to 0, and say how often in ``Trace.notes``; the modelled context
then stays at the running sum, since a growing context is what an append-only KV cache holds.

Sessions are in arrival order (``arrival_s`` non-decreasing) so a replayer can stream the file.
Unknown keys are rejected (they are almost always typos). Parsing errors raise
:class:`TraceFormatError` naming the line, the session and the turn.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

_TURN_KEYS = ("prompt_tokens", "output_tokens", "tool", "tool_duration_s", "tool_result_tokens", "shared_prefix")
_SESSION_KEYS = ("session_id", "source", "arrival_s", "turns")
_PREFIX_KEYS = ("context_id", "tokens")


class TraceFormatError(ValueError):
    """A trace object or line that breaks the format; the message says where and why."""


def _int(value: object, name: str, minimum: int) -> int:
    # bool is an int subclass in Python, but `true` is never a token count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceFormatError(f"{name} must be >= {minimum}, got {value}")
    return value


def _seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceFormatError(f"{name} must be a number of seconds, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise TraceFormatError(f"{name} must be finite and >= 0, got {value!r}")
    return number


def _text(value: object, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise TraceFormatError(f"{name} must be a non-empty string, got {value!r}")
    return value


def _fields(obj: object, keys: tuple[str, ...], what: str, optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise TraceFormatError(f"{what} must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in keys if k not in obj and k not in optional]
    if missing:
        raise TraceFormatError(f"{what} is missing {', '.join(missing)}")
    unknown = sorted(set(obj) - set(keys))
    if unknown:
        raise TraceFormatError(f"{what} has unknown field(s) {', '.join(map(str, unknown))}")
    return obj


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """The first ``tokens`` tokens of the context equal those of every session with this context_id."""

    context_id: str
    tokens: int

    def __post_init__(self) -> None:
        _text(self.context_id, "shared_prefix.context_id")
        _int(self.tokens, "shared_prefix.tokens", 1)

    def to_dict(self) -> dict[str, Any]:
        return {"context_id": self.context_id, "tokens": self.tokens}

    @classmethod
    def from_dict(cls, obj: object) -> SharedPrefix:
        fields = _fields(obj, _PREFIX_KEYS, "shared_prefix")
        return cls(context_id=fields["context_id"], tokens=fields["tokens"])


@dataclass(frozen=True, slots=True)
class TraceTurn:
    """One LLM call and the tool call after it (none on the last turn)."""

    prompt_tokens: int
    output_tokens: int
    tool: str | None = None
    tool_duration_s: float | None = None
    tool_result_tokens: int | None = None
    shared_prefix: SharedPrefix | None = None

    def __post_init__(self) -> None:
        _int(self.prompt_tokens, "prompt_tokens", 0)
        _int(self.output_tokens, "output_tokens", 1)
        tool_fields = (self.tool, self.tool_duration_s, self.tool_result_tokens)
        if self.tool is None:
            if any(v is not None for v in tool_fields):
                raise TraceFormatError("tool_duration_s and tool_result_tokens must be null when tool is null")
        else:
            _text(self.tool, "tool")
            if self.tool_duration_s is None or self.tool_result_tokens is None:
                raise TraceFormatError(f"tool {self.tool!r} needs tool_duration_s and tool_result_tokens")
            # Normalise ints to float so equality and JSON output do not depend on how it was written.
            object.__setattr__(self, "tool_duration_s", _seconds(self.tool_duration_s, "tool_duration_s"))
            _int(self.tool_result_tokens, "tool_result_tokens", 0)
        if self.shared_prefix is not None and not isinstance(self.shared_prefix, SharedPrefix):
            raise TraceFormatError(f"shared_prefix must be a SharedPrefix, got {self.shared_prefix!r}")

    @property
    def appended_tokens(self) -> int:
        """How much this turn grows the context: prompt + output + tool result."""
        return self.prompt_tokens + self.output_tokens + (self.tool_result_tokens or 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "tool": self.tool,
            "tool_duration_s": self.tool_duration_s,
            "tool_result_tokens": self.tool_result_tokens,
            "shared_prefix": None if self.shared_prefix is None else self.shared_prefix.to_dict(),
        }

    @classmethod
    def from_dict(cls, obj: object) -> TraceTurn:
        # The three tool fields and shared_prefix may be omitted (null); the token counts may not.
        fields = _fields(obj, _TURN_KEYS, "turn", optional=_TURN_KEYS[2:])
        prefix = fields.get("shared_prefix")
        return cls(
            prompt_tokens=fields["prompt_tokens"],
            output_tokens=fields["output_tokens"],
            tool=fields.get("tool"),
            tool_duration_s=fields.get("tool_duration_s"),
            tool_result_tokens=fields.get("tool_result_tokens"),
            shared_prefix=None if prefix is None else SharedPrefix.from_dict(prefix),
        )


@dataclass(frozen=True, slots=True)
class TraceSession:
    """One agent run: when it arrives and its turns, the last one without a tool."""

    session_id: str
    source: str
    arrival_s: float
    turns: tuple[TraceTurn, ...]

    def __post_init__(self) -> None:
        _text(self.session_id, "session_id")
        where = f"session {self.session_id!r}"
        try:
            _text(self.source, "source")
            object.__setattr__(self, "arrival_s", _seconds(self.arrival_s, "arrival_s"))
            object.__setattr__(self, "turns", tuple(self.turns))
            if not self.turns:
                raise TraceFormatError("turns must not be empty")
        except TraceFormatError as e:
            raise TraceFormatError(f"{where}: {e}") from None
        context = 0
        for i, turn in enumerate(self.turns):
            if not isinstance(turn, TraceTurn):
                raise TraceFormatError(f"{where} turn {i}: expected a TraceTurn, got {type(turn).__name__}")
            last = i == len(self.turns) - 1
            if last and turn.tool is not None:
                raise TraceFormatError(f"{where} turn {i}: the last turn must have tool null, got {turn.tool!r}")
            if not last and turn.tool is None:
                raise TraceFormatError(f"{where} turn {i}: every turn but the last needs a tool")
            if i == 0 and turn.prompt_tokens == 0:
                raise TraceFormatError(f"{where} turn 0: the first LLM call needs prompt_tokens >= 1")
            context += turn.prompt_tokens
            if turn.shared_prefix is not None and turn.shared_prefix.tokens > context:
                raise TraceFormatError(
                    f"{where} turn {i}: shared_prefix.tokens {turn.shared_prefix.tokens} exceeds the context "
                    f"({context} tokens) at that call"
                )
            context += turn.output_tokens + (turn.tool_result_tokens or 0)

    @property
    def final_context_tokens(self) -> int:
        """Context length after the last turn (every token the session ever appended)."""
        return sum(t.appended_tokens for t in self.turns)

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "source": self.source,
            "arrival_s": self.arrival_s,
            "turns": [t.to_dict() for t in self.turns],
        }

    def to_json_line(self) -> str:
        """One line of JSON, keys in the documented order, no trailing newline."""
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, obj: object) -> TraceSession:
        fields = _fields(obj, _SESSION_KEYS, "session")
        session_id = _text(fields["session_id"], "session_id")
        turns = fields["turns"]
        if not isinstance(turns, list):
            raise TraceFormatError(f"session {session_id!r}: turns must be a list, got {type(turns).__name__}")
        parsed: list[TraceTurn] = []
        for i, turn in enumerate(turns):
            try:
                parsed.append(TraceTurn.from_dict(turn))
            except TraceFormatError as e:
                raise TraceFormatError(f"session {session_id!r} turn {i}: {e}") from None
        return cls(session_id=session_id, source=fields["source"], arrival_s=fields["arrival_s"], turns=tuple(parsed))

    @classmethod
    def from_json_line(cls, line: str) -> TraceSession:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"not JSON: {e}") from None
        return cls.from_dict(obj)


@dataclass(frozen=True, slots=True)
class Trace:
    """Sessions in arrival order. ``notes`` are an importer's remarks for people; not serialised."""

    sessions: tuple[TraceSession, ...]
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sessions", tuple(self.sessions))
        object.__setattr__(self, "notes", tuple(self.notes))
        seen: set[str] = set()
        prefix_tokens: dict[str, int] = {}
        previous = -math.inf
        for s in self.sessions:
            if s.session_id in seen:
                raise TraceFormatError(f"session {s.session_id!r} appears twice")
            seen.add(s.session_id)
            if s.arrival_s < previous:
                raise TraceFormatError(
                    f"session {s.session_id!r}: sessions must be in arrival order ({s.arrival_s} after {previous})"
                )
            previous = s.arrival_s
            for turn in s.turns:
                p = turn.shared_prefix
                if p is not None and prefix_tokens.setdefault(p.context_id, p.tokens) != p.tokens:
                    raise TraceFormatError(
                        f"session {s.session_id!r}: shared_prefix {p.context_id!r} has {p.tokens} tokens here "
                        f"but {prefix_tokens[p.context_id]} elsewhere"
                    )

    def __iter__(self) -> Iterator[TraceSession]:
        return iter(self.sessions)

    def __len__(self) -> int:
        return len(self.sessions)

    def to_json_lines(self) -> list[str]:
        return [s.to_json_line() for s in self.sessions]

    @classmethod
    def from_json_lines(cls, lines: Iterable[str]) -> Trace:
        """Parse JSONL text lines (blank lines skipped); errors name the 1-based line number."""
        sessions: list[TraceSession] = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                sessions.append(TraceSession.from_json_line(line))
            except TraceFormatError as e:
                raise TraceFormatError(f"line {number}: {e}") from None
        return cls(tuple(sessions))


def time_scale(trace: Trace, factor: float) -> Trace:
    """Multiply every tool duration and every arrival gap by ``factor`` (0.01 compresses 100x).

    Arrivals are scaled relative to the first arrival, which stays put, so a trace whose clock
    starts late (Mooncake starts at 0, but a slice need not) keeps its start. Token counts are
    untouched: only waiting time shrinks, which is what makes a long trace replayable quickly.
    """
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"time scale factor must be a finite number > 0, got {factor!r}")
    if not trace.sessions:
        return trace
    start = trace.sessions[0].arrival_s
    sessions = tuple(
        replace(
            s,
            arrival_s=start + (s.arrival_s - start) * factor,
            turns=tuple(
                t if t.tool_duration_s is None else replace(t, tool_duration_s=t.tool_duration_s * factor)
                for t in s.turns
            ),
        )
        for s in trace.sessions
    )
    return Trace(sessions, notes=(*trace.notes, f"time scaled by {factor:g}"))


def head(trace: Trace, limit: int) -> Trace:
    """The first ``limit`` sessions by arrival (a smaller replay of the same workload)."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if limit >= len(trace.sessions):
        return trace
    return Trace(trace.sessions[:limit], notes=(*trace.notes, f"kept the first {limit} sessions"))
