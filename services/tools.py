"""Tool specifications: name, effect class, argument schema, compensation.

Only the *description* of tools lives here (pure data the planner, the
decider's voters and the executor all agree on); the implementations, which
touch the world, live in ``workers/tools.py``.

Effect classes (DESIGN.md section 5) decide what recovery may do with a call
that started but never completed: ``pure`` and ``idempotent`` calls are run
again with the same idempotency key; ``compensatable`` and ``irreversible``
ones become in-doubt and wait for an operator, so they never run twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.events import EffectClass


@dataclass(frozen=True)
class ToolSpec:
    name: str
    effect_class: EffectClass
    description: str
    args_schema: dict[str, Any] = field(default_factory=dict)
    compensation: str | None = None
    """For compensatable tools: the tool that undoes this one (given the same arguments)."""

    @property
    def retry_safe(self) -> bool:
        """May a call caught mid-flight run again (with the same idempotency key)?"""
        return self.effect_class in (EffectClass.PURE, EffectClass.IDEMPOTENT)


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


TOOLS: dict[str, ToolSpec] = {
    spec.name: spec
    for spec in (
        ToolSpec(
            "sleep",
            EffectClass.PURE,
            "Wait a number of seconds.",
            _object({"seconds": {"type": "number", "minimum": 0, "maximum": 3600}}, ["seconds"]),
        ),
        ToolSpec(
            "echo", EffectClass.PURE, "Return the text it is given.", _object({"text": {"type": "string"}}, ["text"])
        ),
        ToolSpec(
            "trace_tool",
            EffectClass.PURE,
            "Stand in for a recorded tool: wait its recorded duration, return its recorded result size.",
            _object(
                {
                    "tool": {"type": "string"},
                    "duration_s": {"type": "number", "minimum": 0},
                    "result_tokens": {"type": "integer", "minimum": 0},
                },
                ["tool", "duration_s", "result_tokens"],
            ),
        ),
        ToolSpec(
            "file_write",
            EffectClass.IDEMPOTENT,
            "Write a file inside the sandbox directory; the same idempotency key writes it once.",
            _object(
                {"path": {"type": "string", "pattern": r"^[A-Za-z0-9_.\-/]+$"}, "content": {"type": "string"}},
                ["path", "content"],
            ),
        ),
        ToolSpec(
            "payment",
            EffectClass.IRREVERSIBLE,
            "Pay an amount to an account; recorded in the payments ledger. Never run twice.",
            _object(
                {"account": {"type": "string"}, "amount_cents": {"type": "integer", "minimum": 1}},
                ["account", "amount_cents"],
            ),
        ),
        ToolSpec(
            "book",
            EffectClass.COMPENSATABLE,
            "Book a resource (e.g. a hotel room); undone by cancel_booking.",
            _object({"resource": {"type": "string"}, "nights": {"type": "integer", "minimum": 1}}, ["resource"]),
            compensation="cancel_booking",
        ),
        ToolSpec(
            "cancel_booking",
            EffectClass.IDEMPOTENT,
            "Cancel a booking made by book (same arguments).",
            _object({"resource": {"type": "string"}, "nights": {"type": "integer", "minimum": 1}}, ["resource"]),
        ),
    )
}
"""Built-in tools by name."""


def idempotency_key(session_id: str, call_id: str) -> str:
    """The key that makes every attempt of one call the same effect (DESIGN.md section 4)."""
    return f"{session_id}/{call_id}"
