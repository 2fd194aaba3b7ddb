"""The projector's read model as data: which rows each log event writes (pure).

``rows(session_id, event_id, body, at) -> list[Upsert]`` says, for one event, what it sets
in the read model (``TABLES``); ``workers/projector.py`` turns each ``Upsert`` into one
``INSERT ... ON CONFLICT`` and runs a poll's worth of them with its offsets in one
transaction.

**A pure function of the log, whatever the interleaving.** Topics are ordered only within
themselves, and the projector reads them interleaved as the broker hands them out. So an
event never writes a column that an event of another topic writes too: a tool call's
proposal (agent.actions) sets its tool and arguments, its verdict (agent.verdicts) the
verdict columns, its runs (agent.effects) the effect columns. Within one topic a session's
events come in one order, so "the first value wins" (``FIRST``: ``COALESCE(old, new)``) is
the same on every read; a count that only grows takes the largest (``MAX``). Tables of
events that happen many times (approvals, cache decisions and hits, merges) are keyed by
event id and only inserted. The status of a session or a tool call is derived from which
columns are set, when the model is read, never stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from schemas import events as ev

__all__ = ["TABLES", "Merge", "Upsert", "rows"]


class Merge(StrEnum):
    FIRST = "first"
    """Keep the value already there; set it only when there is none."""
    MAX = "max"
    """Keep the larger one."""


@dataclass(frozen=True, slots=True)
class Upsert:
    """Set ``values`` in the row of ``table`` keyed by ``key`` (created when missing)."""

    table: str
    key: dict[str, Any]
    values: dict[str, Any] = field(default_factory=dict)
    merge: dict[str, Merge] = field(default_factory=dict)
    """Per column; a column not named here is FIRST."""


TABLES: dict[str, dict[str, str]] = {
    "sessions": {
        "session_id": "text",
        "program": "text",
        "args_json": "text",
        "parent_session_id": "text",
        "requested_program": "text",
        "requested_at": "timestamptz",
        "requested_by": "text",
        "started_at": "timestamptz",
        "finished_at": "timestamptz",
        "output_json": "text",
        "num_llm_calls": "bigint",
        "num_tool_calls": "bigint",
        "failed_at": "timestamptz",
        "failure": "text",
        "cancel_requested_at": "timestamptz",
    },
    "llm_calls": {
        "session_id": "text",
        "call_id": "text",
        "turn": "bigint",
        "engine_id": "text",
        "prompt_tokens": "bigint",
        "started_at": "timestamptz",
        "completed_at": "timestamptz",
        "cached_tokens": "bigint",
        "output_tokens": "bigint",
        "queue_ms": "double precision",
        "prefill_ms": "double precision",
        "decode_ms": "double precision",
    },
    "tool_calls": {
        "session_id": "text",
        "call_id": "text",
        "tool": "text",
        "effect_class": "text",
        "arguments_json": "text",
        "proposed_at": "timestamptz",
        "verdict": "text",
        "verdict_policy": "text",
        "verdict_reason": "text",
        "verdict_at": "timestamptz",
        "attempts": "bigint",
        "first_started_at": "timestamptz",
        "completed_at": "timestamptz",
        "result_tokens": "bigint",
        "duration_ms": "double precision",
        "failed_at": "timestamptz",
        "error": "text",
        "in_doubt_at": "timestamptz",
        "in_doubt_reason": "text",
    },
    "votes": {"session_id": "text", "call_id": "text", "voter": "text", "decision": "text", "reason": "text"},
    "approvals": {
        "event_id": "text",
        "session_id": "text",
        "call_id": "text",
        "decision": "text",
        "author": "text",
        "reason": "text",
        "at": "timestamptz",
    },
    "kv_decisions": {
        "event_id": "text",
        "session_id": "text",
        "engine_id": "text",
        "action": "text",
        "ttl_ms": "bigint",
        "score": "double precision",
        "next_reference_ms": "double precision",
        "num_blocks": "bigint",
        "reason": "text",
        "at": "timestamptz",
    },
    "cache_hits": {
        "event_id": "text",
        "session_id": "text",
        "engine_id": "text",
        "call_id": "text",
        "cached_tokens": "bigint",
        "prompt_tokens": "bigint",
        "tier": "text",
        "at": "timestamptz",
    },
    "checkpoints": {
        "session_id": "text",
        "checkpoint_id": "text",
        "state_digest": "text",
        "num_events": "bigint",
        "taken_at": "timestamptz",
    },
    "forks": {"session_id": "text", "parent_session_id": "text", "checkpoint_id": "text", "at": "timestamptz"},
    "merges": {
        "event_id": "text",
        "session_id": "text",
        "outcome": "text",
        "branch_session_ids": "text",
        "detail": "text",
        "at": "timestamptz",
    },
}
"""Each table's columns and their Postgres types; the key columns are ``KEYS``'s."""

KEYS: dict[str, tuple[str, ...]] = {
    "sessions": ("session_id",),
    "llm_calls": ("session_id", "call_id"),
    "tool_calls": ("session_id", "call_id"),
    "votes": ("session_id", "call_id", "voter"),
    "approvals": ("event_id",),
    "kv_decisions": ("event_id",),
    "cache_hits": ("event_id",),
    "checkpoints": ("session_id", "checkpoint_id"),
    "forks": ("session_id",),
    "merges": ("event_id",),
}


def rows(session_id: str, event_id: str, body: BaseModel, at: datetime) -> list[Upsert]:
    """What ``body`` (of session ``session_id``, appended at ``at``) writes in the read model; []
    for events the model does not hold (a dead letter, a KV block's storage, a swap)."""
    s = {"session_id": session_id}
    match body:
        case ev.SessionRequested():
            return [
                Upsert(
                    "sessions", s, {"requested_program": body.program, "requested_at": at, "requested_by": body.author}
                )
            ]
        case ev.SessionStarted():
            # The planner's start is the program of record (a fork has no request).
            return [
                Upsert(
                    "sessions",
                    s,
                    {
                        "program": body.program,
                        "args_json": body.args_json,
                        "parent_session_id": body.parent_session_id,
                        "started_at": at,
                    },
                )
            ]
        case ev.SessionFinished():
            return [
                Upsert(
                    "sessions",
                    s,
                    {
                        "finished_at": at,
                        "output_json": body.output_json,
                        "num_llm_calls": body.num_llm_calls,
                        "num_tool_calls": body.num_tool_calls,
                    },
                )
            ]
        case ev.SessionFailed():
            return [Upsert("sessions", s, {"failed_at": at, "failure": f"{body.error_type}: {body.reason}"})]
        case ev.CancelRequested():
            return [Upsert("sessions", s, {"cancel_requested_at": at})]
        case ev.LLMCallStarted():
            return [
                Upsert(
                    "llm_calls",
                    {**s, "call_id": body.call_id},
                    {
                        "turn": body.turn,
                        "engine_id": body.engine_id,
                        "prompt_tokens": body.prompt_tokens,
                        "started_at": at,
                    },
                )
            ]
        case ev.LLMCallCompleted():
            return [
                Upsert(
                    "llm_calls",
                    {**s, "call_id": body.call_id},
                    {
                        "completed_at": at,
                        "cached_tokens": body.cached_tokens,
                        "output_tokens": body.output_tokens,
                        "queue_ms": body.queue_ms,
                        "prefill_ms": body.prefill_ms,
                        "decode_ms": body.decode_ms,
                    },
                )
            ]
        case ev.ToolCallProposed():
            return [
                Upsert(
                    "tool_calls",
                    {**s, "call_id": body.call_id},
                    {
                        "tool": body.tool,
                        "effect_class": body.effect_class.value,
                        "arguments_json": body.arguments_json,
                        "proposed_at": at,
                    },
                )
            ]
        case ev.ToolCallCommitted() | ev.ToolCallAborted():
            verdict = "committed" if isinstance(body, ev.ToolCallCommitted) else "aborted"
            reason = body.reason if isinstance(body, ev.ToolCallAborted) else None
            call = {**s, "call_id": body.call_id}
            return [
                Upsert(
                    "tool_calls",
                    call,
                    {"verdict": verdict, "verdict_policy": body.policy, "verdict_reason": reason, "verdict_at": at},
                ),
                *(
                    Upsert("votes", {**call, "voter": v.voter}, {"decision": v.decision.value, "reason": v.reason})
                    for v in body.votes
                ),
            ]
        case ev.ToolCallStarted():
            return [
                Upsert(
                    "tool_calls",
                    {**s, "call_id": body.call_id},
                    {"attempts": body.attempt, "first_started_at": at},
                    {"attempts": Merge.MAX},
                )
            ]
        case ev.ToolCallCompleted():
            return [
                Upsert(
                    "tool_calls",
                    {**s, "call_id": body.call_id},
                    {"completed_at": at, "result_tokens": body.result_tokens, "duration_ms": body.duration_ms},
                )
            ]
        case ev.ToolCallFailed():
            return [
                Upsert(
                    "tool_calls",
                    {**s, "call_id": body.call_id},
                    {"failed_at": at, "error": f"{body.error_type}: {body.error}"},
                )
            ]
        case ev.ToolCallInDoubt():
            return [
                Upsert(
                    "tool_calls", {**s, "call_id": body.call_id}, {"in_doubt_at": at, "in_doubt_reason": body.reason}
                )
            ]
        case ev.ApprovalGiven():
            return [
                Upsert(
                    "approvals",
                    {"event_id": event_id},
                    {
                        **s,
                        "call_id": body.call_id,
                        "decision": body.decision.value,
                        "author": body.author,
                        "reason": body.reason,
                        "at": at,
                    },
                )
            ]
        case ev.CacheDecisionMade():
            return [
                Upsert(
                    "kv_decisions",
                    {"event_id": event_id},
                    {
                        **s,
                        "engine_id": body.engine_id,
                        "action": body.action.value,
                        "ttl_ms": body.ttl_ms,
                        "score": body.score,
                        "next_reference_ms": body.next_reference_ms,
                        "num_blocks": body.num_blocks,
                        "reason": body.reason,
                        "at": at,
                    },
                )
            ]
        case ev.KVCacheHit():
            return [
                Upsert(
                    "cache_hits",
                    {"event_id": event_id},
                    {
                        **s,
                        "engine_id": body.engine_id,
                        "call_id": body.call_id,
                        "cached_tokens": body.cached_tokens,
                        "prompt_tokens": body.prompt_tokens,
                        "tier": body.tier.value,
                        "at": at,
                    },
                )
            ]
        case ev.CheckpointTaken():
            return [
                Upsert(
                    "checkpoints",
                    {**s, "checkpoint_id": body.checkpoint_id},
                    {"state_digest": body.state_digest, "num_events": body.num_events, "taken_at": at},
                )
            ]
        case ev.ForkCreated():
            return [
                Upsert(
                    "forks",
                    s,
                    {"parent_session_id": body.parent_session_id, "checkpoint_id": body.checkpoint_id, "at": at},
                )
            ]
        case ev.MergeApplied():
            return [
                Upsert(
                    "merges",
                    {"event_id": event_id},
                    {
                        **s,
                        "outcome": "applied",
                        "branch_session_ids": json.dumps(body.branch_session_ids),
                        "detail": body.results_json,
                        "at": at,
                    },
                )
            ]
        case ev.MergeConflict():
            return [
                Upsert(
                    "merges",
                    {"event_id": event_id},
                    {
                        **s,
                        "outcome": "conflict",
                        "branch_session_ids": json.dumps(body.branch_session_ids),
                        "detail": json.dumps(body.conflicts),
                        "at": at,
                    },
                )
            ]
    return []
