"""How events look to people (one line each) and to scripts (JSON)."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

from log.types import LoggedEvent


def to_json(data: Any) -> str:
    """``--json`` output: strict JSON, so a NaN or infinity (no value yet, e.g. a mean over
    nothing) is ``null``; every parser reads it."""
    return json.dumps(_finite(data), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def event_to_json(event: LoggedEvent) -> dict[str, Any]:
    """A JSON-ready dict of an event and its position (bytes as hex, or base64 when long)."""
    envelope = event.envelope
    return {
        "topic": event.position.topic,
        "partition": event.position.partition,
        "offset": event.position.offset,
        "event_id": envelope.event_id,
        "session_id": envelope.session_id,
        "seq": envelope.seq,
        "actor": envelope.actor,
        "occurred_at": envelope.occurred_at.isoformat(),
        "causation_id": envelope.causation_id,
        "prev_hash": envelope.prev_hash.hex(),
        "hash": envelope.hash.hex(),
        "type": type(envelope.body).__name__,
        "body": _jsonable(envelope.body.model_dump(mode="python")),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def summary(event: LoggedEvent, width: int = 80) -> str:
    """``key=value`` pairs of the body, cut to ``width`` characters."""
    body = event.envelope.body.model_dump(mode="json", exclude_none=True)
    parts = []
    for key, value in body.items():
        text = json.dumps(value) if isinstance(value, list | dict) else str(value)
        parts.append(f"{key}={text[:40]}")
    line = " ".join(parts)
    return line if len(line) <= width else line[: width - 3] + "..."


def event_line(event: LoggedEvent) -> str:
    """One readable line: time, position, session/seq, actor, type and a summary."""
    e = event.envelope
    return (
        f"{e.occurred_at:%H:%M:%S.%f}"[:-3]
        + f"  {event.position!s:<22} {e.session_id[:24]:<24} #{e.seq:<4} {e.actor:<13} "
        + f"{type(e.body).__name__:<20} {summary(event)}"
    )
