"""Import InferCept's workload file (``merged_exp_uniform.json``, ICML 2024) into the trace format.

The file is a JSON object: session id -> list of LLM calls. A call comes in one of two forms:

- counts: ``prompt_tokens`` (the *whole* context at this call), ``completion_tokens``, and, when a
  tool (InferCept's "augmentation") follows, ``api_time`` (seconds) and ``api_token_length``;
- text (the chat sessions): ``prompt`` (the whole context as text), ``completion`` and
  ``api_token`` (the text the augmentation returned), with ``api_time``. InferCept's own driver
  tokenizes these; we use ``tokenizer`` (default :func:`approx_token_count`).

Choices, each reported in ``Trace.notes``:

- **New tokens from context sizes.** Turn *i*'s ``prompt_tokens`` is the recorded context minus the
  running context (previous context + its completion + its tool result). On the published file
  the difference is always exactly 0: InferCept's driver only ever appends output and tool
  tokens. A negative difference (a recorded context smaller than the running sum, i.e. the
  source truncated its history) is clamped to 0 and counted; the model keeps the running sum.
  For text calls whose prompt starts with the previous context text, the new tokens are the
  tokens of the appended suffix (exact, and immune to tokenizer boundary effects).
- **Negative ``api_token_length``** (-2 in a few sessions that hit a 2048-token window) is clamped to
  0 and counted.
- **A tool after the last call.** 184 sessions end with ``api_time`` on their last call: InferCept's
  driver waits for that tool, appends its result and lets the request finish. The trace format
  ends every session with an LLM call, so by default (``trailing_tool="closing_turn"``) we add a
  closing turn (0 new prompt tokens, 1 output token: the engine reads the result and stops), which
  keeps all 1,841 recorded tool gaps; ``trailing_tool="drop"`` drops those tools instead.
- **Tool names.** Count-form calls are ``"api"`` (the file does not say which augmentation). For
  text calls the returned text tells: ``"tts"`` ("Convert this to text to speech."),
  ``"image_generation"`` ("Generate an image about this."), otherwise ``"human"`` (the next user
  message of a ShareGPT chat; its ``api_time`` is think time, capped at 60 s in the file).
- **Shared prefixes.** Text sessions with identical first prompts (``0``, ``0_1``, ``0_3`` are one
  chat replayed with different augmentations) share that prompt as a ``shared_prefix``
  (context_id ``infercept:`` + a hash of the text). Count-form sessions carry no text, so no
  prefix sharing can be proved for them and none is claimed.
- **Arrivals.** The file has none; InferCept's benchmark draws Poisson arrivals, and so do we,
  over the sessions in sorted id order so that a seed gives one trace.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from services.traces.arrivals import poisson_arrivals
from services.traces.model import SharedPrefix, Trace, TraceFormatError, TraceSession, TraceTurn
from services.traces.tokens import approx_token_count

SOURCE = "infercept"
TrailingTool = Literal["closing_turn", "drop"]
_TEXT_TOOLS = (("Convert this to text to speech", "tts"), ("Generate an image about this", "image_generation"))


@dataclass
class _Counts:
    """What the import had to adjust; becomes ``Trace.notes``."""

    calls: int = 0
    gaps: int = 0
    trailing: int = 0
    clamped_prompt: int = 0
    clamped_prompt_tokens: int = 0
    clamped_result: int = 0
    raised_output: int = 0
    text_sessions: int = 0


def _number(call: Mapping[str, Any], key: str, where: str) -> int:
    value = call[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _string(call: Mapping[str, Any], key: str, where: str) -> str:
    value = call[key]
    if not isinstance(value, str):
        raise TraceFormatError(f"{where}: {key} must be a string, got {value!r}")
    return value


def _tool_name(returned_text: str | None) -> str:
    if returned_text is None:
        return "api"
    for prefix, name in _TEXT_TOOLS:
        if returned_text.startswith(prefix):
            return name
    return "human"


def _llm_tokens(
    call: Mapping[str, Any], where: str, tokenizer: Callable[[str], int], running: int, previous_text: str | None
) -> tuple[int, int, str | None]:
    """(new prompt tokens, may be negative; output tokens; context text after the output, text form only)."""
    try:
        if "prompt_tokens" in call:
            return _number(call, "prompt_tokens", where) - running, _number(call, "completion_tokens", where), None
        prompt = _string(call, "prompt", where)
        completion = _string(call, "completion", where)
    except KeyError as e:
        raise TraceFormatError(f"{where}: missing {e.args[0]}") from None
    if previous_text is not None and prompt.startswith(previous_text):
        new = tokenizer(prompt[len(previous_text) :])  # exactly the appended text
    else:
        new = tokenizer(prompt) - running
    return new, tokenizer(completion), prompt + completion


def _session_turns(
    session_id: str, calls: object, tokenizer: Callable[[str], int], trailing_tool: TrailingTool, counts: _Counts
) -> list[TraceTurn]:
    if not isinstance(calls, list) or not calls:
        raise TraceFormatError(f"session {session_id!r}: expected a non-empty list of calls")
    turns: list[TraceTurn] = []
    running = 0  # modelled context after the previous turn, tokens
    previous_text: str | None = None  # the context after the previous turn as text (text-form calls)
    for i, call in enumerate(calls):
        where = f"session {session_id!r} call {i}"
        if not isinstance(call, Mapping):
            raise TraceFormatError(f"{where}: expected an object, got {type(call).__name__}")
        counts.calls += 1
        new, output, text = _llm_tokens(call, where, tokenizer, running, previous_text)
        if new < 0:
            counts.clamped_prompt += 1
            counts.clamped_prompt_tokens -= new
            new = 0
        if output < 1:
            counts.raised_output += 1
            output = 1
        tool: str | None = None
        duration: float | None = None
        result: int | None = None
        if "api_time" in call:
            duration = call["api_time"]
            returned: str | None = None
            try:
                if text is None:
                    result = _number(call, "api_token_length", where)
                else:
                    returned = _string(call, "api_token", where)
                    result = tokenizer(returned)
                    text += returned
            except KeyError as e:
                raise TraceFormatError(f"{where}: api_time without {e.args[0]}") from None
            if result < 0:
                counts.clamped_result += 1
                result = 0
            tool = _tool_name(returned)
            counts.gaps += 1
        try:
            turns.append(TraceTurn(new, output, tool, duration, result))
        except TraceFormatError as e:
            raise TraceFormatError(f"{where}: {e}") from None
        running += new + output + (result or 0)
        previous_text = text
    if turns[-1].tool is not None:
        counts.trailing += 1
        if trailing_tool == "closing_turn":
            turns.append(TraceTurn(prompt_tokens=0, output_tokens=1))
        else:
            turns[-1] = TraceTurn(turns[-1].prompt_tokens, turns[-1].output_tokens)
    return turns


def from_infercept(
    obj: Mapping[str, Any],
    *,
    arrival_rate_per_s: float,
    rng: random.Random,
    tokenizer: Callable[[str], int] = approx_token_count,
    trailing_tool: TrailingTool = "closing_turn",
) -> Trace:
    """The InferCept workload ``obj`` (the parsed JSON object) as a trace; see the module docstring."""
    if not isinstance(obj, Mapping):
        raise TraceFormatError(f"InferCept workload must be a JSON object of sessions, got {type(obj).__name__}")
    if trailing_tool not in ("closing_turn", "drop"):
        raise ValueError(f"trailing_tool must be 'closing_turn' or 'drop', got {trailing_tool!r}")
    counts = _Counts()
    ids = sorted(obj)
    arrivals = poisson_arrivals(len(ids), arrival_rate_per_s, rng)
    first_prompts: dict[str, str] = {}
    sessions: list[TraceSession] = []
    for session_id, arrival in zip(ids, arrivals, strict=True):
        calls = obj[session_id]
        turns = _session_turns(session_id, calls, tokenizer, trailing_tool, counts)
        first = calls[0]
        if "prompt_tokens" not in first:
            counts.text_sessions += 1
            first_prompts[session_id] = first["prompt"]
        sessions.append(TraceSession(session_id, SOURCE, arrival, tuple(turns)))
    sessions = _share_identical_first_prompts(sessions, first_prompts)
    return Trace(tuple(sessions), notes=_notes(len(ids), counts, trailing_tool))


def _share_identical_first_prompts(sessions: list[TraceSession], first_prompts: dict[str, str]) -> list[TraceSession]:
    """Give sessions whose first prompt text is identical a shared_prefix of that prompt."""
    copies = Counter(first_prompts.values())
    shared: list[TraceSession] = []
    for s in sessions:
        text = first_prompts.get(s.session_id)
        if text is None or copies[text] < 2:
            shared.append(s)
            continue
        context_id = "infercept:" + hashlib.sha256(text.encode()).hexdigest()[:16]
        first = replace(s.turns[0], shared_prefix=SharedPrefix(context_id, s.turns[0].prompt_tokens))
        shared.append(replace(s, turns=(first, *s.turns[1:])))
    return shared


def _notes(num_sessions: int, c: _Counts, trailing_tool: TrailingTool) -> tuple[str, ...]:
    what = "closing turns added" if trailing_tool == "closing_turn" else "those tools dropped"
    notes = [
        f"infercept: {num_sessions} sessions, {c.calls} recorded calls, {c.gaps} tool gaps "
        f"({c.trailing} after a session's last call: {what})",
        f"infercept: {c.text_sessions} text sessions tokenized by the given tokenizer",
    ]
    if c.clamped_prompt:
        notes.append(
            f"infercept: {c.clamped_prompt} calls recorded a context smaller than the running sum "
            f"(by {c.clamped_prompt_tokens} tokens in all): new prompt tokens clamped to 0"
        )
    if c.clamped_result:
        notes.append(f"infercept: {c.clamped_result} negative api_token_length values clamped to 0")
    if c.raised_output:
        notes.append(f"infercept: {c.raised_output} empty completions counted as 1 output token")
    return tuple(notes)
