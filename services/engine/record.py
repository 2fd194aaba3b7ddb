"""What the engine recorder keys its answers by, and how a replayed answer is marked.

The recorder (``workers/engines/recorder.py``) sits between agentlog's processes and an engine
that does not remember answers (vLLM, an external OpenAI-compatible API). A request id names one
LLM call of the log: the planner and the gateway derive it from the call's place in the session,
so a retry after a crash carries the same id. An answer recorded under that id is the call's
answer; computing it again would only spend the engine's time (or an API's money) on a result
the log already has a right to.

The id comes from the ``X-Request-Id`` header, else the body's ``request_id`` (how
``workers/engines/http.py`` and ``chat.py`` send it). A request without one is passed through
unrecorded: nothing names it, so nothing could replay it. The body is not part of the key:
fields such as a scheduling priority or a hold time may differ between attempts of one call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["RECORD_FIELD", "RECORDED_PATHS", "mark_replayed", "request_id_of"]

RECORDED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""The endpoints whose answers are computations worth recording; everything else passes through."""

RECORD_FIELD = "agentlog_record"
"""Top-level field of a replayed JSON answer: ``{"replayed": true, "recorded_at": <epoch s>}``."""

MAX_REQUEST_ID = 512


def request_id_of(headers: Mapping[str, str], body: Any) -> str | None:
    """The request id a completion is recorded under, or None (not recorded). Raises ValueError
    for an id that cannot be one (empty after stripping, too long, not a string)."""
    rid: object = headers.get("X-Request-Id") or headers.get("x-request-id")
    if rid is None and isinstance(body, dict):
        rid = body.get("request_id")
    if rid is None:
        return None
    if not isinstance(rid, str) or not rid.strip():
        raise ValueError("request_id must be a non-empty string")
    if len(rid) > MAX_REQUEST_ID:
        raise ValueError(f"request_id is longer than {MAX_REQUEST_ID} characters")
    return rid


def mark_replayed(answer: dict[str, Any], recorded_at: float) -> dict[str, Any]:
    """The recorded JSON answer as a replay returns it (a copy; the record is not changed)."""
    return {**answer, RECORD_FIELD: {"replayed": True, "recorded_at": recorded_at}}
