"""Import Mooncake's request trace (FAST 2025) and recover multi-turn sessions from hash-id prefixes.

Each line is one request: ``timestamp`` (ms since the trace start), ``input_length``,
``output_length`` and ``hash_ids``, one id per ``block_tokens`` (512) input tokens, where equal ids
mean identical prefixes up to and including that block (each id hashes its block *and* everything
before it). The trace has no session ids; we recover them.

**Recovery rule.** Requests are taken in timestamp order. Request B *continues* the session whose
latest request A it extends:

1. B shares more than the first block with A (``lcp(B, A) >= 2`` blocks): every request starts
   with the same block 0 (a common system prompt), which says nothing about the conversation;
2. B contains all of A's *full* blocks (``lcp >= A.input_length // block_tokens``): a follow-up turn
   re-sends the whole history; only A's last, partial block may differ, since B fills it up;
3. B is longer than A and strictly later, within ``max_gap_s`` (default 1800 s, the usual
   web-analytics session timeout: a user back after half an hour starts a new session).

Among several such sessions the longest match wins, then the most recent. A request that shares
blocks with a session but does not extend its latest request (a retry, an edited earlier turn)
starts a new session; its reuse shows up as a ``shared_prefix``. A limitation: a conversation whose
first request is under ``2 * block_tokens`` tokens can never be continued (its only full block is the
common one), so it appears as single-turn sessions.

**Turns.** The first request's input is the first turn's prompt. Between A and B the user read the
answer and typed: the gap ``(B.timestamp - A.timestamp)`` is the tool ``"human"``'s duration (it also
holds A's own service time, which the trace does not record, so replays stretch a little), and
``B.input_length - (A.input_length + A.output_length)`` tokens (the user's message) are its result; B
itself appends no other prompt. When that difference is negative (the client trimmed the history
or did not re-send the whole answer) it is clamped to 0 and counted in ``Trace.notes``.

**Shared prefixes.** At each turn, the leading blocks of the request that also occur in another
session are shared; when that run grows, the turn declares ``shared_prefix`` with context_id
``mooncake:<id of the last shared block>`` (the id names the whole prefix) and its token count.
In the published trace every session shares at least block 0.

On the published ``conversation_trace.jsonl`` (12,031 requests) this finds the numbers that
``Trace.notes`` reports and ``logctl trace stats`` prints.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from services.traces.model import SharedPrefix, Trace, TraceFormatError, TraceSession, TraceTurn

SOURCE = "mooncake"
HUMAN = "human"
DEFAULT_MAX_GAP_S = 1800.0


@dataclass(frozen=True, slots=True)
class MooncakeRequest:
    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_request(line: str, number: int, block_tokens: int) -> MooncakeRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"line {number}: not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"line {number}: expected an object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceFormatError(f"line {number}: missing {', '.join(missing)}")
    timestamp, inputs, outputs, hash_ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float) or not math.isfinite(timestamp):
        raise TraceFormatError(f"line {number}: timestamp must be a number of ms, got {timestamp!r}")
    if timestamp < 0:
        raise TraceFormatError(f"line {number}: timestamp must be >= 0, got {timestamp}")
    for name, value in (("input_length", inputs), ("output_length", outputs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceFormatError(f"line {number}: {name} must be an integer >= 0, got {value!r}")
    if inputs < 1:
        raise TraceFormatError(f"line {number}: input_length must be >= 1")
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
        raise TraceFormatError(f"line {number}: hash_ids must be a list of integers")
    expected = -(-inputs // block_tokens)
    if len(hash_ids) != expected:
        raise TraceFormatError(
            f"line {number}: {len(hash_ids)} hash_ids for {inputs} input tokens; expected {expected} "
            f"blocks of {block_tokens} tokens (is block_tokens right?)"
        )
    return MooncakeRequest(number, float(timestamp), inputs, outputs, tuple(hash_ids))


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def recover_sessions(
    requests: list[MooncakeRequest], *, block_tokens: int = 512, max_gap_s: float = DEFAULT_MAX_GAP_S
) -> list[list[MooncakeRequest]]:
    """Group requests (in timestamp order) into sessions by the rule in the module docstring."""
    sessions: list[list[MooncakeRequest]] = []
    # Sessions by their first two blocks: a continuation shares at least those with the latest request.
    by_opening: dict[tuple[int, int], list[int]] = defaultdict(list)
    max_gap_ms = max_gap_s * 1000.0
    for r in requests:
        best, best_shared = -1, 0
        opening = (r.hash_ids[0], r.hash_ids[1]) if len(r.hash_ids) >= 2 else None
        for s in by_opening.get(opening, ()) if opening else ():
            latest = sessions[s][-1]
            gap = r.timestamp_ms - latest.timestamp_ms
            if gap <= 0 or gap > max_gap_ms or r.input_length <= latest.input_length:
                continue
            shared = _common_prefix(r.hash_ids, latest.hash_ids)
            if shared < max(2, latest.input_length // block_tokens):
                continue
            # ">=" so that among equally long matches the most recently created session wins.
            if shared >= best_shared:
                best, best_shared = s, shared
        if best >= 0:
            sessions[best].append(r)
            continue
        sessions.append([r])
        if opening:
            by_opening[opening].append(len(sessions) - 1)
    return sessions


def _shared_runs(sessions: list[list[MooncakeRequest]]) -> list[list[int]]:
    """Per session and turn: how many leading blocks also occur in another session."""
    owners: dict[int, set[int]] = defaultdict(set)
    for s, session in enumerate(sessions):
        for r in session:
            for block in r.hash_ids:
                owners[block].add(s)
    runs: list[list[int]] = []
    for session in sessions:
        per_turn: list[int] = []
        for r in session:
            k = 0
            while k < len(r.hash_ids) and len(owners[r.hash_ids[k]]) > 1:
                k += 1
            per_turn.append(k)
        runs.append(per_turn)
    return runs


def from_mooncake(lines: Iterable[str], *, block_tokens: int = 512, max_gap_s: float = DEFAULT_MAX_GAP_S) -> Trace:
    """The Mooncake trace ``lines`` (JSONL text) as a trace of recovered sessions."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if not max_gap_s > 0:
        raise ValueError(f"max_gap_s must be > 0, got {max_gap_s}")
    requests = [parse_request(line, n, block_tokens) for n, line in enumerate(lines, start=1) if line.strip()]
    requests.sort(key=lambda r: r.timestamp_ms)  # stable: file order among equal timestamps
    sessions = recover_sessions(requests, block_tokens=block_tokens, max_gap_s=max_gap_s)
    runs = _shared_runs(sessions)

    def prefix_of(r: MooncakeRequest, k: int) -> tuple[str, int]:
        return f"{SOURCE}:{r.hash_ids[k - 1]}", min(k * block_tokens, r.input_length)

    # One token count per context_id, the smallest declared (they agree on well-formed input).
    prefix_tokens: dict[str, int] = {}
    for session, per_turn in zip(sessions, runs, strict=True):
        for r, k in zip(session, per_turn, strict=True):
            if k:
                context_id, tokens = prefix_of(r, k)
                prefix_tokens[context_id] = min(tokens, prefix_tokens.get(context_id, tokens))

    clamped = clamped_tokens = raised_output = 0
    out: list[TraceSession] = []
    for number, (session, per_turn) in enumerate(zip(sessions, runs, strict=True)):
        turns: list[TraceTurn] = []
        declared = 0
        for j, r in enumerate(session):
            prefix = None
            if per_turn[j] > declared:
                declared = per_turn[j]
                context_id, _ = prefix_of(r, declared)
                prefix = SharedPrefix(context_id, prefix_tokens[context_id])
            output = r.output_length
            if output < 1:
                raised_output += 1
                output = 1
            if j + 1 == len(session):
                turns.append(TraceTurn(r.input_length if j == 0 else 0, output, shared_prefix=prefix))
                break
            nxt = session[j + 1]
            message = nxt.input_length - (r.input_length + r.output_length)
            if message < 0:
                clamped += 1
                clamped_tokens -= message
                message = 0
            gap_s = (nxt.timestamp_ms - r.timestamp_ms) / 1000.0
            turns.append(TraceTurn(r.input_length if j == 0 else 0, output, HUMAN, gap_s, message, prefix))
        out.append(TraceSession(f"{SOURCE}-{number:05d}", SOURCE, session[0].timestamp_ms / 1000.0, tuple(turns)))

    multi = sum(1 for s in sessions if len(s) > 1)
    beyond_first = sum(1 for per_turn in runs if max(per_turn) > 1)
    notes = [
        f"mooncake: {len(requests)} requests -> {len(out)} sessions ({multi} multi-turn), "
        f"{len(requests)} turns, {len(requests) - len(out)} human gaps (max_gap_s={max_gap_s:g})",
        f"mooncake: {beyond_first} sessions share more than the first block with another session",
    ]
    if clamped:
        notes.append(
            f"mooncake: {clamped} continuations re-sent less than the previous context "
            f"({clamped_tokens} tokens in all): their new tokens clamped to 0"
        )
    if raised_output:
        notes.append(f"mooncake: {raised_output} requests with output_length 0 counted as 1 output token")
    return Trace(tuple(out), notes=tuple(notes))
