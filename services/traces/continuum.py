"""Import Continuum's agent trajectories (arXiv 2511.02230, SWE-smith runs) into the trace format.

The file is a JSON list of trajectories. Each has ``messages``, the chat as a JSON string (an
already-parsed list is accepted too), and an id (``traj_id``, else ``instance_id``, else its
position). Assistant messages carry ``tool_calls``: a Python-literal string (parsed with
``ast.literal_eval``; a list is accepted as is) whose entries give ``function.name``,
``function.arguments`` and ``execution_time_seconds``. Message ``content`` is a string or a list
of ``{"type": "text", "text": ...}`` parts (also possibly as a Python-literal string).

A turn is one assistant message:

- ``prompt_tokens``: tokens of the non-tool messages (system, user) since the previous assistant
  message. Tool messages are *not* counted here: they are the previous turn's
  ``tool_result_tokens``, and counting them twice would inflate the context.
- ``output_tokens``: tokens of the assistant text plus each tool call's name and arguments (the
  model generates both).
- ``tool``: the first tool call's name; ``tool_duration_s``: the sum of that message's tool calls'
  execution times (they ran one after the other); ``tool_result_tokens``: tokens of the tool
  messages that follow it.
- The last assistant message gets no tool: its call (``submit`` in SWE-agent) ends the episode and
  nothing it returns is read by the model. Tool messages after it are dropped for the same reason.
- An assistant message without tool calls before the end (the user answers instead) gets tool
  ``"user"`` with duration 0 (no timing is recorded) and no result tokens; the user's message is the
  next turn's prompt.

Trajectories whose leading system message(s) have the same text (SWE-agent uses one system prompt
for every task) share it: their first turn gets a ``shared_prefix`` of its tokens (context_id
``continuum:`` + a hash of the text).

Token counts come from ``tokenizer`` (default :func:`approx_token_count`, an estimate: no real
tokenizer is available offline). Arrivals are Poisson over the trajectories in file order.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from services.traces.arrivals import poisson_arrivals
from services.traces.model import SharedPrefix, Trace, TraceFormatError, TraceSession, TraceTurn
from services.traces.tokens import approx_token_count

SOURCE = "continuum"
NO_TOOL_REPLY = "user"


def _literal(value: object, what: str) -> object:
    """A Python-literal string parsed, anything else as is."""
    if isinstance(value, str):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError) as e:
            raise TraceFormatError(f"{what} is not a Python literal: {e}") from None
    return value


def message_text(content: object) -> str:
    """The text of a message ``content``: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        stripped = content.lstrip()
        if not (stripped.startswith("[{") and "'type'" in stripped):
            return content
        try:
            parsed: object = ast.literal_eval(stripped)
        except (ValueError, SyntaxError):
            return content  # text that merely looks like a literal
        content = parsed
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(
            str(part.get("text", "")) for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    raise TraceFormatError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def _tool_calls(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    calls = _literal(message.get("tool_calls") or [], f"{where} tool_calls")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise TraceFormatError(f"{where}: tool_calls must be a list of objects")
    return calls


def _call_name(call: dict[str, Any], where: str) -> str:
    function = call.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise TraceFormatError(f"{where}: a tool call has no function.name")
    return name


def _call_seconds(call: dict[str, Any], where: str) -> float:
    seconds = call.get("execution_time_seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TraceFormatError(f"{where}: tool call {_call_name(call, where)!r} has no execution_time_seconds")
    return float(seconds)


def _output_tokens(message: dict[str, Any], calls: list[dict[str, Any]], tokenizer: Callable[[str], int]) -> int:
    generated = tokenizer(message_text(message.get("content")))
    for call in calls:
        function = call["function"]
        generated += tokenizer(str(function.get("name", ""))) + tokenizer(str(function.get("arguments", "")))
    return max(1, generated)  # an LLM call emits at least one token, even an empty reply


def _messages(trajectory: object, index: int) -> tuple[str, list[dict[str, Any]]]:
    if not isinstance(trajectory, dict):
        raise TraceFormatError(f"trajectory {index}: expected an object, got {type(trajectory).__name__}")
    session_id = str(trajectory.get("traj_id") or trajectory.get("instance_id") or f"continuum-{index}")
    raw = trajectory.get("messages")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"trajectory {session_id!r}: messages is not JSON: {e}") from None
    if not isinstance(raw, list) or not all(isinstance(m, dict) and "role" in m for m in raw):
        raise TraceFormatError(f"trajectory {session_id!r}: messages must be a list of objects with a role")
    return session_id, raw


def trajectory_turns(
    session_id: str, messages: Sequence[dict[str, Any]], tokenizer: Callable[[str], int]
) -> list[TraceTurn]:
    """The turns of one trajectory's chat; see the module docstring for the rules."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistants:
        raise TraceFormatError(f"trajectory {session_id!r}: no assistant message, so no LLM call")
    turns: list[TraceTurn] = []
    start = 0
    for n, a in enumerate(assistants):
        where = f"trajectory {session_id!r} message {a}"
        prompt = sum(tokenizer(message_text(m.get("content"))) for m in messages[start:a] if m["role"] != "tool")
        message = messages[a]
        calls = _tool_calls(message, where)
        output = _output_tokens(message, calls, tokenizer)
        end = assistants[n + 1] if n + 1 < len(assistants) else len(messages)
        if end == len(messages):
            turns.append(TraceTurn(prompt, output))
            break
        results = sum(tokenizer(message_text(m.get("content"))) for m in messages[a + 1 : end] if m["role"] == "tool")
        if calls:
            tool, seconds = _call_name(calls[0], where), sum(_call_seconds(c, where) for c in calls)
        else:
            tool, seconds = NO_TOOL_REPLY, 0.0
        try:
            turns.append(TraceTurn(prompt, output, tool, seconds, results))
        except TraceFormatError as e:
            raise TraceFormatError(f"{where}: {e}") from None
        start = a + 1
    if turns[0].prompt_tokens == 0:
        raise TraceFormatError(f"trajectory {session_id!r}: nothing precedes the first assistant message")
    return turns


def _leading_system_texts(messages: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    texts: list[str] = []
    for m in messages:
        if m["role"] != "system":
            break
        texts.append(message_text(m.get("content")))
    return tuple(texts)


def _share_system_prompts(
    sessions: list[TraceSession], system_texts: list[tuple[str, ...]], tokenizer: Callable[[str], int]
) -> list[TraceSession]:
    """A shared_prefix on the first turn of sessions whose system prompt text is used by another."""
    copies = Counter(system_texts)
    shared: list[TraceSession] = []
    for session, texts in zip(sessions, system_texts, strict=True):
        # Summed per message exactly as the first turn's prompt is, so it never exceeds that prompt.
        tokens = sum(tokenizer(t) for t in texts)
        if copies[texts] < 2 or tokens == 0:
            shared.append(session)
            continue
        digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16]
        context_id = f"continuum:{digest}"
        first = replace(session.turns[0], shared_prefix=SharedPrefix(context_id, tokens))
        shared.append(replace(session, turns=(first, *session.turns[1:])))
    return shared


def from_continuum(
    obj: Sequence[Any],
    *,
    tokenizer: Callable[[str], int] = approx_token_count,
    arrival_rate_per_s: float,
    rng: random.Random,
) -> Trace:
    """The Continuum trajectories ``obj`` (the parsed JSON list) as a trace; see the module docstring."""
    if not isinstance(obj, list):
        raise TraceFormatError(f"Continuum trace must be a JSON list of trajectories, got {type(obj).__name__}")
    arrivals = poisson_arrivals(len(obj), arrival_rate_per_s, rng)
    sessions: list[TraceSession] = []
    system_texts: list[tuple[str, ...]] = []
    for index, (trajectory, arrival) in enumerate(zip(obj, arrivals, strict=True)):
        session_id, messages = _messages(trajectory, index)
        turns = trajectory_turns(session_id, messages, tokenizer)
        sessions.append(TraceSession(session_id, SOURCE, arrival, tuple(turns)))
        system_texts.append(_leading_system_texts(messages))
    sessions = _share_system_prompts(sessions, system_texts, tokenizer)
    turns_total = sum(len(s.turns) for s in sessions)
    gaps = turns_total - len(sessions)
    notes = (
        f"continuum: {len(sessions)} trajectories, {turns_total} LLM turns, {gaps} tool gaps",
        "continuum: token counts from the given tokenizer (approx_token_count unless one was passed)",
    )
    return Trace(tuple(sessions), notes=notes)
